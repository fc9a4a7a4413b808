"""What the servicers share: configuration, the ledger on one worker thread, wake-ups, and
group commit."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import random
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Generic, TypeVar

import structlog

from fleet.artifacts.store import BlobStore, RegistryBlobStore
from fleet.core.beat_pace import Pace, pace, settle
from fleet.core.coalesce import Coalescer
from fleet.core.errors import (
    Internal,
)
from fleet.core.lifecycle import RolloutState
from fleet.core.manifest import Manifest, SubmitRequest
from fleet.core.placement import HostCapabilities, HostClass, Requirements, unservable_reason
from fleet.core.rollout import Assignment, Completion, Rollout
from fleet.image.store import ImageStore
from fleet.ledger.leases import Beat, Beaten, Claim
from fleet.ledger.store import Ledger
from fleet.server.auth import Authenticator, Caller, Security, current
from fleet.server.hub import SessionHub
from fleet.server.settings import ServerConfig
from fleet.server.work_signal import WorkSignal, conninfo

log = structlog.get_logger(__name__)

T = TypeVar("T")
R = TypeVar("R")

MAX_CLAIM_WAIT_S = 30.0
CLAIM_POLL_S = 0.5
"""How often a waiting claim asks the ledger again when only this replica's own submissions
wake it: work another server stored, or a retry whose backoff ended, is found then."""
SIGNALLED_CLAIM_POLL_S = 30.0
"""The same while other replicas' submissions wake it too (PostgreSQL's notifications, see
`fleet.server.work_signal`), and the sweeper wakes it for retries whose backoff ended: only a
lost notification waits for it, or for the host's next claim. Each wait is drawn from ±25% of
it, so that hosts that began waiting together do not ask together. (At 3 s, 1,000 idle hosts'
claims asked the ledger 330 times a second for nothing.)"""
WAKE_AT_LEAST = 16
"""Waiting claims woken for any new work, however little (`ClaimWaiters`): a fleet with fewer
idle hosts of the class the work needs wakes them all (and others, up to this many), as the
host that can take the work may not be the first in line (another runtime or isolation; a gpu
host while a rollback is in force, which takes cpu work too). In a larger fleet, work the
claims woken cannot take is found by its host's fallback poll or next claim."""
READ_THREADS = 2
"""Threads for read-only ledger calls, beside the ledger's one writing thread."""


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


Wake = int | Mapping[str, int] | None
"""Waiting claims to wake: a count of the longest waiting, whatever their hosts' class; a
count per host class (`gpu`, `cpu`; the key "": whatever the class), each of the longest
waiting of hosts of that class; or None, every one."""


def wakes_any(wake: Wake) -> bool:
    """Whether `wake` asks for any claim to be woken."""
    if wake is None:
        return True
    if isinstance(wake, int):
        return wake > 0
    return any(n > 0 for n in wake.values())


class ClaimWaiters:
    """Hosts' claims waiting for work, woken in the order they began to wait, only as many as
    there may be work for: a rollout submitted wakes one claim, not every idle host's. (Woken
    all at once, a thousand idle hosts' claims each asked the ledger again for every rollout
    submitted or reported, and found nothing but the one.) Work of a known host class wakes
    claims of hosts of that class: woken in order whatever their class, a thousand idle cpu
    hosts' claims stood before the one gpu host's that could take a gpu rollout. A claim
    that was not woken still looks again at its own timeout (`Core.claim_poll_s`), and a
    claim that filled itself wakes as many more (`ClaimBatcher`): there may be more work
    than was counted."""

    def __init__(self) -> None:
        self._waiting: dict[int, tuple[asyncio.Future[None], str]] = {}
        self._by_class: dict[str, dict[int, asyncio.Future[None]]] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def waiting(self, host_class: str) -> int:
        """Claims of hosts of `host_class` waiting now."""
        return len(self._by_class.get(host_class, ()))

    async def wait(self, timeout_s: float, host_class: str = "") -> None:
        """Until woken, or `timeout_s`; `host_class`: the class of the claim's host ("": not
        known, woken only by wake-ups for any class)."""
        future = asyncio.get_running_loop().create_future()
        key, self._next = self._next, self._next + 1
        self._waiting[key] = (future, host_class)
        self._by_class.setdefault(host_class, {})[key] = future
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(future, timeout_s)
        finally:
            self._forget(key)

    def _forget(self, key: int) -> asyncio.Future[None] | None:
        entry = self._waiting.pop(key, None)
        if entry is None:
            return None
        future, host_class = entry
        same = self._by_class[host_class]
        del same[key]
        if not same:
            del self._by_class[host_class]
        return future

    def fire(self, n: Wake = None, *, at_least: int = WAKE_AT_LEAST) -> None:
        """Wakes the claims that have waited longest: `n` of them, whatever their hosts' class,
        or for each class the count `n` gives it, of hosts of that class, `at_least` at least
        (made up with other classes' where fewer of that class wait) (None: every one; 0 or
        no count: none)."""
        if n is None:
            keys = list(self._waiting)
        else:
            keys = []
            for host_class, count in ({"": n} if isinstance(n, int) else n).items():
                if count <= 0:
                    continue
                want = max(count, at_least)
                if not host_class:
                    keys += itertools.islice(self._waiting, want)
                    continue
                mine = list(itertools.islice(self._by_class.get(host_class, {}), want))
                if len(mine) < at_least:  # (few of that class wait: the floor is met by the
                    # others, as in a fleet of few idle hosts, where any may take it: a gpu
                    # host takes cpu work while a rollback is in force)
                    taken = set(mine)
                    others = (key for key in self._waiting if key not in taken)
                    mine += itertools.islice(others, at_least - len(mine))
                keys += mine
        for key in keys:
            future = self._forget(key)
            if future is not None and not future.done():
                future.set_result(None)


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
            lookups = (identities.key_row, identities.host)

            async def auth_db(fn: Callable[..., Any], *args: Any) -> Any:
                # Looking a caller up only reads: every host's beat does, so it is done on the
                # reader threads and waits behind no write (a key's use is written).
                if fn in lookups:
                    return await self.read(fn, *args)
                return await self.db(fn, *args)

            self.auth = Authenticator(
                auth_db, identities.key_row, identities.host, identities.key_used,
                host_port=lambda: self.host_port, cache_s=security.cache_s,
            )  # fmt: skip
        self._db = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger")
        self._reads = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="ledger-read")
        self._hosts: tuple[float, list[HostCapabilities]] | None = None
        self._host_classes: dict[str, str] = {}
        """Hosts' classes, for their claims' wake-ups (`host_class`)."""
        self._host_classes_read = asyncio.Lock()
        self.work_pulse = ClaimWaiters()
        self.event_pulse = Pulse()
        self.hold_inference = False
        """Backpressure: the gateway is over its threshold (or unreachable)."""
        self.gateway_queue_depth = 0
        self.gateway_p95_ms: float | None = None
        """The gateway's p95 latency and oldest queued request, as last read (None: not
        known), for pools' promotion gates."""
        self.gateway_queue_age_ms: float | None = None
        self.gateway_saturated = ""
        """Why the gateway is past its limit, for adaptive pools ("": it is not)."""
        self.pool_events: dict[tuple[str, str], int] = {}
        """Pool events this server wrote, by (pool, kind), for its metrics."""
        self.sessions = SessionHub()
        """Hosts' session streams, and the calls waiting on them."""
        self.inference_running: dict[str, bool] = {}
        """Running rollouts -> whether they call the gateway, as last told to it."""
        self.pace = Pace(config.heartbeat_interval_s, config.lease_ttl_s)
        """How often hosts beat and how long a beat's lease lasts now (`refresh_pace`)."""
        self._closed = False
        self.signal: WorkSignal | None = None
        """Wake-ups to and from other replicas (PostgreSQL only; started on first use)."""

    def _work_signal(self) -> WorkSignal | None:
        if self.signal is None and self.ledger.backend == "postgresql" and not self._closed:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # (called from a thread: made by the loop's first use)
                return None
            self.signal = WorkSignal(conninfo(self.ledger.engine), loop, self.work_pulse.fire)
        return self.signal

    def claim_poll_s(self) -> float:
        """How long a waiting claim sleeps before it asks the ledger again, unless woken
        (`CLAIM_POLL_S`, `SIGNALLED_CLAIM_POLL_S`)."""
        signal = self._work_signal()
        if signal is None or not signal.listening:
            return CLAIM_POLL_S
        return SIGNALLED_CLAIM_POLL_S * random.uniform(0.75, 1.25)

    async def db(self, fn: Callable[..., T], *args: Any) -> T:
        """A ledger call on the ledger's one thread, where every write runs in turn."""
        return await asyncio.get_running_loop().run_in_executor(self._db, fn, *args)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """A read-only ledger call (a rollout, a page, events, the metrics' figures) on the
        reader threads: it reads a snapshot that waits for no writer (SQLite's WAL,
        PostgreSQL's MVCC) and keeps no write waiting behind it. What a write committed before
        it is seen."""
        return await asyncio.get_running_loop().run_in_executor(self._reads, fn, *args)

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

    async def refresh_pace(self, window_s: float | None = None) -> Pace:
        """The pace for the hosts that beat within `window_s` (default: the current lease,
        which every live host's beats fall within), kept in `pace`."""
        since = time.time() - (self.pace.lease_ttl_s if window_s is None else window_s)
        live = await self.read(self.ledger.live_host_count, since)
        c = self.config
        new = settle(
            self.pace, pace(live, c.heartbeat_interval_s, c.lease_ttl_s, c.max_heartbeats_per_s)
        )
        if new != self.pace:
            log.info("heartbeat_pace", hosts=live, interval_s=round(new.heartbeat_interval_s, 2),
                     lease_ttl_s=round(new.lease_ttl_s, 2))  # fmt: skip
            self.pace = new
        return new

    def host_registered(self, host: HostCapabilities) -> None:
        """`host` registered through this replica (its class may be new)."""
        self._hosts = None
        self._host_classes[host.host_id] = str(host.host_class)

    async def host_class(self, host_id: str) -> str:
        """The class of a registered host ("": none registered by that id), for its waiting
        claims' wake-ups. Read with every host's once, then kept: a host's class changes only
        when it registers again, here (`host_registered`) or through another replica (then
        its claims are woken as its old class's until this replica reads the hosts again for
        a host it does not know; each claim still asks the ledger itself)."""
        known = self._host_classes.get(host_id)
        if known is not None:
            return known
        async with self._host_classes_read:  # (one read for the claims that wait on it)
            if host_id not in self._host_classes:
                hosts = await self.read(self.ledger.hosts)
                self._host_classes.update({h.host_id: str(h.host_class) for h in hosts})
        return self._host_classes.get(host_id, "")

    def changed(self, wake: Wake = None) -> None:
        """Something that may let waiting claims take work (new work, a cap raised, a host
        back): wake this replica's watchers, and `wake` claims waiting here and at each other
        replica (None: all of them; `ClaimWaiters`)."""
        self.changed_here(wake)
        signal = self._work_signal()
        if signal is not None and wakes_any(wake):
            signal.send(wake)

    def changed_here(self, wake: Wake = None) -> None:
        """Wake this replica's watchers and `wake` of its waiting claims only (None: all):
        after reports, which make new work only by a retry's backoff or a cap's room (found
        by the others' fallback poll), and come too often to wake other replicas each time."""
        if wakes_any(wake):
            self.work_pulse.fire(wake)
        self.event_pulse.fire()

    def close(self) -> None:
        self._closed = True
        if self.signal is not None:
            self.signal.close()
        self._db.shutdown(wait=True)
        self._reads.shutdown(wait=True)


DEFAULT_HOST_PORT = 50054
"""The host endpoint's port when the API listens on a fixed one."""
HOSTS_FRESH_S = 1.0
"""How long a submission may rely on the hosts another one read (see `Core.unservable_reason`)."""
MAX_CHECKPOINTS_PER_CALL = 256
HEARTBEAT_LINGER_S = 0.1
"""How long a batch of heartbeats waits for more before it is written (`HeartbeatBatcher`):
at 100 beats a second (the default pace's most), about 10 beats a commit."""
MAX_LIST_BYTES = 3 << 20
"""A ListRollouts page ends before this many bytes of rollouts (results included)."""


class GroupCommit(Generic[T, R]):
    """Group commit: items that arrive while one batch is being written go together into the
    next transaction, one durable commit for all of them (`fleet.core.coalesce`). `write`
    gets a batch and returns one answer per item, in order: a result, or the exception that
    refused that item alone. After each batch, `wake(items, answers)` says how many waiting
    claims to wake (None: all), through `after` (default `Core.changed`, which wakes watchers
    too); no `wake`: nothing is woken."""

    MAX_BATCH = 256

    def __init__(
        self,
        core: Core,
        write: Callable[[list[T], float], list[R | Exception]],
        *,
        wake: Callable[[list[T], list[R | Exception]], Wake] | None = None,
        after: Callable[[Wake], None] | None = None,
        drop_abandoned: bool = False,
        linger_s: float = 0.0,
    ) -> None:
        self.core = core

        async def run(items: list[T]) -> list[R | Exception]:
            if linger_s:
                # What arrives meanwhile waits for the next batch: at a steady rate, each
                # batch holds what came in one linger and one write.
                await asyncio.sleep(linger_s)
            answers = await core.db(write, items, time.time())
            if wake is not None:
                (after or core.changed)(wake(items, answers))
            return answers

        self._coalescer: Coalescer[T, R] = Coalescer(
            run, max_batch=self.MAX_BATCH, drop_abandoned=drop_abandoned
        )

    async def submit(self, item: T) -> R:
        return await self._coalescer.submit(item)

    @property
    def coalescer(self) -> Coalescer[T, R]:
        """Its batches so far and what waits for the next (`Coalescer.batches`, `.waiting`)."""
        return self._coalescer


class SubmitBatcher(GroupCommit[tuple[SubmitRequest, Manifest], tuple[Rollout, bool]]):
    """Group commit for SubmitRollout: submissions that arrive while one batch is being stored
    go together into the next transaction (`Submissions.submit_batch`), each answered on its
    own. Claims waiting for work are woken after each batch, other replicas' too."""

    def __init__(self, core: Core) -> None:
        write = functools.partial(
            core.ledger.submit_batch, max_active_per_tenant=core.config.max_active_per_tenant
        )
        super().__init__(core, write, wake=_created)  # type: ignore[arg-type]

    async def store(self, submit: SubmitRequest, manifest: Manifest) -> tuple[Rollout, bool]:
        return await self.submit((submit, manifest))


class CompletionBatcher(GroupCommit[tuple[str, Completion], RolloutState]):
    """Group commit for CompleteWork. This replica's waiting claims and watchers are woken
    after each batch (`Core.changed_here`)."""

    def __init__(self, core: Core) -> None:
        super().__init__(
            core,
            core.ledger.complete_batch,  # type: ignore[arg-type]
            wake=functools.partial(_freed, core.ledger),
            after=core.changed_here,
        )

    async def complete(self, host_id: str, report: Completion) -> RolloutState:
        return await self.submit((host_id, report))


class ClaimBatcher(GroupCommit[Claim, list[Assignment]]):
    """Group commit for ClaimWork: hosts' claims that arrive while one batch is being taken go
    together into the next transaction, in arrival order (`Leases.claim_batch`). Nothing is
    woken after a batch: a claim makes no work for another.

    A claim whose caller gave up before its batch began is not taken. Its host, having had no
    answer, sends it again, perhaps to another replica, which finds no lease under its request
    id yet and leases other work; had the first been taken after that, its leases would have
    gone to a host that never heard of them, and their work would run again once they
    expired."""

    def __init__(self, core: Core) -> None:
        super().__init__(
            core,
            core.ledger.claim_batch,  # type: ignore[arg-type]
            wake=_filled,
            after=functools.partial(core.work_pulse.fire, at_least=0),
            drop_abandoned=True,
        )

    async def claim(self, claim: Claim) -> list[Assignment]:
        return await self.submit(claim)


class HeartbeatBatcher(GroupCommit[Beat, Beaten]):
    """Group commit for Heartbeat: the beats that arrive while one batch is being written go
    together into the next transaction (`Leases.heartbeat_batch`), each answered on its own.
    Each beat renews its leases from when it arrived, not from when its batch committed.
    Nothing is woken after a batch: a renewal makes no work.

    A beat is in no hurry (its deadline is seconds away, its lease longer), so each batch
    lingers `HEARTBEAT_LINGER_S` before it is written: beats from many hosts, which arrive
    spread over the interval rather than together, still share a commit."""

    def __init__(self, core: Core) -> None:
        def write(beats: list[Beat], _now: float) -> list[Beaten | Exception]:
            return list(core.ledger.heartbeat_batch(beats))

        super().__init__(core, write, linger_s=HEARTBEAT_LINGER_S)

    async def beat(self, beat: Beat) -> Beaten:
        return await self.submit(beat)


class CheckpointBatcher(GroupCommit[tuple[str, str, int, int, bytes], None]):
    """Group commit for PutCheckpoint: every running hybrid episode stores one per action."""

    def __init__(self, core: Core) -> None:
        super().__init__(core, core.ledger.put_checkpoints)  # type: ignore[arg-type]


def _created(
    items: list[tuple[SubmitRequest, Manifest]], answers: list[tuple[Rollout, bool] | Exception]
) -> dict[str, int]:
    """Rollouts a submission batch created (each one work item), by the class of host each
    needs: as many claims of hosts of that class to wake."""
    created: dict[str, int] = {}
    for (_, manifest), answer in zip(items, answers, strict=True):
        if not isinstance(answer, Exception) and answer[1]:
            host_class = str(manifest.host_class)
            created[host_class] = created.get(host_class, 0) + 1
    return created


def _filled(claims: list[Claim], answers: list[list[Assignment] | Exception]) -> int:
    """Claims of a batch that took all they asked for: there may be more work than the
    claims woken for it, so as many more are woken."""
    return sum(
        1
        for claim, a in zip(claims, answers, strict=True)
        if not isinstance(a, Exception) and a and len(a) >= claim.max_items
    )


def _freed(
    ledger: Ledger, reports: list[tuple[str, Completion]], answers: list[RolloutState | Exception]
) -> int:
    """Claims to wake after a batch of reports: each report frees at most one place under a
    tenant's or a pool's cap, which matters only while work is due that the latest claims
    could not take (`Leases.claims_left_due`); a report whose rollout is retried at once makes
    work due itself. (When the queue is empty, waking a claim per report only has it look at
    an empty queue.)"""
    retried = sum(1 for a in answers if a == RolloutState.QUEUED)
    return len(reports) if ledger.claims_left_due else retried
