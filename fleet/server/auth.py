"""Who is calling, checked on every call before the servicer sees it (the server's
interceptor, `fleet.api.interceptor`, calls `Authenticator.authenticate` first).

- HostService (but EnrollHost): the caller's client certificate, verified by TLS against the
  fleet CA, names a host (`spiffe://fleet/host/<id>`); that host must be enrolled and not
  revoked. The servicers take the host id from here, never from the request.
- FleetService: an API key in `authorization: Bearer …`; the key names the tenant and scopes.
- AdminService: an API key with the admin scope.
- Health checking, reflection and EnrollHost (which carries its own join token) need nothing.

A server without TLS (`Security` absent: loopback only, or `--insecure`) authenticates no one:
every caller is `OPEN`, and the tenant is the request's, as before identity existed.

What the ledger says of keys and hosts is kept for `cache_s` (1 s by default), so a revoked key
or host is refused at most that long after its revocation, on every server replica. The two
calls every host makes all the time, Heartbeat and ClaimWork, trust a host's identity for
`HOST_BEAT_CACHE_S` instead: looking it up again on each beat was a ledger read (and a
connection check) per beat, more than the beat's share of its batch. Their own transactions
refuse a revoked host (`Leases.heartbeat_batch`, the claim's host check), and revoking ends the
host's leases at once, so revocation still takes effect on them at once; every other call of a
host still sees it within `cache_s`.

EnrollHost, which anyone may call, is refused at a bounded rate (`RefusalLimiter`): per peer
address and overall, so that a flood of bad join tokens is answered RESOURCE_EXHAUSTED before
it reaches the ledger.
"""

from __future__ import annotations

import contextvars
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from fleet.core.credentials import Scope, bearer, host_id_from_uri, matches
from fleet.core.errors import (
    FleetError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from fleet.identity.bounds import no_control, strict_host_id
from fleet.identity.ca import CertificateAuthority
from fleet.ledger.identity import ApiKey, HostIdentity

log = structlog.get_logger(__name__)

FLEET = "/fleet.v1.FleetService/"
SESSIONS = "/fleet.v1.SessionService/"
ADMIN = "/fleet.v1.AdminService/"
HOSTS = "/fleet.v1.HostService/"
PUBLIC = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
    HOSTS + "EnrollHost",
)
SCOPE_OF = {
    "SubmitRollout": Scope.ROLLOUTS_WRITE,
    "SubmitRollouts": Scope.ROLLOUTS_WRITE,
    "CancelRollout": Scope.ROLLOUTS_WRITE,
    "GetRollout": Scope.ROLLOUTS_READ,
    "ListRollouts": Scope.ROLLOUTS_READ,
    "WatchRollout": Scope.ROLLOUTS_READ,
    "ListEgressEvents": Scope.ROLLOUTS_READ,
    "PutBlob": Scope.ROLLOUTS_WRITE,
    "GetArtifact": Scope.ROLLOUTS_READ,
    # A session's calls run code in its machine: each needs the write scope.
    "OpenSession": Scope.ROLLOUTS_WRITE,
    "Exec": Scope.ROLLOUTS_WRITE,
    "WriteFile": Scope.ROLLOUTS_WRITE,
    "ReadFile": Scope.ROLLOUTS_WRITE,
    "CloseSession": Scope.ROLLOUTS_WRITE,
    "ForkSession": Scope.ROLLOUTS_WRITE,
    "ParkSession": Scope.ROLLOUTS_WRITE,
    "ResumeSession": Scope.ROLLOUTS_WRITE,
    "ListSessions": Scope.ROLLOUTS_READ,
}
KEY_TOUCH_S = 60.0
"""A key's last use is written at most this often."""
HOST_BEAT_CACHE_S = 60.0
"""How long Heartbeat and ClaimWork trust a host identity the ledger gave (see the module's
docstring): a host beating every 3 s is looked up once in twenty beats."""
RECHECKED = frozenset({HOSTS + "Heartbeat", HOSTS + "ClaimWork"})
"""Host calls whose own ledger transaction refuses a revoked host."""


@dataclass(frozen=True)
class Caller:
    """Who a call is from."""

    kind: str
    """"tenant", "host", "public" (a call that needs no identity) or "open" (no security)."""
    tenant: str = ""
    scopes: frozenset[Scope] = frozenset()
    key_id: str = ""
    host: HostIdentity | None = None

    @property
    def host_id(self) -> str:
        return self.host.host_id if self.host is not None else ""

    @property
    def all_tenants(self) -> bool:
        """Sees and acts on every tenant's rollouts."""
        return self.kind == "open" or Scope.ADMIN in self.scopes

    def tenant_for(self, requested: str) -> str:
        """The tenant a submission is for: the key's; a request naming another is refused
        (an admin key, or anyone on a server without identity, may name any tenant whose name
        holds no control character)."""
        if self.all_tenants:
            return no_control(requested, "tenant") if requested else self.tenant or "default"
        if requested and requested != self.tenant:
            raise PermissionDenied(
                f"this key is tenant {self.tenant!r}'s; it cannot act for tenant {requested!r}"
            )
        return self.tenant

    def check_owner(self, rollout_id: str, tenant: str) -> None:
        """Another tenant's rollout answers exactly as an unknown one does."""
        if not self.all_tenants and tenant != self.tenant:
            raise NotFound(f"no rollout {rollout_id!r}")

    def host_id_for(self, requested: str) -> str:
        """The host a HostService call is from: the certificate's. A request naming another
        host is refused."""
        if self.kind == "open":
            return requested
        if self.host is None:
            raise Unauthenticated("this call needs a host's client certificate")
        if requested and requested != self.host.host_id:
            raise PermissionDenied(
                f"the request names host {requested!r}, but the client certificate is host "
                f"{self.host.host_id!r}'s"
            )
        return self.host.host_id


OPEN = Caller("open")
PUBLIC_CALLER = Caller("public")
CALLER: contextvars.ContextVar[Caller] = contextvars.ContextVar("fleet_caller", default=OPEN)


def current() -> Caller:
    return CALLER.get()


@dataclass
class _Cached:
    at: float
    value: Any


@dataclass
class Security:
    """A server with TLS: its CA, where hosts call it, and how long it trusts what it read."""

    ca: CertificateAuthority
    host_listen: str = ""
    """host:port of the mutual-TLS host endpoint ("": the API's host, port 50054 or 0)."""
    san: list[str] = field(default_factory=list)
    """Names the server's certificate carries besides its listen addresses."""
    host_cert_ttl_s: float = 24 * 3600.0
    cache_s: float = 1.0


class Authenticator:
    """Checks callers against the ledger's keys and hosts, with a short cache."""

    def __init__(
        self,
        db: Callable[..., Awaitable[Any]],
        key_row: Callable[[str], tuple[ApiKey, str] | None],
        host_row: Callable[[str], HostIdentity | None],
        key_used: Callable[[str, float], None],
        *,
        host_port: Callable[[], int],
        cache_s: float = 1.0,
    ) -> None:
        self._db = db
        self._key_row = key_row
        self._host_row = host_row
        self._key_used = key_used
        self._host_port = host_port
        self.cache_s = cache_s
        self._keys: dict[str, _Cached] = {}
        self._hosts: dict[str, _Cached] = {}
        self._touched: dict[str, float] = {}
        self._verified: dict[str, _Cached] = {}
        """Authorization headers that passed, with their caller, for `cache_s`."""
        self.refusals = 0

    def forget(self) -> None:
        self._keys.clear()
        self._hosts.clear()
        self._verified.clear()

    async def _cached(
        self, table: dict[str, _Cached], key: str, load: Callable[[str], Any],
        ttl_s: float | None = None,
    ) -> Any:  # fmt: skip
        now = time.monotonic()
        hit = table.get(key)
        # (only what was found is trusted for longer: a miss is looked up again)
        trusted = self.cache_s if ttl_s is None or hit is None or hit.value is None else ttl_s
        if hit is not None and now - hit.at < trusted:
            return hit.value
        value = await self._db(load, key)
        if len(table) > 100_000:
            table.clear()
        table[key] = _Cached(now, value)
        return value

    async def authenticate(self, method: str, context: grpc.aio.ServicerContext) -> None:
        """The server interceptor's hook (`fleet.api.interceptor`): makes the caller of
        `method` current for the servicer, or refuses the call (counted, and logged with the
        key it presented)."""
        try:
            CALLER.set(await self.caller(method, context))
        except FleetError as exc:
            self.refusals += 1
            log.info(
                "auth_refused", method=method, code=str(exc.code), reason=exc.message,
                key_id=exc.details.get("key-id", ""), peer=context.peer(),
            )  # fmt: skip
            raise

    async def caller(self, method: str, context: grpc.aio.ServicerContext) -> Caller:
        if method.startswith(PUBLIC):
            return PUBLIC_CALLER
        if method.startswith(HOSTS):
            return await self._host(context, HOST_BEAT_CACHE_S if method in RECHECKED else None)
        if method.startswith((FLEET, SESSIONS, ADMIN)):
            return await self._tenant(method, context)
        raise PermissionDenied(f"{method} is not served to anyone")

    async def _host(self, context: grpc.aio.ServicerContext, ttl_s: float | None) -> Caller:
        # The TLS handshake verified the certificate against the fleet CA; its identities are
        # its subject alternative names (none without a client certificate).
        uris = [v.decode(errors="replace") for v in context.peer_identities() or ()]
        host_ids = [h for h in (host_id_from_uri(u) for u in uris) if h]
        if not uris:
            raise Unauthenticated(
                "HostService needs this host's client certificate: call the server's host "
                f"endpoint (port {self._host_port()}) with the certificate from enrollment "
                "(fleet agent --join TOKEN)"
            )
        if len(host_ids) != 1:
            raise Unauthenticated("the client certificate names no fleet host")
        try:
            strict_host_id(host_ids[0])
        except InvalidArgument:
            raise Unauthenticated("the client certificate names no fleet host") from None
        host: HostIdentity | None = await self._cached(
            self._hosts, host_ids[0], self._host_row, ttl_s
        )
        if host is None:
            raise Unauthenticated(f"host {host_ids[0]!r} is not enrolled in this fleet")
        if host.revoked_at is not None:
            raise Unauthenticated(f"host {host.host_id!r} was revoked (fleet host revoke)")
        return Caller("host", host=host)

    async def _tenant(self, method: str, context: grpc.aio.ServicerContext) -> Caller:
        header = ""
        for k, v in context.invocation_metadata() or ():
            if k == "authorization" and isinstance(v, str):
                header = v
                break
        need = (Scope.ADMIN if method.startswith(ADMIN)
                else SCOPE_OF.get(method.removeprefix(FLEET).removeprefix(SESSIONS)))  # fmt: skip
        # A header checked within the cache time is not hashed and looked up again.
        hit = self._verified.get(header)
        if hit is not None and time.monotonic() - hit.at < self.cache_s:
            caller: Caller = hit.value
            if need is not None and (need in caller.scopes or Scope.ADMIN in caller.scopes):
                return caller
        caller = await self._tenant_checked(method, header, need)
        if len(self._verified) > 100_000:
            self._verified.clear()
        self._verified[header] = _Cached(time.monotonic(), caller)
        return caller

    async def _tenant_checked(self, method: str, header: str, need: Scope | None) -> Caller:
        presented = bearer({"authorization": header} if header else {})
        found = await self._cached(self._keys, presented.id, self._key_row)
        if found is None:
            raise Unauthenticated(
                f"unknown API key {presented.id}", details={"key-id": presented.id}
            )
        key, stored = found
        if not matches(presented.secret, stored):
            raise Unauthenticated(f"API key {key.id}: wrong secret", details={"key-id": key.id})
        now = time.time()
        if key.revoked_at is not None:
            raise Unauthenticated(f"API key {key.id} was revoked", details={"key-id": key.id})
        if key.expires_at is not None and key.expires_at <= now:
            raise Unauthenticated(f"API key {key.id} has expired", details={"key-id": key.id})
        if need is None or (need not in key.scopes and Scope.ADMIN not in key.scopes):
            raise PermissionDenied(
                f"API key {key.id} lacks the scope {need or 'admin'!s} that "
                f"{method.removeprefix(FLEET)} needs (it has: "
                f"{', '.join(sorted(key.scopes)) or 'none'})",
                details={"key-id": key.id},
            )
        if now - self._touched.get(key.id, 0.0) > KEY_TOUCH_S:
            self._touched[key.id] = now
            try:
                await self._db(self._key_used, key.id, now)
            except Exception:
                log.exception("key_touch_failed", key_id=key.id)
        return Caller("tenant", tenant=key.tenant, scopes=key.scopes, key_id=key.id)


@dataclass
class _Bucket:
    tokens: float
    at: float


class RefusalLimiter:
    """Token buckets for refusals of a call anyone may make: each peer address may be refused
    `per_peer` times at once, refilled at `per_peer_per_s`, and all peers together `overall`
    times, refilled at `overall_per_s`. A call takes one refusal from both before it is
    checked (`take`) and gives it back if it was not refused (`refund`), so however many run
    at once, no more than the buckets hold are ever checked and refused."""

    MAX_PEERS = 10_000

    def __init__(
        self, per_peer: int = 20, per_peer_per_s: float = 0.5, overall: int = 200,
        overall_per_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.per_peer, self.per_peer_per_s = per_peer, per_peer_per_s
        self.overall, self.overall_per_s = overall, overall_per_s
        self._clock = clock
        self._all = _Bucket(float(overall), clock())
        self._peers: dict[str, _Bucket] = {}
        self.limited = 0
        """Calls answered RESOURCE_EXHAUSTED (metrics and tests read it)."""

    @staticmethod
    def peer_address(peer: str) -> str:
        """`ipv4:10.0.0.7:51234` -> `ipv4:10.0.0.7` (a new port is the same peer)."""
        address, _, port = peer.rpartition(":")
        return address if address and port.isdigit() else peer

    def _refill(self, bucket: _Bucket, size: int, rate: float, now: float) -> _Bucket:
        bucket.tokens = min(float(size), bucket.tokens + (now - bucket.at) * rate)
        bucket.at = now
        return bucket

    def take(self, peer: str, what: str) -> None:
        """One refusal taken from the peer's and the overall bucket; RESOURCE_EXHAUSTED when
        either is empty, saying when one will be back."""
        now = self._clock()
        address = self.peer_address(peer)
        overall = self._refill(self._all, self.overall, self.overall_per_s, now)
        mine = self._peers.get(address)
        if mine is None:
            if len(self._peers) >= self.MAX_PEERS:
                self._forget_full(now)
            mine = self._peers[address] = _Bucket(float(self.per_peer), now)
        self._refill(mine, self.per_peer, self.per_peer_per_s, now)
        for bucket, rate, whose in ((mine, self.per_peer_per_s, f"from {address}"),
                                    (overall, self.overall_per_s, "from all peers")):  # fmt: skip
            if bucket.tokens < 1.0:
                self.limited += 1
                wait = (1.0 - bucket.tokens) / rate if rate > 0 else math.inf
                raise ResourceExhausted(
                    f"too many refused {what} calls {whose}: try again in {wait:.0f} s",
                    retry_after_s=wait if math.isfinite(wait) else None,
                )
        mine.tokens -= 1.0
        overall.tokens -= 1.0

    def refund(self, peer: str) -> None:
        """The call `take` was made for was not refused: its refusal is given back."""
        mine = self._peers.get(self.peer_address(peer))
        if mine is not None:
            mine.tokens = min(float(self.per_peer), mine.tokens + 1.0)
        self._all.tokens = min(float(self.overall), self._all.tokens + 1.0)

    def _forget_full(self, now: float) -> None:
        """Peers whose buckets have refilled are the same as peers never seen: dropped (all of
        them, if none has refilled), so that the table stays bounded."""
        full = [a for a, b in self._peers.items()
                if b.tokens + (now - b.at) * self.per_peer_per_s >= self.per_peer]  # fmt: skip
        for address in full or list(self._peers):
            del self._peers[address]
