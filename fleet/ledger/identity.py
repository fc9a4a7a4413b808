"""Identity in the ledger: join tokens, enrolled and revoked hosts, tenants' API keys.

Only hashes of secrets are stored. Redeeming a join token and recording the host it enrolled
happen in one transaction, so a refused enrollment spends no use of its token.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import text

from fleet.core.credentials import (
    Presented,
    Scope,
    check_host_id,
    check_tenant,
    matches,
    new_api_key,
    new_join_token,
    secret_hash,
)
from fleet.core.errors import AlreadyExists, InvalidArgument, NotFound, Unauthenticated
from fleet.core.placement import HostClass

if TYPE_CHECKING:
    from fleet.ledger.store import Ledger

MAX_LABELS = 32
MAX_LABEL_BYTES = 256


@dataclass(frozen=True)
class JoinToken:
    id: str
    host_class: HostClass
    labels: dict[str, str]
    created_at: float
    expires_at: float
    uses_left: int
    revoked_at: float | None


@dataclass(frozen=True)
class ApiKey:
    id: str
    tenant: str
    scopes: frozenset[Scope]
    created_at: float
    expires_at: float | None
    last_used_at: float | None
    revoked_at: float | None


@dataclass(frozen=True)
class HostIdentity:
    host_id: str
    host_class: HostClass
    labels: dict[str, str]
    capabilities_json: str
    token_id: str
    enrolled_at: float
    cert_serial: str
    cert_expires_at: float
    revoked_at: float | None


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(f"labels: at most {MAX_LABELS}, got {len(labels)}")
    for key, value in labels.items():
        if not key or len(key) + len(value) > MAX_LABEL_BYTES:
            raise InvalidArgument(f"label {key[:40]!r}: empty key or longer than {MAX_LABEL_BYTES}")
    return labels


def _token(row: Any) -> JoinToken:
    return JoinToken(
        row.id, HostClass(row.host_class), json.loads(row.labels_json), row.created_at,
        row.expires_at, row.uses_left, row.revoked_at,
    )  # fmt: skip


def _key(row: Any) -> ApiKey:
    scopes = frozenset(Scope(s) for s in row.scopes.split(",") if s)
    return ApiKey(row.id, row.tenant, scopes, row.created_at, row.expires_at, row.last_used_at,
                  row.revoked_at)  # fmt: skip


def _host(row: Any) -> HostIdentity:
    return HostIdentity(
        row.host_id, HostClass(row.host_class), json.loads(row.labels_json),
        row.capabilities_json, row.token_id, row.enrolled_at, row.cert_serial,
        row.cert_expires_at, row.revoked_at,
    )  # fmt: skip


class Identities:
    """The identity tables of one ledger."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger

    def _one(self, sql: str, params: dict[str, Any]) -> Any:
        with self._ledger.engine.connect() as conn:
            return conn.execute(text(sql), params).first()

    def _all(self, sql: str, params: dict[str, Any] | None = None) -> list[Any]:
        with self._ledger.engine.connect() as conn:
            return list(conn.execute(text(sql), params or {}))

    # -- join tokens -----------------------------------------------------------------------

    def create_join_token(
        self, host_class: HostClass, labels: dict[str, str], ttl_s: float, uses: int, now: float
    ) -> tuple[JoinToken, Presented]:
        if ttl_s <= 0 or ttl_s > 30 * 86400:
            raise InvalidArgument(f"a join token's ttl must be in (0, 30 days], got {ttl_s:g} s")
        if uses < 1 or uses > 10_000:
            raise InvalidArgument(f"a join token's uses must be 1..10000, got {uses}")
        presented = new_join_token()
        with self._ledger._begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO join_tokens (id, secret_hash, host_class, labels_json, "
                    "created_at, expires_at, uses_left) VALUES (:id, :h, :c, :l, :now, :exp, :u)"
                ),
                {"id": presented.id, "h": secret_hash(presented.secret), "c": host_class.value,
                 "l": json.dumps(check_labels(labels), sort_keys=True), "now": now,
                 "exp": now + ttl_s, "u": uses},
            )  # fmt: skip
        token = JoinToken(presented.id, host_class, labels, now, now + ttl_s, uses, None)
        return token, presented

    def join_tokens(self) -> list[JoinToken]:
        return [_token(r) for r in self._all("SELECT * FROM join_tokens ORDER BY created_at")]

    def revoke_join_token(self, token_id: str, now: float) -> None:
        with self._ledger._begin() as conn:
            done = conn.execute(
                text("UPDATE join_tokens SET revoked_at = :now WHERE id = :id"),
                {"now": now, "id": token_id},
            )
        if done.rowcount == 0:
            raise NotFound(f"no join token {token_id!r}")

    def enroll(
        self, presented: Presented, host_id: str, capabilities_json: Callable[[HostClass], str],
        issue: Callable[[], tuple[str, float]], now: float,
    ) -> tuple[HostIdentity, JoinToken]:  # fmt: skip
        """Spends one use of the join token and records `host_id` as enrolled with what the
        token allows. `capabilities_json(class)` checks and returns the capabilities the host
        enrolls with; `issue()` signs its certificate (serial, expiry). All or nothing."""
        check_host_id(host_id)
        with self._ledger._begin() as conn:
            row = conn.execute(
                text("SELECT * FROM join_tokens WHERE id = :id" + self._ledger._lock_clause),
                {"id": presented.id},
            ).first()
            if row is None or not matches(presented.secret, row.secret_hash):
                raise Unauthenticated(f"join token {presented.id}: unknown or wrong secret")
            if row.revoked_at is not None:
                raise Unauthenticated(f"join token {presented.id} was revoked")
            if row.expires_at <= now:
                raise Unauthenticated(f"join token {presented.id} has expired")
            if row.uses_left <= 0:
                raise Unauthenticated(f"join token {presented.id} has been used up")
            token = _token(row)
            existing = conn.execute(
                text("SELECT revoked_at FROM host_identities WHERE host_id = :h"), {"h": host_id}
            ).first()
            if existing is not None:
                what = "was revoked" if existing.revoked_at is not None else "is enrolled already"
                raise AlreadyExists(
                    f"host id {host_id!r} {what}: enroll under another --host-id"
                    + ("" if existing.revoked_at is not None else
                       ", or revoke the old one first (fleet host revoke)")
                )  # fmt: skip
            caps = capabilities_json(token.host_class)
            serial, not_after = issue()
            conn.execute(
                text("UPDATE join_tokens SET uses_left = uses_left - 1 WHERE id = :id"),
                {"id": presented.id},
            )
            conn.execute(
                text(
                    "INSERT INTO host_identities (host_id, host_class, labels_json, "
                    "capabilities_json, token_id, enrolled_at, cert_serial, cert_expires_at) "
                    "VALUES (:h, :c, :l, :caps, :t, :now, :s, :exp)"
                ),
                {"h": host_id, "c": token.host_class.value, "l": row.labels_json, "caps": caps,
                 "t": presented.id, "now": now, "s": serial, "exp": not_after},
            )  # fmt: skip
        host = HostIdentity(host_id, token.host_class, token.labels, caps, presented.id, now,
                            serial, not_after, None)  # fmt: skip
        return host, token

    def add_host(
        self, host_id: str, host_class: HostClass, capabilities_json: str, serial: str,
        not_after: float, now: float, labels: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        """Records a host the CA's holder enrolled directly (the embedded fleet's agents);
        enrolling the same id again updates it unless it was revoked."""
        check_host_id(host_id)
        with self._ledger._begin() as conn:
            existing = conn.execute(
                text("SELECT revoked_at FROM host_identities WHERE host_id = :h"), {"h": host_id}
            ).first()
            if existing is not None and existing.revoked_at is not None:
                raise AlreadyExists(f"host id {host_id!r} was revoked")
            params = {"h": host_id, "c": host_class.value, "caps": capabilities_json,
                      "now": now, "s": serial, "exp": not_after,
                      "l": json.dumps(check_labels(labels or {}), sort_keys=True)}  # fmt: skip
            if existing is None:
                conn.execute(
                    text(
                        "INSERT INTO host_identities (host_id, host_class, labels_json, "
                        "capabilities_json, token_id, enrolled_at, cert_serial, cert_expires_at) "
                        "VALUES (:h, :c, :l, :caps, '', :now, :s, :exp)"
                    ),
                    params,
                )
            else:
                conn.execute(
                    text(
                        "UPDATE host_identities SET host_class = :c, capabilities_json = :caps, "
                        "cert_serial = :s, cert_expires_at = :exp, labels_json = :l "
                        "WHERE host_id = :h"
                    ),
                    params,
                )

    def renewed(self, host_id: str, serial: str, not_after: float) -> None:
        with self._ledger._begin() as conn:
            conn.execute(
                text(
                    "UPDATE host_identities SET cert_serial = :s, cert_expires_at = :exp "
                    "WHERE host_id = :h AND revoked_at IS NULL"
                ),
                {"h": host_id, "s": serial, "exp": not_after},
            )

    def host(self, host_id: str) -> HostIdentity | None:
        row = self._one("SELECT * FROM host_identities WHERE host_id = :h", {"h": host_id})
        return None if row is None else _host(row)

    def hosts(self) -> list[HostIdentity]:
        return [_host(r) for r in self._all("SELECT * FROM host_identities ORDER BY host_id")]

    def revoke_host(self, host_id: str, now: float) -> int:
        """Refuses the host from now on and ends its leases at once (their work is retried
        elsewhere by the usual rules); returns how many leases it held."""
        with self._ledger._begin() as conn:
            done = conn.execute(
                text(
                    "UPDATE host_identities SET revoked_at = :now "
                    "WHERE host_id = :h AND revoked_at IS NULL"
                ),
                {"now": now, "h": host_id},
            )
            if done.rowcount == 0:
                found = conn.execute(
                    text("SELECT revoked_at FROM host_identities WHERE host_id = :h"),
                    {"h": host_id},
                ).first()
                if found is None:
                    raise NotFound(f"no enrolled host {host_id!r}")
            leases = conn.execute(
                text(
                    "UPDATE work_items SET lease_expires_at = :past "
                    "WHERE lease_owner = :h AND state = 'LEASED'"
                ),
                {"past": now - 1.0, "h": host_id},
            )
        self._ledger.sweep(now)
        return int(leases.rowcount)

    # -- API keys --------------------------------------------------------------------------

    def create_key(
        self, tenant: str, scopes: frozenset[Scope], expires_at: float | None, now: float
    ) -> tuple[ApiKey, Presented]:
        check_tenant(tenant)
        if not scopes:
            raise InvalidArgument("a key needs at least one scope")
        if expires_at is not None and expires_at <= now:
            raise InvalidArgument("a key's expiry must be in the future")
        presented = new_api_key()
        joined = ",".join(sorted(s.value for s in scopes))
        with self._ledger._begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO api_keys (id, secret_hash, tenant, scopes, created_at, "
                    "expires_at) VALUES (:id, :h, :t, :s, :now, :exp)"
                ),
                {"id": presented.id, "h": secret_hash(presented.secret), "t": tenant,
                 "s": joined, "now": now, "exp": expires_at},
            )  # fmt: skip
        return ApiKey(presented.id, tenant, scopes, now, expires_at, None, None), presented

    def keys(self, tenant: str | None = None) -> list[ApiKey]:
        if tenant is None:
            return [_key(r) for r in self._all("SELECT * FROM api_keys ORDER BY created_at")]
        rows = self._all(
            "SELECT * FROM api_keys WHERE tenant = :t ORDER BY created_at", {"t": tenant}
        )
        return [_key(r) for r in rows]

    def key_row(self, key_id: str) -> tuple[ApiKey, str] | None:
        """A key and its secret's hash, for checking a presented key."""
        row = self._one("SELECT * FROM api_keys WHERE id = :id", {"id": key_id})
        return None if row is None else (_key(row), row.secret_hash)

    def key_used(self, key_id: str, now: float) -> None:
        with self._ledger._begin() as conn:
            conn.execute(
                text("UPDATE api_keys SET last_used_at = :now WHERE id = :id"),
                {"now": now, "id": key_id},
            )

    def revoke_key(self, key_id: str, now: float) -> None:
        with self._ledger._begin() as conn:
            done = conn.execute(
                text("UPDATE api_keys SET revoked_at = :now WHERE id = :id AND revoked_at IS NULL"),
                {"now": now, "id": key_id},
            )
        if done.rowcount == 0 and self.key_row(key_id) is None:
            raise NotFound(f"no API key {key_id!r}")
