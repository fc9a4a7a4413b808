"""Join tokens and API keys: their formats, scopes, and how a presented secret is checked.

A join token (`fleet host token create`) lets one new host enroll: `<id>.<secret>`, the id 6
lowercase hex digits, the secret 32 (128 bits). An API key (`fleet key create`) names a tenant
and scopes: `flt_<id>_<secret>`, the id 12 hex digits, the secret 43 base64url characters (256
bits). The ledger keeps only the id and the SHA-256 of the secret: the secrets are random and
long, so a fast hash is enough (there is no password to guess), and a leaked database holds
nothing a caller could present. Comparisons are constant-time.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from fleet.core.errors import InvalidArgument, Unauthenticated

JOIN_TOKEN_RE = re.compile(r"^([0-9a-f]{6})\.([0-9a-f]{32})$")
API_KEY_RE = re.compile(r"^flt_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")
HOST_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
SPIFFE_PREFIX = "spiffe://fleet/host/"


class Scope(enum.StrEnum):
    """What an API key allows."""

    ROLLOUTS_READ = "rollouts:read"
    """Get, list, watch its tenant's rollouts and read their egress events."""
    ROLLOUTS_WRITE = "rollouts:write"
    """Submit and cancel its tenant's rollouts."""
    ADMIN = "admin"
    """Everything, across tenants."""


def parse_scopes(text: str) -> frozenset[Scope]:
    """`rollouts:read,rollouts:write` -> scopes; an unknown one is refused by name."""
    out: set[Scope] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            out.add(Scope(part))
        except ValueError:
            known = ", ".join(s.value for s in Scope)
            raise InvalidArgument(f"unknown scope {part!r} (known: {known})") from None
    if not out:
        raise InvalidArgument("a key needs at least one scope")
    return frozenset(out)


def secret_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def matches(secret: str, stored_hash: str) -> bool:
    return hmac.compare_digest(secret_hash(secret), stored_hash)


@dataclass(frozen=True)
class Presented:
    """A token or key as a caller presented it: its id, to look up, and its secret, to check."""

    id: str
    secret: str


def new_join_token() -> Presented:
    return Presented(secrets.token_hex(3), secrets.token_hex(16))


def format_join_token(token: Presented) -> str:
    return f"{token.id}.{token.secret}"


def parse_join_token(text: str) -> Presented:
    """A join token as typed; a malformed one is refused without echoing it."""
    found = JOIN_TOKEN_RE.match(text.strip())
    if found is None:
        raise Unauthenticated(
            "malformed join token: expected <6 hex digits>.<32 hex digits> "
            "(as printed by `fleet host token create`)"
        )
    return Presented(found.group(1), found.group(2))


def new_api_key() -> Presented:
    return Presented(secrets.token_hex(6), secrets.token_urlsafe(32))


def format_api_key(key: Presented) -> str:
    return f"flt_{key.id}_{key.secret}"


def parse_api_key(text: str) -> Presented:
    found = API_KEY_RE.match(text.strip())
    if found is None:
        raise Unauthenticated(
            "malformed API key: expected flt_<12 hex digits>_<43 characters> "
            "(as printed by `fleet key create`)"
        )
    return Presented(found.group(1), found.group(2))


def bearer(metadata: dict[str, str]) -> Presented:
    """The API key in `authorization: Bearer …` metadata."""
    value = metadata.get("authorization", "")
    if not value:
        raise Unauthenticated(
            "no API key: send `authorization: Bearer flt_…` (CLI: --key or $FLEET_KEY)"
        )
    kind, _, rest = value.partition(" ")
    if kind.lower() != "bearer" or not rest.strip():
        raise Unauthenticated("the authorization metadata must be `Bearer <API key>`")
    return parse_api_key(rest)


def check_host_id(host_id: str) -> str:
    if not HOST_ID_RE.match(host_id):
        raise InvalidArgument(
            f"host id {host_id[:80]!r} must be 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return host_id


def check_tenant(tenant: str) -> str:
    if not TENANT_RE.match(tenant):
        raise InvalidArgument(
            f"tenant {tenant[:80]!r} must be 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return tenant


def host_uri(host_id: str) -> str:
    return SPIFFE_PREFIX + host_id


def host_id_from_uri(uri: str) -> str | None:
    if not uri.startswith(SPIFFE_PREFIX):
        return None
    host_id = uri[len(SPIFFE_PREFIX) :]
    return host_id if HOST_ID_RE.match(host_id) else None
