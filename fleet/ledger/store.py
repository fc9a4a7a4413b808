"""The SQL ledger: rollouts, manifests, work items, leases, hosts, events, artifacts.

Every method is one transaction. Methods are synchronous; the server calls them from one
worker thread so the asyncio loop never blocks on the database.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import random
import secrets
import sqlite3
import threading
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import psycopg
import structlog
from sqlalchemy import Connection, event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, create_engine, func, select

from fleet.core.cost import AttemptCost
from fleet.core.egress import EgressEvent
from fleet.core.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    FleetError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
)
from fleet.core.lifecycle import Outcome, RolloutState, check_transition
from fleet.core.manifest import Manifest, OutputArtifact, SubmitRequest
from fleet.core.placement import HostCapabilities, HostClass, Isolation, Pool, is_local
from fleet.core.policy import EffectiveEgress
from fleet.core.rollout import (
    Assignment,
    AttemptRecord,
    Completion,
    Rollout,
    RolloutEvent,
    StepResult,
)
from fleet.ledger import pools as pool_sql
from fleet.ledger.identity import Identities, check_labels
from fleet.ledger.migrations import migrate
from fleet.ledger.pools import PoolEvent, PoolView
from fleet.ledger.raw import DONE, LEASED, QUEUED, Raw, leases_by_host, marks
from fleet.ledger.tables import (
    CHECKPOINT_ROW_BYTES,
    ArtifactRow,
    AttemptRow,
    EgressEventRow,
    EventRow,
    HostIdentityRow,
    HostRow,
    ManifestRow,
    RolloutLabel,
    RolloutRow,
    WorkItemRow,
)

log = structlog.get_logger(__name__)

# Core tables for the hot paths (claim, complete), where the ORM's per-row cost dominates.
_W = WorkItemRow.__table__  # type: ignore[attr-defined]
_R = RolloutRow.__table__  # type: ignore[attr-defined]
_T = AttemptRow.__table__  # type: ignore[attr-defined]
_E = EventRow.__table__  # type: ignore[attr-defined]
_A = ArtifactRow.__table__  # type: ignore[attr-defined]
_M = ManifestRow.__table__  # type: ignore[attr-defined]
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


# A concurrent insert of the same key, from SQLAlchemy or (hot paths) straight from the driver.
_UNIQUE_CLASH = (IntegrityError, sqlite3.IntegrityError, psycopg.errors.IntegrityError)


_ITEM_COLS = (
    "id, rollout_id, tenant, state, host_class, needs_vm, needs_cuda_device, needs_inference, "
    "priority, attempt, "
    "max_attempts, not_before, deadline, lease_owner, fencing_token, lease_expires_at, "
    "cancel_requested, result_fingerprint, claim_request_id"
)


class _Item(NamedTuple):
    """One work_items row as the hot paths read it (columns in _ITEM_COLS order)."""

    id: str
    rollout_id: str
    tenant: str
    state: str
    host_class: str
    needs_vm: bool
    needs_cuda_device: bool
    needs_inference: bool
    priority: int
    attempt: int
    max_attempts: int
    not_before: float
    deadline: float
    lease_owner: str
    fencing_token: int
    lease_expires_at: float | None
    cancel_requested: bool
    result_fingerprint: str
    claim_request_id: str


MAX_CHECKPOINT_BYTES = 1 << 20
AVOID_HOST_S = 5.0
"""How long after its backoff a retry waits for other hosts before the one that failed it."""
FENCING_STEP = 1 << 31
"""A claim adds 1 plus a random number below this to the fencing token."""
MAX_CHECKPOINT_BYTES_PER_ROLLOUT = 256 << 20
"""What one rollout's checkpoints may hold in all: code in a machine writes them, and must not
fill the ledger's disk."""
_EMPTY_DIGEST = "sha256:" + hashlib.sha256(b"").hexdigest()


def _digest(data: bytes) -> str:
    return _EMPTY_DIGEST if not data else "sha256:" + hashlib.sha256(data).hexdigest()


def _prepare(report: Completion) -> tuple[str, dict[str, bytes], str]:
    """(fingerprint, output blobs by digest, results JSON) of one report."""
    outputs: dict[str, bytes] = {}
    results = []
    for result in report.results:
        digests = {}
        for name, data in (("stdout", result.stdout), ("stderr", result.stderr)):
            digest = _digest(data)
            outputs[digest] = data
            digests[f"{name}_digest"] = digest
        results.append(result.model_copy(update=digests).model_dump(mode="json"))
    return report.fingerprint(), outputs, json.dumps(results)


_INSERT_EVENT = (
    "INSERT INTO events (rollout_id, kind, from_state, to_state, actor, at, message, attempt) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)


def _ts(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, UTC)


def _sqlite_engine(path: Path) -> Engine:
    path.parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(f"sqlite:///{path}", connect_args={"check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" hook below issue BEGIN IMMEDIATE: a writer takes the lock up
        # front instead of failing to upgrade a read lock under contention.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")  # an acknowledged write survives power loss
        cursor.execute("PRAGMA busy_timeout=10000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def _postgres_engine(url: str) -> Engine:
    url = url.replace("postgres://", "postgresql://", 1)
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
    # READ COMMITTED with explicit row locks (FOR UPDATE, SKIP LOCKED for claims and sweeps);
    # synchronous_commit stays on: an acknowledged write is on disk.
    return create_engine(url, pool_pre_ping=True, pool_size=4, max_overflow=4)


class Ledger:
    """The work ledger over one database."""

    def __init__(self, engine: Engine, *, rng: random.Random | None = None) -> None:
        self.engine = engine
        self._rng = rng or random.Random()
        self._manifests: dict[str, Manifest] = {}
        self._pg = engine.dialect.name == "postgresql"
        self._host_caps: dict[str, HostCapabilities] = {}
        database = engine.url.database if engine.dialect.name == "sqlite" else None
        self._lock_path = f"{database}.lock" if database else None
        self._thread_lock = threading.Lock()
        self._lock_file: TextIO | None = None
        self.checkpoint_budget_bytes = MAX_CHECKPOINT_BYTES_PER_ROLLOUT
        self.schema_version = migrate(engine)
        self.identities = Identities(self)

    @property
    def _lock_clause(self) -> str:
        return " FOR UPDATE" if self._pg else ""

    @classmethod
    def sqlite(cls, path: Path) -> Ledger:
        return cls(_sqlite_engine(path))

    @classmethod
    def postgres(cls, url: str) -> Ledger:
        return cls(_postgres_engine(url))

    @classmethod
    def open(cls, target: str) -> Ledger:
        """A ledger from a PostgreSQL URL (postgresql://...) or a SQLite file path."""
        if target.startswith(("postgresql://", "postgres://", "postgresql+psycopg://")):
            return cls.postgres(target)
        return cls.sqlite(Path(target.removeprefix("sqlite:///")))

    @property
    def backend(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        with (
            self._writer_lock(),
            Session(self.engine, expire_on_commit=False) as session,
            session.begin(),
        ):
            yield session

    @contextmanager
    def _begin(self) -> Iterator[Connection]:
        with self._writer_lock(), self.engine.begin() as conn:
            yield conn

    @contextmanager
    def _writer_lock(self) -> Iterator[None]:
        """On SQLite, one writer at a time across processes, queued on a file lock.

        SQLite's own busy handler makes a waiting writer sleep in growing steps, so several
        processes contending for the write lock spend most of their time asleep; a blocking
        flock wakes the next writer the moment the last one commits.
        """
        if self._lock_path is None:
            yield
            return
        with self._thread_lock:
            if self._lock_file is None:
                self._lock_file = open(self._lock_path, "a")  # noqa: SIM115 - held for life
            fcntl.flock(self._lock_file, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_file, fcntl.LOCK_UN)

    # -- helpers -----------------------------------------------------------------------------

    def _event(
        self,
        s: Session,
        rollout_id: str,
        kind: str,
        now: float,
        *,
        before: str = "",
        after: str = "",
        actor: str = "",
        message: str = "",
        attempt: int = 0,
    ) -> None:
        s.add(
            EventRow(
                rollout_id=rollout_id,
                kind=kind,
                from_state=before,
                to_state=after,
                actor=actor,
                at=now,
                message=message,
                attempt=attempt,
            )
        )

    def _move(
        self,
        s: Session,
        row: RolloutRow,
        target: RolloutState,
        now: float,
        *,
        kind: str,
        actor: str,
        message: str = "",
        attempt: int = 0,
    ) -> None:
        current = RolloutState(row.state)
        check_transition(current, target)
        row.state = target.value
        row.updated_at = now
        if target == RolloutState.RUNNING and row.started_at is None:
            row.started_at = now
        if target.final:
            row.finished_at = now
        s.add(row)
        self._event(
            s,
            row.id,
            kind,
            now,
            before=current.value,
            after=target.value,
            actor=actor,
            message=message,
            attempt=attempt,
        )

    def _rollout_row(self, s: Session, rollout_id: str, *, lock: bool = False) -> RolloutRow:
        query = select(RolloutRow).where(RolloutRow.id == rollout_id)
        if lock:
            # Row locks order writers per rollout (item first, then rollout, everywhere), so
            # a rollout's events get sequence numbers in commit order.
            query = query.with_for_update()
        row = s.exec(query).first()
        if row is None:
            raise NotFound(f"no rollout {rollout_id!r}")
        return row

    def _histories(self, s: Session, rollout_ids: list[str]) -> dict[str, list[AttemptRow]]:
        """Attempt rows of many rollouts in one query."""
        out: dict[str, list[AttemptRow]] = {r: [] for r in rollout_ids}
        rows = s.exec(
            select(WorkItemRow.rollout_id, AttemptRow)
            .join(WorkItemRow, col(WorkItemRow.id) == col(AttemptRow.work_id))
            .where(col(WorkItemRow.rollout_id).in_(rollout_ids))
            .order_by(col(AttemptRow.attempt))
        ).all()
        for rollout_id, attempt in rows:
            out[rollout_id].append(attempt)
        return out

    def _view(
        self, s: Session, row: RolloutRow, history: list[AttemptRow] | None = None
    ) -> Rollout:
        if history is None:
            history = self._histories(s, [row.id])[row.id]
        manifest = self._manifest_raw(Raw(s.connection(), self._pg), row.manifest_digest)
        return Rollout(
            priority=row.priority,
            attempt_history=tuple(
                AttemptRecord(
                    attempt=a.attempt,
                    host_id=a.host_id,
                    started_at=_ts(a.started_at) or datetime.now(UTC),
                    ended_at=_ts(a.ended_at),
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
            created_at=_ts(row.created_at) or datetime.now(UTC),
            started_at=_ts(row.started_at),
            finished_at=_ts(row.finished_at),
            outputs=tuple(OutputArtifact.model_validate(o) for o in json.loads(row.outputs_json)),
        )

    def submit(
        self,
        request: SubmitRequest,
        manifest: Manifest,
        now: float,
        *,
        max_active_per_tenant: int = 0,
    ) -> tuple[Rollout, bool]:
        """Stores the manifest and a new rollout, or returns the one with the same key.

        With `max_active_per_tenant`, a tenant with that many queued or running rollouts is
        refused with RESOURCE_EXHAUSTED and a retry hint.
        """
        for _ in range(3):
            try:
                return self._submit(request, manifest, now, max_active_per_tenant)
            except _UNIQUE_CLASH:
                # Another replica stored the same key or manifest between our read and insert;
                # the next try sees its row and answers as for any repeated submission.
                continue
        return self._submit(request, manifest, now, max_active_per_tenant)

    def submit_many(
        self,
        batch: list[tuple[SubmitRequest, Manifest]],
        now: float,
        max_active_per_tenant: int = 0,
    ) -> list[tuple[str, bool]]:
        """Stores many submissions in one transaction (one durable commit for all of them).

        Returns (rollout id, created) per submission, in order; all or nothing.
        """
        for _ in range(3):
            try:
                with self._begin() as conn:
                    return self._insert_rollouts(conn, batch, now, max_active_per_tenant)
            except _UNIQUE_CLASH:
                continue  # another replica stored one of the keys meanwhile: read it again
        with self._begin() as conn:
            return self._insert_rollouts(conn, batch, now, max_active_per_tenant)

    def _submit(
        self, request: SubmitRequest, manifest: Manifest, now: float, max_active: int
    ) -> tuple[Rollout, bool]:
        with self._begin() as conn:
            [(rollout_id, created)] = self._insert_rollouts(
                conn, [(request, manifest)], now, max_active
            )
        if not created:
            return self.get(rollout_id), False
        at = _ts(now) or datetime.now(UTC)
        return (
            Rollout(
                id=rollout_id, state=RolloutState.QUEUED, tenant=request.tenant,
                idempotency_key=request.idempotency_key, labels=dict(request.labels),
                manifest=manifest, manifest_digest=manifest.digest, created_at=at,
                priority=request.priority,
            ),
            True,
        )  # fmt: skip

    def _insert_rollouts(
        self,
        conn: Connection,
        batch: list[tuple[SubmitRequest, Manifest]],
        now: float,
        max_active: int,
    ) -> list[tuple[str, bool]]:
        db = Raw(conn, self._pg)
        keys = sorted({req.idempotency_key for req, _ in batch})
        known: dict[str, tuple[str, str]] = {}
        for start in range(0, len(keys), 500):
            chunk = keys[start : start + 500]
            for rid, key, fp in db.all(
                "SELECT id, idempotency_key, request_fingerprint FROM rollouts "
                f"WHERE idempotency_key IN ({marks(len(chunk))})",
                chunk,
            ):
                known[key] = (rid, fp)
        active: dict[str, int] = {}
        if max_active:
            tenants = sorted({req.tenant for req, _ in batch})
            active = {
                tenant: int(n)
                for tenant, n in db.all(
                    f"SELECT tenant, count(*) FROM work_items WHERE tenant IN "
                    f"({marks(len(tenants))}) AND state IN (?, ?) GROUP BY tenant",
                    [*tenants, QUEUED, LEASED],
                )
            }
        out: list[tuple[str, bool]] = []
        manifests: dict[str, Manifest] = {}
        rollouts: list[tuple[Any, ...]] = []
        labels: list[tuple[Any, ...]] = []
        items: list[tuple[Any, ...]] = []
        events: list[tuple[Any, ...]] = []
        queued = RolloutState.QUEUED.value
        for request, manifest in batch:
            fingerprint = request.fingerprint()
            key = request.idempotency_key
            if key in known:
                rollout_id, stored = known[key]
                if stored != fingerprint:
                    raise AlreadyExists(
                        f"idempotency key {key!r} was already used for rollout {rollout_id} "
                        "with a different body; the body differs, so this submission was "
                        "refused (use a new key for a new rollout)"
                    )
                out.append((rollout_id, False))
                continue
            if max_active:
                count = active.get(request.tenant, 0)
                if count >= max_active:
                    raise ResourceExhausted(
                        f"tenant {request.tenant!r} has {count} rollouts queued or running, "
                        f"at its limit of {max_active}; retry after some finish",
                        retry_after_s=2.0,
                    )
                active[request.tenant] = count + 1
            digest = manifest.digest
            manifests[digest] = manifest
            rollout_id = "r-" + uuid.uuid4().hex[:16]
            known[key] = (rollout_id, fingerprint)
            rollouts.append(
                (rollout_id, key, fingerprint, digest, request.tenant,
                 json.dumps(request.labels, sort_keys=True), queued, request.priority, now, now)
            )  # fmt: skip
            labels += [(rollout_id, k, v) for k, v in request.labels.items()]
            items.append(
                ("w-" + uuid.uuid4().hex[:16], rollout_id, request.tenant, QUEUED,
                 manifest.host_class.value,
                 manifest.requirements.isolation == Isolation.VM,
                 manifest.requirements.cuda_device, manifest.requirements.inference,
                 request.priority,
                 manifest.retry.max_attempts, now, manifest.deadline.timestamp(),
                 manifest.session.host if manifest.session is not None else "")
            )  # fmt: skip
            events.append(
                (rollout_id, "submitted", "", queued, f"tenant:{request.tenant}", now,
                 f"manifest {digest[:19]}, {len(manifest.steps)} steps, "
                 f"{manifest.host_class}-class", 0)
            )  # fmt: skip
            out.append((rollout_id, True))
        if rollouts:
            db.many(
                "INSERT INTO manifests (digest, body, created_at) VALUES (?, ?, ?) "
                "ON CONFLICT DO NOTHING",
                [(d, m.model_dump_json(), now) for d, m in sorted(manifests.items())],
            )
            db.many(
                "INSERT INTO rollouts (id, idempotency_key, request_fingerprint, manifest_digest, "
                "tenant, labels_json, state, priority, attempts, error, host_id, runtime, device, "
                "results_json, egress_json, cpu_s, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, '', '', '', '', '[]', '', 0, ?, ?)",
                rollouts,
            )
            db.many("INSERT INTO rollout_labels (rollout_id, key, value) VALUES (?, ?, ?)", labels)
            db.many(
                "INSERT INTO work_items (id, rollout_id, tenant, state, host_class, needs_vm, "
                "needs_cuda_device, needs_inference, priority, attempt, max_attempts, "
                "not_before, deadline, lease_owner, fencing_token, cancel_requested, "
                "result_fingerprint, claim_request_id, pin_host) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?, ?, '', 0, ?, '', '', ?)",
                [(*row[:-1], False, row[-1]) for row in items],
            )
            db.many(_INSERT_EVENT, events)
            self._manifests.update(manifests)
        return out

    def get(self, rollout_id: str) -> Rollout:
        with self._tx() as s:
            return self._view(s, self._rollout_row(s, rollout_id))

    def list_rollouts(
        self, page_size: int, page_token: str, labels: dict[str, str], could_reach: str = "",
        *, tenant: str | None = None,
    ) -> tuple[list[Rollout], str]:  # fmt: skip
        """Rollouts newest first; the token is the last seq of the previous page.

        `could_reach` keeps only rollouts whose machine's effective egress allowed that host;
        `tenant` only that tenant's (None: every tenant's).
        """
        if page_size < 0:
            raise InvalidArgument(f"page_size must not be negative, got {page_size}")
        size = min(page_size or 50, 500)
        query = select(RolloutRow)
        if tenant is not None:
            query = query.where(RolloutRow.tenant == tenant)
        if page_token:
            try:
                if len(page_token) > 19 or not page_token.isdigit():
                    raise ValueError(page_token)
                before = int(page_token)
            except ValueError:
                raise InvalidArgument(
                    f"page_token {page_token[:40]!r} is not one this server issued"
                ) from None
            query = query.where(col(RolloutRow.seq) < before)
        for key, value in labels.items():
            match = select(RolloutLabel.rollout_id).where(
                RolloutLabel.key == key, RolloutLabel.value == value
            )
            query = query.where(col(RolloutRow.id).in_(match))
        if could_reach:
            query = query.where(col(RolloutRow.egress_json) != "")
        query = query.order_by(col(RolloutRow.seq).desc())
        with self._tx() as s:
            if could_reach:
                # Which names an allowlist covers is decided in Python; scan in chunks.
                rows, more, after = [], False, None
                while True:
                    chunk_query = (
                        query if after is None else query.where(col(RolloutRow.seq) < after)
                    )
                    chunk = list(s.exec(chunk_query.limit(500)))
                    for r in chunk:
                        egress = EffectiveEgress.model_validate_json(r.egress_json)
                        if egress.could_reach(could_reach):
                            rows.append(r)
                    if len(rows) > size or len(chunk) < 500:
                        break
                    after = chunk[-1].seq
                more = len(rows) > size
                rows = rows[:size]
            else:
                rows = list(s.exec(query.limit(size + 1)))
                more = len(rows) > size
                rows = rows[:size]
            token = str(rows[-1].seq) if more and rows else ""
            histories = self._histories(s, [r.id for r in rows]) if rows else {}
            return [self._view(s, r, histories[r.id]) for r in rows], token

    def page_token_at(self, rollout_id: str) -> str:
        """The list_rollouts page token that continues after this rollout."""
        with self._tx() as s:
            return str(self._rollout_row(s, rollout_id).seq)

    def events(self, rollout_id: str, after_sequence: int, limit: int = 500) -> list[RolloutEvent]:
        with self._tx() as s:
            self._rollout_row(s, rollout_id)
            rows = s.exec(
                select(EventRow)
                .where(EventRow.rollout_id == rollout_id, col(EventRow.seq) > after_sequence)
                .order_by(col(EventRow.seq))
                .limit(limit)
            )
            return [
                RolloutEvent(
                    sequence=r.seq or 0,
                    rollout_id=r.rollout_id,
                    kind=r.kind,
                    from_state=RolloutState(r.from_state) if r.from_state else None,
                    to_state=RolloutState(r.to_state) if r.to_state else None,
                    actor=r.actor,
                    at=_ts(r.at) or datetime.now(UTC),
                    message=r.message,
                    attempt=r.attempt,
                )
                for r in rows
            ]

    def cancel(self, rollout_id: str, reason: str, actor: str, now: float) -> Rollout:
        """Queued work ends at once; running work is stopped by its agent at its next beat."""
        with self._tx() as s:
            item = s.exec(
                select(WorkItemRow).where(WorkItemRow.rollout_id == rollout_id).with_for_update()
            ).first()
            row = self._rollout_row(s, rollout_id, lock=True)
            assert item is not None
            state = RolloutState(row.state)
            if state.final:
                return self._view(s, row)
            why = reason or "cancelled by request"
            if item.state == QUEUED:
                item.state = DONE
                s.add(item)
                row.error = why
                self._move(
                    s, row, RolloutState.CANCELLED, now, kind="cancelled", actor=actor, message=why
                )
            elif not item.cancel_requested:
                item.cancel_requested = True
                s.add(item)
                self._event(
                    s,
                    rollout_id,
                    "cancel_requested",
                    now,
                    actor=actor,
                    message=why,
                    attempt=item.attempt,
                )
                row.error = why
                s.add(row)
            return self._view(s, row)

    # -- hosts -------------------------------------------------------------------------------

    def register_host(self, caps: HostCapabilities, now: float) -> None:
        with self._tx() as s:
            row = s.get(HostRow, caps.host_id)
            if row is None:
                row = HostRow(
                    id=caps.host_id,
                    host_class=caps.host_class.value,
                    capabilities_json=caps.model_dump_json(),
                    registered_at=now,
                    last_heartbeat_at=now,
                )
            else:
                row.host_class = caps.host_class.value
                row.capabilities_json = caps.model_dump_json()
                row.last_heartbeat_at = now
                if row.drain_by == "agent":  # its own shutdown's drain: back in service
                    row.state, row.drain_deadline, row.drain_by = "ready", None, ""
            s.add(row)

    def set_host_state(
        self, host_id: str, state: str, drain_deadline: float | None = None, by: str = "operator"
    ) -> None:
        """Cordons (no new work; leases it holds run on), drains (no new work; its leases are
        released at `drain_deadline`), or readies a registered host."""
        if state not in HOST_STATES:
            raise InvalidArgument(f"host state {state!r} is not one of {', '.join(HOST_STATES)}")
        if (state == DRAINING) != (drain_deadline is not None):
            raise InvalidArgument("a drain needs a deadline, and only a drain has one")
        with self._tx() as s:
            row = s.get(HostRow, host_id)
            if row is None:
                raise NotFound(f"no registered host {host_id!r}")
            row.state, row.drain_deadline = state, drain_deadline
            row.drain_by = by if state in (DRAINING, DRAINED) else ""
            s.add(row)

    def agent_drains(self, host_id: str, deadline: float) -> None:
        """An agent shutting down drains its host, unless it is drained or draining already
        (an operator's drain keeps its own deadline)."""
        with self._begin() as conn:
            Raw(conn, self._pg).run(
                "UPDATE hosts SET state = ?, drain_deadline = ?, drain_by = ? "
                "WHERE id = ? AND state NOT IN (?, ?)",
                (DRAINING, deadline, "agent", host_id, DRAINING, DRAINED),
            )

    # -- rollback to the local pool ---------------------------------------------------------

    def _rollback(self, db: Raw) -> tuple[bool, Pool | None]:
        """(whether a rollback is in force, the pool it keeps: None for the default local
        pool, `is_local`)."""
        rows = db.all("SELECT value_json FROM settings WHERE key = ?", ("rollback",))
        if not rows:
            return False, None
        name = json.loads(rows[0][0]).get("local_pool", "")
        found = pool_sql.read(db, "WHERE name = ?", (name,)) if name else []
        return True, (found[0] if found else None)

    def rollback_state(self) -> dict[str, Any] | None:
        """{"since": time, "local_pool": name or ""} while a rollback is in force."""
        with self._begin() as conn:
            rows = Raw(conn, self._pg).all(
                "SELECT value_json FROM settings WHERE key = ?", ("rollback",)
            )
        return dict(json.loads(rows[0][0])) if rows else None

    def rollback(self, deadline: float, now: float, local_pool: str = "") -> list[str]:
        """Rolls back to the local pool: every other host is set draining until `deadline`
        (what it runs then is released and retried on the local pool), nothing new goes to
        any host outside it, and the local gpu hosts take cpu-class work too, until
        `undo_rollback`. Returns the hosts set draining."""
        with self._begin() as conn:
            db = Raw(conn, self._pg)
            if db.all(f"SELECT key FROM settings WHERE key = ?{db.lock}", ("rollback",)):
                raise FailedPrecondition("a rollback is in force already: undo it first")
            if local_pool and not db.all("SELECT name FROM pools WHERE name = ?", (local_pool,)):
                raise NotFound(f"no pool {local_pool!r} (fleet pool list)")
            db.run(
                "INSERT INTO settings (key, value_json, updated_at) VALUES (?, ?, ?)",
                ("rollback", json.dumps({"since": now, "local_pool": local_pool}), now),
            )
            _, local = self._rollback(db)
            drained = []
            for host_id, caps, state in db.all(
                f"SELECT id, capabilities_json, state FROM hosts ORDER BY id{db.lock}", ()
            ):
                if state in ("ready", CORDONED) and not is_local(
                    HostCapabilities.model_validate_json(caps), local
                ):
                    db.run(
                        "UPDATE hosts SET state = ?, drain_deadline = ?, drain_by = ? WHERE id = ?",
                        (DRAINING, deadline, "rollback", host_id),
                    )
                    drained.append(host_id)
            return drained

    def undo_rollback(self) -> list[str]:
        """Ends the rollback: the hosts it drained are ready again; returns them."""
        with self._begin() as conn:
            db = Raw(conn, self._pg)
            if not db.run("DELETE FROM settings WHERE key = ?", ("rollback",)):
                raise FailedPrecondition("no rollback is in force")
            hosts = [row[0] for row in db.all(
                "SELECT id FROM hosts WHERE drain_by = ? ORDER BY id", ("rollback",))]  # fmt: skip
            db.run(
                "UPDATE hosts SET state = ?, drain_deadline = NULL, drain_by = '' "
                "WHERE drain_by = ?",
                ("ready", "rollback"),
            )
            return hosts

    # -- cost ---------------------------------------------------------------------------------

    def set_prices(self, prices: Mapping[str, float], now: float) -> None:
        """Prices per host class and hour (`fleet serve --price`), for `fleet report`."""
        with self._begin() as conn:
            db = Raw(conn, self._pg)
            db.run("DELETE FROM settings WHERE key = ?", ("prices",))
            db.run(
                "INSERT INTO settings (key, value_json, updated_at) VALUES (?, ?, ?)",
                ("prices", json.dumps(dict(prices), sort_keys=True), now),
            )

    def prices(self) -> dict[str, float]:
        with self._begin() as conn:
            rows = Raw(conn, self._pg).all(
                "SELECT value_json FROM settings WHERE key = ?", ("prices",)
            )
        return {k: float(v) for k, v in json.loads(rows[0][0]).items()} if rows else {}

    def cost_attempts(self, since: float, by_label: str = "") -> list[AttemptCost]:
        """Every attempt of the rollouts that ended since `since`, grouped by the pool of the
        host it ran on (the first pool by name that holds it; "-": none), or by the rollout's
        label `by_label`."""
        with self._begin() as conn:
            db = Raw(conn, self._pg)
            hosts = {
                caps.host_id: caps
                for caps in (HostCapabilities.model_validate_json(c)
                             for (c,) in db.all("SELECT capabilities_json FROM hosts", ()))
            }  # fmt: skip
            in_pools = pool_sql.read(db)
            rows = db.all(
                "SELECT r.id, r.state, r.labels_json, w.attempt, a.attempt, a.host_id, "
                "a.started_at, a.ended_at, a.cpu_s, a.peak_memory_mib, a.device_s FROM rollouts r "
                "JOIN work_items w ON w.rollout_id = r.id JOIN attempts a ON a.work_id = w.id "
                "WHERE r.finished_at >= ? ORDER BY r.id, a.attempt",
                (since,),
            )
        out = []
        for rid, state, labels, last, attempt, host_id, start, end, cpu, peak, device in rows:
            caps = hosts.get(host_id)
            if by_label:
                group = json.loads(labels).get(by_label, "-")
            else:
                group = next((p.name for p in in_pools if caps and p.holds(caps)), "-")
            out.append(
                AttemptCost(
                    rollout_id=rid,
                    succeeded=state == RolloutState.SUCCEEDED.value,
                    final=attempt == last,
                    group=group,
                    host_class=caps.host_class.value if caps else "cpu",
                    host_slots=caps.slots if caps else 1,
                    wall_s=max(0.0, float(end or start) - float(start)),
                    cpu_s=float(cpu or 0.0),
                    peak_memory_mib=float(peak or 0.0),
                    device_s=float(device or 0.0),
                    ended_at=float(end or start),
                )
            )
        return out

    # -- pools ------------------------------------------------------------------------------

    def set_pool(self, pool: Pool, now: float) -> None:
        """Makes or changes a pool; claims see it at once, on every server."""
        check_labels(pool.labels)
        if pool.max_running < 0:
            raise InvalidArgument(f"max_running must be 0 (no cap) or more, got {pool.max_running}")
        with self._begin() as conn:
            pool_sql.write(Raw(conn, self._pg), pool, now)

    def delete_pool(self, name: str) -> None:
        with self._begin() as conn:
            if not Raw(conn, self._pg).run("DELETE FROM pools WHERE name = ?", (name,)):
                raise NotFound(f"no pool {name!r}")

    def pools(self) -> list[PoolView]:
        """Every pool, with its hosts, the leases they hold now, and its gates' state."""
        with self._begin() as conn:
            return pool_sql.views(Raw(conn, self._pg))

    def govern(
        self, now: float, p95_ms: float | None = None, queue_age_ms: float | None = None,
        saturated: str = "",
    ) -> list[PoolEvent]:  # fmt: skip
        """Pauses and resumes pools by their gates, and moves adaptive pools' caps (see
        `fleet.ledger.pools.govern`); the gateway's figures are as the server last read them,
        `saturated` says why it is past its limit ("": it is not)."""
        with self._begin() as conn:
            return pool_sql.govern(Raw(conn, self._pg), now, p95_ms, queue_age_ms, saturated)

    def pool_events(self, since: float, pool: str = "", limit: int = 1000) -> list[PoolEvent]:
        with self._begin() as conn:
            return pool_sql.events(Raw(conn, self._pg), since, pool, limit)

    def add_device_seconds(self, seconds: Mapping[str, float]) -> int:
        """Charges the gateway's device seconds to each rollout's latest attempt (the one that
        made the requests, or that was running when they were answered). Returns the attempts
        charged."""
        if not seconds:
            return 0
        charged = 0
        with self._begin() as conn:
            db = Raw(conn, self._pg)
            for rollout_id, spent in sorted(seconds.items()):
                charged += db.run(
                    "UPDATE attempts SET device_s = device_s + ? WHERE id = (SELECT a.id FROM "
                    "attempts a JOIN work_items w ON w.id = a.work_id WHERE w.rollout_id = ? "
                    "ORDER BY a.started_at DESC, a.id DESC LIMIT 1)",
                    (float(spent), rollout_id),
                )
        return charged

    def drain_sweep(self, now: float) -> list[tuple[str, int]]:
        """Draining hosts that hold no lease are drained; those past their deadline have their
        leases released (retried elsewhere by the usual rules, their old attempts fenced off)
        and are drained. Returns (host, leases released) for each host drained."""
        done: list[tuple[str, int]] = []
        with self._begin() as conn:
            db = Raw(conn, self._pg)
            for host_id, deadline in db.all(
                f"SELECT id, drain_deadline FROM hosts WHERE state = ?{db.lock}", (DRAINING,)
            ):
                held = int(
                    db.all(
                        "SELECT count(*) FROM work_items WHERE lease_owner = ? AND state = ?",
                        (host_id, LEASED),
                    )[0][0]
                )
                if held and (deadline is None or now < float(deadline)):
                    continue
                if held:
                    db.run(
                        "UPDATE work_items SET lease_expires_at = ? WHERE lease_owner = ? "
                        "AND state = ?",
                        (now - 1.0, host_id, LEASED),
                    )
                db.run(
                    "UPDATE hosts SET state = ?, drain_deadline = NULL WHERE id = ?",
                    (DRAINED, host_id),
                )
                done.append((host_id, held))
        if any(released for _, released in done):
            self.sweep(now)
        return done

    def host_states(self) -> dict[str, str]:
        """Every registered host's state."""
        with self._tx() as s:
            return {r.id: r.state for r in s.exec(select(HostRow))}

    def host_table(self, now: float, unresponsive_after_s: float) -> list[HostView]:
        """Every registered host as an operator sees it: what it offers, its state (a ready or
        cordoned host that has not beaten for `unresponsive_after_s` shows as unresponsive),
        its agent's version, the slots its leases hold, and its last beat."""
        with self._begin() as conn:
            db = Raw(conn, self._pg)
            held = leases_by_host(db)
            revoked = {
                row[0]
                for row in db.all(
                    "SELECT host_id FROM host_identities WHERE revoked_at IS NOT NULL", ()
                )
            }
            out = []
            for host_id, caps_json, state, beat, images in db.all(
                "SELECT id, capabilities_json, state, last_heartbeat_at, images_json FROM hosts "
                "ORDER BY id",
                (),
            ):
                if host_id in revoked:
                    state = "revoked"
                elif now - float(beat) > unresponsive_after_s:
                    state = "unresponsive" if state == "ready" else f"{state}+unresponsive"
                view = HostView(
                    capabilities=HostCapabilities.model_validate_json(caps_json),
                    state=state, slots_used=int(held.get(host_id, 0)),
                    last_heartbeat_at=float(beat), images=json.loads(images or "[]"),
                )  # fmt: skip
                out.append(view)
            return out

    def hosts(self) -> list[HostCapabilities]:
        with self._tx() as s:
            revoked = select(HostIdentityRow.host_id).where(
                col(HostIdentityRow.revoked_at).is_not(None)
            )
            rows = s.exec(
                select(HostRow).where(col(HostRow.id).not_in(revoked)).order_by(col(HostRow.id))
            )
            return [HostCapabilities.model_validate_json(r.capabilities_json) for r in rows]

    def running_rollouts(self, known: Mapping[str, bool]) -> dict[str, bool]:
        """Every running rollout -> whether it calls the inference gateway; `known` holds
        answers already read (manifests never change), so only new rollouts' are parsed."""
        with self._tx() as s:
            rows = s.exec(
                select(RolloutRow.id, RolloutRow.manifest_digest).where(
                    RolloutRow.state == RolloutState.RUNNING.value
                )
            ).all()
            out: dict[str, bool] = {}
            for rollout_id, digest in rows:
                if rollout_id in known:
                    out[rollout_id] = known[rollout_id]
                    continue
                body = s.get(ManifestRow, digest)
                manifest = Manifest.model_validate_json(body.body) if body is not None else None
                out[rollout_id] = bool(manifest and manifest.requirements.inference)
            return out

    def _host(self, s: Session, host_id: str) -> HostCapabilities:
        row = s.get(HostRow, host_id)
        if row is None:
            raise FailedPrecondition(f"host {host_id!r} is not registered; call RegisterHost first")
        return HostCapabilities.model_validate_json(row.capabilities_json)

    # -- agents ------------------------------------------------------------------------------

    def claim(
        self,
        host_id: str,
        max_items: int,
        now: float,
        lease_ttl_s: float,
        *,
        request_id: str = "",
        max_running_per_tenant: int = 0,
        hold_inference: bool = False,
    ) -> list[Assignment]:
        """Leases up to `max_items` runnable items this host can serve, highest priority first.

        A repeat of a claim (same `request_id`, same host) answers with the leases the first
        one took, so a lost reply never strands work until its lease expires.
        """
        with self._begin() as conn:
            db = Raw(conn, self._pg)
            host = self._host_row(db, host_id)
            if request_id:
                again = db.all(
                    f"SELECT {_ITEM_COLS} FROM work_items WHERE lease_owner = ? AND state = ? "
                    "AND claim_request_id = ?",
                    (host_id, LEASED, request_id),
                )
                if again:
                    return [self._assignment(db, _Item(*row)) for row in again]
            if db.all("SELECT state FROM hosts WHERE id = ?", (host_id,))[0][0] != "ready":
                return []  # (cordoned, draining: checked in the claim's own transaction)
            max_items = min(max_items, pool_sql.room(db, host))
            if max_items <= 0:
                return []  # (a pool it is in runs its cap already)
            classes = [host.host_class.value]
            rolled_back, local = self._rollback(db)
            if rolled_back:
                if not is_local(host, local):
                    return []  # (rolled back to the local pool: nothing new goes elsewhere)
                if host.host_class == HostClass.GPU:
                    classes.append(HostClass.CPU.value)  # (the local host has CPUs too)
            where = (
                f"state = ? AND host_class IN ({marks(len(classes))}) AND not_before <= ? "
                "AND deadline > ? AND pin_host IN ('', ?)"
            )
            params: list[Any] = [QUEUED, *classes, now, now, host_id]
            # The host that failed an attempt (a host error, a lost lease) gets its retry only
            # once others had AVOID_HOST_S to take it, unless no other live host of its class
            # could (one that beat within the last AVOID_HOST_S): a lone host runs it at once.
            where += (
                " AND (avoid_host <> ? OR not_before <= ? OR NOT EXISTS (SELECT 1 FROM hosts "
                "WHERE hosts.host_class = work_items.host_class AND hosts.id <> ? "
                "AND hosts.last_heartbeat_at > ?))"
            )
            params += [host_id, now - AVOID_HOST_S, host_id, now - AVOID_HOST_S]
            if host.isolation != Isolation.VM:
                where += " AND needs_vm = ?"
                params.append(False)
            if host.cuda_devices == 0:
                where += " AND needs_cuda_device = ?"
                params.append(False)
            if hold_inference or not host.gateway:
                # Backpressure (the gateway's queue is over its threshold), or a host whose
                # agent does not know where the gateway is.
                where += " AND needs_inference = ?"
                params.append(False)
            running: dict[str, int] = {}
            want = max(1, max_items)
            if max_running_per_tenant:
                running = {
                    tenant: int(n)
                    for tenant, n in db.all(
                        "SELECT tenant, count(*) FROM work_items WHERE state = ? GROUP BY tenant",
                        (LEASED,),
                    )
                }
                full = sorted(t for t, n in running.items() if n >= max_running_per_tenant)
                if full:
                    where += f" AND tenant NOT IN ({marks(len(full))})"
                    params += full
                want *= 4  # room to skip items of tenants that fill up within this batch
            chosen: list[_Item] = []
            for row in db.all(
                f"SELECT {_ITEM_COLS} FROM work_items WHERE {where} "
                f"ORDER BY priority DESC, not_before, id LIMIT {int(want)}"
                + (" FOR UPDATE SKIP LOCKED" if self._pg else ""),
                params,
            ):
                item = _Item(*row)
                if len(chosen) >= max(1, max_items):
                    break
                if max_running_per_tenant:
                    if running.get(item.tenant, 0) >= max_running_per_tenant:
                        continue
                    running[item.tenant] = running.get(item.tenant, 0) + 1
                chosen.append(item)
            if not chosen:
                return []
            ids = sorted({i.rollout_id for i in chosen})
            rollouts = {
                row[0]: row
                for row in db.all(
                    "SELECT id, state, manifest_digest, started_at FROM rollouts "
                    f"WHERE id IN ({marks(len(ids))}) ORDER BY id{db.lock}",
                    ids,
                )
            }
            expires = now + lease_ttl_s
            lease_at = _ts(expires) or datetime.now(UTC)
            running_state = RolloutState.RUNNING.value
            item_rows, attempt_rows, rollout_rows, event_rows = [], [], [], []
            leased: list[tuple[_Item, int, int, Manifest]] = []
            for item in chosen:
                # The token grows at every claim, by a random step: a caller cannot guess the next
                # attempt's token from the last one it saw.
                attempt = item.attempt + 1
                token = item.fencing_token + 1 + secrets.randbelow(FENCING_STEP)
                rid, state, digest, started_at = rollouts[item.rollout_id]
                current = RolloutState(state)
                check_transition(current, RolloutState.RUNNING)
                item_rows.append((attempt, token, host_id, expires, request_id, item.id))
                attempt_rows.append((item.id, attempt, host_id, token, now))
                rollout_rows.append(
                    (attempt, now, started_at if started_at is not None else now, rid)
                )
                event_rows.append(
                    (rid, "leased", current.value, running_state, host_id, now,
                     f"attempt {attempt} on {host_id}", attempt)
                )  # fmt: skip
                leased.append((item, attempt, token, self._manifest_raw(db, digest)))
            db.many(
                "UPDATE work_items SET state = 'LEASED', attempt = ?, fencing_token = ?, "
                "lease_owner = ?, lease_expires_at = ?, claim_request_id = ?, "
                "result_fingerprint = '' WHERE id = ?",
                item_rows,
            )
            db.many(
                "INSERT INTO attempts (work_id, attempt, host_id, fencing_token, started_at, "
                "outcome, error) VALUES (?, ?, ?, ?, ?, '', '')",
                attempt_rows,
            )
            db.many(
                f"UPDATE rollouts SET state = '{running_state}', attempts = ?, updated_at = ?, "
                "started_at = ? WHERE id = ?",
                rollout_rows,
            )
            db.many(_INSERT_EVENT, event_rows)
            # Hybrid rollouts resume from their latest checkpoint (only they have any).
            hybrid = sorted({i.rollout_id for i, _, _, m in leased if m.requirements.inference})
            saved = self._latest_checkpoints(db, hybrid)
        return [
            Assignment(
                work_id=item.id, rollout_id=item.rollout_id, attempt=attempt,
                fencing_token=token, lease_expires_at=lease_at,
                manifest=manifest,
                checkpoint_sequence=saved.get(item.rollout_id, (0, b""))[0],
                checkpoint=saved.get(item.rollout_id, (0, b""))[1],
                tenant=item.tenant,
            )
            for item, attempt, token, manifest in leased
        ]  # fmt: skip

    def reclaim(
        self, host_id: str, leases: list[tuple[str, int]], now: float, lease_ttl_s: float
    ) -> tuple[list[Assignment], list[str]]:
        """After an agent restart: the leases still this host's, renewed, and those released.

        A lease comes back only if its work is still LEASED to this host under the same fencing
        token, not cancelled and not past its deadline; then nobody else can hold it, and the
        agent may go on with the attempt in the machine that survived. Every other lease it
        named is released: the agent deletes that machine (the work was finished, re-queued or
        leased again, and the fencing token refuses anything the old attempt would still
        report). Leases the host holds that it did not name (their machines are gone) are
        released too, and expire now rather than at the end of their TTL.
        """
        kept: list[Assignment] = []
        released: list[str] = []
        with self._begin() as conn:
            db = Raw(conn, self._pg)
            self._host_row(db, host_id)
            expires = now + lease_ttl_s
            for work_id, token in sorted(set(leases)):
                rows = db.all(
                    f"SELECT {_ITEM_COLS} FROM work_items WHERE id = ?{db.lock}", (work_id,)
                )
                item = _Item(*rows[0]) if rows else None
                if (
                    item is None
                    or item.state != LEASED
                    or item.lease_owner != host_id
                    or item.fencing_token != token
                    or item.cancel_requested
                    or item.deadline <= now
                ):
                    released.append(work_id)
                    continue
                db.run(
                    "UPDATE work_items SET lease_expires_at = ? WHERE id = ?", (expires, work_id)
                )
                db.run(
                    _INSERT_EVENT,
                    (item.rollout_id, "adopted", RolloutState.RUNNING.value,
                     RolloutState.RUNNING.value, host_id, now,
                     f"attempt {item.attempt} adopted by {host_id} after its agent restarted",
                     item.attempt),
                )  # fmt: skip
                assignment = self._assignment(db, item._replace(lease_expires_at=expires))
                if assignment.manifest.requirements.inference:
                    saved = self._latest_checkpoints(db, [item.rollout_id])
                    seq, data = saved.get(item.rollout_id, (0, b""))
                    assignment = assignment.model_copy(
                        update={"checkpoint_sequence": seq, "checkpoint": data}
                    )
                kept.append(assignment)
            # Every other lease of this host belonged to the agent that died and will not be
            # reported: the sweeper ends those attempts now (retry, cancel or fail) instead of
            # when their leases would have run out.
            adopted = {a.work_id for a in kept}
            for (work_id,) in db.all(
                "SELECT id FROM work_items WHERE state = ? AND lease_owner = ? ORDER BY id",
                (LEASED, host_id),
            ):
                if work_id in adopted:
                    continue
                db.run("UPDATE work_items SET lease_expires_at = ? WHERE id = ?", (now, work_id))
                if work_id not in released:
                    released.append(work_id)
        return kept, released

    def _latest_checkpoints(self, db: Raw, rollout_ids: list[str]) -> dict[str, tuple[int, bytes]]:
        """The newest checkpoint of each rollout, in one query."""
        if not rollout_ids:
            return {}
        rows = db.all(
            "SELECT c.rollout_id, c.seq, c.data FROM checkpoints c "
            f"WHERE c.rollout_id IN ({marks(len(rollout_ids))}) AND c.seq = "
            "(SELECT max(seq) FROM checkpoints m WHERE m.rollout_id = c.rollout_id)",
            rollout_ids,
        )
        return {rid: (int(seq), bytes(data)) for rid, seq, data in rows}

    def put_checkpoint(
        self, host_id: str, work_id: str, fencing_token: int, seq: int, data: bytes, now: float
    ) -> None:
        """Stores a hybrid rollout's checkpoint under the attempt's lease (see PutCheckpoint)."""
        [result] = self.put_checkpoints([(host_id, work_id, fencing_token, seq, data)], now)
        if result is not None:
            raise result

    def put_checkpoints(
        self, items: list[tuple[str, str, int, int, bytes]], now: float
    ) -> list[FleetError | None]:
        """Stores many checkpoints (host, work id, fencing token, sequence, data) in one
        transaction, one durable commit; each gets None (stored, or already stored) or the error
        that refused it alone."""
        results: list[FleetError | None] = []
        with self._begin() as conn:
            db = Raw(conn, self._pg)
            for host_id, work_id, fencing_token, seq, data in items:
                try:
                    self._put_checkpoint(db, host_id, work_id, fencing_token, seq, data, now)
                    results.append(None)
                except FleetError as exc:
                    results.append(exc)
        return results

    def _put_checkpoint(
        self, db: Raw, host_id: str, work_id: str, fencing_token: int, seq: int, data: bytes,
        now: float,
    ) -> None:  # fmt: skip
        if seq < 1:
            raise InvalidArgument("checkpoint sequence numbers start at 1")
        if len(data) > MAX_CHECKPOINT_BYTES:
            raise ResourceExhausted(
                f"checkpoint of {len(data)} bytes is over the limit of {MAX_CHECKPOINT_BYTES}"
            )
        rows = db.all(f"SELECT {_ITEM_COLS} FROM work_items WHERE id = ?{db.lock}", (work_id,))
        if not rows:
            raise NotFound(f"no work item {work_id!r}")
        item = _Item(*rows[0])
        if (
            item.fencing_token != fencing_token
            or item.state != LEASED
            or item.lease_owner != host_id
        ):
            raise Aborted(
                f"stale lease for {work_id} (token {fencing_token}, current "
                f"{item.fencing_token}): this attempt may not write checkpoints"
            )
        stored = db.run(
            "INSERT INTO checkpoints (rollout_id, seq, attempt, data, created_at) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT (rollout_id, seq) DO NOTHING",
            (item.rollout_id, seq, item.attempt, data, now),
        )
        if stored:
            charge = len(data) + CHECKPOINT_ROW_BYTES
            [(held,)] = db.all(
                "INSERT INTO checkpoint_usage (rollout_id, bytes) VALUES (?, ?) "
                "ON CONFLICT (rollout_id) DO UPDATE SET bytes = checkpoint_usage.bytes + "
                "excluded.bytes RETURNING bytes",
                (item.rollout_id, charge),
            )
            if held <= self.checkpoint_budget_bytes:
                return
            # Over the budget: this one is not kept (the rest of the batch goes on).
            db.run(
                "DELETE FROM checkpoints WHERE rollout_id = ? AND seq = ?", (item.rollout_id, seq)
            )
            db.run(
                "UPDATE checkpoint_usage SET bytes = bytes - ? WHERE rollout_id = ?",
                (charge, item.rollout_id),
            )
            raise ResourceExhausted(
                f"rollout {item.rollout_id}: checkpoint {seq} ({len(data)} bytes) would bring "
                f"its checkpoints past their limit of {self.checkpoint_budget_bytes} bytes "
                f"({held - charge} held, each charged its size plus {CHECKPOINT_ROW_BYTES})"
            )
        have = db.all(
            "SELECT data FROM checkpoints WHERE rollout_id = ? AND seq = ?",
            (item.rollout_id, seq),
        )
        if bytes(have[0][0]) != data:
            raise Aborted(f"rollout {item.rollout_id} already has checkpoint {seq} with other data")
        # else a resend: already stored

    def checkpoints(self, rollout_id: str) -> list[tuple[int, int, bytes]]:
        """(sequence, attempt, data) of every checkpoint a rollout stored, in order."""
        with self._begin() as conn:
            rows = Raw(conn, self._pg).all(
                "SELECT seq, attempt, data FROM checkpoints WHERE rollout_id = ? ORDER BY seq",
                (rollout_id,),
            )
        return [(int(s), int(a), bytes(d)) for s, a, d in rows]

    def _host_row(self, db: Raw, host_id: str) -> HostCapabilities:
        rows = db.all(
            "SELECT h.capabilities_json, i.revoked_at FROM hosts h "
            "LEFT JOIN host_identities i ON i.host_id = h.id WHERE h.id = ?",
            (host_id,),
        )
        if not rows:
            raise FailedPrecondition(f"host {host_id!r} is not registered; call RegisterHost first")
        if rows[0][1] is not None:
            # Checked here too, in the claim's own transaction: a server's cache of who is
            # revoked may be a moment old, and a revoked host must never take new work.
            raise Unauthenticated(f"host {host_id!r} was revoked")
        text = rows[0][0]
        caps = self._host_caps.get(text)
        if caps is None:
            caps = HostCapabilities.model_validate_json(text)
            if len(self._host_caps) > 1024:
                self._host_caps.clear()
            self._host_caps[text] = caps
        return caps

    def _assignment(self, db: Raw, item: _Item) -> Assignment:
        [(digest,)] = db.all(
            "SELECT manifest_digest FROM rollouts WHERE id = ?", (item.rollout_id,)
        )
        return Assignment(
            work_id=item.id,
            rollout_id=item.rollout_id,
            attempt=item.attempt,
            fencing_token=item.fencing_token,
            lease_expires_at=_ts(item.lease_expires_at) or datetime.now(UTC),
            manifest=self._manifest_raw(db, digest),
            tenant=item.tenant,
        )

    def heartbeat(
        self, host_id: str, leases: list[tuple[str, int]], now: float, lease_ttl_s: float,
        images: list[str] | None = None,
    ) -> tuple[list[tuple[str, int]], list[str]]:  # fmt: skip
        """Renews the host's leases; returns (renewed, work the agent must stop). `images`: the
        digests on its disk now (None: unchanged).

        All or nothing: if any lease is stale (lost, re-leased, or not this host's), nothing
        is renewed and the call is refused with ABORTED naming the stale work ids.
        """
        renewed: list[tuple[str, int]] = []
        stop: list[str] = []
        with self._tx() as s:
            host = s.get(HostRow, host_id)
            if host is None:
                raise FailedPrecondition(f"host {host_id!r} is not registered")
            host.last_heartbeat_at = now
            if images is not None:
                host.images_json = json.dumps(sorted(images))
            s.add(host)
            items = [(s.get(WorkItemRow, w, with_for_update=True), w, t) for w, t in leases]
            stale = [
                w
                for item, w, t in items
                if item is None
                or item.state != LEASED
                or item.lease_owner != host_id
                or item.fencing_token != t
            ]
            if stale:
                raise Aborted(
                    f"stale lease(s) {', '.join(stale)}: lost or leased again; stop that work "
                    "and heartbeat the rest",
                    details={"stale-work-ids": ",".join(stale)},
                )
            for item, work_id, token in items:
                assert item is not None
                if item.cancel_requested or item.deadline <= now:
                    stop.append(work_id)
                item.lease_expires_at = now + lease_ttl_s
                s.add(item)
                renewed.append((work_id, token))
        return renewed, stop

    def complete(self, host_id: str, report: Completion, now: float) -> RolloutState:
        """Records one attempt's result under its fencing token; exactly one result wins."""
        [result] = self.complete_many(host_id, [report], now)
        if isinstance(result, FleetError):
            raise result
        return result

    def _manifest_raw(self, db: Raw, digest: str) -> Manifest:
        """Manifests are immutable, so each is parsed once per process."""
        manifest = self._manifests.get(digest)
        if manifest is None:
            [(body,)] = db.all("SELECT body FROM manifests WHERE digest = ?", (digest,))
            manifest = Manifest.model_validate_json(body)
            if len(self._manifests) > 4096:
                self._manifests.clear()
            self._manifests[digest] = manifest
        return manifest

    def complete_many(
        self, host_id: str, reports: list[Completion], now: float
    ) -> list[RolloutState | FleetError]:
        """One host's results, recorded in one transaction (see complete_batch)."""
        return self.complete_batch([(host_id, r) for r in reports], now)

    def complete_batch(
        self, reports: list[tuple[str, Completion]], now: float
    ) -> list[RolloutState | FleetError]:
        """Records many attempts' results, from any hosts, in one transaction (group commit).

        Each report is judged on its own: a stale or unknown one gets its error in the answer
        and changes nothing, while the others are recorded.
        """
        out: list[RolloutState | FleetError] = []
        if not reports:
            return out
        # Everything that needs no database is prepared before the write transaction: on
        # SQLite the transaction holds the one write lock, so its length bounds throughput.
        prepared = [_prepare(report) for _, report in reports]
        with self._begin() as conn:
            db = Raw(conn, self._pg)
            ids = sorted({r.work_id for _, r in reports})
            items = {
                row[0]: _Item(*row)
                for row in db.all(
                    f"SELECT {_ITEM_COLS} FROM work_items WHERE id IN ({marks(len(ids))}) "
                    f"ORDER BY id{db.lock}",
                    ids,
                )
            }
            rollout_ids = sorted({i.rollout_id for i in items.values()})
            rollouts = {
                row[0]: row
                for row in (
                    db.all(
                        "SELECT id, state, manifest_digest, error FROM rollouts "
                        f"WHERE id IN ({marks(len(rollout_ids))}) ORDER BY id{db.lock}",
                        rollout_ids,
                    )
                    if rollout_ids
                    else []
                )
            }
            artifacts: dict[str, bytes] = {}
            attempt_rows: list[tuple[Any, ...]] = []
            item_rows: list[tuple[Any, ...]] = []
            rollout_rows: list[tuple[Any, ...]] = []
            event_rows: list[tuple[Any, ...]] = []
            egress_rows: list[tuple[Any, ...]] = []
            seen: dict[str, tuple[str, RolloutState]] = {}
            for (host_id, report), (fingerprint, outputs, results_json) in zip(
                reports, prepared, strict=True
            ):
                if report.work_id in seen:  # the same work twice in one batch
                    first_fp, first_state = seen[report.work_id]
                    out.append(
                        first_state
                        if first_fp == fingerprint
                        else Aborted(f"work item {report.work_id}: two different reports")
                    )
                    continue
                item = items.get(report.work_id)
                if item is None:
                    out.append(NotFound(f"no work item {report.work_id!r}"))
                    continue
                if item.fencing_token != report.fencing_token:
                    out.append(
                        Aborted(
                            f"stale fencing token {report.fencing_token} for {report.work_id} "
                            f"(current {item.fencing_token}): the lease was lost and the work "
                            "leased again"
                        )
                    )
                    continue
                rid, rollout_state, digest, rollout_error = rollouts[item.rollout_id]
                if item.state == DONE:
                    if item.result_fingerprint == fingerprint:
                        out.append(RolloutState(rollout_state))  # already recorded
                    else:
                        out.append(
                            Aborted(
                                f"work item {report.work_id} already has a final result under "
                                f"token {report.fencing_token}; a different report was refused"
                            )
                        )
                    continue
                if item.state != LEASED or item.lease_owner != host_id:
                    out.append(
                        Aborted(f"work item {report.work_id} is not leased to host {host_id}")
                    )
                    continue
                artifacts.update(outputs)
                manifest = self._manifest_raw(db, digest)
                target, kind, error, not_before = self._judge(item, report, manifest, now)
                if target == RolloutState.CANCELLED:
                    error = rollout_error or error  # the reason given with the cancel request
                current = RolloutState(rollout_state)
                check_transition(current, target)
                attempt_rows.append(
                    (now, report.outcome.value, report.error, report.cpu_seconds,
                     report.peak_memory_mib, report.artifact_failed, item.id, item.attempt)
                )  # fmt: skip
                requeue = target == RolloutState.QUEUED
                item_rows.append(
                    (
                        QUEUED if requeue else DONE,
                        "" if requeue else item.lease_owner,
                        not_before if not_before is not None else item.not_before,
                        fingerprint,
                        host_id if requeue else "",
                        item.id,
                    )
                )
                outputs_json = json.dumps([o.model_dump() for o in report.outputs])
                rollout_rows.append(
                    (
                        target.value, error, host_id, report.runtime, report.device,
                        results_json,
                        report.egress.model_dump_json() if report.egress else "",
                        now, now if target.final else None, report.cpu_seconds, outputs_json,
                        rid,
                    )
                )  # fmt: skip
                event_rows.append(
                    (rid, kind, current.value, target.value, host_id, now, error, item.attempt)
                )
                egress_rows += [
                    (rid, item.attempt, e.machine, e.at, e.kind, e.destination, e.decision,
                     e.reason)
                    for e in report.egress_events
                ]  # fmt: skip
                seen[report.work_id] = (fingerprint, target)
                out.append(target)
            db.many(
                "INSERT INTO artifacts (digest, size_bytes, data, created_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT DO NOTHING",
                [(d, len(b), b, now) for d, b in sorted(artifacts.items())],
            )
            db.many(
                "UPDATE attempts SET ended_at = ?, outcome = ?, error = ?, cpu_s = ?, "
                "peak_memory_mib = ?, artifact_failed = ? WHERE work_id = ? AND attempt = ?",
                attempt_rows,
            )
            db.many(
                "UPDATE work_items SET state = ?, lease_owner = ?, lease_expires_at = NULL, "
                "not_before = ?, result_fingerprint = ?, avoid_host = ? WHERE id = ?",
                item_rows,
            )
            db.many(
                "UPDATE rollouts SET state = ?, error = ?, host_id = ?, runtime = ?, device = ?, "
                "results_json = ?, egress_json = ?, updated_at = ?, finished_at = ?, "
                "cpu_s = cpu_s + ?, outputs_json = ? WHERE id = ?",
                rollout_rows,
            )
            db.many(_INSERT_EVENT, event_rows)
            db.many(
                "INSERT INTO egress_events (rollout_id, attempt, machine, at, kind, destination, "
                "decision, reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                egress_rows,
            )
        return out

    def egress_events(self, rollout_id: str) -> list[tuple[int, EgressEvent]]:
        """(attempt, event) for every refused DNS query and connection of a rollout, in order."""
        with self._tx() as s:
            self._rollout_row(s, rollout_id)  # NotFound for an unknown rollout
            rows = s.exec(
                select(EgressEventRow)
                .where(EgressEventRow.rollout_id == rollout_id)
                .order_by(col(EgressEventRow.seq))
            ).all()
            return [
                (
                    r.attempt,
                    EgressEvent(
                        at=r.at, machine=r.machine, kind=r.kind,
                        destination=r.destination, decision=r.decision,
                        reason=r.reason,
                    ),
                )
                for r in rows
            ]  # fmt: skip

    def _judge(
        self, item: Any, report: Completion, manifest: Manifest, now: float
    ) -> tuple[RolloutState, str, str, float | None]:
        """(target state, event kind, error, retry not_before) for one report."""
        outcome = report.outcome
        if item.cancel_requested:
            return RolloutState.CANCELLED, "cancelled", report.error or "cancelled", None
        if outcome == Outcome.SUCCEEDED:  # (a session's report says why it closed)
            why = report.error[:500] if manifest.session is not None else ""
            return RolloutState.SUCCEEDED, "succeeded", why, None
        if outcome == Outcome.STEP_FAILED:
            return RolloutState.FAILED, "failed", report.error or "a step failed", None
        if outcome == Outcome.CANCELLED:
            why = report.error or "stopped at the rollout's deadline"
            return RolloutState.FAILED, "deadline_exceeded", why, None
        if outcome == Outcome.MALFORMED_INPUT:
            why = f"malformed input, quarantined: {report.error}"
            return RolloutState.QUARANTINED, "quarantined", why, None
        if outcome == Outcome.INCOMPATIBLE:
            why = f"incompatible, not retried: {report.error}"
            return RolloutState.FAILED, "incompatible", why, None
        # TRANSIENT_ERROR: retried while the policy and the deadline allow.
        if manifest.retry.may_retry(item.attempt) and item.deadline > now:
            delay = manifest.retry.backoff_s(item.attempt, self._rng)
            why = f"transient error: {report.error}; retry in {delay:.2f}s"
            return RolloutState.QUEUED, "retry_scheduled", why, now + delay
        why = f"attempts exhausted ({item.attempt}); last error: {report.error}"
        return RolloutState.FAILED, "failed", why, None

    def sweep(self, now: float) -> int:
        """Expires lost leases (retry or fail) and fails queued work past its deadline."""
        changed = 0
        with self._tx() as s:
            expired = s.exec(
                select(WorkItemRow)
                .where(WorkItemRow.state == LEASED, col(WorkItemRow.lease_expires_at) < now)
                .with_for_update(skip_locked=True)
            ).all()
            for item in expired:
                changed += 1
                row = self._rollout_row(s, item.rollout_id, lock=True)
                attempt = s.exec(
                    select(AttemptRow).where(
                        AttemptRow.work_id == item.id, AttemptRow.attempt == item.attempt
                    )
                ).one()
                attempt.ended_at, attempt.outcome = now, Outcome.LEASE_EXPIRED.value
                attempt.error = f"lease held by {item.lease_owner} expired"
                s.add(attempt)
                owner, item.lease_owner, item.lease_expires_at = item.lease_owner, "", None
                item.avoid_host = owner
                if item.cancel_requested:
                    item.state = DONE
                    self._move(
                        s,
                        row,
                        RolloutState.CANCELLED,
                        now,
                        kind="cancelled",
                        actor="ledger",
                        message=row.error or "cancelled",
                    )
                elif item.attempt < item.max_attempts and item.deadline > now:
                    manifest = Manifest.model_validate_json(
                        s.get(ManifestRow, row.manifest_digest).body  # type: ignore[union-attr]
                    )
                    item.state = QUEUED
                    item.not_before = now + manifest.retry.backoff_s(item.attempt, self._rng)
                    self._move(
                        s,
                        row,
                        RolloutState.QUEUED,
                        now,
                        kind="lease_expired",
                        actor="ledger",
                        attempt=item.attempt,
                        message=f"lease on {owner} expired; will retry",
                    )
                else:
                    item.state = DONE
                    row.error = (
                        f"lease on {owner} expired on attempt {item.attempt} of "
                        f"{item.max_attempts}"
                        + ("" if item.deadline > now else ", and the deadline has passed")
                    )
                    self._move(
                        s,
                        row,
                        RolloutState.FAILED,
                        now,
                        kind="failed",
                        actor="ledger",
                        message=row.error,
                        attempt=item.attempt,
                    )
                s.add(item)
            late = s.exec(
                select(WorkItemRow)
                .where(WorkItemRow.state == QUEUED, col(WorkItemRow.deadline) <= now)
                .with_for_update(skip_locked=True)
            ).all()
            for item in late:
                changed += 1
                item.state = DONE
                s.add(item)
                row = self._rollout_row(s, item.rollout_id, lock=True)
                row.error = "the deadline passed before the rollout could start"
                self._move(
                    s,
                    row,
                    RolloutState.FAILED,
                    now,
                    kind="deadline_exceeded",
                    actor="ledger",
                    message=row.error,
                )
        if changed:
            log.info("ledger_swept", changed=changed)
        return changed

    def figures(self, now: float, window_s: float = 60.0) -> dict[str, float]:
        """The numbers behind the server's metrics: counts by state, throughput, retries, CPU."""
        with self._begin() as conn:
            db = Raw(conn, self._pg)
            out: dict[str, float] = {
                f"state_{state}": float(n)
                for state, n in db.all("SELECT state, count(*) FROM rollouts GROUP BY state")
            }
            [(recent,)] = db.all(
                "SELECT count(*) FROM rollouts WHERE state = ? AND finished_at >= ?",
                (RolloutState.SUCCEEDED.value, now - window_s),
            )
            [(retries, cpu)] = db.all(
                "SELECT coalesce(sum(CASE WHEN attempts > 1 THEN attempts - 1 ELSE 0 END), 0), "
                "coalesce(sum(cpu_s), 0) FROM rollouts WHERE state = ?",
                (RolloutState.SUCCEEDED.value,),
            )
            [(inference,)] = db.all(
                "SELECT count(*) FROM work_items WHERE needs_inference = ? AND state = ?",
                (True, DONE),
            )
        done = out.get(f"state_{RolloutState.SUCCEEDED.value}", 0.0)
        out.update(
            trajectories_per_second=float(recent) / window_s,
            retries=float(retries),
            cpu_seconds_per_trajectory=float(cpu) / done if done else 0.0,
            inference_trajectories=float(inference),
        )
        return out

    def work_lease(self, work_id: str) -> tuple[str, int, Manifest] | None:
        """(lease owner, fencing token, manifest) of a leased work item; None otherwise."""
        with self._begin() as conn:
            db = Raw(conn, self._pg)
            rows = db.all(
                "SELECT w.lease_owner, w.fencing_token, r.manifest_digest FROM work_items w "
                "JOIN rollouts r ON r.id = w.rollout_id WHERE w.id = ? AND w.state = ?",
                (work_id, LEASED),
            )
            if not rows:
                return None
            owner, token, digest = rows[0]
            return str(owner), int(token), self._manifest_raw(db, digest)

    def rollout_lease(self, rollout_id: str) -> tuple[str, str] | None:
        """(work id, lease owner) of a rollout's leased work item; None when none is leased."""
        with self._begin() as conn:
            db = Raw(conn, self._pg)
            rows = db.all(
                "SELECT id, lease_owner FROM work_items WHERE rollout_id = ? AND state = ?",
                (rollout_id, LEASED),
            )
            return (str(rows[0][0]), str(rows[0][1])) if rows else None

    def leased_to(self, host_id: str) -> int:
        """How many work items are leased to a host right now."""
        with self._begin() as conn:
            return int(
                conn.execute(
                    select(func.count())
                    .select_from(_W)
                    .where(_W.c.lease_owner == host_id, _W.c.state == LEASED)
                ).scalar_one()
            )

    def artifact(self, digest: str) -> bytes:
        with self._tx() as s:
            row = s.get(ArtifactRow, digest)
            if row is None:
                raise NotFound(f"no artifact {digest}")
            return row.data

    def attempts(self, rollout_id: str) -> list[AttemptRow]:
        with self._tx() as s:
            item = s.exec(select(WorkItemRow).where(WorkItemRow.rollout_id == rollout_id)).one()
            return list(
                s.exec(
                    select(AttemptRow)
                    .where(AttemptRow.work_id == item.id)
                    .order_by(col(AttemptRow.attempt))
                )
            )
