"""The host agent: registers, heartbeats, claims leased work, runs it in machines, completes it."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import structlog

import fleet
from fleet.agent import journal
from fleet.agent.attempt import INIT_TIMEOUT_S, Attempt, Running, parent_key
from fleet.agent.capabilities import capabilities, make_runtime
from fleet.agent.checkpoints import RETRYABLE, CheckpointSender
from fleet.agent.config import AgentConfig
from fleet.agent.images import ImageCache
from fleet.agent.journal import AttemptJournal
from fleet.agent.link import Link
from fleet.agent.sessions import SessionHost
from fleet.api import convert
from fleet.api.pb import host_pb2, host_pb2_grpc
from fleet.core.errors import (
    FailedPrecondition,
    Unauthenticated,
)
from fleet.core.placement import HostCapabilities, HostClass
from fleet.core.rollout import Assignment, Completion
from fleet.runtime.base import Leftover, Machine, MachineSpec, Parent, Runtime

log = structlog.get_logger(__name__)

IMAGES_REREAD_S = 10.0
"""How often the images on disk are listed again, for the host list."""
MAX_IMAGES_REPORTED = 256
SESSIONS_CLOSE_S = 10.0
"""How long a drain that ended waits for the sessions it closed to end, before it stops them."""
REFUSED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
CLAIM_REPEAT_TIMEOUT_S = 10.0
"""How long a stopping agent waits for the answer to the claim it repeats (`_settle_claim`)."""
R = TypeVar("R")


class Agent:
    def __init__(self, config: AgentConfig, runtime: Runtime | None = None) -> None:
        """`runtime`: the one this agent runs machines on, where the caller made it (tests, an
        embedded fleet); by default the one `config.runtime` names, made here."""
        if config.identity is not None and config.identity.host_id != config.host_id:
            raise FailedPrecondition(
                f"host id {config.host_id!r} is not the one this host's certificate names "
                f"({config.identity.host_id!r})"
            )
        self.config = config
        self.runtime: Runtime = runtime or make_runtime(
            config.runtime, config.machines_dir, config.net, config.default_disk_gib
        )
        self.caps: HostCapabilities = capabilities(
            config.host_id, config.host_class, config.runtime, config.slots
        ).model_copy(update={"gateway": config.gateway is not None, "labels": dict(config.labels)})
        self.log = log.bind(host_id=config.host_id, host_class=config.host_class.value)
        self._running: dict[str, Running] = {}
        self._slot_freed = asyncio.Event()
        self._serving: set[asyncio.Task[None]] = set()
        """Every attempt's task, from its claim to its report (and the claim that report made)."""
        self._handing_over = 0
        """Slots whose finished work is being reported, with a claim for the next in the same
        call: the claim loop leaves them to it."""
        self._claiming = True
        """Whether reports also claim the next work (not once the agent is stopping)."""
        self.stub: host_pb2_grpc.HostServiceStub | None = None
        self.checkpoints: CheckpointSender | None = None
        self._parents: dict[str, Parent] = {}
        self._parents_lock = asyncio.Lock()
        self._heartbeat_s = 3.0
        cap = config.image_cache_gib
        self.images = ImageCache(config.images, None if cap is None else int(cap * (1 << 30)))
        self.images.busy = self._parent_images
        self.refused = ""
        """Why the server stopped accepting this host ("": it has not)."""
        self.journal_dir = config.machines_dir.parent / "journal" / config.host_id
        self.sessions = SessionHost(config.host_id)
        self._drain_until = 0.0
        """When this agent's drain ends (0: it is not draining)."""
        self._images_read_at = -IMAGES_REREAD_S
        self._images_reported: list[str] | None = None
        """What the last beat that carried images said (None: say them on the next)."""

    async def run(self, stop: asyncio.Event) -> None:
        """Serves until `stop` is set; running work is finished first."""
        link = Link(self.config.server, self.config.identity, self.config.identity_files)
        async with link:
            stub: Any = link
            self.stub = stub
            self.checkpoints = CheckpointSender(stub)
            await self._register(stub, stop)
            adopted = await self._reconcile(stub, stop)
            reaped = await self.runtime.reap(self.caps.host_id, keep=adopted)
            if reaped:
                self.log.info("orphans_reaped", machines=reaped)
            renewals = asyncio.create_task(link.renewals(stop))
            beat = asyncio.create_task(self._heartbeats(stub, stop))
            # A session stream to each replica given: any of them reaches this host's sessions.
            sessions = [
                asyncio.create_task(self.sessions.serve(replica, stop, server))
                for server, replica in link.session_stubs()
            ]
            try:
                await self._claim_loop(stub, stop)
                # Sessions that can park stay open while the drain runs: the server parks them
                # and resumes them on other hosts. The rest close now, as they always did.
                self.sessions.close_all("the agent is stopping", unparkable_only=True)
                await self._drain(stub)
            finally:
                beat.cancel()
                renewals.cancel()
                for task in sessions:
                    task.cancel()
                for task in sessions:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                with contextlib.suppress(asyncio.CancelledError):
                    await beat
                with contextlib.suppress(asyncio.CancelledError):
                    await renewals
                for parent in list(self._parents.values()):  # children went with their work
                    await parent.delete()
                self._parents.clear()
        if self.refused:
            raise Unauthenticated(f"the server refused host {self.caps.host_id!r}: {self.refused}")

    async def _drain(self, stub: host_pb2_grpc.HostServiceStub) -> None:
        """Stopping: the host takes no new work (the server is told at once, and at every beat
        until the end), running work goes on until `drain_deadline_s`, then is stopped; the
        server releases its leases for retry elsewhere at the same deadline."""
        self._claiming = False
        if not self._serving:
            return
        deadline_s = self.config.drain_deadline_s
        self._drain_until = time.time() + deadline_s
        self.log.info("agent_draining", running=len(self._serving), deadline_s=deadline_s)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await stub.Heartbeat(self._beat_request(), timeout=10)
        end = time.monotonic() + deadline_s
        # (A report sent before the drain began may still bring work back: it is run too.)
        while self._serving and (left := end - time.monotonic()) > 0:
            await asyncio.wait(set(self._serving), timeout=left)
        # Sessions not moved by the deadline close (their attempts end as closed, not cancelled).
        if self.sessions.close_all(f"the agent stopped and its {deadline_s:g} s drain ended"):
            await asyncio.wait(set(self._serving), timeout=SESSIONS_CLOSE_S)
        late = set(self._serving)
        for work_id, running in list(self._running.items()):
            if running.task in late:
                self._stop(work_id, f"the agent stopped and its {deadline_s:g} s drain ended")
        if late:
            await asyncio.gather(*late, return_exceptions=True)

    def _beat_request(self) -> host_pb2.HeartbeatRequest:
        leases = [
            host_pb2.LeaseRef(work_id=w, fencing_token=r.assignment.fencing_token)
            for w, r in self._running.items()
        ]
        drain = self._drain_until - time.time() if self._drain_until else 0.0
        images = self._images_to_report()
        return host_pb2.HeartbeatRequest(
            request_id=uuid.uuid4().hex, host_id=self.caps.host_id, leases=leases,
            drain_deadline_s=max(drain, 0.001) if self._drain_until else 0.0,
            images_cached=images or [], images_changed=images is not None,
        )  # fmt: skip

    def _images_to_report(self) -> list[str] | None:
        """The images on disk, when they changed since the last beat that carried them (read
        at most every IMAGES_REREAD_S); None: unchanged."""
        now = time.monotonic()
        if now - self._images_read_at < IMAGES_REREAD_S:
            return None
        self._images_read_at = now
        try:
            found = self.images.cached()[:MAX_IMAGES_REPORTED]
        except OSError:
            log.warning("images_unlisted", exc_info=True)
            return None
        if found == self._images_reported:
            return None
        self._images_reported = found
        return found

    async def _register(self, stub: host_pb2_grpc.HostServiceStub, stop: asyncio.Event) -> None:
        self._images_reported, self._images_read_at = None, -IMAGES_REREAD_S  # said again
        request = host_pb2.RegisterHostRequest(
            request_id=uuid.uuid4().hex,
            host_id=self.caps.host_id,
            host_class=convert.HOST_CLASS_TO_PB[self.caps.host_class],
            capabilities=convert.capabilities_to_pb(self.caps),
            agent_version=fleet.__version__,
        )
        reply = await self._until_reachable(stub.RegisterHost, request, stop, 10)
        self._heartbeat_s = reply.heartbeat_interval_s or 3.0
        cas = [self.config.registry_ca]
        if self.config.identity is not None:
            cas.append(self.config.identity.ca_pem)
        self.images.use_registry(reply.registry, b"".join(cas) or None)
        self.log.info(
            "agent_registered",
            runtime=self.caps.runtime,
            isolation=self.caps.isolation,
            reason=self.caps.runtime_reason,
            device=self.caps.device,
            slots=self.caps.slots,
        )

    async def _until_reachable(
        self, call: Callable[..., Awaitable[R]], request: object, stop: asyncio.Event,
        timeout_s: float,
    ) -> R:  # fmt: skip
        """`call(request)`, again with backoff while the server is unreachable."""
        delay = 0.1
        while True:
            try:
                return await call(request, timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE or stop.is_set():
                    raise
                self.log.info("server_unreachable", retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _reconcile(
        self, stub: host_pb2_grpc.HostServiceStub, stop: asyncio.Event
    ) -> set[str]:
        """Machines an earlier run of this agent left: adopts those whose work is still leased
        to this host (the attempt goes on in them); returns their names. The rest are reaped."""
        leftovers = await self.runtime.leftovers(self.caps.host_id)
        candidates: dict[str, Leftover] = {}
        leases: list[host_pb2.LeaseRef] = []
        for leftover in leftovers:
            lease = leftover.lease
            if leftover.adoptable and lease is not None:
                candidates[lease[0]] = leftover
                leases.append(host_pb2.LeaseRef(work_id=lease[0], fencing_token=lease[1]))
            else:
                self.log.info("machine_not_adoptable", machine=leftover.name,
                              why=leftover.why_not or "no lease")  # fmt: skip
        kept: set[str] = set()
        # Asked even when nothing survived: the leases the dead agent held end now.
        request = host_pb2.ReclaimWorkRequest(
            request_id=uuid.uuid4().hex,
            host_id=self.caps.host_id,
            leases=leases,
        )
        try:
            reply = await self._until_reachable(stub.ReclaimWork, request, stop, 30)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self.log.warning("reclaim_unsupported", machines=len(leftovers),
                             note="the server predates ReclaimWork: every leftover machine is "
                             "deleted, its work retried when its lease runs out")  # fmt: skip
            reply = host_pb2.ReclaimWorkResponse()
        for item in reply.items:
            assignment = convert.assignment_from_pb(item)
            found = candidates.get(assignment.work_id)
            if found is None:  # not one it asked for: leave it to its lease
                self.log.error("reclaim_unasked", work_id=assignment.work_id)
                continue
            self._start(stub, Running(assignment, adopt=found))
            kept.add(found.name)
            self.log.info("work_adopted", work_id=assignment.work_id,
                          rollout_id=assignment.rollout_id, attempt=assignment.attempt,
                          machine=found.name)  # fmt: skip
        for work_id in reply.released_work_ids:
            gone = candidates.get(work_id)
            self.log.info("work_released", work_id=work_id, machine=gone.name if gone else "")
        await asyncio.to_thread(journal.prune, self.journal_dir, set(self._running))
        return kept

    async def _heartbeats(self, stub: host_pb2_grpc.HostServiceStub, stop: asyncio.Event) -> None:
        while True:
            wait_s = self._heartbeat_s
            try:
                reply = await stub.Heartbeat(self._beat_request(), timeout=10)
                for work_id in reply.stop_work_ids:
                    self._stop(work_id, "the server asked to stop it (cancelled or deadline)")
                paced = reply.heartbeat_interval_s  # (the server paces a large fleet)
                if paced > 0 and paced != self._heartbeat_s:
                    # Every host hears of a new pace within one old interval: each waits a
                    # random part of the new one first, so that their beats spread over it
                    # again rather than keep the bunch they were told in.
                    self._heartbeat_s = paced
                    wait_s = random.uniform(0, paced)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.ABORTED:
                    stale = dict(exc.trailing_metadata() or ()).get("fleet-stale-work-ids", "")
                    lost = [w for w in str(stale).split(",") if w in self._running]
                    for work_id in lost:
                        self._lost(work_id)
                    if lost:
                        continue  # beat again at once for the leases still held
                self.log.warning("heartbeat_failed", code=exc.code().name, error=exc.details())
            await asyncio.sleep(wait_s)

    def _lost(self, work_id: str) -> None:
        """A lease the server no longer honours: stop the work and forget it."""
        running = self._running.pop(work_id, None)
        if running and running.task and not running.stop_reason:
            running.stop_reason = "lease lost"
            running.task.cancel()
            self.log.warning("lease_lost", work_id=work_id)

    def _stop(self, work_id: str, reason: str) -> None:
        running = self._running.get(work_id)
        if running and running.task and not running.stop_reason:
            running.stop_reason = reason
            running.task.cancel()
            self.log.info("work_stopping", work_id=work_id, reason=reason)

    async def _claim_loop(self, stub: host_pb2_grpc.HostServiceStub, stop: asyncio.Event) -> None:
        stopper = asyncio.ensure_future(stop.wait())  # (one for the loop, not one per claim)
        try:
            await self._claims(stub, stop, stopper)
        finally:
            stopper.cancel()

    async def _claims(
        self, stub: host_pb2_grpc.HostServiceStub, stop: asyncio.Event, stopper: asyncio.Future[Any]
    ) -> None:
        while not stop.is_set():
            free = self.config.slots - len(self._running) - self._handing_over
            if free <= 0:
                self._slot_freed.clear()
                waiter = asyncio.ensure_future(self._slot_freed.wait())
                await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                continue
            request = host_pb2.ClaimWorkRequest(
                request_id=uuid.uuid4().hex,
                host_id=self.caps.host_id,
                max_items=free,
                wait_s=self.config.claim_wait_s,
            )
            try:
                claim = asyncio.ensure_future(
                    stub.ClaimWork(request, timeout=self.config.claim_wait_s + 10)
                )
                done, _ = await asyncio.wait({claim, stopper}, return_when=asyncio.FIRST_COMPLETED)
                if claim not in done:
                    await self._settle_claim(stub, claim, request)
                    break
                reply = claim.result()
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    await self._register(stub, stop)  # the server forgot us (a new ledger)
                    continue
                if exc.code() in REFUSED:
                    # Revoked, or no longer trusted: the server has released this host's
                    # leases already; stop the work here and end, saying why.
                    self.refused = exc.details() or exc.code().name
                    self.log.error("agent_refused", code=exc.code().name, error=self.refused)
                    for work_id in list(self._running):
                        self._stop(work_id, f"the server refused this host: {self.refused}")
                    break
                self.log.warning("claim_failed", code=exc.code().name, error=exc.details())
                await asyncio.sleep(1.0)
                continue
            for item in reply.items:
                self._start(stub, Running(convert.assignment_from_pb(item)))

    async def _settle_claim(
        self,
        stub: host_pb2_grpc.HostServiceStub,
        claim: asyncio.Future[host_pb2.ClaimWorkResponse],
        request: host_pb2.ClaimWorkRequest,
    ) -> None:
        """Stopping while a claim waits: the server may have leased work to it already, its
        answer still on the way. Dropped, that answer would strand the work until its lease
        expired (and this host, running nothing, would skip its drain). Waiting out the long
        poll would hold the stop up to `claim_wait_s`; so the claim is cancelled and sent again
        at once, without waiting, under the same request id, which the server answers with
        the leases the first one took. What comes back runs as the drain runs the rest.

        (A repeat that finds none of its own may lease work queued meanwhile, as a report
        sent before the drain may: it is drained the same way.)"""
        claim.cancel()
        await asyncio.wait({claim})
        log_ = self.log.bind(request_id=request.request_id)
        if claim.cancelled() or claim.exception() is not None:
            again = host_pb2.ClaimWorkRequest()
            again.CopyFrom(request)
            again.wait_s = 0.0
            try:
                reply = await stub.ClaimWork(again, timeout=CLAIM_REPEAT_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                log_.warning("claim_unsettled", code=exc.code().name, error=exc.details(),
                             note="what it leased is retried once its lease expires")  # fmt: skip
                return
        else:  # (answered before the cancel reached it)
            reply = claim.result()
        items = [item for item in reply.items if item.work_id not in self._running]
        if items:
            log_.info("claim_settled_on_stop", work_ids=[item.work_id for item in items])
        for item in items:
            self._start(stub, Running(convert.assignment_from_pb(item)))

    def _start(self, stub: host_pb2_grpc.HostServiceStub, running: Running) -> None:
        """Runs a leased work item (claimed, or adopted after a restart)."""
        self._running[running.assignment.work_id] = running
        task = running.task = asyncio.create_task(self._serve(stub, running))
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)

    async def _serve(self, stub: host_pb2_grpc.HostServiceStub, running: Running) -> None:
        a = running.assignment
        log_ = self.log.bind(rollout_id=a.rollout_id, work_id=a.work_id, attempt=a.attempt)
        try:
            completion = await Attempt(self, running, log_).execute()
        except BaseException:
            self._running.pop(a.work_id, None)
            self._slot_freed.set()
            raise
        # The report also claims work for the slot it frees (one call for both, where the
        # server has work queued); the claim loop takes the slot back only if none came.
        self._running.pop(a.work_id, None)
        self._handing_over += 1
        try:
            claimed = await self._complete(stub, completion, log_, claim=int(self._claiming))
            for item in claimed:
                self._start(stub, Running(convert.assignment_from_pb(item)))
        finally:
            self._handing_over -= 1
            self._slot_freed.set()
        if running.journalled:
            journal = AttemptJournal(self.journal_dir, a.work_id, a.fencing_token)
            await asyncio.to_thread(journal.remove)

    async def warm_parent(self, a: Assignment, spec: MachineSpec, warmup: str) -> Parent:
        """This host's warm parent for the rollout's tenant, image, Smolfile, warm-up and way
        to the gateway (made once). Never shared across tenants: a namespace parent's fork
        server holds each child's step before it forks it (its environment, inference token
        included), and it runs warm-up code a tenant sent, so one tenant's warm-up must never
        see another's children."""
        key = parent_key(
            a.tenant, a.manifest.image_digest, a.manifest.smolfile_digest, warmup,
            "gateway" if spec.gateway is not None else "",
        )  # fmt: skip
        async with self._parents_lock:
            parent = self._parents.get(key)
            if parent is not None:
                return parent
            labels = {"fleet": "1", "host": self.caps.host_id, "parent": key, "tenant": a.tenant}

            async def prepare(machine: Machine) -> None:
                for command in spec.smolfile.init:
                    init = await machine.exec(["/bin/sh", "-c", command], timeout_s=INIT_TIMEOUT_S)
                    if init.exit_code != 0:
                        raise FailedPrecondition(
                            f"warm parent: init command {command!r} exited {init.exit_code}"
                        )

            pool = spec.smolfile.branch.pool_size if spec.smolfile.branch else None
            parent = await self.runtime.create_parent(
                spec.model_copy(update={"name": f"fleet-parent-{key}", "labels": labels}),
                warmup, pool or 0, prepare,
            )  # fmt: skip
            self._parents[key] = parent
            self.log.info("warm_parent_started", parent=key, image=a.manifest.image_digest[:19],
                          carries_memory=parent.carries_memory)  # fmt: skip
            return parent

    def parents(self) -> list[Parent]:
        """The warm parents this agent keeps now."""
        return list(self._parents.values())

    def _parent_images(self) -> set[str]:
        return {p.spec.image_digest for p in self._parents.values()}

    async def _complete(
        self,
        stub: host_pb2_grpc.HostServiceStub,
        completion: Completion,
        log_: structlog.BoundLogger,
        claim: int = 0,
    ) -> list[host_pb2.WorkAssignment]:
        """Reports the attempt; with `claim`, the same call claims up to that many work items
        (returned, leased to this host)."""
        request = convert.completion_to_pb(self.caps.host_id, completion, uuid.uuid4().hex)
        request.claim_max_items = claim
        delay = 0.2
        # A completion is idempotent under its fencing token, so resending is safe, also after
        # an INTERNAL error whose transaction may or may not have committed; so is its claim
        # (the same request id answers the leases it took the first time).
        for _ in range(30):
            try:
                reply = await stub.CompleteWork(request, timeout=10)
                log_.info("work_reported", outcome=completion.outcome, claimed=len(reply.items))
                return list(reply.items)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in {*RETRYABLE, grpc.StatusCode.INTERNAL}:
                    log_.warning("completion_refused", code=exc.code().name, error=exc.details())
                    return []
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        log_.error("completion_undelivered", note="the lease will expire and the work rerun")
        return []


def default_host_id(host_class: HostClass, index: int = 0) -> str:
    return f"{socket.gethostname()}-{host_class.value}-{index}"
