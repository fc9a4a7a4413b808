"""The agent's connection to the server, and its identity: enrollment with a join token, a
channel with its client certificate, and renewal at two thirds of the certificate's life.

A renewed certificate means a new channel: calls made from then on go over it, calls already
in flight finish on the old one, which is closed a minute later. Work is not interrupted.

An agent given several server replicas (one ledger) uses one at a time. When it is out of reach
the link turns to the next, and a call that failed for it is sent again there: every HostService
call carries what makes a repeat harmless (a claim its request id, a report its fencing token),
so leases are renewed, work claimed and attempts reported on the replica that is left.

The session stream is not moved: the agent keeps one open to every replica given, each over a
channel of its own to that replica alone (`session_stubs`), so a session call reaches the host
through whichever replica its caller uses. With one address (one `dns:` name, say) there is one
stream, on the link's channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import structlog

from fleet.api import convert
from fleet.api.pb import host_pb2, host_pb2_grpc
from fleet.connect import Replicas, is_gone, parse_servers, with_port
from fleet.core.errors import FailedPrecondition, Unauthenticated, error_for
from fleet.core.placement import HostCapabilities
from fleet.identity.ca import csr_for, key_pem, load_cert, new_key
from fleet.identity.tls import HostFiles, HostIdentityMaterial, discover_ca

log = structlog.get_logger(__name__)

OLD_CHANNEL_GRACE_S = 60.0
RECONNECT_BACKOFF_MAX_MS = 1000
"""The longest wait between the channel's attempts to reach a server that went away. gRPC's
default grows to two minutes, so a host could come back to a restarted server only after its
leases (15 s by default), which the server holds for one lease after it starts, had expired."""
CHANNEL_OPTIONS = [("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS)]
RENEW_AT = 2 / 3
"""Renew when this fraction of the certificate's life has passed."""
UNARY = frozenset(
    m.name
    for m in host_pb2.DESCRIPTOR.services_by_name["HostService"].methods
    if not m.client_streaming and not m.server_streaming
)
"""HostService's one-request-one-answer calls: those the link sends again on another replica."""


async def enroll(
    server: str | Sequence[str], join_token: str, host_id: str, caps: HostCapabilities,
    files: HostFiles, *, ca_fingerprint: str = "", ca_pem: bytes = b"",
) -> HostIdentityMaterial:  # fmt: skip
    """Joins the fleet at `server` (its API endpoint; of several replicas, the first that
    answers): checks the server against the pinned CA (its fingerprint, or its certificate),
    makes a key here, and trades the join token and a CSR for a client certificate. Writes
    the identity to `files` and returns it."""
    servers = parse_servers(server)
    for address in servers[:-1]:
        try:
            return await _enroll(address, join_token, host_id, caps, files,
                                 ca_fingerprint=ca_fingerprint, ca_pem=ca_pem)  # fmt: skip
        except _Gone as gone:
            log.warning("enroll_server_unreachable", server=address, error=str(gone))
    try:
        return await _enroll(servers[-1], join_token, host_id, caps, files,
                             ca_fingerprint=ca_fingerprint, ca_pem=ca_pem)  # fmt: skip
    except _Gone as gone:
        raise error_for("UNAVAILABLE", f"enrollment: {gone}") from None


class _Gone(Exception):
    """A server that could not be reached while enrolling (another replica may be)."""


async def _enroll(
    server: str, join_token: str, host_id: str, caps: HostCapabilities, files: HostFiles,
    *, ca_fingerprint: str, ca_pem: bytes,
) -> HostIdentityMaterial:  # fmt: skip
    if not ca_pem:
        if not ca_fingerprint:
            raise FailedPrecondition(
                "enrolling needs the fleet CA pinned: --ca-fingerprint sha256:… (printed by "
                "`fleet host token create`) or --ca FILE"
            )
        ca_pem = await asyncio.to_thread(discover_ca, server, ca_fingerprint)
    key = new_key()
    request = host_pb2.EnrollHostRequest(
        join_token=join_token, host_id=host_id, csr_pem=csr_for(key, host_id),
        capabilities=convert.capabilities_to_pb(caps),
    )  # fmt: skip

    credentials = grpc.ssl_channel_credentials(root_certificates=ca_pem)
    try:
        async with grpc.aio.secure_channel(server, credentials) as channel:
            reply = await host_pb2_grpc.HostServiceStub(channel).EnrollHost(request, timeout=30)
    except grpc.aio.AioRpcError as exc:
        if is_gone(exc):
            raise _Gone(f"{server}: {exc.details()}") from None
        raise error_for(exc.code().name, f"enrollment refused: {exc.details()}") from None
    if reply.ca_pem != ca_pem and load_cert(reply.ca_pem, "CA") != load_cert(ca_pem, "CA"):
        raise Unauthenticated("the server answered with another CA than the pinned one")
    await asyncio.to_thread(
        files.save, key_pem(key), reply.certificate_pem, ca_pem, server, reply.host_port
    )
    identity = files.load()
    log.info("host_enrolled", host_id=identity.host_id, server=server,
             host_endpoint=identity.host_address, expires_at=identity.not_after)  # fmt: skip
    return identity


class Link:
    """The HostService stub the agent calls through; its methods are the current channel's.
    `server`: the API address of each replica (comma-separated, or a list), in the order they
    are tried."""

    def __init__(self, server: str | Sequence[str], identity: HostIdentityMaterial | None,
                 files: HostFiles | None) -> None:  # fmt: skip
        self.replicas = Replicas(server)
        self.identity = identity
        self.files = files
        self._channel: grpc.aio.Channel | None = None
        self._channel_of = 0
        self._stub: Any = None
        self._closing: set[asyncio.Task[None]] = set()
        self._pinned: dict[int, tuple[grpc.aio.Channel, Any]] = {}
        """Channels (and stubs) to one replica each, by its index: its session stream's."""

    @property
    def server(self) -> str:
        """The API address of the replica in use."""
        return self.replicas.current

    @property
    def address(self) -> str:
        """Where HostService is called now: the replica's mutual-TLS endpoint (on the port
        enrollment named), or its API address without TLS."""
        return self._address_of(self.replicas.index)

    def _address_of(self, index: int) -> str:
        """Where replica `index` serves HostService (see `address`)."""
        server = self.replicas.servers[index]
        if self.identity is None:
            return server
        if not self.replicas.several:
            return self.identity.host_address
        return with_port(server, self.identity.host_port)

    def _channel_to(self, address: str) -> grpc.aio.Channel:
        """A channel to `address`, with this host's certificate where it has one."""
        if self.identity is None:
            return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(
            address, self.identity.channel_credentials(), options=CHANNEL_OPTIONS
        )

    def _open(self) -> None:
        self._channel_of = self.replicas.index
        self._channel = self._channel_to(self.address)
        self._stub = host_pb2_grpc.HostServiceStub(self._channel)

    def session_stubs(self) -> list[tuple[str, Any]]:
        """(replica, HostService stub) for each session stream the agent keeps open: with
        several replicas, one each, whose calls go to that replica alone (a stream to a
        replica that is down waits for it, while the others serve); with one address, the
        link itself. Each stub's methods are looked up again at every call, so a stream
        opened again after a renewal uses the new certificate."""
        if not self.replicas.several:
            return [(self.server, self)]
        return [(server, _Pinned(self, i)) for i, server in enumerate(self.replicas.servers)]

    def _pinned_stub(self, index: int) -> Any:
        """The stub of replica `index`'s own channel (opened on first use)."""
        found = self._pinned.get(index)
        if found is None:
            channel = self._channel_to(self._address_of(index))
            found = self._pinned[index] = (channel, host_pb2_grpc.HostServiceStub(channel))
        return found[1]

    def _retire_pinned(self) -> None:
        """Retires every replica's own channel (after a renewal: its streams open again on a
        new one, with the new certificate, once the old channel closes)."""
        for channel, _ in self._pinned.values():
            self._retire(channel)
        self._pinned.clear()

    def _retire(self, channel: grpc.aio.Channel | None) -> None:
        """Closes `channel` after a grace: calls already on it finish there."""
        if channel is None:
            return
        task = asyncio.create_task(_close_later(channel))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _move_on(self, channel: grpc.aio.Channel | None, exc: grpc.aio.AioRpcError) -> bool:
        """After a call on `channel` failed: when its replica is out of reach, the link turns
        to the next one (once for every call that failed on that channel). Returns whether it
        did."""
        if channel is not self._channel or not is_gone(exc):
            return False
        if not self.replicas.move_from(self._channel_of, str(exc.details())):
            return False
        self._open()
        self._retire(channel)
        return True

    async def _unary(self, name: str, request: Any, **kwargs: Any) -> Any:
        """HostService's `name` on the replica in use; on the next one, and so on round the
        list once, while each is out of reach."""
        for tries in range(len(self.replicas.servers), 0, -1):
            channel = self._channel
            try:
                return await getattr(self._stub, name)(request, **kwargs)
            except grpc.aio.AioRpcError as exc:
                if not self._move_on(channel, exc) or tries == 1:
                    raise
        raise AssertionError("unreachable")

    async def __aenter__(self) -> Link:
        self._open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._closing:
            task.cancel()
        if self._channel is not None:
            await self._channel.close()
        for channel, _ in self._pinned.values():
            await channel.close()
        self._pinned.clear()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in UNARY and self.replicas.several:
            return functools.partial(self._unary, name)
        return getattr(self._stub, name)

    def renew_in(self, now: float | None = None) -> float | None:
        """Seconds until the certificate should be renewed (None: no certificate)."""
        if self.identity is None:
            return None
        life = self.identity.not_after - self.identity.not_before
        due = self.identity.not_before + life * RENEW_AT
        return max(0.0, due - (now if now is not None else time.time()))

    async def renew(self) -> None:
        """A new key and certificate; later calls use them."""
        assert self.identity is not None
        key = new_key()
        reply = await self.RenewCertificate(
            host_pb2.RenewCertificateRequest(csr_pem=csr_for(key, self.identity.host_id)),
            timeout=30,
        )
        if self.files is not None:
            await asyncio.to_thread(self.files.renewed, key_pem(key), reply.certificate_pem)
        self.identity = dataclasses.replace(
            self.identity, key_pem=key_pem(key), cert_pem=reply.certificate_pem
        )
        old = self._channel
        self._open()
        self._retire(old)
        self._retire_pinned()
        log.info("host_certificate_renewed", host_id=self.identity.host_id,
                 expires_at=self.identity.not_after)  # fmt: skip

    async def renewals(self, stop: asyncio.Event) -> None:
        """Renews the certificate at two thirds of its life, until `stop`."""
        while not stop.is_set():
            wait = self.renew_in()
            if wait is None:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
                return
            try:
                await self.renew()
            except Exception as exc:
                assert self.identity is not None
                left = self.identity.not_after - time.time()
                log.warning("certificate_renewal_failed", error=str(exc), expires_in_s=left)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), min(30.0, max(left / 10, 1.0)))


class _Pinned:
    """HostService on one replica only, never moved to another: a session stream's stub.
    Each method is the one of the replica's current channel (`Link._pinned_stub`)."""

    def __init__(self, link: Link, index: int) -> None:
        self._link = link
        self._index = index

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._link._pinned_stub(self._index), name)


async def _close_later(channel: grpc.aio.Channel) -> None:
    await asyncio.sleep(OLD_CHANNEL_GRACE_S)
    await channel.close()


def host_files(home: Path) -> HostFiles:
    return HostFiles(home / "host")
