"""Leases: claims (caps, backpressure, pins, rollback), reclaims after a restart, heartbeats
and the sweep of expired leases and deadlines."""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, NamedTuple

import structlog

from fleet.core.errors import (
    Aborted,
    FailedPrecondition,
    FleetError,
    Unauthenticated,
)
from fleet.core.lifecycle import Outcome, RolloutState, check_transition
from fleet.core.manifest import Manifest
from fleet.core.placement import HostClass, Isolation, is_local
from fleet.core.rollout import (
    Assignment,
)
from fleet.ledger import pools as pool_sql
from fleet.ledger import queries as Q
from fleet.ledger.base import (
    AVOID_HOST_S,
    FENCING_STEP,
    LedgerBase,
    as_datetime,
    revoked,
    unregistered,
)
from fleet.ledger.raw import DONE, LEASED, QUEUED, Raw
from fleet.ledger.records import Item

log = structlog.get_logger(__name__)


class Claim(NamedTuple):
    """One host's claim, as `Leases.claim` takes it (see there)."""

    host_id: str
    max_items: int
    lease_ttl_s: float
    request_id: str = ""
    max_running_per_tenant: int = 0
    hold_inference: bool = False


class _Taken(NamedTuple):
    """What one claim took: a repeat's leases as first answered (`again`), or the items it
    leased now with their manifests and latest checkpoints."""

    again: list[Assignment] | None = None
    leased: Sequence[tuple[Item, int, int, Manifest]] = ()
    saved: Mapping[str, tuple[int, bytes]] = MappingProxyType({})
    expires: float = 0.0

    def assignments(self) -> list[Assignment]:
        if self.again is not None:
            return self.again
        lease_at = as_datetime(self.expires) or datetime.now(UTC)
        return [
            Assignment(
                work_id=item.id, rollout_id=item.rollout_id, attempt=attempt,
                fencing_token=token, lease_expires_at=lease_at, manifest=manifest,
                checkpoint_sequence=self.saved.get(item.rollout_id, (0, b""))[0],
                checkpoint=self.saved.get(item.rollout_id, (0, b""))[1],
                tenant=item.tenant,
            )
            for item, attempt, token, manifest in self.leased
        ]  # fmt: skip


class Beat(NamedTuple):
    """One host's heartbeat, as `Leases.heartbeat` takes it (see there)."""

    host_id: str
    leases: Sequence[tuple[str, int]]
    now: float
    lease_ttl_s: float
    images: Sequence[str] | None = None


Beaten = tuple[list[tuple[str, int]], list[str]]
"""A heartbeat's answer: (the leases renewed, the work the agent must stop)."""

ANY_DUE = "SELECT 1 FROM work_items WHERE state = ? AND not_before <= ? AND deadline > ? LIMIT 1"
"""Whether any queued item may be claimed now, by any host (the claim index's first column)."""

HOSTS_KNOWN = (
    "SELECT h.id, i.revoked_at FROM hosts h LEFT JOIN host_identities i ON i.host_id = h.id "
    "WHERE h.id IN ({marks})"
)
"""Which of some hosts are registered, and when each was revoked (a heartbeat from a host not
registered, or revoked, is refused)."""

LEASES_OF_CLAIMS = (
    f"SELECT lease_owner, {Q.ITEM_COLS} FROM work_items WHERE state = ? "
    "AND claim_request_id IN ({marks})"
)
"""The leases some claims took (a repeated claim is answered with them), by request id."""
CHUNK = 500
"""Values bound in one IN list at most."""

LEASED_MANIFESTS = (
    "SELECT DISTINCT r.manifest_digest FROM work_items w JOIN rollouts r ON r.id = w.rollout_id "
    "WHERE w.state = ? AND w.lease_owner = ?"
)
"""The manifests of the work a host holds leases on (what it may read from the server)."""


class Leases(LedgerBase):
    claims_left_due = True
    """Whether work was still due for someone after the latest claim batch (`claim_batch`):
    work the claims in it could not take (a cap full, another class). Until a claim batch
    finds the queue empty, a report that frees room may let a waiting claim take it."""

    # -- agents ------------------------------------------------------------------------------

    def leases_image(self, host_id: str, digest: str) -> bool:
        """Whether `host_id` holds a lease whose manifest names the image `digest`: the one
        reason a host reads an image from the server's store (images are tenants' data)."""
        with self._read() as db:
            rows = db.all(LEASED_MANIFESTS, (LEASED, host_id))
            manifests = self._manifests_raw(db, (row[0] for row in rows))
        return any(m.image_digest == digest for m in manifests.values())

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
        claim = Claim(host_id, max_items, lease_ttl_s, request_id, max_running_per_tenant,
                      hold_inference)  # fmt: skip
        with self._tx() as db:
            taken = self._claim(db, claim, now)
        return taken.assignments()

    def claim_batch(self, claims: list[Claim], now: float) -> list[list[Assignment] | FleetError]:
        """Many hosts' claims in one transaction (group commit), each as `claim` would take it,
        in order: a later one sees what the earlier ones leased (tenants' and pools' caps
        included). Each is answered on its own: one refused (an unknown host) gets its error
        and leases nothing, while the others are taken."""
        taken: list[_Taken | FleetError] = []
        with self._tx() as db:
            # Most claims of an idle fleet find nothing: when nothing at all is due, each is
            # only checked (its host, a repeat of it) and none reads pools, caps or the queue.
            # (A claim leases items and never makes one due: once nothing is due, that holds
            # for the rest of the batch. So it is asked again after each claim that leased:
            # many claims woken for one rollout read the queue only until it is taken.)
            due = db.one(ANY_DUE, (QUEUED, now, now)) is not None
            for n, claim in enumerate(claims):
                if not due:
                    taken += self._claims_nothing_due(db, claims[n:])
                    break
                # A savepoint each: a claim that fails part way leaves nothing of itself.
                db.run(Q.SAVEPOINT)
                try:
                    took = self._claim(db, claim, now)
                    taken.append(took)
                    if took.leased:
                        due = db.one(ANY_DUE, (QUEUED, now, now)) is not None
                except FleetError as exc:
                    db.run(Q.ROLLBACK_TO_SAVEPOINT)
                    taken.append(exc)
                db.run(Q.RELEASE_SAVEPOINT)
        self.claims_left_due = due
        return [t if isinstance(t, FleetError) else t.assignments() for t in taken]

    def _claims_nothing_due(self, db: Raw, claims: list[Claim]) -> list[_Taken | FleetError]:
        """Claims while no item is due anywhere: each refused as `_claim` would refuse it (an
        unknown or revoked host), a repeat answered with the leases it took, else nothing.
        Two statements for them all (which hosts are known or revoked; which claims took
        leases before), not two each: a fleet's idle claims come in bursts of hundreds.
        Nothing is written."""
        hosts = sorted({c.host_id for c in claims})
        revoked_now = {row[0]: row[1] is not None for row in db.all_in(HOSTS_KNOWN, hosts)}
        asked = sorted({c.request_id for c in claims if c.request_id})
        took: dict[tuple[str, str], list[Item]] = {}
        for start in range(0, len(asked), CHUNK):
            part = asked[start : start + CHUNK]
            for owner, *row in db.all(LEASES_OF_CLAIMS, [LEASED, *part], n=len(part)):
                item = Item(*row)
                took.setdefault((owner, item.claim_request_id), []).append(item)
        answers: list[_Taken | FleetError] = []
        for claim in claims:
            if claim.host_id not in revoked_now:
                answers.append(unregistered(claim.host_id))
            elif revoked_now[claim.host_id]:
                answers.append(revoked(claim.host_id))
            elif again := took.get((claim.host_id, claim.request_id)) if claim.request_id else None:
                answers.append(_Taken(again=[self._assignment(db, item) for item in again]))
            else:
                answers.append(_Taken())
        return answers

    def _claim(self, db: Raw, claim: Claim, now: float) -> _Taken:
        """One claim in the caller's transaction: its leases written, its answer not yet
        built (that needs no database, so it is built after the commit)."""
        host_id, max_items, request_id = claim.host_id, claim.max_items, claim.request_id
        max_running_per_tenant = claim.max_running_per_tenant
        host, state = self._host_row(db, host_id)
        if request_id:
            again = db.all(Q.LEASES_OF_CLAIM, (host_id, LEASED, request_id))
            if again:
                return _Taken(again=[self._assignment(db, Item(*row)) for row in again])
        if state != "ready":
            return _Taken()  # (cordoned, draining: checked in the claim's own transaction)
        max_items = min(max_items, pool_sql.room(db, host))
        if max_items <= 0:
            return _Taken()  # (a pool it is in runs its cap already)
        classes = [host.host_class.value]
        rolled_back, local = self._rollback(db)
        if rolled_back:
            if not is_local(host, local):
                return _Taken()  # (rolled back to the local pool: nothing new goes elsewhere)
            if host.host_class == HostClass.GPU:
                classes.append(HostClass.CPU.value)  # (the local host has CPUs too)
        running: dict[str, int] = {}
        full: list[str] = []
        want = max(1, max_items)
        if max_running_per_tenant:
            running = {t: int(n) for t, n in db.all(Q.LEASES_BY_TENANT, (LEASED,))}
            full = sorted(t for t, n in running.items() if n >= max_running_per_tenant)
            want *= 4  # room to skip items of tenants that fill up within this batch
        avoid_until = now - AVOID_HOST_S
        params: list[Any] = [
            QUEUED, classes[0], classes[-1], now, now, host_id,
            host_id, avoid_until, host_id, avoid_until,
            host.isolation == Isolation.VM, host.isolation == Isolation.NAMESPACE,
            host.cuda_devices > 0,
            # Backpressure (the gateway's queue is over its threshold), or a host whose
            # agent does not know where the gateway is: no work that calls the gateway.
            not claim.hold_inference and bool(host.gateway),
            *(full or [""]),  # ("": no tenant is called that)
            want,
        ]  # fmt: skip
        chosen: list[Item] = []
        if db.postgres:
            db.one(Q.CLAIM_IN_LEASE_ORDER)
        for row in db.all(Q.CLAIMABLE, params, n=len(full) or 1):
            item = Item(*row)
            if len(chosen) >= max(1, max_items):
                break
            if max_running_per_tenant:
                if running.get(item.tenant, 0) >= max_running_per_tenant:
                    continue
                running[item.tenant] = running.get(item.tenant, 0) + 1
            chosen.append(item)
        if not chosen:
            return _Taken()
        ids = sorted({i.rollout_id for i in chosen})
        rollouts = {row[0]: row for row in db.all(Q.CLAIMED_ROLLOUTS, ids, n=len(ids))}
        manifests = self._manifests_raw(db, (row[2] for row in rollouts.values()))
        expires = now + claim.lease_ttl_s
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
            rollout_rows.append((attempt, now, started_at if started_at is not None else now, rid))
            event_rows.append(
                (rid, "leased", current.value, running_state, host_id, now,
                 f"attempt {attempt} on {host_id}", attempt)
            )  # fmt: skip
            leased.append((item, attempt, token, manifests[digest]))
        with db.pipeline():
            db.many(Q.LEASE_ITEM, item_rows)
            db.many(Q.INSERT_ATTEMPT, attempt_rows)
            db.many(Q.RUN_ROLLOUT, rollout_rows)
            db.many(Q.INSERT_EVENT, event_rows)
        # Hybrid rollouts resume from their latest checkpoint (only they have any).
        hybrid = sorted({i.rollout_id for i, _, _, m in leased if m.requirements.inference})
        return _Taken(leased=leased, saved=self._latest_checkpoints(db, hybrid), expires=expires)

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
        with self._tx() as db:
            self._host_row(db, host_id)
            expires = now + lease_ttl_s
            for work_id, token in sorted(set(leases)):
                found = db.one(Q.ITEM_FOR_UPDATE, (work_id,))
                item = Item(*found) if found else None
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
                db.run(Q.SET_LEASE_EXPIRY, (expires, work_id))
                db.run(
                    Q.INSERT_EVENT,
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
            for (work_id,) in db.all(Q.LEASED_TO_HOST, (LEASED, host_id)):
                if work_id in adopted:
                    continue
                db.run(Q.SET_LEASE_EXPIRY, (now, work_id))
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
        [answer] = self.heartbeat_batch([Beat(host_id, leases, now, lease_ttl_s, images)])
        if isinstance(answer, FleetError):
            raise answer
        return answer

    def heartbeat_batch(self, beats: Sequence[Beat]) -> list[Beaten | FleetError]:
        """Many hosts' heartbeats in one transaction (group commit), each answered as
        `heartbeat` would answer it alone: one refused (an unknown host, a stale lease) gets
        its error and writes nothing, while the others are renewed.

        A heartbeat was a durable commit of its own, and with a thousand hosts beating every
        few seconds those commits were most of what the database did. Here the beats' hosts
        and leases are read in two statements (the leases locked in id order, as every writer
        takes them), checked, and the renewals written as two statement batches."""
        if not beats:
            return []
        answers: list[Beaten | FleetError] = []
        with self._tx() as db:
            host_ids = sorted({b.host_id for b in beats})
            # (checked here, in the beats' own transaction: the server trusts a host's
            # identity for its beats longer than for its other calls, see fleet.server.auth)
            known = {row[0]: row[1] is not None for row in db.all_in(HOSTS_KNOWN, host_ids)}
            ids = sorted({w for b in beats for w, _ in b.leases})
            held = {row[0]: Item(*row) for row in db.all_in(Q.ITEMS_FOR_UPDATE, ids)}
            host_rows: dict[str, tuple[float, str | None, str]] = {}
            expiry_rows: dict[str, tuple[float, str]] = {}
            for beat in beats:
                answer = self._judge_beat(beat, known, held)
                answers.append(answer)
                if isinstance(answer, FleetError):
                    continue
                images = json.dumps(sorted(beat.images)) if beat.images is not None else None
                last = host_rows.get(beat.host_id)
                if last is None or beat.now >= last[0]:
                    # (a host's later beat wins; one that said nothing of its images keeps
                    # what an earlier one of the batch said)
                    kept = images if images is not None or last is None else last[1]
                    host_rows[beat.host_id] = (beat.now, kept, beat.host_id)
                for work_id, _ in beat.leases:
                    expires = beat.now + beat.lease_ttl_s
                    if work_id not in expiry_rows or expires > expiry_rows[work_id][0]:
                        expiry_rows[work_id] = (expires, work_id)
            with db.pipeline():
                db.many(Q.HOST_BEAT, [host_rows[h] for h in sorted(host_rows)])
                db.many(Q.SET_LEASE_EXPIRY, [expiry_rows[w] for w in sorted(expiry_rows)])
        return answers

    @staticmethod
    def _judge_beat(
        beat: Beat, known: Mapping[str, bool], held: Mapping[str, Item]
    ) -> Beaten | FleetError:
        """One beat's answer, judged on the rows its batch read (nothing written). `known`:
        the registered hosts among the batch's -> whether each was revoked."""
        host_id, now = beat.host_id, beat.now
        revoked = known.get(host_id)
        if revoked is None:
            return FailedPrecondition(f"host {host_id!r} is not registered")
        if revoked:
            return Unauthenticated(f"host {host_id!r} was revoked (fleet host revoke)")
        items = [(held.get(w), w, t) for w, t in beat.leases]
        stale = [
            w
            for item, w, t in items
            if item is None
            or item.state != LEASED
            or item.lease_owner != host_id
            or item.fencing_token != t
        ]
        if stale:
            return Aborted(
                f"stale lease(s) {', '.join(stale)}: lost or leased again; stop that work "
                "and heartbeat the rest",
                details={"stale-work-ids": ",".join(stale)},
            )
        stop = [
            w for item, w, _ in items if item is not None
            and (item.cancel_requested or item.deadline <= now)
        ]  # fmt: skip
        return [(w, t) for _, w, t in items], stop

    def _expire_lost(
        self, db: Raw, now: float, seen_since: float | None = None
    ) -> tuple[int, list[str]]:
        """Ends the leases past their expiry in the caller's transaction: each item is retried
        or fails by the usual rules; with `seen_since`, only those of hosts that beat since
        then. Returns (how many, the tenant of each item now done)."""
        changed = 0
        ended: list[str] = []
        rows = (
            db.all(Q.EXPIRED_LEASES, (LEASED, now)) if seen_since is None
            else db.all(Q.EXPIRED_LEASES_OF_HOSTS_SEEN, (LEASED, now, seen_since))
        )  # fmt: skip
        for item in [Item(*r) for r in rows]:
            changed += 1
            row = self._rollout(db, item.rollout_id, lock=True)
            owner = item.lease_owner
            db.run(
                Q.END_ATTEMPT,
                (now, Outcome.LEASE_EXPIRED.value, f"lease held by {owner} expired",
                 item.id, item.attempt),
            )  # fmt: skip
            if item.cancel_requested:
                state, not_before = DONE, item.not_before
                self._move(
                    db, row, RolloutState.CANCELLED, now, kind="cancelled", actor="ledger",
                    message=row.error or "cancelled",
                )  # fmt: skip
            elif item.attempt < item.max_attempts and item.deadline > now:
                manifest = self._manifest_raw(db, row.manifest_digest)
                state = QUEUED
                not_before = now + manifest.retry.backoff_s(item.attempt, self._rng)
                self._move(
                    db, row, RolloutState.QUEUED, now, kind="lease_expired", actor="ledger",
                    attempt=item.attempt, message=f"lease on {owner} expired; will retry",
                )  # fmt: skip
            else:
                state, not_before = DONE, item.not_before
                error = (
                    f"lease on {owner} expired on attempt {item.attempt} of "
                    f"{item.max_attempts}"
                    + ("" if item.deadline > now else ", and the deadline has passed")
                )
                self._move(
                    db, row, RolloutState.FAILED, now, kind="failed", actor="ledger",
                    message=error, attempt=item.attempt, error=error,
                )  # fmt: skip
            db.run(Q.RELEASE_LEASE, (state, not_before, owner, item.id))
            if state == DONE:
                ended.append(item.tenant)
        return changed, ended

    def sweep(self, now: float, *, late: bool = True, seen_since: float | None = None) -> int:
        """Expires lost leases (retry or fail) and, with `late`, fails queued work past its
        deadline (which reads every queued item: a server does it less often). With
        `seen_since`, only the leases of hosts that beat since then are judged (a server that
        has just started: see `SweepClock`)."""
        with self._tx() as db:
            changed, ended = self._expire_lost(db, now, seen_since)
            late_items = db.all(Q.LATE_ITEMS, (QUEUED, now)) if late else []
            for item in [Item(*r) for r in late_items]:
                changed += 1
                db.run(Q.SET_ITEM_STATE, (DONE, item.id))
                ended.append(item.tenant)
                row = self._rollout(db, item.rollout_id, lock=True)
                error = "the deadline passed before the rollout could start"
                self._move(
                    db, row, RolloutState.FAILED, now, kind="deadline_exceeded", actor="ledger",
                    message=error, error=error,
                )  # fmt: skip
            self._count_active(db, ended, -1)
        if changed:
            log.info("ledger_swept", changed=changed)
        return changed
