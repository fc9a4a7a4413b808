"""Identity in the ledger: join tokens, enrolled and revoked hosts, tenants' API keys.

Only hashes of secrets are stored. Redeeming a join token and recording the host it enrolled
happen in one transaction, so a refused enrollment spends no use of its token. A token is
checked on a read first: a wrong, spent or expired one is refused without taking the ledger's
writer, so a flood of them keeps no submission waiting.

A join token's bound (`fleet.identity.bounds.HostBound`: class, labels, runtimes) is kept with
the host it enrolled, whose registrations it bounds ever after.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleet.core.credentials import (
    Presented,
    Scope,
    matches,
    new_api_key,
    new_join_token,
    secret_hash,
)
from fleet.core.errors import AlreadyExists, InvalidArgument, NotFound, Unauthenticated
from fleet.core.labels import check_labels
from fleet.core.placement import HostCapabilities, HostClass, RuntimeKind
from fleet.identity.bounds import (
    DEFAULT_RUNTIMES,
    HostBound,
    parse_runtimes,
    runtimes_text,
    strict_host_id,
    strict_tenant,
)
from fleet.ledger import queries as Q
from fleet.ledger.leases import Leases
from fleet.ledger.raw import LEASED, Raw

# The identity tables' statements that read or write the runtimes a token allows.
TOKEN_COLS = (
    "id, host_class, labels_json, created_at, expires_at, uses_left, revoked_at, runtimes, "
    "secret_hash"
)
INSERT_TOKEN = (
    "INSERT INTO join_tokens (id, secret_hash, host_class, labels_json, created_at, expires_at, "
    "uses_left, runtimes) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
TOKENS = f"SELECT {TOKEN_COLS} FROM join_tokens ORDER BY created_at"
TOKEN = f"SELECT {TOKEN_COLS} FROM join_tokens WHERE id = ?"
TOKEN_FOR_UPDATE = f"{TOKEN} FOR UPDATE"
HOST_COLS = (
    "host_id, host_class, labels_json, capabilities_json, token_id, enrolled_at, cert_serial, "
    "cert_expires_at, revoked_at, runtimes"
)
HOST = f"SELECT {HOST_COLS} FROM host_identities WHERE host_id = ?"
HOSTS = f"SELECT {HOST_COLS} FROM host_identities ORDER BY host_id"
INSERT_HOST = (
    "INSERT INTO host_identities (host_id, host_class, labels_json, capabilities_json, token_id, "
    "enrolled_at, cert_serial, cert_expires_at, runtimes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
UPDATE_HOST = (
    "UPDATE host_identities SET host_class = ?, capabilities_json = ?, cert_serial = ?, "
    "cert_expires_at = ?, labels_json = ?, runtimes = ? WHERE host_id = ?"
)


@dataclass(frozen=True)
class JoinToken:
    id: str
    host_class: HostClass
    labels: dict[str, str]
    created_at: float
    expires_at: float
    uses_left: int
    revoked_at: float | None
    runtimes: frozenset[RuntimeKind] = DEFAULT_RUNTIMES

    @property
    def bound(self) -> HostBound:
        return HostBound(self.host_class, self.labels, self.runtimes, f"join token {self.id}")


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
    runtimes: frozenset[RuntimeKind] = frozenset()
    """What it may register with (empty: the runtime it enrolled with)."""

    @property
    def bound(self) -> HostBound:
        """Its join token's bound, as kept when it enrolled."""
        runtimes = self.runtimes or frozenset(
            {HostCapabilities.model_validate_json(self.capabilities_json).runtime}
        )
        source = f"its join token ({self.token_id})" if self.token_id else "its enrollment"
        return HostBound(self.host_class, self.labels, runtimes, source)


def _token(row: Any) -> JoinToken:
    """From a row of `TOKEN_COLS`."""
    token_id, host_class, labels, created_at, expires_at, uses_left, revoked_at, runtimes = row[:8]
    return JoinToken(token_id, HostClass(host_class), json.loads(labels), created_at,
                     expires_at, uses_left, revoked_at, parse_runtimes(runtimes))  # fmt: skip


def _key(row: Any) -> ApiKey:
    """From a row of `Q.API_KEY_COLS`."""
    key_id, tenant, scopes, created_at, expires_at, last_used_at, revoked_at = row[:7]
    return ApiKey(key_id, tenant, frozenset(Scope(s) for s in scopes.split(",") if s),
                  created_at, expires_at, last_used_at, revoked_at)  # fmt: skip


def _host(row: Any) -> HostIdentity:
    """From a row of `HOST_COLS`."""
    host_id, host_class, labels, caps, token_id, enrolled_at, serial, expires, revoked = row[:9]
    runtimes = parse_runtimes(row[9]) if row[9] else frozenset()
    return HostIdentity(host_id, HostClass(host_class), json.loads(labels), caps, token_id,
                        enrolled_at, serial, expires, revoked, runtimes)  # fmt: skip


class Identities:
    """The identity tables of one ledger.

    It needs of its ledger only the transactions and the lease sweep a revoked host's leases
    go through: `Leases`, below `fleet.ledger.store.Ledger`, which is made of this class too.
    """

    def __init__(self, ledger: Leases) -> None:
        self._ledger = ledger

    def _one(self, sql: str, params: tuple[Any, ...]) -> Any:
        with self._ledger._read() as db:
            return db.one(sql, params)

    def _all(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        with self._ledger._read() as db:
            return db.all(sql, params)

    # -- join tokens -----------------------------------------------------------------------

    def create_join_token(
        self, host_class: HostClass, labels: dict[str, str], ttl_s: float, uses: int, now: float,
        *, runtimes: frozenset[RuntimeKind] = DEFAULT_RUNTIMES,
    ) -> tuple[JoinToken, Presented]:  # fmt: skip
        """A token that enrolls up to `uses` hosts of `host_class`, with `labels`, on one of
        `runtimes` (by default the namespace runtime only)."""
        if ttl_s <= 0 or ttl_s > 30 * 86400:
            raise InvalidArgument(f"a join token's ttl must be in (0, 30 days], got {ttl_s:g} s")
        if uses < 1 or uses > 10_000:
            raise InvalidArgument(f"a join token's uses must be 1..10000, got {uses}")
        if not runtimes:
            raise InvalidArgument("a join token allows at least one runtime")
        presented = new_join_token()
        with self._ledger._tx() as db:
            db.run(
                INSERT_TOKEN,
                (presented.id, secret_hash(presented.secret), host_class.value,
                 json.dumps(check_labels(labels), sort_keys=True), now, now + ttl_s, uses,
                 runtimes_text(runtimes)),
            )  # fmt: skip
        token = JoinToken(presented.id, host_class, dict(labels), now, now + ttl_s, uses, None,
                          frozenset(runtimes))  # fmt: skip
        return token, presented

    def join_tokens(self) -> list[JoinToken]:
        return [_token(r) for r in self._all(TOKENS)]

    def revoke_join_token(self, token_id: str, now: float) -> None:
        with self._ledger._tx() as db:
            done = db.run(Q.REVOKE_JOIN_TOKEN, (now, token_id))
        if done == 0:
            raise NotFound(f"no join token {token_id!r}")

    @staticmethod
    def _admit(db: Raw, sql: str, presented: Presented, host_id: str, now: float) -> JoinToken:
        """The token, if it may enroll `host_id` now (read with `sql`); else the refusal."""
        strict_host_id(host_id)
        row = db.one(sql, (presented.id,))
        if row is None or not matches(presented.secret, row[8]):
            raise Unauthenticated(f"join token {presented.id}: unknown or wrong secret")
        token = _token(row)
        if token.revoked_at is not None:
            raise Unauthenticated(f"join token {presented.id} was revoked")
        if token.expires_at <= now:
            raise Unauthenticated(f"join token {presented.id} has expired")
        if token.uses_left <= 0:
            raise Unauthenticated(f"join token {presented.id} has been used up")
        existing = db.one(Q.HOST_REVOKED_AT, (host_id,))
        if existing is not None:
            what = "was revoked" if existing[0] is not None else "is enrolled already"
            raise AlreadyExists(
                f"host id {host_id!r} {what}: enroll under another --host-id"
                + ("" if existing[0] is not None else
                   ", or revoke the old one first (fleet host revoke)")
            )  # fmt: skip
        return token

    def admit(self, presented: Presented, host_id: str, now: float) -> JoinToken:
        """What `enroll` would refuse, found on a read: a wrong, spent, expired or revoked
        token, or a host id taken. It waits for no writer and keeps none waiting, so the
        server answers bad tokens without holding up a single write."""
        with self._ledger._read() as db:
            return self._admit(db, TOKEN, presented, host_id, now)

    def enroll(
        self, presented: Presented, host_id: str, capabilities_json: Callable[[JoinToken], str],
        issue: Callable[[], tuple[str, float]], now: float,
    ) -> tuple[HostIdentity, JoinToken]:  # fmt: skip
        """Spends one use of the join token and records `host_id` as enrolled with what the
        token allows, its bound kept with it. `capabilities_json(token)` checks the
        capabilities the host enrolls with against the token (`JoinToken.bound`) and returns
        them; `issue()` signs its certificate (serial, expiry). All or nothing."""
        with self._ledger._tx() as db:
            token = self._admit(db, TOKEN_FOR_UPDATE, presented, host_id, now)
            caps = capabilities_json(token)
            serial, not_after = issue()
            db.run(Q.SPEND_JOIN_TOKEN, (presented.id,))
            db.run(
                INSERT_HOST,
                (host_id, token.host_class.value, json.dumps(token.labels, sort_keys=True),
                 caps, presented.id, now, serial, not_after, runtimes_text(token.runtimes)),
            )  # fmt: skip
        host = HostIdentity(host_id, token.host_class, token.labels, caps, presented.id, now,
                            serial, not_after, None, token.runtimes)  # fmt: skip
        return host, token

    def add_host(
        self, host_id: str, host_class: HostClass, capabilities_json: str, serial: str,
        not_after: float, now: float, labels: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        """Records a host the CA's holder enrolled directly (the embedded fleet's agents);
        enrolling the same id again updates it unless it was revoked. Its bound is what it
        was enrolled with: its class, labels and runtime."""
        strict_host_id(host_id)
        labels_json = json.dumps(check_labels(labels or {}), sort_keys=True)
        runtime = HostCapabilities.model_validate_json(capabilities_json).runtime.value
        with self._ledger._tx() as db:
            existing = db.one(Q.HOST_REVOKED_AT, (host_id,))
            if existing is not None and existing[0] is not None:
                raise AlreadyExists(f"host id {host_id!r} was revoked")
            if existing is None:
                db.run(
                    INSERT_HOST,
                    (host_id, host_class.value, labels_json, capabilities_json, "", now, serial,
                     not_after, runtime),
                )  # fmt: skip
            else:
                db.run(
                    UPDATE_HOST,
                    (host_class.value, capabilities_json, serial, not_after, labels_json,
                     runtime, host_id),
                )  # fmt: skip

    def renewed(self, host_id: str, serial: str, not_after: float) -> None:
        with self._ledger._tx() as db:
            db.run(Q.RENEW_HOST_CERTIFICATE, (serial, not_after, host_id))

    def host(self, host_id: str) -> HostIdentity | None:
        row = self._one(HOST, (host_id,))
        return None if row is None else _host(row)

    def hosts(self) -> list[HostIdentity]:
        return [_host(r) for r in self._all(HOSTS)]

    def revoke_host(self, host_id: str, now: float) -> int:
        """Refuses the host from now on and ends its leases at once (their work is retried
        elsewhere by the usual rules); returns how many leases it held."""
        with self._ledger._tx() as db:
            if not db.run(Q.REVOKE_HOST, (now, host_id)) and not db.one(
                Q.HOST_REVOKED_AT, (host_id,)
            ):
                raise NotFound(f"no enrolled host {host_id!r}")
            leases = db.run(Q.EXPIRE_LEASES_OF_HOST, (now - 1.0, host_id, LEASED))
            # Its work retried (or failed) in the same transaction: a report the host sends
            # after this finds its lease gone and is refused as stale. (A sweep after the
            # commit left a window in which the revoked host's report was still taken.)
            _, ended = self._ledger._expire_lost(db, now)
            self._ledger._count_active(db, ended, -1)
        return leases

    # -- API keys --------------------------------------------------------------------------

    def create_key(
        self, tenant: str, scopes: frozenset[Scope], expires_at: float | None, now: float
    ) -> tuple[ApiKey, Presented]:
        strict_tenant(tenant)
        if not scopes:
            raise InvalidArgument("a key needs at least one scope")
        if expires_at is not None and expires_at <= now:
            raise InvalidArgument("a key's expiry must be in the future")
        presented = new_api_key()
        joined = ",".join(sorted(s.value for s in scopes))
        with self._ledger._tx() as db:
            db.run(
                Q.INSERT_API_KEY,
                (presented.id, secret_hash(presented.secret), tenant, joined, now, expires_at),
            )
        return ApiKey(presented.id, tenant, scopes, now, expires_at, None, None), presented

    def keys(self, tenant: str | None = None) -> list[ApiKey]:
        rows = self._all(Q.API_KEYS, (tenant is None, tenant or ""))
        return [_key(r) for r in rows]

    def key_row(self, key_id: str) -> tuple[ApiKey, str] | None:
        """A key and its secret's hash, for checking a presented key."""
        row = self._one(Q.API_KEY, (key_id,))
        return None if row is None else (_key(row), row[7])

    def key_used(self, key_id: str, now: float) -> None:
        with self._ledger._tx() as db:
            db.run(Q.API_KEY_USED, (now, key_id))

    def revoke_key(self, key_id: str, now: float) -> None:
        with self._ledger._tx() as db:
            done = db.run(Q.REVOKE_API_KEY, (now, key_id))
        if done == 0 and self.key_row(key_id) is None:
            raise NotFound(f"no API key {key_id!r}")
