"""Reads: rollouts, their events and attempts, leases and artifacts, the metrics' figures."""

from __future__ import annotations

from datetime import UTC, datetime

import structlog
from sqlmodel import col, func, select

from fleet.core.egress import EffectiveEgress, EgressEvent
from fleet.core.errors import (
    InvalidArgument,
    NotFound,
)
from fleet.core.lifecycle import RolloutState
from fleet.core.manifest import Manifest
from fleet.core.rollout import (
    Rollout,
    RolloutEvent,
)
from fleet.ledger.base import LedgerBase, as_datetime
from fleet.ledger.raw import DONE, LEASED, Raw
from fleet.ledger.tables import (
    ArtifactRow,
    AttemptRow,
    EgressEventRow,
    EventRow,
    RolloutLabel,
    RolloutRow,
    WorkItemRow,
)

log = structlog.get_logger(__name__)

_WORK_ITEMS = WorkItemRow.__table__  # type: ignore[attr-defined]


class Reads(LedgerBase):
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
                    at=as_datetime(r.at) or datetime.now(UTC),
                    message=r.message,
                    attempt=r.attempt,
                )
                for r in rows
            ]

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

    def figures(self, now: float, window_s: float = 60.0) -> dict[str, float]:
        """The numbers behind the server's metrics: counts by state, throughput, retries, CPU."""
        with self._begin() as conn:
            db = Raw.of(conn, self._pg)
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
            db = Raw.of(conn, self._pg)
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
            db = Raw.of(conn, self._pg)
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
                    .select_from(_WORK_ITEMS)
                    .where(_WORK_ITEMS.c.lease_owner == host_id, _WORK_ITEMS.c.state == LEASED)
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
