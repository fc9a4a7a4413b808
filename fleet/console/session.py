"""Console sessions: a signed, expiring cookie naming the API key a person signed in with (its
id, tenant and scopes; never its secret), and the CSRF tokens bound to it.

The cookie is `payload.signature`, both base64url: the payload is JSON, the signature an
HMAC-SHA256 over it with the console's secret. Anything that does not verify, or has expired,
is treated as no session at all. Each session carries a random nonce; its CSRF token is an HMAC
of that nonce, so a token from one session is worthless in another.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass

from fleet.core.credentials import Scope

COOKIE = "fleet_console"
"""The session cookie's name."""
PRE_COOKIE = "fleet_console_login"
"""A random value set with the sign-in form: its CSRF token is bound to it (login CSRF)."""
DEFAULT_TTL_S = 8 * 3600.0


@dataclass(frozen=True)
class Session:
    """Who a signed-in browser is: the key's id, tenant and scopes as signed at sign-in."""

    key_id: str
    tenant: str
    scopes: tuple[str, ...]
    expires_at: float
    nonce: str


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Sessions:
    """Issues and checks session cookies and CSRF tokens with one secret.

    The secret is derived from the server's token secret when it has one (so replicas sharing
    it accept each other's sessions), else drawn at random (sign-ins last as long as the
    process)."""

    def __init__(self, secret: bytes = b"", ttl_s: float = DEFAULT_TTL_S) -> None:
        base = secret or secrets.token_bytes(32)
        self._key = hmac.new(base, b"fleet console session v1", hashlib.sha256).digest()
        self.ttl_s = ttl_s

    def _sign(self, purpose: str, data: str) -> str:
        return _b64(hmac.new(self._key, f"{purpose}\0{data}".encode(), hashlib.sha256).digest())

    def issue(self, key_id: str, tenant: str, scopes: tuple[str, ...], now: float) -> str:
        """A cookie value for a key that has just been verified."""
        body = {"k": key_id, "t": tenant, "s": list(scopes), "e": now + self.ttl_s,
                "n": secrets.token_urlsafe(16)}  # fmt: skip
        payload = _b64(json.dumps(body, separators=(",", ":")).encode())
        return f"{payload}.{self._sign('session', payload)}"

    def check(self, value: str, now: float) -> Session | None:
        """The session a cookie value carries; None when it is malformed, was not signed with
        this secret (tampered), or has expired."""
        payload, dot, signature = value.partition(".")
        if not dot or len(value) > 4096:
            return None
        if not hmac.compare_digest(signature, self._sign("session", payload)):
            return None
        try:
            body = json.loads(_unb64(payload))
            session = Session(
                key_id=str(body["k"]), tenant=str(body["t"]),
                scopes=tuple(str(s) for s in body["s"]), expires_at=float(body["e"]),
                nonce=str(body["n"]),
            )  # fmt: skip
        except (ValueError, KeyError, TypeError):
            return None
        return session if session.expires_at > now else None

    def csrf(self, nonce: str) -> str:
        """The CSRF token of the session (or pre-login value) with this nonce."""
        return self._sign("csrf", nonce)

    def csrf_ok(self, nonce: str, token: str) -> bool:
        return bool(nonce) and hmac.compare_digest(token, self.csrf(nonce))


def cookie_header(name: str, value: str, max_age_s: int, path: str = "/") -> str:
    """A Set-Cookie value with the flags every console cookie carries: HttpOnly (no script
    reads it), Secure (browsers send it over HTTPS and to loopback only), SameSite=Strict (no
    other site's page makes the browser send it)."""
    return f"{name}={value}; Path={path}; Max-Age={max_age_s}; HttpOnly; Secure; SameSite=Strict"


def parse_cookies(header: str) -> dict[str, str]:
    """name -> value of a Cookie header (the first of a repeated name)."""
    out: dict[str, str] = {}
    for part in header.split(";"):
        name, eq, value = part.strip().partition("=")
        if eq and name and name not in out:
            out[name] = value
    return out


@dataclass(frozen=True)
class Viewer:
    """A signed-in person: the key's tenant, and whether it is an admin key."""

    key_id: str
    tenant: str
    admin: bool
    csrf: str
    scopes: frozenset[Scope] = frozenset()
    """The key's scopes: a session action needs the one the API asks of it."""

    @property
    def scope(self) -> str | None:
        """The tenant whose records this viewer reads (None: every tenant's)."""
        return None if self.admin else self.tenant
