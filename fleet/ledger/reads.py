"""Reads: rollouts, their events and attempts, leases and artifacts, the metrics' figures."""

from __future__ import annotations

from datetime import UTC, datetime

import structlog

from fleet.core.egress import EffectiveEgress, EgressEvent
from fleet.core.errors import (
    InvalidArgument,
    NotFound,
)
from fleet.core.lifecycle import FINAL_STATES, RolloutState
from fleet.core.manifest import Manifest
from fleet.core.rollout import (
    Rollout,
    RolloutEvent,
)
from fleet.ledger import queries as Q
from fleet.ledger.base import LedgerBase, as_datetime
from fleet.ledger.raw import LEASED, Raw
from fleet.ledger.records import AttemptRec, RolloutRec, Settled

log = structlog.get_logger(__name__)

_SCAN = 500
"""Rows a listing filtered by egress reads at a time."""
SETTLE_S = 300.0
"""How long after a rollout finished its figures are settled (kept, not read again): longer
than a transaction takes to commit and than replicas' clocks differ, so that no rollout
finishes, as its row says, before a time whose figures were already summed."""
_FINALS = sorted(state.value for state in FINAL_STATES)
_UNFINISHED = sorted(state.value for state in RolloutState if not state.final)
_LATER = 1e18
"""An end of time for `finished_at`: the recent rows' range is open above."""


def _finished(db: Raw, since: float, until: float) -> Settled:
    """The figures of the rollouts that finished in [since, until)."""
    marks = len(_FINALS)
    by_state: dict[str, int] = {}
    retries, cpu_s = 0, 0.0
    for state, n, beyond_first, cpu in db.all(Q.FINISHED_FIGURES, (*_FINALS, since, until),
                                              n=marks):  # fmt: skip
        by_state[state] = int(n)
        if state == RolloutState.SUCCEEDED.value:
            retries, cpu_s = int(beyond_first), float(cpu)
    inference = db.value(Q.FINISHED_CALLING_INFERENCE, (*_FINALS, since, until, True), n=marks)
    return Settled(until, by_state, retries, cpu_s, int(inference))


def _list_filters(
    tenant: str | None, state: RolloutState | None, since: float | None, before: float | None,
    egress_known: bool, labels: dict[str, str],
) -> tuple[str, list[object]]:  # fmt: skip
    """The conditions of a `LIST_ROLLOUTS` page and their values, in order."""
    where, values = "", list[object]()
    for sql, value in ((Q.AND_TENANT, tenant), (Q.AND_STATE, state and state.value),
                       (Q.AND_CREATED_SINCE, since), (Q.AND_CREATED_BEFORE, before)):  # fmt: skip
        if value is not None:
            where += sql
            values.append(value)
    if egress_known:
        where += Q.AND_EGRESS_KNOWN
    for key, value in sorted(labels.items()):
        where += Q.AND_LABELLED
        values += [key, value]
    return where, values


class Reads(LedgerBase):
    def list_rollouts(
        self, page_size: int, page_token: str, labels: dict[str, str], could_reach: str = "",
        *, tenant: str | None = None, state: RolloutState | None = None,
        created_since: float | None = None, created_before: float | None = None,
    ) -> tuple[list[Rollout], str]:  # fmt: skip
        """Rollouts newest first; the token is the last seq of the previous page.

        `could_reach` keeps only rollouts whose machine's effective egress allowed that host;
        `tenant` only that tenant's (None: every tenant's); `state` only those in it;
        `created_since` / `created_before` only those created in [since, before). Every filter
        but `could_reach` is applied in SQL, so that a page of a rare state reads that page's
        rows, not every rollout before them.
        """
        if page_size < 0:
            raise InvalidArgument(f"page_size must not be negative, got {page_size}")
        size = min(page_size or 50, 500)
        before = 1 << 62
        if page_token:
            if len(page_token) > 19 or not page_token.isdigit():
                raise InvalidArgument(
                    f"page_token {page_token[:40]!r} is not one this server issued"
                )
            before = int(page_token)
        where, values = _list_filters(tenant, state, created_since, created_before,
                                      bool(could_reach), labels)  # fmt: skip
        sql = Q.LIST_ROLLOUTS.replace(Q.LABELS, where)
        with self._read() as db:

            def page(before: int, limit: int) -> list[RolloutRec]:
                return [RolloutRec(*r) for r in db.all(sql, (before, *values, limit))]

            if not could_reach:
                rows = page(before, size + 1)
            else:
                # Which names an allowlist covers is decided in Python; scan in chunks.
                rows = []
                while True:
                    chunk = page(before, _SCAN)
                    rows += [
                        r for r in chunk
                        if EffectiveEgress.model_validate_json(r.egress_json).could_reach(
                            could_reach)
                    ]  # fmt: skip
                    if len(rows) > size or len(chunk) < _SCAN:
                        break
                    before = chunk[-1].seq
            more = len(rows) > size
            rows = rows[:size]
            token = str(rows[-1].seq) if more and rows else ""
            histories = self._histories(db, [r.id for r in rows]) if rows else {}
            return [self._view(db, r, histories[r.id]) for r in rows], token

    def rollout_tokens(self, rollout_id: str) -> dict[str, tuple[int, int]]:
        """model -> (prompt tokens, completion tokens) the gateway charged to a rollout, over
        all its attempts; NotFound for an unknown rollout."""
        with self._read() as db:
            self._rollout(db, rollout_id)
            rows = db.all(Q.ROLLOUT_TOKENS, (rollout_id,))
        return {str(model): (int(prompt), int(completion)) for model, prompt, completion in rows}

    def page_token_at(self, rollout_id: str) -> str:
        """The list_rollouts page token that continues after this rollout."""
        with self._read() as db:
            return str(self._rollout(db, rollout_id).seq)

    def events(self, rollout_id: str, after_sequence: int, limit: int = 500) -> list[RolloutEvent]:
        with self._read() as db:
            self._rollout(db, rollout_id)  # NotFound for an unknown rollout
            rows = db.all(Q.EVENTS_AFTER, (rollout_id, after_sequence, limit))
        return [
            RolloutEvent(
                sequence=int(seq), rollout_id=rollout_id, kind=kind,
                from_state=RolloutState(before) if before else None,
                to_state=RolloutState(after) if after else None,
                actor=actor, at=as_datetime(at) or datetime.now(UTC), message=message,
                attempt=int(attempt),
            )
            for seq, kind, before, after, actor, at, message, attempt in rows
        ]  # fmt: skip

    def egress_events(self, rollout_id: str) -> list[tuple[int, EgressEvent]]:
        """(attempt, event) for every refused DNS query and connection of a rollout, in order."""
        with self._read() as db:
            self._rollout(db, rollout_id)  # NotFound for an unknown rollout
            rows = db.all(Q.EGRESS_EVENTS, (rollout_id,))
        return [
            (int(attempt), EgressEvent(at=at, machine=machine, kind=kind,
                                       destination=destination, decision=decision,
                                       reason=reason))
            for attempt, at, machine, kind, destination, decision, reason in rows
        ]  # fmt: skip

    def figures(self, now: float, window_s: float = 60.0) -> dict[str, float]:
        """The numbers behind the server's metrics: counts by state, throughput, retries, CPU.

        Rollouts that finished more than SETTLE_S ago are settled: a final rollout never
        changes, so their sums are kept from one call to the next and only the rows that
        settled since are read, with the recent and unfinished ones. A scrape reads what
        changed lately, not the whole history (a million finished rollouts: 0.8 s a scrape
        read in full)."""
        succeeded = RolloutState.SUCCEEDED.value
        settle = now - SETTLE_S
        with self._settled_lock, self._read() as db:
            settled = self._settled
            if settled is None or settle < settled.until:  # (first call, or the clock went back)
                settled = Settled()
            if settle > settled.until:
                settled = settled.plus(_finished(db, settled.until, settle))
            recent = settled.plus(_finished(db, settle, _LATER))
            unfinished = db.all(Q.UNFINISHED_BY_STATE, _UNFINISHED, n=len(_UNFINISHED))
            last_window = db.value(Q.FINISHED_SINCE, (succeeded, now - window_s))
            self._settled = settled
        out = {f"state_{state}": float(n) for state, n in sorted(recent.by_state.items())}
        out.update({f"state_{state}": float(n) for state, n in unfinished})
        done = recent.by_state.get(succeeded, 0)
        out.update(
            trajectories_per_second=float(last_window) / window_s,
            retries=float(recent.retries),
            cpu_seconds_per_trajectory=recent.cpu_s / done if done else 0.0,
            inference_trajectories=float(recent.inference),
        )
        return out

    def forget_settled_figures(self) -> None:
        """Rows were deleted (retention): the kept sums counted them, so the next `figures`
        sums from the start again."""
        with self._settled_lock:
            self._settled = None

    def work_lease(self, work_id: str) -> tuple[str, int, Manifest, str] | None:
        """(lease owner, fencing token, manifest, tenant) of a leased work item; None
        otherwise."""
        with self._read() as db:
            row = db.one(Q.WORK_LEASE, (work_id, LEASED))
            if row is None:
                return None
            owner, token, digest, tenant = row
            return str(owner), int(token), self._manifest_raw(db, digest), str(tenant)

    def rollout_lease(self, rollout_id: str) -> tuple[str, str] | None:
        """(work id, lease owner) of a rollout's leased work item; None when none is leased."""
        with self._read() as db:
            row = db.one(Q.ROLLOUT_LEASE, (rollout_id, LEASED))
        return (str(row[0]), str(row[1])) if row else None

    def leased_to(self, host_id: str) -> int:
        """How many work items are leased to a host right now."""
        with self._read() as db:
            return int(db.value(Q.LEASES_OF_HOST, (host_id, LEASED)))

    def artifact(self, digest: str) -> bytes:
        with self._read() as db:
            row = db.one(Q.ARTIFACT, (digest,))
        if row is None:
            raise NotFound(f"no artifact {digest}")
        return bytes(row[0])

    def attempts(self, rollout_id: str) -> list[AttemptRec]:
        """Every attempt of a rollout, in order."""
        with self._read() as db:
            self._rollout(db, rollout_id)  # NotFound for an unknown rollout
            return self._histories(db, [rollout_id])[rollout_id]
