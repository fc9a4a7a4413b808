"""The host agent: registers, heartbeats, claims leased work, runs it in machines, completes it."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import structlog

import fleet
from fleet._proto.fleet.v1 import host_pb2, host_pb2_grpc
from fleet.agent import journal
from fleet.agent.capabilities import RuntimeChoice, capabilities, make_runtime
from fleet.agent.checkpoints import RELAY_ADDRESS, RETRYABLE, CheckpointRelay, CheckpointSender
from fleet.agent.files import (
    InputPlacementFailed,
    StepLog,
    collect_outputs,
    place_inputs,
    remove_staged,
    stage_inputs,
)
from fleet.agent.images import ImageCache
from fleet.agent.journal import AttemptJournal
from fleet.agent.link import Link
from fleet.agent.passage import CHECKPOINTS_SOCKET, GATEWAY_SOCKET, GatewaySplice, child_address
from fleet.agent.sessions import SessionHost
from fleet.agent.settings import DEFAULT_DRAIN_S, DEFAULT_SLOTS
from fleet.core.egress import EffectiveEgress, effective_egress
from fleet.core.errors import (
    ErrorCode,
    FailedPrecondition,
    FleetError,
    InvalidArgument,
    Unauthenticated,
    Unavailable,
)
from fleet.core.lifecycle import Outcome
from fleet.core.manifest import OutputArtifact, Step, check_steps
from fleet.core.placement import HostCapabilities, HostClass, Isolation
from fleet.core.rollout import Assignment, Completion, StepResult
from fleet.core.smolfile import Smolfile
from fleet.identity.tls import HostFiles, HostIdentityMaterial, client_ssl_context
from fleet.image import oci
from fleet.image.store import ImageStore
from fleet.runtime import disk
from fleet.runtime.base import Leftover, Machine, MachineSpec, Parent, Runtime, resolve_secrets
from fleet.runtime.cgroups import DEFAULT_PIDS_MAX
from fleet.runtime.disk import DEFAULT_DISK_GIB
from fleet.runtime.netns import NetConfig
from fleet.server import convert
from fleet.server.convert import MAX_EGRESS_EVENTS

log = structlog.get_logger(__name__)

INIT_TIMEOUT_S = 300.0
IMAGES_REREAD_S = 10.0
"""How often the images on disk are listed again, for the host list."""
MAX_IMAGES_REPORTED = 256
REFUSED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
R = TypeVar("R")


@dataclass
class AgentConfig:
    """One agent's settings."""

    server: str
    """host:port of a fleet server."""
    host_id: str
    """Stable name of this host in the fleet."""
    host_class: HostClass
    runtime: RuntimeChoice
    """The runtime preflight chose, and why."""
    machines_dir: Path
    images: ImageStore
    slots: int = DEFAULT_SLOTS
    """Work items run at once."""
    claim_wait_s: float = 5.0
    """Long-poll wait per ClaimWork call."""
    net: NetConfig | None = None
    """Where machine links end and which resolver the DNS forwarder asks (namespace runtime)."""
    gateway: tuple[str, int] | None = None
    """The inference gateway's HTTP endpoint as machines reach it ("host": this host)."""
    identity: HostIdentityMaterial | None = None
    """This host's certificate and the CA, for a server with TLS (None: a server without)."""
    identity_files: HostFiles | None = None
    """Where the identity lives, rewritten at renewal."""
    gateway_ca: bytes = b""
    """The fleet CA, when the gateway's HTTP endpoint serves TLS ("https://" given): machines
    and the warm children's splice verify it against this."""
    registry_ca: bytes = b""
    """A CA the image registry's certificate chains to, besides the system's and the fleet's."""
    image_cache_gib: float | None = None
    """Bound on the images fetched from the server kept here (None: no bound)."""
    default_disk_gib: int | None = DEFAULT_DISK_GIB
    """A namespace machine's writable layer where its Smolfile bounds none (None: unbounded)."""
    labels: dict[str, str] = field(default_factory=dict)
    """What pools select this host by (an enrolled host's come from its join token)."""
    drain_deadline_s: float = DEFAULT_DRAIN_S
    """On stopping (SIGTERM), how long running work may go on; the host takes no new work
    meanwhile, and what still runs after it is released for retry elsewhere."""


@dataclass
class _Running:
    assignment: Assignment
    task: asyncio.Task[None] | None = None
    stop_reason: str = ""
    results: list[StepResult] = field(default_factory=list)
    machine: Machine | None = None
    relay: CheckpointRelay | None = None
    splice: GatewaySplice | None = None
    """A warm child's way to the gateway (other machines reach it over their own link)."""
    adopt: Leftover | None = None
    """The machine an earlier run of this agent left running this attempt (after a restart)."""
    image: str = ""
    """The image digest this attempt holds in the image cache ("": none yet)."""
    logs: list[OutputArtifact] = field(default_factory=list)
    """Steps' whole stdout/stderr where it passed the inline limit (stored already)."""


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        if config.identity is not None and config.identity.host_id != config.host_id:
            raise FailedPrecondition(
                f"host id {config.host_id!r} is not the one this host's certificate names "
                f"({config.identity.host_id!r})"
            )
        self.config = config
        self.runtime: Runtime = make_runtime(
            config.runtime, config.machines_dir, config.net, config.default_disk_gib
        )
        self.caps: HostCapabilities = capabilities(
            config.host_id, config.host_class, config.runtime, config.slots
        ).model_copy(update={"gateway": config.gateway is not None, "labels": dict(config.labels)})
        self.log = log.bind(host_id=config.host_id, host_class=config.host_class.value)
        self._running: dict[str, _Running] = {}
        self._slot_freed = asyncio.Event()
        self._stub: host_pb2_grpc.HostServiceStub | None = None
        self._checkpoints: CheckpointSender | None = None
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
        self._images_read_at = -IMAGES_REREAD_S
        self._images_reported: list[str] | None = None
        """What the last beat that carried images said (None: say them on the next)."""
        """When this agent's drain ends (0: it is not draining)."""

    async def run(self, stop: asyncio.Event) -> None:
        """Serves until `stop` is set; running work is finished first."""
        link = Link(self.config.server, self.config.identity, self.config.identity_files)
        async with link:
            stub: Any = link
            self._stub = stub
            self._checkpoints = CheckpointSender(stub)
            await self._register(stub, stop)
            adopted = await self._reconcile(stub, stop)
            reaped = await self.runtime.reap(self.caps.host_id, keep=adopted)
            if reaped:
                self.log.info("orphans_reaped", machines=reaped)
            renewals = asyncio.create_task(link.renewals(stop))
            beat = asyncio.create_task(self._heartbeats(stub, stop))
            sessions = asyncio.create_task(self.sessions.serve(stub, stop))
            try:
                await self._claim_loop(stub, stop)
                self.sessions.close_all("the agent is stopping")
                await self._drain(stub)
            finally:
                beat.cancel()
                renewals.cancel()
                sessions.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sessions
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
        tasks = [r.task for r in self._running.values() if r.task]
        if not tasks:
            return
        deadline_s = self.config.drain_deadline_s
        self._drain_until = time.time() + deadline_s
        self.log.info("agent_draining", running=len(tasks), deadline_s=deadline_s)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await stub.Heartbeat(self._beat_request(), timeout=10)
        _, late = await asyncio.wait(tasks, timeout=deadline_s)
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
            running = _Running(assignment, adopt=found)
            self._running[assignment.work_id] = running
            running.task = asyncio.create_task(self._serve(stub, running))
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
            try:
                reply = await stub.Heartbeat(self._beat_request(), timeout=10)
                for work_id in reply.stop_work_ids:
                    self._stop(work_id, "the server asked to stop it (cancelled or deadline)")
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.ABORTED:
                    stale = dict(exc.trailing_metadata() or ()).get("fleet-stale-work-ids", "")
                    lost = [w for w in str(stale).split(",") if w in self._running]
                    for work_id in lost:
                        self._lost(work_id)
                    if lost:
                        continue  # beat again at once for the leases still held
                self.log.warning("heartbeat_failed", code=exc.code().name, error=exc.details())
            await asyncio.sleep(self._heartbeat_s)

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
        while not stop.is_set():
            free = self.config.slots - len(self._running)
            if free <= 0:
                self._slot_freed.clear()
                waiter = asyncio.create_task(self._slot_freed.wait())
                stopper = asyncio.create_task(stop.wait())
                await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                stopper.cancel()
                continue
            try:
                claim = asyncio.ensure_future(
                    stub.ClaimWork(
                        host_pb2.ClaimWorkRequest(
                            request_id=uuid.uuid4().hex,
                            host_id=self.caps.host_id,
                            max_items=free,
                            wait_s=self.config.claim_wait_s,
                        ),
                        timeout=self.config.claim_wait_s + 10,
                    )
                )
                stopper = asyncio.create_task(stop.wait())
                done, _ = await asyncio.wait({claim, stopper}, return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                if claim not in done:
                    claim.cancel()
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
                assignment = convert.assignment_from_pb(item)
                running = _Running(assignment)
                self._running[assignment.work_id] = running
                running.task = asyncio.create_task(self._serve(stub, running))

    async def _serve(self, stub: host_pb2_grpc.HostServiceStub, running: _Running) -> None:
        a = running.assignment
        log_ = self.log.bind(rollout_id=a.rollout_id, work_id=a.work_id, attempt=a.attempt)
        try:
            completion = await self._execute(running, log_)
        finally:
            self._running.pop(a.work_id, None)
            self._slot_freed.set()
        await self._complete(stub, completion, log_)
        await asyncio.to_thread(AttemptJournal(self.journal_dir, a.work_id, a.fencing_token).remove)

    async def _checkpoint_relay(
        self, machine: Machine, a: Assignment
    ) -> tuple[CheckpointRelay, str] | None:
        """Where the machine stores its state between model calls (where its runtime gives the
        agent a channel to it), and how a step there names it (`FLEET_CHECKPOINTS`)."""
        channel = machine.channel()
        if channel is None or self._checkpoints is None:
            why = "the machine's runtime offers the agent no channel to it for the relay"
            self.log.warning("checkpoints_unavailable", rollout_id=a.rollout_id, reason=why)
            return None
        sender = self._checkpoints

        async def put(seq: int, data: bytes) -> None:
            await sender.put(
                host_pb2.PutCheckpointRequest(
                    host_id=self.caps.host_id, work_id=a.work_id, fencing_token=a.fencing_token,
                    sequence=seq, data=data,
                )
            )  # fmt: skip

        relay = CheckpointRelay(a.checkpoint_sequence, a.checkpoint, put)
        if channel.kind == "unix":
            await relay.start_unix(channel.path)
            return relay, child_address(CHECKPOINTS_SOCKET)
        await relay.start_in_netns(str(channel.path))
        return relay, "{}:{}".format(*RELAY_ADDRESS)

    async def _gateway_splice(self, sockets: Path, gateway: tuple[str, int]) -> GatewaySplice:
        """The gateway for a warm child, on a socket the agent joins to the gateway's endpoint
        (`host`: this host, reached from the uplink's namespace as the machines' links are)."""
        where = ("127.0.0.1" if gateway[0] == "host" else gateway[0], gateway[1])
        tls = client_ssl_context(self.config.gateway_ca) if self.config.gateway_ca else None
        splice = GatewaySplice(
            sockets, where, self.config.net.uplink_path if self.config.net else None, tls
        )
        await splice.start()
        return splice

    async def _warm_parent(self, a: Assignment, spec: MachineSpec, warmup: str) -> Parent:
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

    def _gateway_for(self, a: Assignment) -> tuple[str, int] | None:
        """The gateway endpoint for a rollout that uses it; None for every other rollout."""
        if not a.manifest.requirements.inference:
            return None
        if self.config.gateway is None:
            raise Unavailable(
                f"rollout {a.rollout_id} calls the inference gateway and host "
                f"{self.caps.host_id} has none configured (fleet agent --gateway HOST:PORT)"
            )
        if not a.inference_token:
            raise Unavailable(f"rollout {a.rollout_id} uses the gateway but came without a token")
        return self.config.gateway

    def _device(self, assignment: Assignment) -> str:
        if assignment.manifest.host_class == HostClass.GPU:
            return self.caps.device if self.caps.cuda_devices else "cpu (no CUDA device here)"
        return "cpu"

    async def _execute(self, running: _Running, log_: structlog.BoundLogger) -> Completion:
        """Runs the attempt, then collects what its machine was refused and deletes it."""
        try:
            return await self._execute_attempt(running, log_)
        finally:
            if running.image:
                self.images.release(running.image)
            if running.assignment.manifest.inputs:
                await asyncio.to_thread(remove_staged, self._inputs_dir(running.assignment))

    def _parent_images(self) -> set[str]:
        return {p.spec.image_digest for p in self._parents.values()}

    async def _execute_attempt(self, running: _Running, log_: structlog.BoundLogger) -> Completion:
        completion = await self._attempt(running, log_)
        a = running.assignment
        if running.logs:
            completion = completion.model_copy(update={"outputs": tuple(running.logs)})
        collect = completion.outcome in (Outcome.SUCCEEDED, Outcome.STEP_FAILED)
        if a.manifest.outputs and running.machine is not None and collect:
            try:
                outputs = await collect_outputs(
                    running.machine, self._stub, a, self.config.machines_dir.parent / "spool"
                )
                completion = completion.model_copy(update={"outputs": (*outputs, *running.logs)})
            except Exception:
                log_.exception("outputs_not_collected")
                completion = completion.model_copy(update={
                    "outcome": Outcome.TRANSIENT_ERROR, "artifact_failed": True,
                    "error": "the agent could not collect the outputs; see its log",
                })  # fmt: skip
        if running.relay is not None:
            await running.relay.stop()
        if running.splice is not None:
            await running.splice.stop()
        machine = running.machine
        if machine is None:
            return completion
        try:
            cpu = await asyncio.shield(machine.cpu_seconds())
            if cpu is not None:
                completion = completion.model_copy(update={"cpu_seconds": round(cpu, 6)})
            peak = await asyncio.shield(machine.memory_peak_mib())
            if peak is not None:
                completion = completion.model_copy(update={"peak_memory_mib": round(peak, 3)})
        except Exception:
            log_.exception("cpu_seconds_failed", machine=machine.name)
        try:
            events = await asyncio.shield(machine.egress_events())
            if events:
                for event in events:
                    log_.info("egress_refused", kind=event.kind, destination=event.destination,
                              reason=event.reason)  # fmt: skip
                kept = tuple(events[:MAX_EGRESS_EVENTS])
                completion = completion.model_copy(update={"egress_events": kept})
        except Exception:
            log_.exception("egress_events_failed", machine=machine.name)
        try:
            await asyncio.shield(machine.delete())
        except Exception:
            log_.exception("machine_delete_failed", machine=machine.name)
        return completion

    def _inputs_dir(self, a: Assignment) -> Path:
        return self.config.machines_dir.parent / "inputs" / a.work_id

    async def _stage_inputs(self, a: Assignment) -> tuple[tuple[str, str], ...]:
        """Inputs fetched to this host to be mounted read-only, where the runtime can mount
        (the namespace runtime); elsewhere they are copied in after the machine starts."""
        if not a.manifest.inputs or not self.runtime.mounts_read_only:
            return ()
        return await stage_inputs(self._stub, a, self._inputs_dir(a))

    def _cannot_honour(self, a: Assignment) -> str:
        """Why this host's own runtime cannot give the rollout what it requires ("": it can)."""
        needs = a.manifest.requirements
        isolation = self.runtime.isolation
        if needs.isolation == Isolation.VM and isolation != Isolation.VM:
            return (f"the rollout requires vm isolation and this host's runtime gives "
                    f"{isolation.value}")  # fmt: skip
        if needs.cuda_device and self.caps.cuda_devices < 1:
            return "the rollout requires a CUDA device and this host has none"
        if needs.inference and self.config.gateway is None:
            return "the rollout calls the inference gateway and this host knows of none"
        return ""

    async def _attempt(self, running: _Running, log_: structlog.BoundLogger) -> Completion:
        a = running.assignment
        runtime_name, device = self.caps.runtime.value, self._device(a)

        egress: EffectiveEgress | None = None
        moving = ""
        """The artifact being moved (an image, inputs): a failure then is an artifact's."""

        def report(outcome: Outcome, error: str = "") -> Completion:
            return Completion(
                artifact_failed=bool(moving) and outcome != Outcome.CANCELLED,
                egress=egress,
                work_id=a.work_id,
                fencing_token=a.fencing_token,
                outcome=outcome,
                results=tuple(running.results),
                error=error,
                runtime=runtime_name,
                device=device,
            )

        machine: Machine | None = None
        rootfs_ready = False
        unmet = self._cannot_honour(a)
        if unmet:
            # A host that registered as more than it is (or a server that placed it wrongly)
            # must not run it: another host is tried.
            log_.error("requirement_unmet", reason=unmet)
            return report(Outcome.TRANSIENT_ERROR, f"host {self.caps.host_id}: {unmet}")
        try:
            parsed = a.manifest.parsed_smolfile()
            if a.manifest.session is None:  # a plan no host can run is malformed, not retried
                check_steps(a.manifest.steps)
            egress = effective_egress(parsed.spec, runtime_name)
            reference = (
                a.manifest.image_ref if oci.looks_like_reference(a.manifest.image_ref) else ""
            )
            moving = "image"
            await self.images.acquire(self._stub, a.manifest.image_digest, reference)
            running.image = a.manifest.image_digest
            rootfs = await asyncio.to_thread(self.config.images.rootfs, a.manifest.image_digest)
            rootfs_ready, moving = True, "inputs"
            staged = await self._stage_inputs(a)
            moving = ""
            spec = MachineSpec(
                name=f"fleet-{a.rollout_id}-a{a.attempt}",
                smolfile=parsed.spec,
                image_digest=a.manifest.image_digest,
                rootfs=rootfs,
                labels={
                    "fleet": "1",
                    "host": self.caps.host_id,
                    "rollout": a.rollout_id,
                    "attempt": str(a.attempt),
                    # The lease it runs under: a restarted agent adopts it only if still held.
                    "work": a.work_id,
                    "fence": str(a.fencing_token),
                },
                secrets=resolve_secrets(parsed.spec),
                gateway=self._gateway_for(a),
                gateway_tls=bool(self.config.gateway_ca),
                inputs=staged,
            )
            if spec.gateway is not None:  # recorded for review: what else this machine reached
                where = f"{spec.gateway[0]}:{spec.gateway[1]}"
                egress = egress.model_copy(
                    update={"enforced_by": f"{egress.enforced_by}; plus the inference gateway "
                            f"({where}), with a token for this rollout"}
                )  # fmt: skip
            steps = list(enumerate(a.manifest.steps))
            session = a.manifest.session
            forks = self.runtime.forks_children
            if session is None:
                steps, warm, why = warm_plan(parsed.spec, steps, forks, runtime_name)
            elif session.fork_of:  # a copy of the source's machine, whatever it is
                warm, why = None, ""
            else:
                warm, why = warm_session(parsed.spec, forks, runtime_name)
            if why:
                log_.info("warm_parent_not_used", reason=why)
                if egress is not None:
                    egress = egress.model_copy(
                        update={"enforced_by": f"{egress.enforced_by}; ran as its own machine, "
                                f"not a warm parent's child ({why})"}
                    )  # fmt: skip
            if running.adopt is not None:  # (a warm parent's children are never adopted)
                record = await asyncio.to_thread(
                    AttemptJournal.resume, self.journal_dir, a.work_id, a.fencing_token
                )
                machine = await self.runtime.adopt(running.adopt, spec)
                running.results = list(record.results)
                finished = record.finished
                steps = [(i, step) for i, step in steps if i not in finished]
                log_.info("attempt_resumed", machine=machine.name, steps_done=sorted(finished),
                          init_done=record.init_done)  # fmt: skip
                failed = next((r for r in record.results if not r.ok), None)
                if failed is not None:  # the old agent died between that step and its report
                    running.machine = machine
                    why = "timed out" if failed.timed_out else f"exited {failed.exit_code}"
                    return report(Outcome.STEP_FAILED, f"step {failed.index} ({failed.name}) {why}")
            else:
                record = AttemptJournal(self.journal_dir, a.work_id, a.fencing_token)
                if session is not None and session.fork_of:
                    source = self.sessions.machine_of(session.fork_of)
                    if source is None:
                        return report(
                            Outcome.STEP_FAILED,
                            f"session {session.fork_of} is not open on host "
                            f"{self.caps.host_id}: there is nothing to fork",
                        )
                    machine = await source.fork(spec)
                    log_.info("session_forked", source=session.fork_of, machine=machine.name)
                elif warm is not None:
                    parent = await self._warm_parent(a, spec, warm)
                    machine = await parent.branch(spec.name)
                    if parent.carries_memory:  # the warm-up ran once, in the parent
                        steps = steps[1:]
                    else:  # the parent's disk and memory image carried; not its interpreter
                        steps = [(i, with_warm_up(step, warm)) for i, step in steps[1:]]
                    channel = machine.channel()
                    if (
                        spec.gateway is not None
                        and egress is not None
                        and (channel is not None and channel.kind == "unix")
                    ):
                        how = (f"ran as a warm parent's child: its own loopback only, the "
                               f"gateway through {child_address(GATEWAY_SOCKET)}, joined by "
                               f"the agent")  # fmt: skip
                        egress = egress.model_copy(
                            update={"enforced_by": f"{egress.enforced_by}; {how}"}
                        )
                else:
                    machine = await self.runtime.create(spec)
            running.machine = machine
            extra_env = {
                "FLEET_ROLLOUT_ID": a.rollout_id,
                "FLEET_ATTEMPT": str(a.attempt),
                "FLEET_DEVICE": device,
            }
            if spec.gateway is not None:
                extra_env["FLEET_INFERENCE_TOKEN"] = a.inference_token
                channel = machine.channel()
                if channel is not None and channel.kind == "unix":  # no network of its own
                    running.splice = await self._gateway_splice(channel.path, spec.gateway)
                    extra_env["FLEET_GATEWAY"] = child_address(GATEWAY_SOCKET)
                elif self.config.gateway_ca:
                    extra_env["FLEET_GATEWAY_CA"] = self.config.gateway_ca.decode()
                relay = await self._checkpoint_relay(machine, a)
                if relay is not None:
                    running.relay, extra_env["FLEET_CHECKPOINTS"] = relay
            if a.manifest.inputs and not spec.inputs and running.adopt is None:
                try:
                    moving = "inputs"
                    await place_inputs(machine, self._stub, a)
                    moving = ""
                except InputPlacementFailed as exc:
                    return report(Outcome.STEP_FAILED, str(exc))
            forked = session is not None and bool(session.fork_of)  # (its source ran them)
            init_commands = (
                [] if warm is not None or forked or record.init_done else parsed.spec.init
            )
            for command in init_commands:
                init = await machine.exec(
                    ["/bin/sh", "-c", command], env=extra_env, timeout_s=INIT_TIMEOUT_S
                )
                if init.exit_code != 0:
                    return report(
                        Outcome.STEP_FAILED,
                        f"init command {command!r} exited {init.exit_code}: "
                        f"{init.stderr.decode(errors='replace')[-500:]}",
                    )
            if init_commands:  # journalled only when there was something not to run again
                await asyncio.to_thread(record.mark_init_done)
            if a.manifest.session is not None:  # held for the caller's calls, not a plan
                why = await self.sessions.hold(a, machine, extra_env, a.manifest.session)
                log_.info("session_closed", reason=why)
                return report(Outcome.SUCCEEDED, why)
            for index, step in steps:
                left = a.manifest.deadline.timestamp() - time.time()
                if left <= 0:
                    return report(Outcome.CANCELLED, "the rollout's deadline passed")
                timeout = min(step.timeout_s, left)
                with StepLog(self.config.machines_dir.parent / "spool", index) as step_log:
                    result = await machine.exec(
                        list(step.argv),
                        env={**extra_env, **step.env},
                        workdir=step.workdir,
                        timeout_s=timeout,
                        on_output=step_log.sink,
                    )
                    # Output past the inline limit is kept whole, as an artifact.
                    running.logs += await step_log.keep(self._stub, a, result)
                step_result = StepResult(
                    index=index,
                    name=step.name,
                    exit_code=result.exit_code,
                    timed_out=result.timed_out,
                    duration_s=result.duration_s,
                    stdout=result.stdout,
                    stderr=result.stderr,
                    stdout_truncated=result.stdout_truncated,
                    stderr_truncated=result.stderr_truncated,
                )
                running.results.append(step_result)
                await asyncio.to_thread(record.record, step_result)
                log_.info(
                    "step_finished",
                    step=index,
                    exit_code=result.exit_code,
                    timed_out=result.timed_out,
                    seconds=round(result.duration_s, 3),
                )
                if result.pids_exhausted and (result.exit_code != 0 or result.oom_killed):
                    return report(
                        Outcome.STEP_FAILED,
                        f"step {index} ({step.name}) hit the machine's process limit "
                        f"({DEFAULT_PIDS_MAX} processes)"
                        + (", then ran out of memory" if result.oom_killed else ""),
                    )
                if result.oom_killed:
                    limit = parsed.spec.memory_mib_effective
                    return report(
                        Outcome.STEP_FAILED,
                        f"step {index} ({step.name}) was killed: out of memory "
                        f"(the Smolfile's limit is {limit} MiB)",
                    )
                if result.disk_full and result.exit_code != 0 and not result.timed_out:
                    bound = disk.bound_gib(parsed.spec)
                    whose = "the Smolfile's" if bound is not None else "the host's default"
                    return report(
                        Outcome.STEP_FAILED,
                        f"step {index} ({step.name}) exited {result.exit_code} with the "
                        f"machine's disk full ({whose} bound)",
                    )
                if result.timed_out:
                    why = "deadline" if timeout < step.timeout_s else f"{step.timeout_s:g}s timeout"
                    return report(Outcome.STEP_FAILED, f"step {index} ({step.name}) hit its {why}")
                if result.exit_code != 0:
                    return report(
                        Outcome.STEP_FAILED, f"step {index} ({step.name}) exited {result.exit_code}"
                    )
            return report(Outcome.SUCCEEDED)
        except asyncio.CancelledError:
            return report(Outcome.CANCELLED, running.stop_reason or "agent stopped")
        except FleetError as exc:
            outcome = failure_class(exc, image_ready=machine is not None or rootfs_ready)
            log_.warning("attempt_error", code=exc.code, error=exc.message, outcome=outcome)
            return report(outcome, f"{exc.code}: {exc.message}")
        except Exception as exc:
            log_.exception("attempt_crashed")
            return report(Outcome.TRANSIENT_ERROR, f"agent error: {exc!r}")

    async def _complete(
        self,
        stub: host_pb2_grpc.HostServiceStub,
        completion: Completion,
        log_: structlog.BoundLogger,
    ) -> None:
        request = convert.completion_to_pb(self.caps.host_id, completion, uuid.uuid4().hex)
        delay = 0.2
        # A completion is idempotent under its fencing token, so resending is safe, also after
        # an INTERNAL error whose transaction may or may not have committed.
        for _ in range(30):
            try:
                await stub.CompleteWork(request, timeout=10)
                log_.info("work_reported", outcome=completion.outcome)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in {*RETRYABLE, grpc.StatusCode.INTERNAL}:
                    log_.warning("completion_refused", code=exc.code().name, error=exc.details())
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        log_.error("completion_undelivered", note="the lease will expire and the work rerun")


def parent_key(
    tenant: str, image_digest: str, smolfile_digest: str, warmup: str, reach: str = ""
) -> str:
    """Which warm parent a rollout's children come from: one per tenant, image, Smolfile,
    warm-up and what its machine reaches (`reach`: "gateway" or ""; each part length-prefixed,
    so no two different tuples share a key)."""
    parts = (tenant, image_digest, smolfile_digest, warmup, reach)
    body = "".join(f"{len(part.encode())}:{part}" for part in parts)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def warm_plan(
    spec: Smolfile, steps: list[tuple[int, Step]], forks_children: bool, runtime_name: str
) -> tuple[list[tuple[int, Step]], str | None, str]:
    """(the steps to run, the warm-up code when they run as a warm parent's children, and why
    they do not where the rollout asked to).

    A rollout asks with `[branch] enabled = true` and a first step named `warm-up` that is
    `python3 -c CODE`: CODE runs once per parent, and every later step finds what it loaded
    already in memory. Where that cannot be (a Smolfile that asks for egress: a child has no
    network beyond its loopback; a runtime that forks no children), each later step runs the
    warm-up first, in its own interpreter, and so starts from the state a fork would have had.
    """
    if not (spec.branch and spec.branch.enabled) or not steps or steps[0][1].name != "warm-up":
        return steps, None, ""
    argv = list(steps[0][1].argv)
    if len(argv) != 3 or argv[0] != "python3" or argv[1] != "-c":
        raise InvalidArgument("the warm-up step must be python3 -c CODE")
    warm = argv[2]
    if spec.egress_requested:
        why = "a warm parent's children have no network beyond their loopback"
    elif not forks_children:
        why = f"this host's {runtime_name} runtime forks no warm children"
    else:
        return steps, warm, ""
    return [(i, with_warm_up(step, warm)) for i, step in steps[1:]], None, why


def warm_session(spec: Smolfile, forks_children: bool, runtime_name: str) -> tuple[str | None, str]:
    """(the warm-up, "" for a session whose machine is a warm parent's child, or None; and why
    not, where its Smolfile asked with `[branch] enabled = true`). A session's parent runs the
    Smolfile's `init` once; each session is then a copy-on-write child of it."""
    if not (spec.branch and spec.branch.enabled):
        return None, ""
    if spec.egress_requested:
        return None, "a warm parent's children have no network beyond their loopback"
    if not forks_children:
        return None, f"this host's {runtime_name} runtime forks no warm children"
    return "", ""


def with_warm_up(step: Step, warm_up: str) -> Step:
    """A `python3 -c` step that runs the warm-up code first, in its own interpreter: in a cold
    machine it then starts from the state a warm parent's fork would have started from."""
    argv = list(step.argv)
    if len(argv) >= 3 and argv[0] == "python3" and argv[1] == "-c":
        return step.model_copy(update={"argv": ("python3", "-c", f"{warm_up}\n{argv[2]}",
                                                *argv[3:])})  # fmt: skip
    return step


def failure_class(exc: FleetError, *, image_ready: bool) -> Outcome:
    """How the agent classes an error before any step ran.

    Malformed input (the manifest's Smolfile, its secrets) is quarantined: no host can run it.
    A runtime that cannot express the manifest fails fast. Anything about this host (a corrupt
    local image copy, a runtime error) is transient: another attempt, maybe elsewhere, can work.
    """
    if exc.code == ErrorCode.INVALID_ARGUMENT:
        return Outcome.MALFORMED_INPUT
    if exc.code == ErrorCode.FAILED_PRECONDITION and image_ready:
        return Outcome.INCOMPATIBLE
    return Outcome.TRANSIENT_ERROR


def default_host_id(host_class: HostClass, index: int = 0) -> str:
    return f"{socket.gethostname()}-{host_class.value}-{index}"
