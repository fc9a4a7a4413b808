"""Submissions: rollouts stored once per idempotency key, alone or many in one transaction;
cancels."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import structlog

from fleet.core.errors import (
    Aborted,
    AlreadyExists,
    FleetError,
    ResourceExhausted,
)
from fleet.core.lifecycle import RolloutState
from fleet.core.manifest import Manifest, SubmitRequest
from fleet.core.placement import Isolation
from fleet.core.rollout import (
    Rollout,
)
from fleet.ledger import queries as Q
from fleet.ledger.base import LedgerBase, as_datetime, new_id
from fleet.ledger.engines import UNIQUE_CLASH
from fleet.ledger.raw import DONE, QUEUED, Raw
from fleet.ledger.records import Item

log = structlog.get_logger(__name__)


class Submissions(LedgerBase):
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
        [answer] = self.submit_batch([(request, manifest)], now, max_active_per_tenant)
        if isinstance(answer, FleetError):
            raise answer
        return answer

    def submit_batch(
        self,
        batch: list[tuple[SubmitRequest, Manifest]],
        now: float,
        max_active_per_tenant: int = 0,
    ) -> list[tuple[Rollout, bool] | FleetError]:
        """Many callers' submissions in one transaction (group commit), each as `submit` takes
        it and answered on its own: one refused (a key reused with another body, its tenant at
        its limit) gets its error and stores nothing, the others are stored.

        They are taken in (tenant, key) order, so replicas take tenants' counts and keys in one
        order (PostgreSQL cannot deadlock on them); answers come in the callers' order. All are
        first written together (a few statements for the batch); only when one of them is
        refused are they written again one by one, each under its own savepoint."""
        if len(batch) == 1:
            return [self._submit_alone(*batch[0], now, max_active_per_tenant)]
        order = sorted(
            range(len(batch)), key=lambda i: (batch[i][0].tenant, batch[i][0].idempotency_key)
        )
        ordered = [batch[i] for i in order]
        max_active = max_active_per_tenant
        with self._tx() as db:
            together = None
            if len(batch) > 1:
                together = self._submit_together(db, ordered, now, max_active)
            if together is None:
                together = [self._submit_one(db, req, m, now, max_active) for req, m in ordered]
        answers = dict(zip(order, together, strict=True))
        return [answers[i] for i in range(len(batch))]

    def _submit_alone(
        self, request: SubmitRequest, manifest: Manifest, now: float, max_active: int
    ) -> tuple[Rollout, bool] | FleetError:
        """One submission in a transaction of its own, with no savepoint: refused, it has
        written nothing (refusals come before the first write); clashing with another replica's
        same key or manifest, the transaction is undone and the next try reads that row."""
        for _ in range(3):
            try:
                with self._tx() as db:
                    [(rollout_id, created)] = self._insert_rollouts(
                        db, [(request, manifest)], now, max_active
                    )
                    if created:
                        return self._queued(rollout_id, request, manifest, now), True
                    return self._view(db, self._rollout(db, rollout_id)), False
            except FleetError as exc:
                return exc
            except UNIQUE_CLASH:
                continue
        return _clashing(request)

    def _submit_together(
        self, db: Raw, batch: list[tuple[SubmitRequest, Manifest]], now: float, max_active: int
    ) -> list[tuple[Rollout, bool] | FleetError] | None:
        """All of a batch written at once, under a savepoint; None (and nothing written) when
        any of them is refused."""
        db.run(Q.SAVEPOINT)
        try:
            stored = self._insert_rollouts(db, batch, now, max_active)
        except FleetError:
            stored = None
        except UNIQUE_CLASH:
            stored = None
        if stored is None:
            db.run(Q.ROLLBACK_TO_SAVEPOINT)
            db.run(Q.RELEASE_SAVEPOINT)
            return None
        db.run(Q.RELEASE_SAVEPOINT)
        return [
            (self._queued(rollout_id, request, manifest, now), True) if created
            else (self._view(db, self._rollout(db, rollout_id)), False)
            for (request, manifest), (rollout_id, created) in zip(batch, stored, strict=True)
        ]  # fmt: skip

    def _submit_one(
        self, db: Raw, request: SubmitRequest, manifest: Manifest, now: float, max_active: int
    ) -> tuple[Rollout, bool] | FleetError:
        """One submission in the caller's transaction, under a savepoint: refused, it leaves
        nothing of itself."""
        for _ in range(3):
            db.run(Q.SAVEPOINT)
            try:
                [(rollout_id, created)] = self._insert_rollouts(
                    db, [(request, manifest)], now, max_active
                )
                if created:
                    answer: tuple[Rollout, bool] | FleetError = (
                        self._queued(rollout_id, request, manifest, now),
                        True,
                    )
                else:
                    answer = self._view(db, self._rollout(db, rollout_id)), False
            except FleetError as exc:
                answer = exc
                db.run(Q.ROLLBACK_TO_SAVEPOINT)
            except UNIQUE_CLASH:
                # Another replica stored the same key or manifest between our read and insert;
                # the next try sees its row and answers as for any repeated submission.
                db.run(Q.ROLLBACK_TO_SAVEPOINT)
                db.run(Q.RELEASE_SAVEPOINT)
                continue
            db.run(Q.RELEASE_SAVEPOINT)
            return answer
        return _clashing(request)

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
                with self._tx() as db:
                    return self._insert_rollouts(db, batch, now, max_active_per_tenant)
            except UNIQUE_CLASH:
                continue  # another replica stored one of the keys meanwhile: read it again
        with self._tx() as db:
            return self._insert_rollouts(db, batch, now, max_active_per_tenant)

    @staticmethod
    def _queued(rollout_id: str, request: SubmitRequest, manifest: Manifest, now: float) -> Rollout:
        """A rollout as its submission stored it."""
        return Rollout(
            id=rollout_id, state=RolloutState.QUEUED, tenant=request.tenant,
            idempotency_key=request.idempotency_key, labels=dict(request.labels),
            manifest=manifest, manifest_digest=manifest.digest,
            created_at=as_datetime(now) or datetime.now(UTC), priority=request.priority,
        )  # fmt: skip

    def _insert_rollouts(
        self,
        db: Raw,
        batch: list[tuple[SubmitRequest, Manifest]],
        now: float,
        max_active: int,
    ) -> list[tuple[str, bool]]:
        keys = sorted({req.idempotency_key for req, _ in batch})
        known: dict[str, tuple[str, str]] = {}
        for rid, key, fp in db.all_in(Q.ROLLOUTS_BY_KEY, keys):
            known[key] = (rid, fp)
        active: dict[str, int] = {}
        if max_active:
            tenants = sorted({req.tenant for req, _ in batch})
            active = {
                tenant: int(n) for tenant, n in db.all(Q.ACTIVE_OF_TENANTS, tenants, n=len(tenants))
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
            rollout_id = new_id("r-")
            known[key] = (rollout_id, fingerprint)
            rollouts.append(
                (rollout_id, key, fingerprint, digest, request.tenant,
                 json.dumps(request.labels, sort_keys=True) if request.labels else "{}",
                 queued, request.priority, now, now)
            )  # fmt: skip
            labels += [(rollout_id, k, v) for k, v in request.labels.items()]
            items.append(
                (new_id("w-"), rollout_id, request.tenant, QUEUED,
                 manifest.host_class.value,
                 manifest.requirements.isolation == Isolation.VM,
                 manifest.requirements.isolation == Isolation.NAMESPACE,
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
            with db.pipeline():
                db.many(
                    Q.INSERT_MANIFEST,
                    [(d, m.model_dump_json(), now) for d, m in sorted(manifests.items())],
                )
                db.many(Q.INSERT_ROLLOUT, rollouts)
                db.many(Q.INSERT_LABEL, labels)
                db.many(Q.INSERT_WORK_ITEM, [(*row[:-1], False, row[-1]) for row in items])
                db.many(Q.INSERT_EVENT, events)
                self._count_active(db, [row[2] for row in items], 1)
            self._keep_manifests(manifests)
        return out

    def cancel(self, rollout_id: str, reason: str, actor: str, now: float) -> Rollout:
        """Queued work ends at once; running work is stopped by its agent at its next beat."""
        with self._tx() as db:
            found = db.one(Q.ITEM_OF_ROLLOUT_FOR_UPDATE, (rollout_id,))
            row = self._rollout(db, rollout_id, lock=True)
            assert found is not None
            item = Item(*found)
            if RolloutState(row.state).final:
                return self._view(db, row)
            why = reason or "cancelled by request"
            if item.state == QUEUED:
                db.run(Q.SET_ITEM_STATE, (DONE, item.id))
                self._count_active(db, [item.tenant], -1)
                row = self._move(
                    db, row, RolloutState.CANCELLED, now, kind="cancelled", actor=actor,
                    message=why, error=why,
                )  # fmt: skip
            elif not item.cancel_requested:
                db.run(Q.REQUEST_CANCEL, (item.id,))
                self._event(
                    db, rollout_id, "cancel_requested", now, actor=actor, message=why,
                    attempt=item.attempt,
                )  # fmt: skip
                db.run(Q.SET_ROLLOUT_ERROR, (why, rollout_id))
                row = row._replace(error=why)
            return self._view(db, row)


def _clashing(request: SubmitRequest) -> Aborted:
    """The answer to a submission that other submissions of its key kept clashing with."""
    return Aborted(
        f"idempotency key {request.idempotency_key!r}: other submissions of it kept "
        "clashing with this one; retry",
        retry_after_s=0.1,
    )
