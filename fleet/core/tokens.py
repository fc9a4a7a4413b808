"""Rollout-scoped inference tokens: issued by the fleet server, checked by the gateway.

A token names one rollout and its deadline and is signed with HMAC-SHA256 under a secret the
server and the gateway share. The gateway refuses a token that is malformed, signed with
another key, expired, or scoped to a different rollout than the request claims.

Format: `v1.<payload>.<signature>`, both parts unpadded base64url; the payload is compact JSON
`{"rid": rollout id, "exp": unix seconds, "iat": unix seconds, "mdl": [model, ...], "tnt": tenant,
"mpt": prompt tokens, "mct": completion tokens}` (`iat`, when the attempt that carries it was
leased, may be absent in tokens of older servers; `mdl`, the upstream models the rollout may
call through the gateway, is absent when it names none; `tnt`, the rollout's tenant, absent in
older tokens; `mpt` and `mct`, the rollout's token budgets, absent when it set none). The model
list, the tenant and the budgets ride in the signed claims so that the gateway decides on a
request without asking the server what the rollout was allowed.

A token is good only while its rollout runs: the server tells the gateway which rollouts are
running (`RunningRollouts`, signed with the same secret, every poll), and the gateway refuses a
token whose rollout is not among them unless it was issued after that list was read.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import json
import math

from pydantic import BaseModel, ConfigDict

from fleet.core.errors import PermissionDenied, Unauthenticated

MIN_SECRET_BYTES = 16


class TokenClaims(BaseModel):
    model_config = ConfigDict(frozen=True)

    rollout_id: str
    expires_at: float
    issued_at: float = 0.0
    models: tuple[str, ...] = ()
    """The upstream models (`UPSTREAM/MODEL`) the rollout's request allowed; the gateway's own
    model needs no listing."""
    tenant: str = ""
    """The rollout's tenant ("" in tokens of servers that did not say), whose tokens per minute
    the gateway may bound."""
    max_prompt_tokens: int = 0
    """The rollout's prompt-token budget over all its model calls (0: none)."""
    max_completion_tokens: int = 0
    """The rollout's completion-token budget over all its model calls (0: none)."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _check_secret(secret: bytes) -> None:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"token secret must be at least {MIN_SECRET_BYTES} bytes")


def issue(
    secret: bytes, rollout_id: str, expires_at: float, issued_at: float = 0.0,
    models: tuple[str, ...] = (), tenant: str = "", max_prompt_tokens: int = 0,
    max_completion_tokens: int = 0,
) -> str:  # fmt: skip
    """A token for `rollout_id`, valid until `expires_at` (the rollout's deadline) and while
    the rollout runs; `issued_at`: when its attempt was leased; `models`: the upstream models
    it may call; `tenant`: whose rollout it is; the budgets: the rollout's token budgets (0:
    none). What is unset is left out, so a token without them is as it was before them."""
    _check_secret(secret)
    claims: dict[str, object] = {"rid": rollout_id, "exp": round(expires_at, 3)}
    if issued_at:
        claims["iat"] = round(issued_at, 3)
    if models:
        claims["mdl"] = list(models)
    if tenant:
        claims["tnt"] = tenant
    if max_prompt_tokens:
        claims["mpt"] = int(max_prompt_tokens)
    if max_completion_tokens:
        claims["mct"] = int(max_completion_tokens)
    payload = json.dumps(claims, separators=(",", ":"))
    body = _b64(payload.encode())
    signature = hmac.new(secret, f"v1.{body}".encode(), hashlib.sha256).digest()
    return f"v1.{body}.{_b64(signature)}"


def verify(secret: bytes, token: str, now: float, rollout_id: str = "") -> TokenClaims:
    """The token's claims, or Unauthenticated / PermissionDenied saying what is wrong.

    With `rollout_id`, the token must be scoped to that rollout.
    """
    _check_secret(secret)
    if not token:
        raise Unauthenticated("no inference token: requests need the rollout's token")
    claims = _signed_claims(secret, token)
    rid = claims.rollout_id
    if now >= claims.expires_at:
        raise PermissionDenied(f"inference token for rollout {rid} expired at its deadline")
    if rollout_id and rollout_id != rid:
        raise PermissionDenied(f"inference token is scoped to rollout {rid}, not to {rollout_id}")
    return claims


def _budget(claims: dict[str, object], name: str) -> int:
    """A budget claim: a whole number of tokens, at least 0 (0 when absent)."""
    value = claims.get(name, 0)
    if type(value) is not int or value < 0:  # (not a bool, a float or a string)
        raise ValueError(f"{name} is not a token count")
    return value


@functools.lru_cache(maxsize=8192)
def _signed_claims(secret: bytes, token: str) -> TokenClaims:
    """The claims of a token whose signature verifies under `secret` (its expiry unchecked).

    Remembered per token: a rollout's machine sends the same token with every action, and the
    answer cannot change (only a valid signature is remembered; expiry is checked on each use).
    """
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != "v1":
        raise Unauthenticated("malformed inference token (expected v1.<payload>.<signature>)")
    try:
        signature = _unb64(parts[2])
        claims = json.loads(_unb64(parts[1]))
        rid, exp = str(claims["rid"]), float(claims["exp"])
        iat = float(claims.get("iat", 0.0))
        models = claims.get("mdl", [])
        tenant = claims.get("tnt", "")
        if not (math.isfinite(exp) and math.isfinite(iat)):
            raise ValueError("not finite")
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise ValueError("models are not a list of names")
        if not isinstance(tenant, str):
            raise ValueError("tenant is not a name")
        budgets = _budget(claims, "mpt"), _budget(claims, "mct")
    except (ValueError, KeyError, TypeError, AttributeError):
        raise Unauthenticated("malformed inference token (unreadable payload)") from None
    expected = hmac.new(secret, f"v1.{parts[1]}".encode(), hashlib.sha256).digest()
    if not hmac.compare_digest(signature, expected):
        raise Unauthenticated("inference token signature does not verify (another key?)")
    return TokenClaims(
        rollout_id=rid, expires_at=exp, issued_at=iat, models=tuple(models), tenant=tenant,
        max_prompt_tokens=budgets[0], max_completion_tokens=budgets[1],
    )  # fmt: skip


RUNNING_TAG = "running.v1"


def sign_running(secret: bytes, rollout_ids: list[str], as_of: float) -> str:
    """The server's signature over the rollouts it says are running at `as_of`."""
    _check_secret(secret)
    text = "\n".join([RUNNING_TAG, repr(round(as_of, 6)), *sorted(rollout_ids)])
    return _b64(hmac.new(secret, text.encode(), hashlib.sha256).digest())


def check_running(secret: bytes, rollout_ids: list[str], as_of: float, signature: str) -> None:
    """Unauthenticated unless `signature` is the server's over exactly these rollouts."""
    expected = sign_running(secret, rollout_ids, as_of)
    if not hmac.compare_digest(expected.encode(), signature.encode()):
        raise Unauthenticated("running rollouts: signature does not verify (another key?)")
