"""Leases: claims (caps, backpressure, pins, rollback), reclaims after a restart, heartbeats
and the sweep of expired leases and deadlines."""

from __future__ import annotations

import json
import secrets
from datetime import UTC, datetime
from typing import Any

import structlog
from sqlmodel import col, select

from fleet.core.errors import (
    Aborted,
    FailedPrecondition,
)
from fleet.core.lifecycle import Outcome, RolloutState, check_transition
from fleet.core.manifest import Manifest
from fleet.core.placement import HostClass, Isolation, is_local
from fleet.core.rollout import (
    Assignment,
)
from fleet.ledger import pools as pool_sql
from fleet.ledger.base import (
    AVOID_HOST_S,
    FENCING_STEP,
    INSERT_EVENT,
    ITEM_COLS,
    Item,
    LedgerBase,
    as_datetime,
)
from fleet.ledger.raw import DONE, LEASED, QUEUED, Raw, marks
from fleet.ledger.tables import (
    AttemptRow,
    HostRow,
    ManifestRow,
    WorkItemRow,
)

log = structlog.get_logger(__name__)


class Leases(LedgerBase):
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
        with self._write() as db:
            host = self._host_row(db, host_id)
            if request_id:
                again = db.all(
                    f"SELECT {ITEM_COLS} FROM work_items WHERE lease_owner = ? AND state = ? "
                    "AND claim_request_id = ?",
                    (host_id, LEASED, request_id),
                )
                if again:
                    return [self._assignment(db, Item(*row)) for row in again]
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
            chosen: list[Item] = []
            for row in db.all(
                f"SELECT {ITEM_COLS} FROM work_items WHERE {where} "
                f"ORDER BY priority DESC, not_before, id LIMIT {int(want)}"
                + (" FOR UPDATE SKIP LOCKED" if self._pg else ""),
                params,
            ):
                item = Item(*row)
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
            lease_at = as_datetime(expires) or datetime.now(UTC)
            running_state = RolloutState.RUNNING.value
            item_rows, attempt_rows, rollout_rows, event_rows = [], [], [], []
            leased: list[tuple[Item, int, int, Manifest]] = []
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
            db.many(INSERT_EVENT, event_rows)
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
            db = Raw.of(conn, self._pg)
            self._host_row(db, host_id)
            expires = now + lease_ttl_s
            for work_id, token in sorted(set(leases)):
                rows = db.all(
                    f"SELECT {ITEM_COLS} FROM work_items WHERE id = ?{db.lock}", (work_id,)
                )
                item = Item(*rows[0]) if rows else None
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
                    INSERT_EVENT,
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
