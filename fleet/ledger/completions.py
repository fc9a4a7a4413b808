"""Completions: agents' reports judged into the next state, many in one transaction."""

from __future__ import annotations

import json
from typing import Any

import structlog

from fleet.core.errors import (
    Aborted,
    FleetError,
    NotFound,
)
from fleet.core.lifecycle import (
    Outcome,
    RolloutState,
    WorkItemState,
    check_item_transition,
    check_transition,
)
from fleet.core.manifest import Manifest
from fleet.core.rollout import (
    Completion,
)
from fleet.ledger import queries as Q
from fleet.ledger.base import LedgerBase, prepare_report
from fleet.ledger.parks import repark_failed_resumes
from fleet.ledger.raw import DONE, LEASED, QUEUED
from fleet.ledger.records import Item

log = structlog.get_logger(__name__)


class Completions(LedgerBase):
    def complete(self, host_id: str, report: Completion, now: float) -> RolloutState:
        """Records one attempt's result under its fencing token; exactly one result wins."""
        [result] = self.complete_many(host_id, [report], now)
        if isinstance(result, FleetError):
            raise result
        return result

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
        prepared = [prepare_report(report) for _, report in reports]
        with self._tx() as db:
            ids = sorted({r.work_id for _, r in reports})
            items = {row[0]: Item(*row) for row in db.all(Q.ITEMS_FOR_UPDATE, ids, n=len(ids))}
            rollout_ids = sorted({i.rollout_id for i in items.values()})
            rollouts = {
                row[0]: row
                for row in (
                    db.all(Q.REPORTED_ROLLOUTS, rollout_ids, n=len(rollout_ids))
                    if rollout_ids
                    else []
                )
            }
            manifests = self._manifests_raw(db, (row[2] for row in rollouts.values()))
            artifacts: dict[str, bytes] = {}
            attempt_rows: list[tuple[Any, ...]] = []
            item_rows: list[tuple[Any, ...]] = []
            rollout_rows: list[tuple[Any, ...]] = []
            event_rows: list[tuple[Any, ...]] = []
            egress_rows: list[tuple[Any, ...]] = []
            seen: dict[str, tuple[str, RolloutState]] = {}
            ended: list[str] = []  # (the tenant of each item that is done now)
            unstarted: list[str] = []  # (resumes that failed before their machine started)
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
                            f"stale fencing token {report.fencing_token} for {report.work_id}: "
                            "the lease was lost and the work leased again"
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
                manifest = manifests[digest]
                target, kind, error, not_before = self._judge(item, report, manifest, now)
                if target == RolloutState.CANCELLED:
                    error = rollout_error or error  # the reason given with the cancel request
                current = RolloutState(rollout_state)
                check_transition(current, target)
                attempt_rows.append(
                    (now, report.outcome.value, report.error, report.cpu_seconds,
                     report.peak_memory_mib, report.artifact_failed, item.id, item.attempt)
                )  # fmt: skip
                if _failed_unstarted_resume(target, report, manifest):
                    unstarted.append(rid)
                requeue = target == RolloutState.QUEUED
                if not requeue:
                    ended.append(item.tenant)
                check_item_transition(
                    WorkItemState(item.state),
                    WorkItemState.QUEUED if requeue else WorkItemState.DONE,
                )
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
            with db.pipeline():
                db.many(
                    Q.INSERT_ARTIFACT, [(d, len(b), b, now) for d, b in sorted(artifacts.items())]
                )
                db.many(Q.REPORT_ATTEMPT, attempt_rows)
                db.many(Q.REPORT_ITEM, item_rows)
                db.many(Q.REPORT_ROLLOUT, rollout_rows)
                db.many(Q.INSERT_EVENT, event_rows)
                db.many(Q.INSERT_EGRESS_EVENT, egress_rows)
                self._count_active(db, ended, -1)
            repark_failed_resumes(db, unstarted, now)
        return out

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


def _failed_unstarted_resume(target: RolloutState, report: Completion, manifest: Manifest) -> bool:
    """Whether the report ends a rollout that starts a machine from a parked layer (a resume;
    a fork of a parked session, too) without its machine having started: its layer could not
    be fetched, unpacked or made into a machine, which the agent reports as the artifact's
    failure. Such a resume lost nothing, and its session parks again (`fleet.ledger.parks`)."""
    started_from_layer = manifest.session is not None and bool(manifest.session.layer)
    failed = target in (RolloutState.FAILED, RolloutState.QUARANTINED)
    return started_from_layer and failed and report.artifact_failed
