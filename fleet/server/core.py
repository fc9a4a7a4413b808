"""What the servicers share: configuration, the ledger on one worker thread, wake-ups, and
group commit."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Generic, TypeVar

import structlog

from fleet.artifacts.store import BlobStore, RegistryBlobStore
from fleet.core.coalesce import Coalescer
from fleet.core.errors import (
    Internal,
)
from fleet.core.lifecycle import RolloutState
from fleet.core.manifest import Manifest, SubmitRequest
from fleet.core.placement import HostCapabilities, HostClass, Requirements, unservable_reason
from fleet.core.rollout import Assignment, Completion, Rollout
from fleet.image.store import ImageStore
from fleet.ledger.leases import Claim
from fleet.ledger.store import Ledger
from fleet.server.auth import Authenticator, Caller, Security, current
from fleet.server.hub import SessionHub
from fleet.server.settings import ServerConfig

log = structlog.get_logger(__name__)

T = TypeVar("T")
R = TypeVar("R")

MAX_CLAIM_WAIT_S = 30.0
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
        self._reads = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="ledger-read")
        self._hosts: tuple[float, list[HostCapabilities]] | None = None
        self.work_pulse = Pulse()
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

    def hosts_changed(self) -> None:
        self._hosts = None

    def changed(self) -> None:
        self.work_pulse.fire()
        self.event_pulse.fire()

    def close(self) -> None:
        self._db.shutdown(wait=True)
        self._reads.shutdown(wait=True)


DEFAULT_HOST_PORT = 50054
"""The host endpoint's port when the API listens on a fixed one."""
HOSTS_FRESH_S = 1.0
"""How long a submission may rely on the hosts another one read (see `Core.unservable_reason`)."""
MAX_CHECKPOINTS_PER_CALL = 256
MAX_LIST_BYTES = 3 << 20
"""A ListRollouts page ends before this many bytes of rollouts (results included)."""


class GroupCommit(Generic[T, R]):
    """Group commit: items that arrive while one batch is being written go together into the
    next transaction, one durable commit for all of them (`fleet.core.coalesce`). `write`
    gets a batch and returns one answer per item, in order: a result, or the exception that
    refused that item alone. Claims and watchers are woken after each batch (`notify`)."""

    MAX_BATCH = 256

    def __init__(
        self,
        core: Core,
        write: Callable[[list[T], float], list[R | Exception]],
        *,
        notify: bool = True,
    ) -> None:
        self.core = core

        async def run(items: list[T]) -> list[R | Exception]:
            return await core.db(write, items, time.time())

        self._coalescer: Coalescer[T, R] = Coalescer(
            run, max_batch=self.MAX_BATCH, after_batch=core.changed if notify else None
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
    own. Claims waiting for work are woken after each batch."""

    def __init__(self, core: Core) -> None:
        write = functools.partial(
            core.ledger.submit_batch, max_active_per_tenant=core.config.max_active_per_tenant
        )
        super().__init__(core, write)  # type: ignore[arg-type]

    async def store(self, submit: SubmitRequest, manifest: Manifest) -> tuple[Rollout, bool]:
        return await self.submit((submit, manifest))


class CompletionBatcher(GroupCommit[tuple[str, Completion], RolloutState]):
    """Group commit for CompleteWork."""

    def __init__(self, core: Core) -> None:
        super().__init__(core, core.ledger.complete_batch)  # type: ignore[arg-type]

    async def complete(self, host_id: str, report: Completion) -> RolloutState:
        return await self.submit((host_id, report))


class ClaimBatcher(GroupCommit[Claim, list[Assignment]]):
    """Group commit for ClaimWork: hosts' claims that arrive while one batch is being taken go
    together into the next transaction, in arrival order (`Leases.claim_batch`). Nothing is
    woken after a batch: a claim makes no work for another."""

    def __init__(self, core: Core) -> None:
        super().__init__(core, core.ledger.claim_batch, notify=False)  # type: ignore[arg-type]

    async def claim(self, claim: Claim) -> list[Assignment]:
        return await self.submit(claim)


class CheckpointBatcher(GroupCommit[tuple[str, str, int, int, bytes], None]):
    """Group commit for PutCheckpoint: every running hybrid episode stores one per action."""

    def __init__(self, core: Core) -> None:
        super().__init__(core, core.ledger.put_checkpoints, notify=False)  # type: ignore[arg-type]
