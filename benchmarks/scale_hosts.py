"""Simulated hosts for `benchmarks.scale`: many in one process, each speaking the real host
protocol over its own mutual-TLS channel with a certificate of its own.

A host here is what `fleet.agent.agent.Agent` is on the wire, without machines: it enrolls
with a join token (`fleet.agent.link.enroll`, as `fleet agent --join` does), registers,
heartbeats at the interval the server gives (naming the leases it holds), long-polls
`ClaimWork` with the agent's wait, and reports each item at once as a succeeded no-op step
through `CompleteWork`, claiming the next in the same call. Its workload is the fake runtime's
no-op; what it costs the servers and the database is the control plane's own.

Each host knows both replicas' host endpoints and moves to the other when its own answers
UNAVAILABLE (or does not answer in time), resending the same request: a claim under the same
request id gets back the lease the dead replica may have granted, and a report is idempotent
under its fencing token, so a replica's death neither loses nor repeats work.

A worker process runs its share of the hosts and obeys its parent over a pipe: let this many
of its hosts claim, stop claiming, hand over its counters, stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import structlog

import fleet
from benchmarks.harness import quiet
from fleet.agent.capabilities import RuntimeChoice, capabilities
from fleet.agent.config import AgentConfig
from fleet.agent.link import CHANNEL_OPTIONS, enroll
from fleet.api import convert
from fleet.api.pb import host_pb2, host_pb2_grpc
from fleet.core.errors import ResourceExhausted
from fleet.core.lifecycle import Outcome
from fleet.core.placement import HostCapabilities, HostClass, RuntimeKind
from fleet.core.rollout import Completion, StepResult
from fleet.identity.tls import HostFiles

log = structlog.get_logger(__name__)

MOVE_ON = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
"""Codes that send a host to the other replica (the agent retries the same ones)."""
GIVE_UP_S = 120.0
"""How long a call is retried across both replicas before the host gives it up."""


def _agent_claim_wait_s() -> float:
    [found] = [f.default for f in dataclasses.fields(AgentConfig) if f.name == "claim_wait_s"]
    assert isinstance(found, float)
    return found


CLAIM_WAIT_S = _agent_claim_wait_s()
"""How long a claim waits for work at the server: the agent's own default."""
ENROLLING_AT_ONCE = 16
"""Enrollments in flight at once, all workers together (each a TLS handshake and a signature).
The server bounds EnrollHost calls in flight per peer address (refused ones are counted before
they are checked), and every simulated host calls from 127.0.0.1: kept below that bound."""
ENROLL_TRIES = 30


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a worker process is given: its hosts' numbers, the replicas, and how to join."""

    first: int
    count: int
    api: tuple[str, ...]
    """Each replica's API endpoint (enrollment)."""
    host_endpoints: tuple[str, ...]
    """Each replica's mutual-TLS host endpoint, in the same order."""
    ca_pem: bytes
    join_token: str
    slots: int
    work_s: float
    claim_wait_s: float
    """How long a claim waits at the server for work (the agent's default: CLAIM_WAIT_S)."""
    workers: int
    """How many worker processes share the hosts."""
    root: str
    """Where the hosts' identities are written (one directory each)."""


def host_id(index: int) -> str:
    return f"sim-{index:05d}"


@dataclasses.dataclass
class Counters:
    """A worker's figures, handed to its parent (cumulative, except `claims`: those since the
    last hand-over)."""

    heartbeats: int = 0
    heartbeat_errors: int = 0
    lost_leases: int = 0
    completed: int = 0
    not_final: int = 0
    """Reports the server answered with a state that is not final."""
    refused: int = 0
    """Calls given up: refused, or neither replica answered for GIVE_UP_S."""
    last_completed_at: float = 0.0
    claims: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    """(rollout id, when it was claimed) of every item claimed."""
    moves: list[tuple[str, float, float]] = dataclasses.field(default_factory=list)
    """(host id, when it left its replica, when its first call on the other one succeeded)."""


class SimHost:
    """One simulated host; see the module's docstring."""

    def __init__(self, index: int, plan: Plan, caps: HostCapabilities, counters: Counters) -> None:
        self.host_id = host_id(index)
        self.plan = plan
        self.caps = caps.model_copy(update={"host_id": self.host_id})
        self.counters = counters
        self.replica = index % len(plan.api)
        """The replica it enrolled with and calls first."""
        self.credentials: grpc.ChannelCredentials | None = None
        self.stubs: dict[int, Any] = {}
        self.channels: list[grpc.aio.Channel] = []
        self.held: dict[str, int] = {}
        """Leases held: work id -> fencing token."""
        self.claiming = asyncio.Event()
        self.claim_idle = asyncio.Event()
        """Set while no ClaimWork of this host is waiting at a server."""
        self.claim_idle.set()
        self.slot_freed = asyncio.Event()
        self.handing_over = 0
        self.heartbeat_s = 3.0
        self.moved_at = 0.0
        self.tasks: set[asyncio.Task[None]] = set()
        self.log = log.bind(host_id=self.host_id)

    async def join(self) -> None:
        """Enrolls with the join token at its replica, as `fleet agent --join` does (again,
        after a pause, while the replica says too many calls from this address are in
        flight)."""
        files = HostFiles(Path(self.plan.root) / self.host_id)
        for tries_left in range(ENROLL_TRIES - 1, -1, -1):
            try:
                identity = await enroll(
                    self.plan.api[self.replica], self.plan.join_token, self.host_id, self.caps,
                    files, ca_pem=self.plan.ca_pem,
                )  # fmt: skip
                break
            except ResourceExhausted:
                if not tries_left:
                    raise
                await asyncio.sleep(random.uniform(0.5, 1.5))
        self.credentials = identity.channel_credentials()

    def _stub(self, replica: int) -> Any:
        stub = self.stubs.get(replica)
        if stub is None:
            assert self.credentials is not None, "the host has not joined"
            channel = grpc.aio.secure_channel(
                self.plan.host_endpoints[replica], self.credentials, options=CHANNEL_OPTIONS
            )
            self.channels.append(channel)
            stub = self.stubs[replica] = host_pb2_grpc.HostServiceStub(channel)
        return stub

    async def call(self, method: str, request: Any, timeout_s: float) -> Any:
        """`method(request)` on this host's replica; on UNAVAILABLE, the same request on the
        other one (and back, with backoff, for up to GIVE_UP_S)."""
        give_up = time.monotonic() + GIVE_UP_S
        delay = 0.05
        while True:
            replica = self.replica
            try:
                reply = await getattr(self._stub(replica), method)(request, timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in MOVE_ON or time.monotonic() > give_up:
                    raise
                if replica == self.replica:  # (a concurrent call may have moved it already)
                    self.replica = (replica + 1) % len(self.plan.api)
                    self.moved_at = self.moved_at or time.time()
                    self.log.info("replica_gone", method=method, code=exc.code().name,
                                  next=self.plan.host_endpoints[self.replica])  # fmt: skip
                await asyncio.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(delay * 2, 1.0)
                continue
            if self.moved_at:
                self.counters.moves.append((self.host_id, self.moved_at, time.time()))
                self.moved_at = 0.0
            return reply

    async def register(self) -> None:
        request = host_pb2.RegisterHostRequest(
            request_id=uuid.uuid4().hex, host_id=self.host_id,
            host_class=convert.HOST_CLASS_TO_PB[self.caps.host_class],
            capabilities=convert.capabilities_to_pb(self.caps), agent_version=fleet.__version__,
        )  # fmt: skip
        reply = await self.call("RegisterHost", request, 30)
        self.heartbeat_s = reply.heartbeat_interval_s or 3.0

    def start(self) -> None:
        self._spawn(self._heartbeats())
        self._spawn(self._claims())

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.counters.refused += 1
            self.log.error("host_task_failed", error=repr(task.exception()))

    async def _heartbeats(self) -> None:
        # Real hosts start at scattered times: their beats are spread over the interval.
        await asyncio.sleep(random.uniform(0, self.heartbeat_s))
        while True:
            request = host_pb2.HeartbeatRequest(
                request_id=uuid.uuid4().hex, host_id=self.host_id,
                leases=[host_pb2.LeaseRef(work_id=w, fencing_token=t)
                        for w, t in self.held.items()],
            )  # fmt: skip
            wait_s = self.heartbeat_s
            try:
                reply = await self.call("Heartbeat", request, 10)
                self.counters.heartbeats += 1
                if reply.heartbeat_interval_s > 0 and reply.heartbeat_interval_s != wait_s:
                    # A new pace (as the agent takes it): a random part of it first, so the
                    # hosts' beats spread over the new interval again.
                    self.heartbeat_s = reply.heartbeat_interval_s
                    wait_s = random.uniform(0, self.heartbeat_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.ABORTED:
                    stale = dict(exc.trailing_metadata() or ()).get("fleet-stale-work-ids", "")
                    lost = [w for w in str(stale).split(",") if self.held.pop(w, None)]
                    self.counters.lost_leases += len(lost)
                else:
                    self.counters.heartbeat_errors += 1
            await asyncio.sleep(wait_s)

    async def _claims(self) -> None:
        while True:
            await self.claiming.wait()
            free = self.plan.slots - len(self.held) - self.handing_over
            if free <= 0:
                self.slot_freed.clear()
                await self.slot_freed.wait()
                continue
            request = host_pb2.ClaimWorkRequest(
                request_id=uuid.uuid4().hex, host_id=self.host_id, max_items=free,
                wait_s=self.plan.claim_wait_s,
            )  # fmt: skip
            self.claim_idle.clear()
            try:
                reply = await self.call("ClaimWork", request, self.plan.claim_wait_s + 10)
            finally:
                self.claim_idle.set()
            self._run(reply.items)

    def _run(self, items: Any) -> None:
        now = time.time()
        for item in items:
            self.held[item.work_id] = item.fencing_token
            self.counters.claims.append((item.rollout_id, now))
            self._spawn(self._serve(item.work_id, item.fencing_token))

    async def _serve(self, work_id: str, fencing_token: int) -> None:
        """The no-op attempt: reported at once (after `work_s`) as one succeeded step."""
        if self.plan.work_s:
            await asyncio.sleep(self.plan.work_s)
        completion = Completion(
            work_id=work_id, fencing_token=fencing_token, outcome=Outcome.SUCCEEDED,
            results=(StepResult(index=0, name="step", exit_code=0),),
            runtime=RuntimeKind.NAMESPACE.value, device="cpu",
        )  # fmt: skip
        request = convert.completion_to_pb(self.host_id, completion, uuid.uuid4().hex)
        request.claim_max_items = 1 if self.claiming.is_set() else 0
        self.handing_over += 1
        self.held.pop(work_id, None)
        try:
            reply = await self._complete(request)
        finally:
            self.handing_over -= 1
            self.slot_freed.set()
        if reply is None:
            return
        if convert.STATE_FROM_PB[reply.state].final:
            self.counters.completed += 1
            self.counters.last_completed_at = time.time()
        else:
            self.counters.not_final += 1
        self._run(reply.items)

    async def _complete(self, request: host_pb2.CompleteWorkRequest) -> Any:
        """The report, resent (it is idempotent under its fencing token) after an INTERNAL
        error as the agent does; None: refused."""
        for _ in range(30):
            try:
                return await self.call("CompleteWork", request, 10)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.INTERNAL:
                    self.counters.refused += 1
                    self.log.warning("completion_refused", code=exc.code().name,
                                     error=exc.details())  # fmt: skip
                    return None
                await asyncio.sleep(0.2)
        self.counters.refused += 1
        return None

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for channel in self.channels:
            await channel.close()


class Worker:
    """A process's share of the hosts, driven by its parent over `conn`."""

    def __init__(self, plan: Plan, conn: Connection) -> None:
        self.plan = plan
        self.conn = conn
        self.counters = Counters()
        caps = capabilities(
            "sim", HostClass.CPU, RuntimeChoice(RuntimeKind.NAMESPACE, "simulated host"),
            plan.slots,
        )  # fmt: skip
        self.hosts = [
            SimHost(i, plan, caps, self.counters)
            for i in range(plan.first, plan.first + plan.count)
        ]

    async def run(self) -> None:
        gate = asyncio.Semaphore(max(1, ENROLLING_AT_ONCE // self.plan.workers))

        async def join(host: SimHost) -> None:
            async with gate:
                await host.join()
                await host.register()

        await asyncio.gather(*(join(h) for h in self.hosts))
        for host in self.hosts:
            host.start()
        self.conn.send(("ready", len(self.hosts)))
        loop = asyncio.get_running_loop()
        commands: dict[str, Callable[..., Awaitable[Any]]] = {
            "claim": self._claim, "pause": self._pause, "stats": self._stats,
        }  # fmt: skip
        try:
            while True:
                name, *args = await loop.run_in_executor(None, self.conn.recv)
                if name == "stop":
                    break
                self.conn.send(await commands[name](*args))
        finally:
            await asyncio.gather(*(h.close() for h in self.hosts))
        self.conn.send(("stopped", None))

    async def _claim(self, count: int) -> tuple[str, int]:
        """The first `count` hosts claim work from now on."""
        for host in self.hosts[:count]:
            host.claiming.set()
        return ("claiming", min(count, len(self.hosts)))

    async def _pause(self) -> tuple[str, int]:
        """No host claims work from now on; answered once no claim of theirs is waiting at a
        server (at most the claim wait), so that work submitted next waits for a `claim`."""
        for host in self.hosts:
            host.claiming.clear()
        waits = [h.claim_idle.wait() for h in self.hosts if not h.claim_idle.is_set()]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*waits), self.plan.claim_wait_s + 15)
        return ("paused", sum(1 for h in self.hosts if not h.claim_idle.is_set()))

    async def _stats(self) -> tuple[str, Counters]:
        counters = dataclasses.replace(self.counters, claims=list(self.counters.claims),
                                       moves=list(self.counters.moves))  # fmt: skip
        self.counters.claims.clear()
        self.counters.moves.clear()
        return ("stats", counters)


def worker_main(plan: Plan, conn: Connection) -> None:
    """A worker process's entry point (spawned: nothing of the parent's state is carried)."""
    quiet()
    try:
        asyncio.run(Worker(plan, conn).run())
    except Exception as exc:
        conn.send(("failed", repr(exc)))
        raise
