"""The ledger's foundation: its transactions (its engines are made in `engines`), the rows'
shared helpers, and the constants every part uses. The methods, by verb, are in `submissions`,
`reads`, `hosts`, `leases`, `completions` and `checkpoints`; `fleet.ledger.store.Ledger` is all
of them."""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import random
import sqlite3
import threading
import time
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Self, TextIO

import structlog
from sqlalchemy.engine import Engine

from fleet.core.egress import EffectiveEgress
from fleet.core.errors import (
    FailedPrecondition,
    NotFound,
    Unauthenticated,
)
from fleet.core.lifecycle import RolloutState, check_transition
from fleet.core.manifest import Manifest, OutputArtifact
from fleet.core.placement import HostCapabilities, Pool
from fleet.core.rollout import (
    Assignment,
    AttemptRecord,
    Completion,
    Rollout,
    StepResult,
)
from fleet.ledger import pools as pool_sql
from fleet.ledger import queries as Q
from fleet.ledger.engines import postgres_engine, sqlite_connect, sqlite_engine
from fleet.ledger.migrations import migrate
from fleet.ledger.raw import Raw
from fleet.ledger.records import AttemptRec, Item, RolloutRec, Settled

log = structlog.get_logger(__name__)
CORDONED = "cordoned"
DRAINING = "draining"
DRAINED = "drained"


@dataclass(frozen=True)
class HostView:
    """A registered host, for `fleet host list`."""

    capabilities: HostCapabilities
    state: str
    slots_used: int
    last_heartbeat_at: float
    images: list[str]
    """The digests on its disk, as its agent last said."""


HOST_STATES = ("ready", CORDONED, DRAINING, DRAINED)


MAX_CHECKPOINT_BYTES = 1 << 20
MANIFESTS_KEPT = 4096
"""Parsed manifests a ledger keeps in memory (the newest stored or read)."""
AVOID_HOST_S = 5.0
"""How long after its backoff a retry waits for other hosts before the one that failed it."""
FENCING_STEP = 1 << 31
"""A claim adds 1 plus a random number below this to the fencing token."""
MAX_CHECKPOINT_BYTES_PER_ROLLOUT = 256 << 20
"""What one rollout's checkpoints may hold in all: code in a machine writes them, and must not
fill the ledger's disk."""
EMPTY_DIGEST = "sha256:" + hashlib.sha256(b"").hexdigest()


def blob_digest(data: bytes) -> str:
    return EMPTY_DIGEST if not data else "sha256:" + hashlib.sha256(data).hexdigest()


def prepare_report(report: Completion) -> tuple[str, dict[str, bytes], str]:
    """(fingerprint, output blobs by digest, results JSON) of one report."""
    outputs: dict[str, bytes] = {}
    results = []
    for result in report.results:
        digests = {}
        for name, data in (("stdout", result.stdout), ("stderr", result.stderr)):
            digest = blob_digest(data)
            outputs[digest] = data
            digests[f"{name}_digest"] = digest
        results.append({**result.model_dump(mode="json"), **digests})  # (fields kept in order)
    return report.fingerprint(), outputs, json.dumps(results)


def new_id(prefix: str) -> str:
    """A new rollout's or work item's id: the time in microseconds, then 48 random bits
    (`r-661a5466f5f47` and 12 hex digits).

    Ids that grow with time keep each index over them (events by rollout, attempts by work
    item, the claim index's tie-breaker) written at its end, so a transaction touching many
    new rollouts dirties a few pages instead of one per rollout: with random ids a claim or
    completion of 32 jobs wrote 104 pages to SQLite's log, with these 38, and its durable
    commit took half as long. The random part keeps two ids made in the same microsecond
    apart; an id is a name, not a secret (a rollout is guarded by its tenant)."""
    return f"{prefix}{time.time_ns() // 1000:013x}{os.urandom(6).hex()}"


def as_datetime(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, UTC)


def unregistered(host_id: str) -> FailedPrecondition:
    return FailedPrecondition(f"host {host_id!r} is not registered; call RegisterHost first")


def revoked(host_id: str) -> Unauthenticated:
    return Unauthenticated(f"host {host_id!r} was revoked")


class LedgerBase:
    """The work ledger over one database."""

    def __init__(self, engine: Engine, *, rng: random.Random | None = None) -> None:
        self.engine = engine
        self._rng = rng or random.Random()
        self._manifests: dict[str, Manifest] = {}
        """Manifests by digest, oldest first (see `_keep_manifests`)."""
        self._manifests_lock = threading.Lock()
        self._settled: Settled | None = None
        """The metrics' settled figures, kept between calls of `figures` (see `reads`)."""
        self._settled_lock = threading.Lock()
        self._pg = engine.dialect.name == "postgresql"
        self._host_caps: dict[str, HostCapabilities] = {}
        database = engine.url.database if engine.dialect.name == "sqlite" else None
        self._lock_path = f"{database}.lock" if database else None
        self._thread_lock = threading.Lock()
        self._lock_file: TextIO | None = None
        self._raw_writer: sqlite3.Connection | None = None
        self.checkpoint_budget_bytes = MAX_CHECKPOINT_BYTES_PER_ROLLOUT
        try:
            self.schema_version = migrate(engine)
        except BaseException:
            engine.dispose()  # (refused, e.g. a newer schema: its connection is not kept open)
            raise
        # A ledger dropped without engine.dispose() closes its pooled connections as it goes,
        # rather than leaving the driver to find them open.
        weakref.finalize(self, engine.dispose)

    @classmethod
    def sqlite(cls, path: Path) -> Self:
        return cls(sqlite_engine(path))

    @classmethod
    def postgres(cls, url: str) -> Self:
        return cls(postgres_engine(url))

    @classmethod
    def open(cls, target: str) -> Self:
        """A ledger from a PostgreSQL URL (postgresql://...) or a SQLite file path."""
        if target.startswith(("postgresql://", "postgres://", "postgresql+psycopg://")):
            return cls.postgres(target)
        return cls.sqlite(Path(target.removeprefix("sqlite:///")))

    @property
    def backend(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def _tx(self) -> Iterator[Raw]:
        """One write transaction, as the executor every method runs its statements on.

        On SQLite it runs on a connection of this ledger's own, outside SQLAlchemy's pool (its
        checkout, events and reset cost about as much as the durable commit itself: 169 against
        73 µs for one write, measured), under the writer lock, which serializes its users,
        threads and processes alike: one writer at a time, queued on a file lock. (SQLite's own
        busy handler makes a waiting writer sleep in growing steps, so several processes
        contending for the write lock spend most of their time asleep; a blocking flock wakes
        the next writer the moment the last one commits.) On PostgreSQL it is a pooled
        connection's transaction."""
        if self._pg or self._lock_path is None:
            with self.engine.begin() as conn:
                yield Raw(conn.connection.cursor(), self._pg)
            return
        with self._thread_lock:
            if self._lock_file is None:
                self._lock_file = open(self._lock_path, "a")  # noqa: SIM115 - held for life
                # ...of this ledger: closed when it goes.
                weakref.finalize(self, self._lock_file.close)
            fcntl.flock(self._lock_file, fcntl.LOCK_EX)
            try:
                if self._raw_writer is None:  # (made under the lock: it sets the journal mode)
                    self._raw_writer = sqlite_connect(self.engine.url.database or "")
                    weakref.finalize(self, self._raw_writer.close)
                connection = self._raw_writer
                connection.execute("BEGIN IMMEDIATE")
                try:
                    yield Raw(connection.cursor(), postgres=False)
                    connection.execute("COMMIT")
                except BaseException:
                    if connection.in_transaction:  # (some errors end it themselves)
                        connection.execute("ROLLBACK")
                    raise
            finally:
                fcntl.flock(self._lock_file, fcntl.LOCK_UN)

    @contextmanager
    def _read(self) -> Iterator[Raw]:
        """One read-only transaction (a consistent snapshot) that waits for no writer: SQLite's
        WAL lets readers run beside the one writer."""
        with self.engine.connect() as conn:
            dbapi = conn.connection
            cursor = dbapi.cursor()
            if not self._pg:
                cursor.execute("BEGIN")
            try:
                yield Raw(cursor, self._pg)
            finally:
                if self._pg:
                    dbapi.rollback()
                else:
                    cursor.execute("ROLLBACK")

    # -- helpers -----------------------------------------------------------------------------

    def _count_active(self, db: Raw, tenants: Iterable[str], step: int) -> None:
        """Each of `tenants` (one entry per item) gained (`step` 1: submitted) or lost (-1:
        ended) a queued or leased item: `tenant_active` follows, in tenant order (replicas
        updating the same tenants take their rows in one order)."""
        counts = Counter(tenants)
        db.many(Q.COUNT_ACTIVE, [(t, n * step) for t, n in sorted(counts.items())])

    def _event(
        self, db: Raw, rollout_id: str, kind: str, now: float, *, before: str = "",
        after: str = "", actor: str = "", message: str = "", attempt: int = 0,
    ) -> None:  # fmt: skip
        db.run(Q.INSERT_EVENT, (rollout_id, kind, before, after, actor, now, message, attempt))

    def _move(
        self, db: Raw, row: RolloutRec, target: RolloutState, now: float, *, kind: str,
        actor: str, message: str = "", attempt: int = 0, error: str | None = None,
    ) -> RolloutRec:  # fmt: skip
        """Moves a rollout to `target` (a transition its state allows), with its event;
        `error`: its error from now on (None: unchanged). Returns the row as it is now."""
        current = RolloutState(row.state)
        check_transition(current, target)
        moved = row._replace(
            state=target.value, updated_at=now,
            started_at=now if target == RolloutState.RUNNING and row.started_at is None
            else row.started_at,
            finished_at=now if target.final else row.finished_at,
            error=row.error if error is None else error,
        )  # fmt: skip
        db.run(
            Q.MOVE_ROLLOUT,
            (moved.state, moved.updated_at, moved.started_at, moved.finished_at, moved.error,
             row.id),
        )  # fmt: skip
        self._event(
            db, row.id, kind, now, before=current.value, after=target.value, actor=actor,
            message=message, attempt=attempt,
        )  # fmt: skip
        return moved

    def _rollout(self, db: Raw, rollout_id: str, *, lock: bool = False) -> RolloutRec:
        # Row locks order writers per rollout (item first, then rollout, everywhere), so a
        # rollout's events get sequence numbers in commit order.
        row = db.one(Q.ROLLOUT_FOR_UPDATE if lock else Q.ROLLOUT, (rollout_id,))
        if row is None:
            raise NotFound(f"no rollout {rollout_id!r}")
        return RolloutRec(*row)

    def _histories(self, db: Raw, rollout_ids: list[str]) -> dict[str, list[AttemptRec]]:
        """Attempt rows of many rollouts in one query."""
        out: dict[str, list[AttemptRec]] = {r: [] for r in rollout_ids}
        for rollout_id, *attempt in db.all(Q.HISTORIES, rollout_ids, n=len(rollout_ids)):
            out[rollout_id].append(AttemptRec(*attempt))
        return out

    def _view(self, db: Raw, row: RolloutRec, history: list[AttemptRec] | None = None) -> Rollout:
        if history is None:
            history = self._histories(db, [row.id])[row.id]
        manifest = self._manifest_raw(db, row.manifest_digest)
        return Rollout(
            priority=row.priority,
            attempt_history=tuple(
                AttemptRecord(
                    attempt=a.attempt,
                    host_id=a.host_id,
                    started_at=as_datetime(a.started_at) or datetime.now(UTC),
                    ended_at=as_datetime(a.ended_at),
                    outcome=a.outcome,
                    error=a.error,
                )
                for a in history
            ),
            id=row.id,
            state=RolloutState(row.state),
            tenant=row.tenant,
            idempotency_key=row.idempotency_key,
            labels=json.loads(row.labels_json),
            manifest=manifest,
            manifest_digest=row.manifest_digest,
            egress=EffectiveEgress.model_validate_json(row.egress_json)
            if row.egress_json
            else None,
            attempts=row.attempts,
            results=tuple(StepResult.model_validate(r) for r in json.loads(row.results_json)),
            error=row.error,
            host_id=row.host_id,
            runtime=row.runtime,
            device=row.device,
            created_at=as_datetime(row.created_at) or datetime.now(UTC),
            started_at=as_datetime(row.started_at),
            finished_at=as_datetime(row.finished_at),
            outputs=tuple(OutputArtifact.model_validate(o) for o in json.loads(row.outputs_json)),
        )

    def _latest_checkpoints(self, db: Raw, rollout_ids: list[str]) -> dict[str, tuple[int, bytes]]:
        """The newest checkpoint of each rollout, in one query."""
        if not rollout_ids:
            return {}
        rows = db.all(Q.LATEST_CHECKPOINTS, rollout_ids, n=len(rollout_ids))
        return {rid: (int(seq), bytes(data)) for rid, seq, data in rows}

    def _host_row(self, db: Raw, host_id: str) -> tuple[HostCapabilities, str]:
        """A registered, unrevoked host's capabilities and state (`HOST_STATES`)."""
        row = db.one(Q.HOST_FOR_CLAIM, (host_id,))
        if row is None:
            raise unregistered(host_id)
        if row[1] is not None:
            # Checked here too, in the claim's own transaction: a server's cache of who is
            # revoked may be a moment old, and a revoked host must never take new work.
            raise revoked(host_id)
        text = row[0]
        caps = self._host_caps.get(text)
        if caps is None:
            caps = HostCapabilities.model_validate_json(text)
            if len(self._host_caps) > 1024:
                self._host_caps.clear()
            self._host_caps[text] = caps
        return caps, row[2]

    def _assignment(self, db: Raw, item: Item) -> Assignment:
        digest = db.value(Q.MANIFEST_DIGEST, (item.rollout_id,))
        return Assignment(
            work_id=item.id,
            rollout_id=item.rollout_id,
            attempt=item.attempt,
            fencing_token=item.fencing_token,
            lease_expires_at=as_datetime(item.lease_expires_at) or datetime.now(UTC),
            manifest=self._manifest_raw(db, digest),
            tenant=item.tenant,
        )

    def _manifest_raw(self, db: Raw, digest: str) -> Manifest:
        """One manifest (see `_manifests_raw`)."""
        return self._manifests_raw(db, (digest,))[digest]

    def _manifests_raw(self, db: Raw, digests: Iterable[str]) -> dict[str, Manifest]:
        """Manifests by digest. They are immutable, so each is parsed once per process (while
        it is among the last `MANIFESTS_KEPT` stored or read); those not in memory are read in
        one statement, not one each (a claim or completion of many items after a restart, or
        of rollouts another replica stored)."""
        found: dict[str, Manifest] = {}
        missing: list[str] = []
        for digest in set(digests):
            manifest = self._manifests.get(digest)
            if manifest is None:
                missing.append(digest)
            else:
                found[digest] = manifest
        if missing:
            read: dict[str, Manifest] = {}
            missing.sort()
            for digest, body in db.all_in(Q.MANIFEST_BODIES, missing):
                read[digest] = Manifest.model_validate_json(body)
            self._keep_manifests(read)
            found.update(read)
        return found

    def _keep_manifests(self, manifests: dict[str, Manifest]) -> None:
        """Remembers manifests just stored or read, forgetting the oldest beyond
        `MANIFESTS_KEPT`: a server that stores a million rollouts keeps a few thousand."""
        with self._manifests_lock:  # (threads store and read at once)
            kept = self._manifests
            kept.update(manifests)
            over = len(kept) - MANIFESTS_KEPT
            if over > 0:
                for digest in list(itertools.islice(kept, over)):
                    del kept[digest]

    def get(self, rollout_id: str) -> Rollout:
        with self._read() as db:
            return self._view(db, self._rollout(db, rollout_id))

    def _rollback(self, db: Raw) -> tuple[bool, Pool | None]:
        """(whether a rollback is in force, the pool it keeps: None for the default local
        pool, `is_local`)."""
        row = db.one(Q.SETTING, ("rollback",))
        if row is None:
            return False, None
        name = json.loads(row[0]).get("local_pool", "")
        found = pool_sql.read(db, name) if name else []
        return True, (found[0] if found else None)
