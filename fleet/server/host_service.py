"""HostService: enrollment, leases, checkpoints, images and artifacts for host agents.

What a host is may not grow past its join token (`HostBound`: class, labels, runtimes), at
enrollment or at any registration after it. A host reads an image only while it holds a lease
whose manifest names it, and a rollout's input only with that rollout's lease.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import grpc
import structlog
from google.protobuf.timestamp_pb2 import Timestamp

import fleet
from fleet.api import convert
from fleet.api.pb import (
    host_pb2,
    host_pb2_grpc,
)
from fleet.artifacts.store import file_chunks
from fleet.core import tokens
from fleet.core.credentials import parse_join_token
from fleet.core.errors import (
    Aborted,
    FailedPrecondition,
    FleetError,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
)
from fleet.core.manifest import is_digest
from fleet.core.placement import HostCapabilities
from fleet.core.rollout import Assignment, Completion
from fleet.core.versions import check_agent
from fleet.identity.ca import Issued
from fleet.ledger.identity import JoinToken
from fleet.ledger.leases import Beat, Claim
from fleet.server.auth import RefusalLimiter, Security
from fleet.server.core import (
    MAX_CHECKPOINTS_PER_CALL,
    MAX_CLAIM_WAIT_S,
    MIB,
    CheckpointBatcher,
    ClaimBatcher,
    CompletionBatcher,
    Core,
    HeartbeatBatcher,
)

log = structlog.get_logger(__name__)
MAX_IMAGES_REPORTED = 256
"""Image digests a heartbeat may say a host holds."""
OVER_LIMIT_DRAIN_BYTES = 4 << 30
"""What the server still reads (and drops) of an output past its limit before it answers: a
host still sending when the call ends sees gRPC's INTERNAL instead of the refusal, so the rest
is read first, up to this much."""


class HostServicer(host_pb2_grpc.HostServiceServicer):  # type: ignore[misc]
    def __init__(self, core: Core) -> None:
        self.core = core
        self.batcher = CompletionBatcher(core)
        self.claims = ClaimBatcher(core)
        self.checkpoints = CheckpointBatcher(core)
        self.beats = HeartbeatBatcher(core)
        self.enroll_refusals = RefusalLimiter()
        """Bounds refused enrollments, per peer address and overall (anyone may call)."""

    def _host_id(self, requested: str) -> str:
        return self.core.caller().host_id_for(requested)

    async def EnrollHost(
        self, request: host_pb2.EnrollHostRequest, context: grpc.aio.ServicerContext
    ) -> host_pb2.EnrollHostResponse:
        security = self.core.security
        if security is None:
            raise FailedPrecondition(
                "this server has no TLS, so hosts cannot enroll: start it with a CA "
                "(fleet ca init; fleet serve --tls)"
            )
        # A refusal is taken before anything is checked and given back if there was none:
        # past the bound, bad tokens are answered here, before the ledger is read at all.
        peer = context.peer()
        self.enroll_refusals.take(peer, "EnrollHost")
        try:
            reply = await self._enroll(request, context, security)
        except FleetError:
            raise  # a refusal: it stays counted
        except BaseException:
            self.enroll_refusals.refund(peer)  # (not a refusal: the server's own failure)
            raise
        self.enroll_refusals.refund(peer)
        return reply

    async def _enroll(
        self, request: host_pb2.EnrollHostRequest, context: grpc.aio.ServicerContext,
        security: Security,
    ) -> host_pb2.EnrollHostResponse:  # fmt: skip
        presented = parse_join_token(request.join_token)
        ttl = security.host_cert_ttl_s

        def caps_json(token: JoinToken) -> str:
            caps = convert.capabilities_from_pb(
                host_pb2.RegisterHostRequest(
                    host_id=request.host_id, host_class=convert.HOST_CLASS_TO_PB[token.host_class],
                    capabilities=request.capabilities,
                )
            )  # fmt: skip
            token.bound.check(caps)
            # The host's labels are its token's, those it named being among them.
            return caps.model_copy(update={"labels": dict(token.labels)}).model_dump_json()

        # Everything that refuses an enrollment is found on a read first (the bound too): only
        # an enrollment that will be taken waits for the ledger's writer.
        now = time.time()
        token = await self.core.read(
            self.core.ledger.identities.admit, presented, request.host_id, now
        )
        caps_json(token)

        signed: list[Issued] = []

        def issue() -> tuple[str, float]:
            signed.append(security.ca.sign_host_csr(request.csr_pem, request.host_id, _td(ttl)))
            return signed[0].serial, signed[0].not_after

        host, token = await self.core.db(
            self.core.ledger.identities.enroll, presented, request.host_id, caps_json, issue, now
        )
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

    async def RegisterHost(
        self, request: host_pb2.RegisterHostRequest, context: grpc.aio.ServicerContext
    ) -> host_pb2.RegisterHostResponse:
        request.host_id = self._host_id(request.host_id)
        check_agent(request.agent_version, fleet.__version__, request.host_id)
        caps = convert.capabilities_from_pb(request).model_copy(
            update={"agent_version": request.agent_version}
        )
        enrolled = self.core.caller().host
        if enrolled is not None:
            enrolled.bound.check(caps)
            check_within(caps, HostCapabilities.model_validate_json(enrolled.capabilities_json))
            caps = caps.model_copy(update={"labels": dict(enrolled.labels)})
        await self.core.db(self.core.ledger.register_host, caps, time.time())
        self.core.host_registered(caps)
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
            lease_ttl_s=self.core.pace.lease_ttl_s,
            heartbeat_interval_s=self.core.pace.heartbeat_interval_s,
            registry=self.core.config.registry,
        )

    async def Heartbeat(
        self, request: host_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> host_pb2.HeartbeatResponse:
        now = time.time()
        host_id = self._host_id(request.host_id)
        leases = [(lease.work_id, lease.fencing_token) for lease in request.leases]
        images: list[str] | None = None
        if request.images_changed:
            images = list(request.images_cached)
            if len(images) > MAX_IMAGES_REPORTED or any(
                len(d) > 100 or not d.startswith("sha256:") for d in images
            ):
                raise InvalidArgument(
                    f"images_cached: at most {MAX_IMAGES_REPORTED} digests of the form sha256:<hex>"
                )
        if request.drain_deadline_s > 0:
            await self.core.db(self.core.ledger.agent_drains, host_id,
                               now + request.drain_deadline_s)  # fmt: skip
        pace = self.core.pace
        renewed, stop = await self.beats.beat(Beat(host_id, leases, now, pace.lease_ttl_s, images))
        return host_pb2.HeartbeatResponse(
            renewed=[host_pb2.LeaseRef(work_id=w, fencing_token=t) for w, t in renewed],
            stop_work_ids=stop,
            # (from seconds, not through a datetime: every beat of every host answers this)
            lease_expires_at=_timestamp(now + pace.lease_ttl_s),
            heartbeat_interval_s=pace.heartbeat_interval_s,
        )

    def _with_token(self, a: Assignment) -> Assignment:
        """A rollout that uses the gateway gets a token scoped to it, valid to its deadline,
        that says what the gateway enforces: its models, its tenant and its token budgets."""
        if not a.manifest.requirements.inference:
            return a
        secret = self.core.config.token_secret
        if not secret:
            raise FailedPrecondition(
                "this server has no token secret, so it cannot give rollouts that use the "
                "inference gateway their tokens (see Paths.token_secret)"
            )
        m = a.manifest
        token = tokens.issue(
            secret, a.rollout_id, m.deadline.timestamp(), time.time(), models=m.models,
            tenant=a.tenant, max_prompt_tokens=m.max_prompt_tokens,
            max_completion_tokens=m.max_completion_tokens,
        )  # fmt: skip
        return a.model_copy(update={"inference_token": token})

    async def ClaimWork(
        self, request: host_pb2.ClaimWorkRequest, context: grpc.aio.ServicerContext
    ) -> host_pb2.ClaimWorkResponse:
        if request.max_items < 1:
            raise InvalidArgument("max_items must be at least 1")
        if not math.isfinite(request.wait_s) or request.wait_s < 0:
            raise InvalidArgument(
                f"wait_s must be a finite number of seconds, 0 or more, got {request.wait_s!r} "
                f"(the server waits at most {MAX_CLAIM_WAIT_S:g})"
            )
        wait_s = min(request.wait_s, MAX_CLAIM_WAIT_S)
        host_id = self._host_id(request.host_id)
        give_up = time.monotonic() + wait_s
        host_class: str | None = None
        while True:
            items = await self._claim(host_id, request.max_items, request.request_id)
            if items:
                return host_pb2.ClaimWorkResponse(items=items)
            left = give_up - time.monotonic()
            if left <= 0 or context.done():
                return host_pb2.ClaimWorkResponse()
            if host_class is None:  # (woken by work for hosts of its class)
                host_class = await self.core.host_class(host_id)
            # Woken by new work; the timeout also catches retries whose backoff just ended.
            await self.core.work_pulse.wait(min(left, self.core.claim_poll_s()), host_class)

    async def _claim(
        self, host_id: str, max_items: int, request_id: str
    ) -> list[host_pb2.WorkAssignment]:
        """Up to `max_items` work items leased to the host now (none waiting: none)."""
        items = await self.claims.claim(
            Claim(
                host_id, max_items, self.core.pace.lease_ttl_s, request_id=request_id,
                max_running_per_tenant=self.core.config.max_running_per_tenant,
                hold_inference=self.core.hold_inference,
            )
        )  # fmt: skip
        if items:
            self.core.event_pulse.fire()
        return [convert.assignment_to_pb(self._with_token(a)) for a in items]

    async def PutCheckpoint(
        self, request: host_pb2.PutCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> host_pb2.PutCheckpointResponse:
        host_id = self._host_id(request.host_id)
        await self.checkpoints.submit(
            (host_id, request.work_id, request.fencing_token, request.sequence, request.data)
        )
        return host_pb2.PutCheckpointResponse()

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

    async def ReclaimWork(
        self, request: host_pb2.ReclaimWorkRequest, context: grpc.aio.ServicerContext
    ) -> host_pb2.ReclaimWorkResponse:
        host_id = self._host_id(request.host_id)
        leases = [(lease.work_id, lease.fencing_token) for lease in request.leases]
        for work_id, _ in leases:
            if not work_id:
                raise InvalidArgument("leases[].work_id must not be empty")
        kept, released = await self.core.db(
            self.core.ledger.reclaim, host_id, leases, time.time(), self.core.pace.lease_ttl_s,
        )  # fmt: skip
        log.info("work_reclaimed", host_id=host_id,
                 adopted=[a.work_id for a in kept], released=released)  # fmt: skip
        return host_pb2.ReclaimWorkResponse(
            items=[convert.assignment_to_pb(self._with_token(a)) for a in kept],
            released_work_ids=released,
        )

    async def SessionCommands(
        self, replies: AsyncIterator[host_pb2.SessionReply], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[host_pb2.SessionCommand]:
        """A host's session stream: its first message names it; then commands go down and
        output comes up until either side ends (the host's calls then fail UNAVAILABLE)."""
        iterator = replies.__aiter__()
        try:
            first = await iterator.__anext__()
        except StopAsyncIteration:
            return
        if first.WhichOneof("kind") != "host_id":
            raise InvalidArgument("the session stream's first message names the host")
        host_id = self._host_id(first.host_id)
        hub = self.core.sessions
        link = hub.attach(host_id)
        log.info("session_stream_open", host_id=host_id)

        async def pump() -> None:
            async for reply in iterator:
                hub.deliver(link, reply)

        reader = asyncio.create_task(pump())
        command: asyncio.Task[host_pb2.SessionCommand] | None = None
        try:
            while True:
                command = asyncio.create_task(link.commands.get())
                done, _ = await asyncio.wait({command, reader}, return_when=asyncio.FIRST_COMPLETED)
                if command not in done:
                    break
                yield command.result()
        finally:
            # (the stream cancelled, the server stopping: the wait for a command ends too)
            if command is not None:
                command.cancel()
            reader.cancel()
            hub.detach(link)
            log.info("session_stream_closed", host_id=host_id)

    async def GetBlob(
        self, request: host_pb2.GetBlobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[host_pb2.BlobChunk]:
        host_id = self._host_id("")
        log.info("blob_served", digest=request.digest, offset=request.offset, host_id=host_id,
                 work_id=request.work_id)  # fmt: skip
        open_server = self.core.caller().kind == "open"  # no identity: no host to check
        if not request.work_id:
            # An image: only to a host that holds a lease whose manifest names it.
            if not is_digest(request.digest):
                raise InvalidArgument(
                    f"digest {request.digest[:80]!r} is not sha256:<64 hex digits>"
                )
            if not open_server and not await self.core.read(
                self.core.ledger.leases_image, host_id, request.digest
            ):
                raise PermissionDenied(
                    f"host {host_id} holds no lease whose rollout runs image "
                    f"{request.digest[:80]}: it may not read it"
                )
            async for chunk in stream_blob(self.core, request, context):
                yield chunk
            return
        # A rollout's input, or the layer a resumed session starts from: only to the host
        # that holds its lease.
        lease = await self.core.db(self.core.ledger.work_lease, request.work_id)
        if lease is None or (lease[0] != host_id and not open_server):
            raise Aborted(f"work item {request.work_id} is not leased to host {host_id}")
        allowed = {i.digest for i in lease[2].inputs}
        if lease[2].session is not None and lease[2].session.layer:
            allowed.add(lease[2].session.layer)
        if request.digest not in allowed:
            raise NotFound(f"work item {request.work_id} has no input {request.digest}")
        async for offset, data, total in self.core.blobs.chunks(request.digest, request.offset):
            yield host_pb2.BlobChunk(offset=offset, data=data, total_size=total)

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
        try:
            # Recorded as the rollout's tenant's own, so it may name the output as an input of
            # a later rollout (outputs are bounded per rollout, not by the upload quota).
            digest, size = await self.core.blobs.put(
                parts(), limit, "an output (fleet serve --max-output-mib)", owner=lease[3]
            )
        except ResourceExhausted as exc:
            # The refusal reaches the host only if the host is no longer sending when the
            # call ends (else gRPC answers it INTERNAL): the rest is read and dropped first.
            drained = await _drain(iterator, OVER_LIMIT_DRAIN_BYTES)
            log.info("artifact_refused", work_id=first.work_id, limit=limit, drained=drained)
            raise ResourceExhausted(
                f"not stored: {exc.message}",
                retry_after_s=exc.retry_after_s,
                details=exc.details,
            ) from exc
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
        # The report is stored: a claim that fails now fails the call, and the host's retry
        # finds the report stored already (it is idempotent under its fencing token).
        items = []
        if request.claim_max_items:
            items = await self._claim(host_id, request.claim_max_items, request.request_id)
        return host_pb2.CompleteWorkResponse(state=convert.STATE_TO_PB[state], items=items)


async def _drain(parts: AsyncIterator[host_pb2.ArtifactPart], max_bytes: int) -> int:
    """Reads what is left of a call's parts, up to `max_bytes`, keeping none; returns how
    many bytes were read."""
    read = 0
    async for part in parts:
        read += len(part.data)
        if read > max_bytes:
            break
    return read


def _timestamp(seconds: float) -> Timestamp:
    """Epoch seconds as a protobuf Timestamp (to the microsecond, as a datetime would be)."""
    micros = round(seconds * 1_000_000)
    return Timestamp(seconds=micros // 1_000_000, nanos=micros % 1_000_000 * 1000)


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


async def stream_blob(
    core: Core, request: host_pb2.GetBlobRequest, context: grpc.aio.ServicerContext
) -> AsyncIterator[host_pb2.BlobChunk]:
    """An image archive of the server's store, from `offset`, in chunks."""
    if not is_digest(request.digest):
        raise InvalidArgument(f"digest {request.digest[:80]!r} is not sha256:<64 hex digits>")
    path = core.images.blob_path(request.digest)
    try:
        handle = await asyncio.to_thread(path.open, "rb")
    except OSError:
        raise NotFound(f"image {request.digest} is not in this server's store") from None
    with handle:
        size = os.fstat(handle.fileno()).st_size
        if request.offset > size:
            raise OutOfRange(f"offset {request.offset} is past the blob's end ({size} bytes)")
        async for offset, data, total in file_chunks(handle, request.offset):
            yield host_pb2.BlobChunk(offset=offset, data=data, total_size=total)
