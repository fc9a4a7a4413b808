"""The SQL ledger: rollouts, manifests, work items, leases, hosts, events, artifacts.

Every method is one transaction. Methods are synchronous; the server calls them from one
worker thread so the asyncio loop never blocks on the database.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog
from sqlalchemy import event
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, create_engine, func, select

from fleet.core.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from fleet.core.lifecycle import Outcome, RolloutState, check_transition
from fleet.core.manifest import Manifest, SubmitRequest
from fleet.core.placement import HostCapabilities, Isolation
from fleet.core.rollout import (
    Assignment,
    AttemptRecord,
    Completion,
    Rollout,
    RolloutEvent,
    StepResult,
)
from fleet.ledger.migrations import migrate
from fleet.ledger.tables import (
    ArtifactRow,
    AttemptRow,
    EventRow,
    HostRow,
    ManifestRow,
    RolloutLabel,
    RolloutRow,
    WorkItemRow,
)

log = structlog.get_logger(__name__)

QUEUED, LEASED, DONE = "QUEUED", "LEASED", "DONE"


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
        self.schema_version = migrate(engine)

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
        with Session(self.engine, expire_on_commit=False) as session, session.begin():
            yield session

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

    def _view(self, s: Session, row: RolloutRow) -> Rollout:
        manifest_row = s.get(ManifestRow, row.manifest_digest)
        assert manifest_row is not None  # foreign key
        history = s.exec(
            select(AttemptRow)
            .join(WorkItemRow, col(WorkItemRow.id) == col(AttemptRow.work_id))
            .where(WorkItemRow.rollout_id == row.id)
            .order_by(col(AttemptRow.attempt))
        ).all()
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
            manifest=Manifest.model_validate_json(manifest_row.body),
            manifest_digest=row.manifest_digest,
            attempts=row.attempts,
            results=tuple(StepResult.model_validate(r) for r in json.loads(row.results_json)),
            error=row.error,
            host_id=row.host_id,
            runtime=row.runtime,
            device=row.device,
            created_at=_ts(row.created_at) or datetime.now(UTC),
            started_at=_ts(row.started_at),
            finished_at=_ts(row.finished_at),
        )

    def _insert_once(self, s: Session, table: Any, values: dict[str, Any]) -> None:
        """INSERT that leaves an existing row alone: content-addressed rows are immutable, and
        two writers of the same content must both succeed."""
        dialect = self.engine.dialect.name
        stmt = (pg_insert if dialect == "postgresql" else sqlite_insert)(table).values(**values)
        s.execute(stmt.on_conflict_do_nothing())

    def _put_artifact(self, s: Session, data: bytes, now: float) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        self._insert_once(
            s,
            ArtifactRow,
            {"digest": digest, "size_bytes": len(data), "data": data, "created_at": now},
        )
        return digest

    # -- submitters --------------------------------------------------------------------------

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
            except IntegrityError:
                # Another replica stored the same key or manifest between our read and insert;
                # the next try sees its row and answers as for any repeated submission.
                continue
        return self._submit(request, manifest, now, max_active_per_tenant)

    def _submit(
        self, request: SubmitRequest, manifest: Manifest, now: float, max_active: int
    ) -> tuple[Rollout, bool]:
        fingerprint = request.fingerprint()
        with self._tx() as s:
            existing = s.exec(
                select(RolloutRow).where(RolloutRow.idempotency_key == request.idempotency_key)
            ).first()
            if existing is not None:
                if existing.request_fingerprint != fingerprint:
                    raise AlreadyExists(
                        f"idempotency key {request.idempotency_key!r} was already used for "
                        f"rollout {existing.id} with a different body; the body differs, so "
                        "this submission was refused (use a new key for a new rollout)"
                    )
                return self._view(s, existing), False
            if max_active:
                active = s.exec(
                    select(func.count())
                    .select_from(WorkItemRow)
                    .where(
                        WorkItemRow.tenant == request.tenant,
                        col(WorkItemRow.state).in_([QUEUED, LEASED]),
                    )
                ).one()
                if active >= max_active:
                    raise ResourceExhausted(
                        f"tenant {request.tenant!r} has {active} rollouts queued or running, "
                        f"at its limit of {max_active}; retry after some finish",
                        retry_after_s=2.0,
                    )
            digest = manifest.digest
            self._insert_once(
                s,
                ManifestRow,
                {"digest": digest, "body": manifest.model_dump_json(), "created_at": now},
            )
            rollout_id = "r-" + uuid.uuid4().hex[:16]
            row = RolloutRow(
                id=rollout_id,
                idempotency_key=request.idempotency_key,
                request_fingerprint=fingerprint,
                manifest_digest=digest,
                tenant=request.tenant,
                labels_json=json.dumps(request.labels, sort_keys=True),
                state=RolloutState.QUEUED.value,
                priority=request.priority,
                created_at=now,
                updated_at=now,
            )
            s.add(row)
            s.flush()
            assert row.seq is not None
            for key, value in request.labels.items():
                s.add(RolloutLabel(rollout_seq=row.seq, key=key, value=value))
            s.add(
                WorkItemRow(
                    id="w-" + uuid.uuid4().hex[:16],
                    rollout_id=rollout_id,
                    tenant=request.tenant,
                    state=QUEUED,
                    host_class=manifest.host_class.value,
                    needs_vm=manifest.requirements.isolation == Isolation.VM,
                    needs_cuda_device=manifest.requirements.cuda_device,
                    priority=request.priority,
                    max_attempts=manifest.retry.max_attempts,
                    not_before=now,
                    deadline=manifest.deadline.timestamp(),
                )
            )
            self._event(
                s,
                rollout_id,
                "submitted",
                now,
                after=RolloutState.QUEUED.value,
                actor=f"tenant:{request.tenant}",
                message=f"manifest {digest[:19]}, {len(manifest.steps)} steps, "
                f"{manifest.host_class}-class",
            )
            return self._view(s, row), True

    def get(self, rollout_id: str) -> Rollout:
        with self._tx() as s:
            return self._view(s, self._rollout_row(s, rollout_id))

    def list_rollouts(
        self, page_size: int, page_token: str, labels: dict[str, str]
    ) -> tuple[list[Rollout], str]:
        """Rollouts newest first; the token is the last seq of the previous page."""
        if page_size < 0:
            raise InvalidArgument(f"page_size must not be negative, got {page_size}")
        size = min(page_size or 50, 500)
        query = select(RolloutRow)
        if page_token:
            try:
                before = int(page_token)
            except ValueError:
                raise InvalidArgument(
                    f"page_token {page_token!r} is not one this server issued"
                ) from None
            query = query.where(col(RolloutRow.seq) < before)
        for key, value in labels.items():
            match = select(RolloutLabel.rollout_seq).where(
                RolloutLabel.key == key, RolloutLabel.value == value
            )
            query = query.where(col(RolloutRow.seq).in_(match))
        query = query.order_by(col(RolloutRow.seq).desc()).limit(size + 1)
        with self._tx() as s:
            rows = list(s.exec(query))
            more = len(rows) > size
            rows = rows[:size]
            token = str(rows[-1].seq) if more and rows else ""
            return [self._view(s, r) for r in rows], token

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
            s.add(row)

    def hosts(self) -> list[HostCapabilities]:
        with self._tx() as s:
            rows = s.exec(select(HostRow).order_by(col(HostRow.id)))
            return [HostCapabilities.model_validate_json(r.capabilities_json) for r in rows]

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
    ) -> list[Assignment]:
        """Leases up to `max_items` runnable items this host can serve, highest priority first.

        A repeat of a claim (same `request_id`, same host) answers with the leases the first
        one took, so a lost reply never strands work until its lease expires.
        """
        with self._tx() as s:
            host = self._host(s, host_id)
            if request_id:
                again = s.exec(
                    select(WorkItemRow).where(
                        WorkItemRow.lease_owner == host_id,
                        WorkItemRow.state == LEASED,
                        WorkItemRow.claim_request_id == request_id,
                    )
                ).all()
                if again:
                    return [self._assignment(s, item) for item in again]
            query = select(WorkItemRow).where(
                WorkItemRow.state == QUEUED,
                WorkItemRow.host_class == host.host_class.value,
                col(WorkItemRow.not_before) <= now,
                col(WorkItemRow.deadline) > now,
            )
            if host.isolation != Isolation.VM:
                query = query.where(col(WorkItemRow.needs_vm).is_(False))
            if host.cuda_devices == 0:
                query = query.where(col(WorkItemRow.needs_cuda_device).is_(False))
            running: dict[str, int] = {}
            want = max(1, max_items)
            if max_running_per_tenant:
                counts = s.exec(
                    select(WorkItemRow.tenant, func.count())
                    .where(WorkItemRow.state == LEASED)
                    .group_by(col(WorkItemRow.tenant))
                ).all()
                running = {tenant: int(n) for tenant, n in counts}
                full = [t for t, n in running.items() if n >= max_running_per_tenant]
                if full:
                    query = query.where(col(WorkItemRow.tenant).not_in(full))
                want *= 4  # room to skip items of tenants that fill up within this batch
            query = query.order_by(
                col(WorkItemRow.priority).desc(), col(WorkItemRow.not_before), col(WorkItemRow.id)
            ).limit(want)
            query = query.with_for_update(skip_locked=True)
            out: list[Assignment] = []
            for item in s.exec(query).all():
                if len(out) >= max(1, max_items):
                    break
                if max_running_per_tenant:
                    if running.get(item.tenant, 0) >= max_running_per_tenant:
                        continue
                    running[item.tenant] = running.get(item.tenant, 0) + 1
                item.claim_request_id = request_id
                item.state = LEASED
                item.attempt += 1
                item.fencing_token += 1
                item.lease_owner = host_id
                item.lease_expires_at = now + lease_ttl_s
                item.result_fingerprint = ""
                s.add(item)
                s.add(
                    AttemptRow(
                        work_id=item.id,
                        attempt=item.attempt,
                        host_id=host_id,
                        fencing_token=item.fencing_token,
                        started_at=now,
                    )
                )
                row = self._rollout_row(s, item.rollout_id, lock=True)
                row.attempts = item.attempt
                self._move(
                    s,
                    row,
                    RolloutState.RUNNING,
                    now,
                    kind="leased",
                    actor=host_id,
                    message=f"attempt {item.attempt} on {host_id}",
                    attempt=item.attempt,
                )
                out.append(self._assignment(s, item))
            return out

    def _assignment(self, s: Session, item: WorkItemRow) -> Assignment:
        row = self._rollout_row(s, item.rollout_id)
        manifest_row = s.get(ManifestRow, row.manifest_digest)
        assert manifest_row is not None
        return Assignment(
            work_id=item.id,
            rollout_id=item.rollout_id,
            attempt=item.attempt,
            fencing_token=item.fencing_token,
            lease_expires_at=_ts(item.lease_expires_at) or datetime.now(UTC),
            manifest=Manifest.model_validate_json(manifest_row.body),
        )

    def heartbeat(
        self, host_id: str, leases: list[tuple[str, int]], now: float, lease_ttl_s: float
    ) -> tuple[list[tuple[str, int]], list[str]]:
        """Renews the host's leases; returns (renewed, work the agent must stop).

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
        fingerprint = report.fingerprint()
        with self._tx() as s:
            item = s.get(WorkItemRow, report.work_id, with_for_update=True)
            if item is None:
                raise NotFound(f"no work item {report.work_id!r}")
            if item.fencing_token != report.fencing_token:
                raise Aborted(
                    f"stale fencing token {report.fencing_token} for {report.work_id} (current "
                    f"{item.fencing_token}): the lease was lost and the work leased again"
                )
            row = self._rollout_row(s, item.rollout_id, lock=True)
            if item.state == DONE:
                if item.result_fingerprint == fingerprint:
                    return RolloutState(row.state)  # the same report again: already recorded
                raise Aborted(
                    f"work item {report.work_id} already has a final result under token "
                    f"{report.fencing_token}; a different report was refused"
                )
            if item.state != LEASED or item.lease_owner != host_id:
                raise Aborted(f"work item {report.work_id} is not leased to host {host_id}")
            attempt = s.exec(
                select(AttemptRow).where(
                    AttemptRow.work_id == item.id, AttemptRow.attempt == item.attempt
                )
            ).one()
            attempt.ended_at = now
            attempt.outcome = report.outcome.value
            attempt.error = report.error
            s.add(attempt)

            results = []
            for result in report.results:
                results.append(
                    result.model_copy(
                        update={
                            "stdout_digest": self._put_artifact(s, result.stdout, now),
                            "stderr_digest": self._put_artifact(s, result.stderr, now),
                        }
                    )
                )
            manifest = Manifest.model_validate_json(
                s.get(ManifestRow, row.manifest_digest).body  # type: ignore[union-attr]
            )
            item.lease_expires_at = None
            item.result_fingerprint = fingerprint
            row.host_id, row.runtime, row.device = host_id, report.runtime, report.device
            row.results_json = json.dumps([r.model_dump(mode="json") for r in results])

            outcome = report.outcome
            if item.cancel_requested:
                target, kind = RolloutState.CANCELLED, "cancelled"
            elif outcome == Outcome.SUCCEEDED:
                target, kind = RolloutState.SUCCEEDED, "succeeded"
                row.error = ""
            elif outcome == Outcome.STEP_FAILED:
                target, kind = RolloutState.FAILED, "failed"
                row.error = report.error or "a step failed"
            elif outcome == Outcome.CANCELLED:
                target, kind = RolloutState.FAILED, "deadline_exceeded"
                row.error = report.error or "stopped at the rollout's deadline"
            elif outcome == Outcome.MALFORMED_INPUT:
                target, kind = RolloutState.QUARANTINED, "quarantined"
                row.error = f"malformed input, quarantined: {report.error}"
            elif outcome == Outcome.INCOMPATIBLE:
                target, kind = RolloutState.FAILED, "incompatible"
                row.error = f"incompatible, not retried: {report.error}"
            else:  # TRANSIENT_ERROR: retried while the policy allows
                if manifest.retry.may_retry(item.attempt) and item.deadline > now:
                    delay = manifest.retry.backoff_s(item.attempt, self._rng)
                    item.state = QUEUED
                    item.lease_owner = ""
                    item.not_before = now + delay
                    s.add(item)
                    row.error = report.error
                    self._move(
                        s,
                        row,
                        RolloutState.QUEUED,
                        now,
                        kind="retry_scheduled",
                        actor=host_id,
                        attempt=item.attempt,
                        message=f"transient error: {report.error}; retry in {delay:.2f}s",
                    )
                    return RolloutState.QUEUED
                target, kind = RolloutState.FAILED, "failed"
                row.error = f"attempts exhausted ({item.attempt}); last error: {report.error}"
            item.state = DONE
            s.add(item)
            self._move(
                s,
                row,
                target,
                now,
                kind=kind,
                actor=host_id,
                message=row.error,
                attempt=item.attempt,
            )
            return target

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


def now_s() -> float:
    return time.time()
