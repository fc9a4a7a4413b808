"""The fleet server: FleetService and HostService over one ledger, health and reflection on."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fleet._proto.fleet.v1 import (
    fleet_pb2,
    fleet_pb2_grpc,
    host_pb2,
    host_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    types_pb2,
)
from fleet.artifacts.store import BlobStore, RegistryBlobStore
from fleet.core import tokens
from fleet.core.credentials import parse_join_token
from fleet.core.errors import (
    Aborted,
    FailedPrecondition,
    FleetError,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from fleet.core.lifecycle import RolloutState
from fleet.core.manifest import SubmitRequest, build_manifest, image_of, validate_request
from fleet.core.placement import HostCapabilities, HostClass, Requirements, unservable_reason
from fleet.core.rollout import Assignment, Completion
from fleet.identity.ca import Issued
from fleet.identity.tls import ServerTls, is_loopback, server_names, split_address
from fleet.image import oci
from fleet.image.store import ImageStore
from fleet.ledger.retention import purge_finished, referenced_blobs
from fleet.ledger.store import Ledger
from fleet.server import convert
from fleet.server.auth import Authenticator, AuthInterceptor, Caller, Security, current
from fleet.server.status import STATUS_FOR, mapped

log = structlog.get_logger(__name__)
T = TypeVar("T")
R = TypeVar("R")

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_CLAIM_WAIT_S = 30.0


@dataclass(frozen=True)
class ServerConfig:
    """Server tunables."""

    lease_ttl_s: float = 15.0
    """How long a lease lives without a heartbeat."""
    heartbeat_interval_s: float = 3.0
    """How often agents are told to beat."""
    sweep_interval_s: float = 0.5
    """How often expired leases and missed deadlines are handled."""
    max_message_bytes: int = MAX_MESSAGE_BYTES
    """Largest request accepted; bigger ones get RESOURCE_EXHAUSTED."""
    max_active_per_tenant: int = 100_000
    """Queued plus running rollouts one tenant may have; more are refused with a retry hint."""
    max_running_per_tenant: int = 0
    """Rollouts of one tenant leased at once across the fleet (0: no limit)."""
    token_secret: bytes = b""
    """Signs inference tokens for rollouts that use the gateway (shared with the gateway)."""
    gateway_address: str = ""
    """The gateway's gRPC address, watched for backpressure ("": no watching)."""
    backpressure_queue_depth: int = 256
    """Gateway queue depth at which rollouts that use it stop being started."""
    backpressure_resume_depth: int = 64
    """Depth at which they start again (below the threshold, so the router does not flap)."""
    gateway_poll_s: float = 0.25
    """How often the gateway's queue is read."""
    metrics_listen: str = ""
    """host:port for GET /metrics (Prometheus text); "": no metrics endpoint."""
    artifacts_dir: str = ""
    """Where uploaded inputs and collected outputs are kept ("": beside a SQLite ledger, else
    $FLEET_HOME/artifacts)."""
    max_input_mib: float = 1024.0
    """A rollout's inputs together, at most."""
    max_output_mib: float = 1024.0
    """A rollout's outputs together, at most (per attempt)."""
    registry: str = ""
    """An OCI registry repository hosts fetch images from by digest ("": from this server)."""
    artifacts_registry: str = ""
    """Keep inputs and outputs in this OCI registry repository (replicas sharing a ledger
    share it; `artifacts_dir` is then a local cache)."""
    registry_ca: bytes = b""
    """A CA registries' certificates chain to, besides the system's and the fleet's."""
    retain_days: float = 30.0
    """Finished rollouts are deleted with their files this long after they end (0: kept)."""
    retention_interval_s: float = 3600.0
    """How often retention runs (and once at start)."""


MIB = 1 << 20


def artifacts_root(ledger: Ledger, images: ImageStore, config: ServerConfig) -> Path:
    if config.artifacts_dir:
        return Path(config.artifacts_dir)
    database = ledger.engine.url.database if ledger.backend == "sqlite" else None
    if database:
        return Path(database).parent / "artifacts"
    return images.root.parent / "artifacts"


class Pulse:
    """Wakes every waiter when something changed; waiters also time out and look again."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout_s)


class Core:
    """Shared state of the servicers: the ledger on one worker thread, and wake-ups."""

    def __init__(
        self, ledger: Ledger, images: ImageStore, config: ServerConfig,
        security: Security | None = None,
    ) -> None:  # fmt: skip
        self.ledger = ledger
        self.images = images
        self.config = config
        self.security = security
        root = artifacts_root(ledger, images, config)
        self.blobs = (
            RegistryBlobStore(root, config.artifacts_registry, config.registry_ca or None)
            if config.artifacts_registry
            else BlobStore(root)
        )
        self.host_port = 0
        """The mutual-TLS host endpoint's port (0: none, the server has no TLS)."""
        self.auth: Authenticator | None = None
        if security is not None:
            identities = ledger.identities
            self.auth = Authenticator(
                self.db, identities.key_row, identities.host, identities.key_used,
                host_port=lambda: self.host_port, cache_s=security.cache_s,
            )  # fmt: skip
        self._db = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger")
        self._hosts: tuple[float, list[HostCapabilities]] | None = None
        self.work_pulse = Pulse()
        self.event_pulse = Pulse()
        self.hold_inference = False
        """Backpressure: the gateway is over its threshold (or unreachable)."""
        self.gateway_queue_depth = 0

    async def db(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._db, fn, *args)

    def caller(self) -> Caller:
        """Who the current call is from (see `fleet.server.auth`)."""
        caller = current()
        if self.security is not None and caller.kind == "open":
            raise Internal("a call reached a servicer without being authenticated")
        return caller

    async def unservable_reason(self, host_class: HostClass, needs: Requirements) -> str | None:
        """Why no registered host could ever serve such work (None: some host could). The
        hosts are read from the ledger at most once every HOSTS_FRESH_S for work some host
        serves (every submission asks); a refusal is always decided on a fresh read, so a host
        registered since, here or through another server, is never missed."""
        now = time.monotonic()
        cached = self._hosts
        if (
            cached is not None
            and now - cached[0] < HOSTS_FRESH_S
            and unservable_reason(cached[1], host_class, needs) is None
        ):
            return None
        hosts = await self.db(self.ledger.hosts)
        self._hosts = (now, hosts)
        return unservable_reason(hosts, host_class, needs)

    def hosts_changed(self) -> None:
        self._hosts = None

    def changed(self) -> None:
        self.work_pulse.fire()
        self.event_pulse.fire()

    def close(self) -> None:
        self._db.shutdown(wait=True)


DEFAULT_HOST_PORT = 50054
"""The host endpoint's port when the API listens on a fixed one."""
HOSTS_FRESH_S = 1.0
"""How long a submission may rely on the hosts another one read (see `Core.unservable_reason`)."""
MAX_CHECKPOINTS_PER_CALL = 256
MAX_LIST_BYTES = 3 << 20
"""A ListRollouts page ends before this many bytes of rollouts (results included)."""


class GroupCommit(Generic[T, R]):
    """Group commit: items that arrive while one batch is being written go together into the
    next transaction, one durable commit for all of them. `write` gets a batch and returns one
    answer per item, in order: a result, or the exception that refused that item alone."""

    MAX_BATCH = 256

    def __init__(
        self,
        core: Core,
        write: Callable[[list[T], float], list[R | Exception]],
        *,
        notify: bool = True,
    ) -> None:
        self.core = core
        self._write = write
        self._notify = notify
        """Wake claims and watchers after each batch (what it wrote changes rollouts)."""
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._flushing = False
        self._task: asyncio.Task[None] | None = None

    async def submit(self, item: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if not self._flushing:
            self._flushing = True
            self._task = asyncio.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch = self._pending[: self.MAX_BATCH]
                del self._pending[: self.MAX_BATCH]
                try:
                    answers = await self.core.db(self._write, [i for i, _ in batch], time.time())
                except Exception as exc:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for (_, future), answer in zip(batch, answers, strict=True):
                    if future.done():
                        continue
                    if isinstance(answer, Exception):
                        future.set_exception(answer)
                    else:
                        future.set_result(answer)
                if self._notify:
                    self.core.changed()
        finally:
            self._flushing = False


class CompletionBatcher(GroupCommit[tuple[str, Completion], RolloutState]):
    """Group commit for CompleteWork."""

    def __init__(self, core: Core) -> None:
        super().__init__(core, core.ledger.complete_batch)  # type: ignore[arg-type]

    async def complete(self, host_id: str, report: Completion) -> RolloutState:
        return await self.submit((host_id, report))


class CheckpointBatcher(GroupCommit[tuple[str, str, int, int, bytes], None]):
    """Group commit for PutCheckpoint: every running hybrid episode stores one per action."""

    def __init__(self, core: Core) -> None:
        super().__init__(core, core.ledger.put_checkpoints, notify=False)  # type: ignore[arg-type]


class FleetServicer(fleet_pb2_grpc.FleetServiceServicer):  # type: ignore[misc]
    def __init__(self, core: Core) -> None:
        self.core = core

    @mapped
    async def SubmitRollout(
        self, request: fleet_pb2.SubmitRolloutRequest, context: grpc.aio.ServicerContext
    ) -> fleet_pb2.SubmitRolloutResponse:
        now = datetime.now(UTC)
        request.tenant = self.core.caller().tenant_for(request.tenant)
        submit = convert.submit_from_pb(request)
        parsed = validate_request(submit, now)
        await self._check_inputs(submit)
        image = image_of(parsed)
        pinned = ""
        if oci.looks_like_archive(image):  # on the submitter's disk: uploaded flattened
            image_digest = await self._import_upload(request.image_upload, image,
                                                     submit.smolfile_name)  # fmt: skip
        elif oci.looks_like_reference(image):  # a registry's image: pinned by its digests
            cas = [self.core.config.registry_ca]
            if self.core.security is not None:
                cas.append(self.core.security.ca.pem)
            image_digest, pinned = await asyncio.to_thread(
                oci.resolve, image, b"".join(cas) or None
            )
        else:
            image_digest = await self.core.db(self.core.images.resolve, image)
        manifest = build_manifest(submit, parsed, image_digest, now, pinned)
        reason = await self.core.unservable_reason(manifest.host_class, manifest.requirements)
        if reason:
            raise FailedPrecondition(reason)
        rollout, created = await self.core.db(
            functools.partial(
                self.core.ledger.submit,
                max_active_per_tenant=self.core.config.max_active_per_tenant,
            ),
            submit,
            manifest,
            now.timestamp(),
        )
        if created:
            self.core.changed()
        log.info(
            "rollout_submitted",
            rollout_id=rollout.id,
            created=created,
            request_id=request.request_id,
            host_class=manifest.host_class,
        )
        return fleet_pb2.SubmitRolloutResponse(
            rollout=convert.rollout_to_pb(rollout), created=created
        )

    async def _import_upload(self, digest: str, image: str, where: str) -> str:
        """The image a submitter flattened from an archive and uploaded (PutBlob), stored in
        the image store under its digest."""
        if not digest:
            raise InvalidArgument(
                f"{where}: image {image!r} is an archive on the submitter's disk: submit with "
                "the fleet CLI (it uploads the archive), or push the image to a registry"
            )
        try:
            await asyncio.to_thread(self.core.blobs.size, digest)  # (fetched, where remote)
            blob = await asyncio.to_thread(self.core.blobs.path, digest)
        except NotFound:
            raise FailedPrecondition(f"image_upload {digest} was not uploaded (PutBlob)") from None
        await asyncio.to_thread(self.core.images.add_blob, digest, blob)
        return digest

    async def _check_inputs(self, submit: SubmitRequest) -> None:
        """Every input was uploaded, with the size the request states, within the limit."""
        total = 0
        for index, item in enumerate(submit.inputs):
            try:
                size = await asyncio.to_thread(self.core.blobs.size, item.digest)
            except NotFound:
                raise FailedPrecondition(
                    f"inputs[{index}] ({item.path}): blob {item.digest} was not uploaded "
                    "(PutBlob it first)"
                ) from None
            if size != item.size:
                raise InvalidArgument(
                    f"inputs[{index}] ({item.path}): size {item.size} but the blob holds {size}"
                )
            total += size
        limit = self.core.config.max_input_mib * MIB
        if total > limit:
            raise ResourceExhausted(
                f"inputs: {total / MIB:.1f} MiB together, over the limit of "
                f"{self.core.config.max_input_mib:g} MiB (fleet serve --max-input-mib)"
            )

    @mapped
    async def PutBlob(
        self, requests: AsyncIterator[fleet_pb2.BlobPart], context: grpc.aio.ServicerContext
    ) -> fleet_pb2.PutBlobResponse:
        self.core.caller()

        async def parts() -> AsyncIterator[bytes]:
            async for part in requests:
                yield part.data

        limit = int(self.core.config.max_input_mib * MIB)
        digest, size = await self.core.blobs.put(
            parts(), limit, "an input (fleet serve --max-input-mib)"
        )
        log.info("blob_stored", digest=digest, size=size, key_id=self.core.caller().key_id)
        return fleet_pb2.PutBlobResponse(digest=digest, size=size)

    async def GetArtifact(
        self, request: fleet_pb2.GetArtifactRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[fleet_pb2.ArtifactChunk]:
        try:
            rollout = await self.core.db(self.core.ledger.get, request.rollout_id)
            self.core.caller().check_owner(request.rollout_id, rollout.tenant)
            known = {i.digest for i in rollout.manifest.inputs}
            known |= {o.digest for o in rollout.outputs if o.digest}
            if request.digest not in known:
                raise NotFound(f"rollout {request.rollout_id} has no artifact {request.digest}")
            async for offset, data, total in self.core.blobs.chunks(request.digest, request.offset):
                yield fleet_pb2.ArtifactChunk(offset=offset, data=data, total_size=total)
        except FleetError as exc:
            await context.abort(STATUS_FOR[exc.code], exc.message)

    @mapped
    async def GetRollout(
        self, request: fleet_pb2.GetRolloutRequest, context: grpc.aio.ServicerContext
    ) -> types_pb2.Rollout:
        rollout = await self.core.db(self.core.ledger.get, request.id)
        self.core.caller().check_owner(request.id, rollout.tenant)
        return convert.rollout_to_pb(rollout)

    async def _check_owner(self, rollout_id: str) -> None:
        caller = self.core.caller()
        if not caller.all_tenants:
            rollout = await self.core.db(self.core.ledger.get, rollout_id)
            caller.check_owner(rollout_id, rollout.tenant)

    @mapped
    async def ListRollouts(
        self, request: fleet_pb2.ListRolloutsRequest, context: grpc.aio.ServicerContext
    ) -> fleet_pb2.ListRolloutsResponse:
        caller = self.core.caller()
        rollouts, token = await self.core.db(
            functools.partial(
                self.core.ledger.list_rollouts,
                tenant=None if caller.all_tenants else caller.tenant,
            ),
            request.page_size,
            request.page_token,
            dict(request.labels),
            request.could_reach.strip(),
        )
        page: list[types_pb2.Rollout] = []
        size = 0
        for rollout in rollouts:
            pb = convert.rollout_to_pb(rollout)
            size += pb.ByteSize()
            if page and size > MAX_LIST_BYTES:
                # A client's default receive limit is 4 MiB: end the page early instead.
                token = await self.core.db(self.core.ledger.page_token_at, page[-1].id)
                break
            page.append(pb)
        return fleet_pb2.ListRolloutsResponse(rollouts=page, next_page_token=token)

    async def WatchRollout(
        self, request: fleet_pb2.WatchRolloutRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[types_pb2.RolloutEvent]:
        after = request.after_sequence
        if after < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "after_sequence is negative")
        try:
            await self._check_owner(request.id)
        except FleetError as exc:
            await context.abort(STATUS_FOR[exc.code], exc.message)
            return
        while True:
            try:
                events = await self.core.db(self.core.ledger.events, request.id, after)
                rollout = None if events else await self.core.db(self.core.ledger.get, request.id)
            except FleetError as exc:
                await context.abort(STATUS_FOR[exc.code], exc.message)
                return
            for e in events:
                after = e.sequence
                yield convert.event_to_pb(e)
            if rollout is not None and rollout.state.final:
                return
            if not events:
                await self.core.event_pulse.wait(1.0)

    @mapped
    async def CancelRollout(
        self, request: fleet_pb2.CancelRolloutRequest, context: grpc.aio.ServicerContext
    ) -> types_pb2.Rollout:
        await self._check_owner(request.id)
        caller = self.core.caller()
        actor = f"request:{request.request_id}" if request.request_id else "client"
        if caller.key_id:
            actor += f" key:{caller.key_id}"
        rollout = await self.core.db(
            self.core.ledger.cancel, request.id, request.reason, actor, time.time()
        )
        self.core.changed()
        return convert.rollout_to_pb(rollout)

    @mapped
    async def ListEgressEvents(
        self, request: fleet_pb2.ListEgressEventsRequest, context: grpc.aio.ServicerContext
    ) -> fleet_pb2.ListEgressEventsResponse:
        if not request.rollout_id:
            raise InvalidArgument("rollout_id is empty")
        await self._check_owner(request.rollout_id)
        rows = await self.core.db(self.core.ledger.egress_events, request.rollout_id)
        return fleet_pb2.ListEgressEventsResponse(
            events=[convert.egress_event_to_pb(e, request.rollout_id, a) for a, e in rows]
        )


class HostServicer(host_pb2_grpc.HostServiceServicer):  # type: ignore[misc]
    def __init__(self, core: Core) -> None:
        self.core = core
        self.batcher = CompletionBatcher(core)
        self.checkpoints = CheckpointBatcher(core)

    def _host_id(self, requested: str) -> str:
        return self.core.caller().host_id_for(requested)

    @mapped
    async def EnrollHost(
        self, request: host_pb2.EnrollHostRequest, context: grpc.aio.ServicerContext
    ) -> host_pb2.EnrollHostResponse:
        security = self.core.security
        if security is None:
            raise FailedPrecondition(
                "this server has no TLS, so hosts cannot enroll: start it with a CA "
                "(fleet ca init; fleet serve --tls)"
            )
        presented = parse_join_token(request.join_token)
        ttl = security.host_cert_ttl_s

        def caps_json(host_class: HostClass) -> str:
            caps = convert.capabilities_from_pb(
                host_pb2.RegisterHostRequest(
                    host_id=request.host_id, host_class=convert.HOST_CLASS_TO_PB[host_class],
                    capabilities=request.capabilities,
                )
            )  # fmt: skip
            return caps.model_dump_json()

        signed: list[Issued] = []

        def issue() -> tuple[str, float]:
            signed.append(security.ca.sign_host_csr(request.csr_pem, request.host_id, _td(ttl)))
            return signed[0].serial, signed[0].not_after

        host, token = await self.core.db(
            self.core.ledger.identities.enroll, presented, request.host_id, caps_json, issue,
            time.time(),
        )  # fmt: skip
        issued = signed[0]
        log.info("host_enrolled", host_id=host.host_id, host_class=host.host_class,
                 token_id=token.id, serial=issued.serial, peer=context.peer())  # fmt: skip
        return host_pb2.EnrollHostResponse(
            host_id=host.host_id,
            host_class=convert.HOST_CLASS_TO_PB[host.host_class],
            certificate_pem=issued.pem,
            ca_pem=security.ca.pem,
            host_port=self.core.host_port,
            expires_at=convert.ts(datetime.fromtimestamp(issued.not_after, UTC)),
        )

    @mapped
    async def RenewCertificate(
        self, request: host_pb2.RenewCertificateRequest, context: grpc.aio.ServicerContext
    ) -> host_pb2.RenewCertificateResponse:
        security = self.core.security
        host_id = self._host_id("")
        if security is None:
            raise FailedPrecondition("this server has no TLS: there is no certificate to renew")
        issued = security.ca.sign_host_csr(request.csr_pem, host_id,
                                           _td(security.host_cert_ttl_s))  # fmt: skip
        await self.core.db(
            self.core.ledger.identities.renewed, host_id, issued.serial, issued.not_after
        )
        log.info("host_certificate_renewed", host_id=host_id, serial=issued.serial)
        return host_pb2.RenewCertificateResponse(
            certificate_pem=issued.pem,
            expires_at=convert.ts(datetime.fromtimestamp(issued.not_after, UTC)),
        )

    @mapped
    async def RegisterHost(
        self, request: host_pb2.RegisterHostRequest, context: grpc.aio.ServicerContext
    ) -> host_pb2.RegisterHostResponse:
        request.host_id = self._host_id(request.host_id)
        caps = convert.capabilities_from_pb(request)
        enrolled = self.core.caller().host
        if enrolled is not None:
            check_within(caps, HostCapabilities.model_validate_json(enrolled.capabilities_json))
        await self.core.db(self.core.ledger.register_host, caps, time.time())
        self.core.hosts_changed()
        log.info(
            "host_registered",
            host_id=caps.host_id,
            host_class=caps.host_class,
            runtime=caps.runtime,
            isolation=caps.isolation,
            reason=caps.runtime_reason,
        )
        return host_pb2.RegisterHostResponse(
            host_id=caps.host_id,
            lease_ttl_s=self.core.config.lease_ttl_s,
            heartbeat_interval_s=self.core.config.heartbeat_interval_s,
            registry=self.core.config.registry,
        )

    @mapped
    async def Heartbeat(
        self, request: host_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> host_pb2.HeartbeatResponse:
        now = time.time()
        host_id = self._host_id(request.host_id)
        leases = [(lease.work_id, lease.fencing_token) for lease in request.leases]
        renewed, stop = await self.core.db(
            self.core.ledger.heartbeat, host_id, leases, now, self.core.config.lease_ttl_s
        )
        return host_pb2.HeartbeatResponse(
            renewed=[host_pb2.LeaseRef(work_id=w, fencing_token=t) for w, t in renewed],
            stop_work_ids=stop,
            lease_expires_at=convert.ts(
                datetime.fromtimestamp(now + self.core.config.lease_ttl_s, UTC)
            ),
        )

    def _with_token(self, a: Assignment) -> Assignment:
        """A rollout that uses the gateway gets a token scoped to it, valid to its deadline."""
        if not a.manifest.requirements.inference:
            return a
        secret = self.core.config.token_secret
        if not secret:
            raise FailedPrecondition(
                "this server has no token secret, so it cannot give rollouts that use the "
                "inference gateway their tokens (see Paths.token_secret)"
            )
        token = tokens.issue(secret, a.rollout_id, a.manifest.deadline.timestamp())
        return a.model_copy(update={"inference_token": token})

    @mapped
    async def ClaimWork(
        self, request: host_pb2.ClaimWorkRequest, context: grpc.aio.ServicerContext
    ) -> host_pb2.ClaimWorkResponse:
        if request.max_items < 1:
            raise InvalidArgument("max_items must be at least 1")
        wait_s = min(max(request.wait_s, 0.0), MAX_CLAIM_WAIT_S)
        host_id = self._host_id(request.host_id)
        give_up = time.monotonic() + wait_s
        while True:
            items = await self.core.db(
                functools.partial(
                    self.core.ledger.claim,
                    request_id=request.request_id,
                    max_running_per_tenant=self.core.config.max_running_per_tenant,
                    hold_inference=self.core.hold_inference,
                ),
                host_id,
                request.max_items,
                time.time(),
                self.core.config.lease_ttl_s,
            )
            if items:
                self.core.event_pulse.fire()
                return host_pb2.ClaimWorkResponse(
                    items=[convert.assignment_to_pb(self._with_token(a)) for a in items]
                )
            left = give_up - time.monotonic()
            if left <= 0 or context.done():
                return host_pb2.ClaimWorkResponse()
            # Woken by new work; the timeout also catches retries whose backoff just ended.
            await self.core.work_pulse.wait(min(left, 0.5))

    @mapped
    async def PutCheckpoint(
        self, request: host_pb2.PutCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> host_pb2.PutCheckpointResponse:
        host_id = self._host_id(request.host_id)
        await self.checkpoints.submit(
            (host_id, request.work_id, request.fencing_token, request.sequence, request.data)
        )
        return host_pb2.PutCheckpointResponse()

    @mapped
    async def PutCheckpoints(
        self, request: host_pb2.PutCheckpointsRequest, context: grpc.aio.ServicerContext
    ) -> host_pb2.PutCheckpointsResponse:
        if len(request.checkpoints) > MAX_CHECKPOINTS_PER_CALL:
            raise InvalidArgument(
                f"checkpoints: at most {MAX_CHECKPOINTS_PER_CALL} per call, "
                f"got {len(request.checkpoints)}"
            )
        host_ids = [self._host_id(c.host_id) for c in request.checkpoints]
        answers = await asyncio.gather(
            *(
                self.checkpoints.submit((h, c.work_id, c.fencing_token, c.sequence, c.data))
                for h, c in zip(host_ids, request.checkpoints, strict=True)
            ),
            return_exceptions=True,
        )
        outcomes = []
        for answer in answers:
            if isinstance(answer, FleetError):  # refused alone; the others are stored
                outcomes.append(host_pb2.CheckpointOutcome(code=str(answer.code),
                                                           message=answer.message))  # fmt: skip
            elif isinstance(answer, BaseException):  # the whole batch failed: a retry may not
                raise answer
            else:
                outcomes.append(host_pb2.CheckpointOutcome())
        return host_pb2.PutCheckpointsResponse(outcomes=outcomes)

    @mapped
    async def ReclaimWork(
        self, request: host_pb2.ReclaimWorkRequest, context: grpc.aio.ServicerContext
    ) -> host_pb2.ReclaimWorkResponse:
        host_id = self._host_id(request.host_id)
        leases = [(lease.work_id, lease.fencing_token) for lease in request.leases]
        for work_id, _ in leases:
            if not work_id:
                raise InvalidArgument("leases[].work_id must not be empty")
        kept, released = await self.core.db(
            self.core.ledger.reclaim, host_id, leases, time.time(),
            self.core.config.lease_ttl_s,
        )  # fmt: skip
        log.info("work_reclaimed", host_id=host_id,
                 adopted=[a.work_id for a in kept], released=released)  # fmt: skip
        return host_pb2.ReclaimWorkResponse(
            items=[convert.assignment_to_pb(self._with_token(a)) for a in kept],
            released_work_ids=released,
        )

    async def GetBlob(
        self, request: host_pb2.GetBlobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[host_pb2.BlobChunk]:
        try:
            host_id = self._host_id("")
        except FleetError as exc:
            await context.abort(STATUS_FOR[exc.code], exc.message)
        log.info("blob_served", digest=request.digest, offset=request.offset, host_id=host_id,
                 work_id=request.work_id)  # fmt: skip
        if not request.work_id:
            async for chunk in stream_blob(self.core, request, context):
                yield chunk
            return
        try:  # a rollout's input: only to the host that holds its lease
            lease = await self.core.db(self.core.ledger.work_lease, request.work_id)
            open_server = self.core.caller().kind == "open"  # no identity: no host to check
            if lease is None or (lease[0] != host_id and not open_server):
                raise Aborted(f"work item {request.work_id} is not leased to host {host_id}")
            if request.digest not in {i.digest for i in lease[2].inputs}:
                raise NotFound(f"work item {request.work_id} has no input {request.digest}")
            async for offset, data, total in self.core.blobs.chunks(request.digest, request.offset):
                yield host_pb2.BlobChunk(offset=offset, data=data, total_size=total)
        except FleetError as exc:
            await context.abort(STATUS_FOR[exc.code], exc.message)

    @mapped
    async def PutArtifact(
        self, requests: AsyncIterator[host_pb2.ArtifactPart], context: grpc.aio.ServicerContext
    ) -> host_pb2.PutArtifactResponse:
        host_id = self._host_id("")
        iterator = requests.__aiter__()
        try:
            first = await iterator.__anext__()
        except StopAsyncIteration:
            raise InvalidArgument("PutArtifact: no parts") from None
        lease = await self.core.db(self.core.ledger.work_lease, first.work_id)
        open_server = self.core.caller().kind == "open"  # no identity: the token alone
        if (
            lease is None
            or (lease[0] != host_id and not open_server)
            or lease[1] != first.fencing_token
        ):
            raise Aborted(
                f"work item {first.work_id!r} is not leased to host {host_id} under token "
                f"{first.fencing_token}: this attempt may not store outputs"
            )

        async def parts() -> AsyncIterator[bytes]:
            yield first.data
            async for part in iterator:
                yield part.data

        limit = int(self.core.config.max_output_mib * MIB)
        digest, size = await self.core.blobs.put(
            parts(), limit, "an output (fleet serve --max-output-mib)"
        )
        log.info("artifact_stored", work_id=first.work_id, digest=digest, size=size)
        return host_pb2.PutArtifactResponse(digest=digest, size=size)

    async def _check_outputs(self, report: Completion) -> Completion:
        """Each stored output exists with the size reported; past the per-rollout limit the
        rest are listed as not stored (the completion itself is never refused for it)."""
        limit = self.core.config.max_output_mib * MIB
        total = 0
        kept = []
        for output in report.outputs:
            if output.digest:
                size = await asyncio.to_thread(self.core.blobs.size, output.digest)
                if size != output.size:
                    raise InvalidArgument(f"outputs: {output.path} is {size} bytes stored, "
                                          f"{output.size} reported")  # fmt: skip
                total += size
                if total > limit:
                    output = output.model_copy(update={
                        "digest": "", "size": 0,
                        "error": f"over the rollout's output limit of "
                                 f"{self.core.config.max_output_mib:g} MiB",
                    })  # fmt: skip
            kept.append(output)
        return report.model_copy(update={"outputs": tuple(kept)})

    @mapped
    async def CompleteWork(
        self, request: host_pb2.CompleteWorkRequest, context: grpc.aio.ServicerContext
    ) -> host_pb2.CompleteWorkResponse:
        host_id = self._host_id(request.host_id)
        report = convert.completion_from_pb(request)
        report = await self._check_outputs(report)
        state = await self.batcher.complete(host_id, report)
        log.info(
            "work_completed",
            work_id=request.work_id,
            host_id=host_id,
            outcome=report.outcome,
            state=state,
            request_id=request.request_id,
        )
        return host_pb2.CompleteWorkResponse(state=convert.STATE_TO_PB[state])


def _td(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def check_within(claimed: HostCapabilities, enrolled: HostCapabilities) -> None:
    """A registering host may claim no more than it enrolled with."""
    problems = []
    if claimed.host_class != enrolled.host_class:
        problems.append(f"class {claimed.host_class} (enrolled as {enrolled.host_class})")
    if claimed.isolation != enrolled.isolation:
        problems.append(f"isolation {claimed.isolation} (enrolled with {enrolled.isolation})")
    if claimed.runtime != enrolled.runtime:
        problems.append(f"runtime {claimed.runtime} (enrolled with {enrolled.runtime})")
    if claimed.cuda_devices > enrolled.cuda_devices:
        problems.append(f"{claimed.cuda_devices} CUDA devices (enrolled with "
                        f"{enrolled.cuda_devices})")  # fmt: skip
    if claimed.gateway and not enrolled.gateway:
        problems.append("a gateway (enrolled without one)")
    if problems:
        raise PermissionDenied(
            f"host {claimed.host_id!r} claims more than it enrolled with: "
            + "; ".join(problems)
            + ". Enroll it again under a new host id to change them"
        )


BLOB_CHUNK_BYTES = 3 << 20
"""Under a client's default 4 MiB receive limit."""
DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


async def stream_blob(
    core: Core, request: host_pb2.GetBlobRequest, context: grpc.aio.ServicerContext
) -> AsyncIterator[host_pb2.BlobChunk]:
    """An image archive of the server's store, from `offset`, in 1 MiB chunks."""
    if not DIGEST_RE.match(request.digest):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"digest {request.digest[:80]!r} is not sha256:<64 hex digits>",
        )
    path = core.images.blob_path(request.digest)
    try:
        handle = await asyncio.to_thread(path.open, "rb")
    except OSError:
        await context.abort(
            grpc.StatusCode.NOT_FOUND, f"image {request.digest} is not in this server's store"
        )
        return
    with handle:
        size = os.fstat(handle.fileno()).st_size
        offset = request.offset
        if offset > size:
            await context.abort(
                grpc.StatusCode.OUT_OF_RANGE,
                f"offset {offset} is past the blob's end ({size} bytes)",
            )
        handle.seek(offset)
        while offset < size or size == 0:
            data = await asyncio.to_thread(handle.read, BLOB_CHUNK_BYTES)
            if not data and size:
                break
            yield host_pb2.BlobChunk(offset=offset, data=data, total_size=size)
            offset += len(data)
            if size == 0:
                break


async def _sweeper(core: Core) -> None:
    while True:
        try:
            if await core.db(core.ledger.sweep, time.time()):
                core.changed()
        except Exception:
            log.exception("sweep_failed")
        await asyncio.sleep(core.config.sweep_interval_s)


async def _retention(core: Core) -> None:
    """Deletes rollouts (and their files) that ended more than `retain_days` ago."""
    while True:
        try:
            cutoff = time.time() - core.config.retain_days * 86400
            removed = await core.db(purge_finished, core.ledger, cutoff)
            keep = await core.db(referenced_blobs, core.ledger)
            blobs = await asyncio.to_thread(core.blobs.collect_garbage, keep, cutoff)
            if removed or blobs:
                log.info("retention", rollouts_removed=removed, blobs_removed=blobs,
                         retain_days=core.config.retain_days)  # fmt: skip
        except Exception:
            log.exception("retention_failed")
        await asyncio.sleep(core.config.retention_interval_s)


async def _watch_gateway(core: Core) -> None:
    """Backpressure: holds rollouts that call the gateway while its queue is too deep.

    Over `backpressure_queue_depth` they stay queued (CPU-only work goes on); they start again
    once the queue is down to `backpressure_resume_depth`. An unreachable gateway holds them too.
    """
    config = core.config
    host, _ = split_address(config.gateway_address)
    if core.security is not None and not is_loopback(host):
        # Beyond loopback the gateway serves TLS with a certificate from the same CA.
        credentials = grpc.ssl_channel_credentials(root_certificates=core.security.ca.pem)
        channel = grpc.aio.secure_channel(config.gateway_address, credentials)
    else:
        channel = grpc.aio.insecure_channel(config.gateway_address)
    async with channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        while True:
            before = core.hold_inference
            try:
                status = await stub.Status(
                    inference_pb2.GatewayStatusRequest(), timeout=max(1.0, config.gateway_poll_s)
                )
                depth = int(status.queue_depth)
                core.gateway_queue_depth = depth
                if depth >= config.backpressure_queue_depth:
                    core.hold_inference = True
                elif depth <= config.backpressure_resume_depth:
                    core.hold_inference = False
                why = f"gateway queue depth {depth}"
            except grpc.aio.AioRpcError as exc:
                core.hold_inference = True
                why = f"gateway unreachable: {exc.code().name}"
            if core.hold_inference != before:
                log.info("backpressure", hold_inference=core.hold_inference, reason=why)
                if not core.hold_inference:
                    core.changed()  # wake claims waiting for work
            await asyncio.sleep(config.gateway_poll_s)


class FleetServer:
    """A running server: `await start()`, then `await stop()`."""

    def __init__(
        self,
        ledger: Ledger,
        images: ImageStore,
        listen: str = "127.0.0.1:0",
        config: ServerConfig | None = None,
        security: Security | None = None,
    ) -> None:
        self.config = config or ServerConfig()
        self.security = security
        self.core = Core(ledger, images, self.config, security)
        self.listen = listen
        self.port = 0
        self.tls: ServerTls | None = None
        self._server: grpc.aio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._retention: asyncio.Task[None] | None = None
        self._metrics: asyncio.Server | None = None
        self.metrics_port = 0

    @property
    def address(self) -> str:
        host = self.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    @property
    def host_address(self) -> str:
        """Where hosts call HostService: the mutual-TLS endpoint, or the API's without TLS."""
        if self.security is None:
            return self.address
        host, _ = split_address(self._host_listen())
        return f"{host}:{self.core.host_port}"

    def _host_listen(self) -> str:
        assert self.security is not None
        if self.security.host_listen:
            return self.security.host_listen
        host, port = split_address(self.listen)
        return f"{host}:{DEFAULT_HOST_PORT if port else 0}"

    async def start(self) -> None:
        limit = self.config.max_message_bytes
        interceptors = []
        if self.core.auth is not None:
            interceptors.append(AuthInterceptor(self.core.auth))
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit * 4),
            ],
            interceptors=interceptors,
        )
        fleet_pb2_grpc.add_FleetServiceServicer_to_server(FleetServicer(self.core), server)
        host_pb2_grpc.add_HostServiceServicer_to_server(HostServicer(self.core), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        names = [
            fleet_pb2.DESCRIPTOR.services_by_name["FleetService"].full_name,
            host_pb2.DESCRIPTOR.services_by_name["HostService"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ]
        reflection.enable_server_reflection(names, server)
        if self.security is None:
            self.port = server.add_insecure_port(self.listen)
            log.warning(
                "server_insecure", listen=self.listen,
                note="no TLS and no authentication: any caller that reaches this port may act "
                "as any tenant or host",
            )  # fmt: skip
        else:
            host_listen = self._host_listen()
            names = server_names(self.listen, [*self.security.san,
                                               split_address(host_listen)[0]])  # fmt: skip
            self.tls = ServerTls.issue(self.security.ca, names)
            self.port = server.add_secure_port(
                self.listen, self.tls.credentials(require_client_cert=False)
            )
            self.core.host_port = server.add_secure_port(
                host_listen, self.tls.credentials(require_client_cert=True)
            )
            if self.core.host_port == 0:
                raise FailedPrecondition(f"cannot listen on {host_listen} (host endpoint)")
        if self.port == 0:
            raise FailedPrecondition(f"cannot listen on {self.listen}")
        await server.start()
        for name in ["", *names[:2]]:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        self._sweeper = asyncio.create_task(_sweeper(self.core))
        if self.config.retain_days > 0:
            self._retention = asyncio.create_task(_retention(self.core))
        if self.config.gateway_address:
            self._watcher = asyncio.create_task(_watch_gateway(self.core))
        if self.config.metrics_listen:
            from fleet.server.metrics import serve_metrics

            host, _, port = self.config.metrics_listen.rpartition(":")
            self._metrics, self.metrics_port = await serve_metrics(self.core, host, int(port))
        log.info("server_started", address=self.address, tls=self.security is not None,
                 host_address=self.host_address)  # fmt: skip

    async def stop(self, grace_s: float = 1.0) -> None:
        for task in (self._sweeper, self._watcher, self._retention):
            if task is not None:
                task.cancel()
        if self._metrics is not None:
            self._metrics.close()
        if self._server:
            await self._server.stop(grace_s)
        self.core.close()
        log.info("server_stopped", address=self.address)

    async def wait(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()
