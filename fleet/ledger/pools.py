"""Pools in the ledger: their caps at claim time, their gates and adaptive caps, their events.

Every decision about a pool is taken in one transaction that holds the pool's row (FOR UPDATE
on PostgreSQL, the write lock on SQLite), so server replicas governing one ledger take turns:
a pool is paused once, its cap moved once per interval, and each of those is one event.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fleet.core.adaptive import Control, Decision, Observation, decide
from fleet.core.gates import Gates, Signals, judge
from fleet.core.lifecycle import Outcome
from fleet.core.placement import HostCapabilities, HostClass, Pool
from fleet.ledger import queries as Q
from fleet.ledger.raw import LEASED, QUEUED, Raw

RETRIED = (Outcome.TRANSIENT_ERROR.value, Outcome.LEASE_EXPIRED.value)
"""Outcomes whose attempt is retried: what a pool's retry rate counts."""
MAX_EVENTS = 1000


@dataclass(frozen=True)
class PoolView:
    """A pool as an operator sees it."""

    pool: Pool
    members: list[str]
    running: int
    """Leases its hosts hold now."""
    slots: int
    """The slots of its ready hosts (an adaptive cap never exceeds them)."""
    paused_at: float | None
    paused_why: str
    control: Control


@dataclass(frozen=True)
class PoolEvent:
    seq: int
    pool: str
    at: float
    kind: str
    cap: int
    message: str
    figures: dict[str, float]


@dataclass(frozen=True)
class _Row:
    """A pool row: the pool as configured, and its gates' and controller's state."""

    pool: Pool
    paused_at: float | None
    paused_why: str
    control: str


def leases_by_host(db: Raw) -> dict[str, int]:
    """How many leases each host holds now."""
    return {owner: int(n) for owner, n in db.all(Q.LEASES_BY_HOST, (LEASED,))}


def _rows(db: Raw, sql: str = Q.POOLS, params: tuple[Any, ...] = ()) -> list[_Row]:
    """The pools a statement of `Q.POOL_COLS` selects."""
    out = []
    for row in db.all(sql, params):
        name, host_class, labels, cap, gates, adaptive, paused_at, why, control = row
        pool = Pool(
            name=name, host_class=HostClass(host_class), labels=json.loads(labels),
            max_running=int(cap), gates=Gates.model_validate_json(gates or "{}"),
            adaptive=None if not adaptive else json.loads(adaptive),
        )  # fmt: skip
        at = None if paused_at is None else float(paused_at)
        out.append(_Row(pool, at, why, control or "{}"))
    return out


def read(db: Raw, name: str = "") -> list[Pool]:
    """Every pool by name, or the one named (none: no such pool)."""
    rows = _rows(db, Q.POOL, (name,)) if name else _rows(db)
    return [row.pool for row in rows]


def _hosts(db: Raw, host_class: HostClass | None = None) -> list[tuple[HostCapabilities, str]]:
    if host_class is None:
        rows = db.all(Q.HOSTS_AND_STATES)
    else:
        rows = db.all(Q.HOSTS_OF_CLASS_AND_STATES, (host_class.value,))
    return [(HostCapabilities.model_validate_json(caps), state) for caps, state in rows]


def room(db: Raw, host: HostCapabilities) -> int:
    """How many more leases `host` may take under the pools it is in: none while one of them
    is paused, else what their caps leave (locked for the rest of the claim's transaction, so
    replicas claiming at once for one pool's hosts take turns and the cap holds across them)."""
    governed = _rows(db, Q.POOLS_LIMITING_CLASS_FOR_UPDATE, (host.host_class.value,))
    rows = [row for row in governed if row.pool.holds(host)]
    if not rows:
        return 1 << 30
    if any(row.paused_at is not None for row in rows):
        return 0
    mine = [row.pool for row in rows]
    hosts = [h for h, _ in _hosts(db, host.host_class)]
    held = leases_by_host(db)
    return min(
        pool.max_running - sum(int(held.get(h.host_id, 0)) for h in hosts if pool.holds(h))
        for pool in mine
        if pool.max_running > 0
    )


def views(db: Raw) -> list[PoolView]:
    hosts = _hosts(db)
    held = leases_by_host(db)
    out = []
    for row in _rows(db):
        members = [(h, state) for h, state in hosts if row.pool.holds(h)]
        out.append(
            PoolView(
                pool=row.pool, members=[h.host_id for h, _ in members],
                running=sum(int(held.get(h.host_id, 0)) for h, _ in members),
                slots=sum(h.slots for h, state in members if state == "ready"),
                paused_at=row.paused_at, paused_why=row.paused_why,
                control=Control.model_validate_json(row.control),
            )
        )  # fmt: skip
    return out


def write(db: Raw, pool: Pool, now: float) -> None:
    """Makes or changes a pool. An adaptive pool starts (or starts again) at its `start` cap;
    a change of anything else keeps its controller's cap and memory."""
    old = _rows(db, Q.POOL_FOR_UPDATE, (pool.name,))
    adaptive = pool.adaptive.model_dump_json() if pool.adaptive else ""
    cap = pool.max_running
    control = Control(since=now).model_dump_json()
    if pool.adaptive is not None:
        cap = pool.adaptive.start
        if old and old[0].pool.adaptive == pool.adaptive:
            cap, control = old[0].pool.max_running, old[0].control
    gates = pool.gates.model_dump_json() if pool.gates.any() else "{}"
    values = (pool.host_class.value, json.dumps(pool.labels, sort_keys=True), cap, gates,
              adaptive, control, now)  # fmt: skip
    if old:
        db.run(Q.UPDATE_POOL, (*values, pool.name))
        if not pool.gates.any():
            db.run(Q.RESUME_POOL, (pool.name,))
    else:
        db.run(Q.INSERT_POOL, (*values, pool.name))


def signals(
    db: Raw, members: list[str], gates: Gates, now: float, p95_ms: float | None,
    queue_age_ms: float | None,
) -> Signals:  # fmt: skip
    """The pool's signals: the gateway's (as the server last read them) and its hosts' attempts
    ended in the gates' window."""
    attempts = retried = artifacts = 0
    if members:
        for outcome, failed, n in db.all(
            Q.OUTCOMES_ON_HOSTS_SINCE, (now - gates.window_s, *members), n=len(members)
        ):
            attempts += int(n)
            retried += int(n) if outcome in RETRIED else 0
            artifacts += int(n) if failed else 0
    return Signals(p95_ms=p95_ms, queue_age_ms=queue_age_ms, attempts=attempts,
                   retried=retried, artifact_failures=artifacts)  # fmt: skip


def _completed(db: Raw, members: list[str], since: float) -> int:
    if not members:
        return 0
    return int(
        db.value(Q.OUTCOME_ON_HOSTS_SINCE, (since, Outcome.SUCCEEDED.value, *members),
                 n=len(members))
    )  # fmt: skip


def record(
    db: Raw, pool: str, kind: str, cap: int, message: str, figures: dict[str, float], now: float
) -> PoolEvent:
    db.run(
        Q.INSERT_POOL_EVENT, (pool, now, kind, cap, message, json.dumps(figures, sort_keys=True))
    )
    return PoolEvent(0, pool, now, kind, cap, message, figures)


def govern(
    db: Raw, now: float, p95_ms: float | None, queue_age_ms: float | None, saturated: str
) -> list[PoolEvent]:
    """Judges every governed pool once: pauses or resumes it by its gates, and moves an
    adaptive pool's cap once its interval has passed. Returns the events written."""
    events: list[PoolEvent] = []
    governed = [row.pool for row in _rows(db, Q.POOLS_GOVERNED_FOR_UPDATE)]
    if not governed:
        return events
    by_name = {v.pool.name: v for v in views(db)}
    for pool in governed:
        view = by_name[pool.name]
        paused = view.paused_at is not None
        why = ""
        if pool.gates.any():
            seen = signals(db, view.members, pool.gates, now, p95_ms, queue_age_ms)
            verdict, reasons = judge(pool.gates, seen, paused)
            if verdict == "pause":
                why = "; ".join(reasons)
                db.run(Q.PAUSE_POOL, (now, why, pool.name))
                events.append(
                    record(
                        db,
                        pool.name,
                        "paused",
                        pool.max_running,
                        f"new dispatches paused: {why}",
                        seen.figures(),
                        now,
                    )
                )
            elif verdict == "resume":
                db.run(Q.RESUME_POOL, (pool.name,))
                events.append(record(
                    db, pool.name, "resumed", pool.max_running,
                    f"every signal back under its limit after {now - (view.paused_at or now):.1f}s",
                    seen.figures(), now,
                ))  # fmt: skip
                paused = False
        if pool.adaptive is None:
            continue
        control = view.control
        if why:  # a gate just tripped: back off now, then hold while paused
            saturated_now = f"gate tripped: {why}"
        elif paused or now - control.since < pool.adaptive.interval_s:
            continue
        else:
            saturated_now = saturated
        # The interval's first part is the pipeline filling to the new cap: not counted.
        elapsed = max(1e-6, now - control.since) if control.since else pool.adaptive.interval_s
        counted = elapsed * (1 - pool.adaptive.warmup)
        rate = _completed(db, view.members, now - counted) / counted
        queued = db.value(Q.QUEUED_OF_CLASS, (QUEUED, pool.host_class.value))
        seen_obs = Observation(rate=rate, ceiling=view.slots, waiting=int(queued) > 0,
                               running=view.running, saturated=saturated_now)  # fmt: skip
        cap, new_control, decision = decide(pool.adaptive, pool.max_running, control, seen_obs, now)
        db.run(Q.SET_POOL_CAP, (cap, new_control.model_dump_json(), pool.name))
        if decision.kind != "held" or cap != pool.max_running:
            events.append(_decided(db, pool.name, decision, seen_obs, view.running, now))
    return events


def _decided(
    db: Raw, pool: str, decision: Decision, seen: Observation, running: int, now: float
) -> PoolEvent:
    figures = {"rate_per_s": round(seen.rate, 4), "ceiling": seen.ceiling,
               "running": running, "cap": decision.cap}  # fmt: skip
    return record(db, pool, decision.kind, decision.cap, f"cap {decision.cap}: {decision.why}",
                  figures, now)  # fmt: skip


def events(db: Raw, since: float, pool: str = "", limit: int = MAX_EVENTS) -> list[PoolEvent]:
    rows = db.all(Q.POOL_EVENTS_SINCE, (since, not pool, pool, limit))
    return [
        PoolEvent(int(seq), name, float(at), kind, int(cap), message, json.loads(figures))
        for seq, name, at, kind, cap, message, figures in reversed(rows)
    ]
