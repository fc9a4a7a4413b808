"""What the console's operator pages read: pools (caps, gates, the signals of their last
judgement, pauses and the adaptive controller's decisions), the cost report, and sessions.

Each function runs on one of the server's reader threads and returns plain values for a
template. Pools and cost span every tenant: their pages are an admin's; sessions are scoped to
the viewer's tenant like rollouts."""

from __future__ import annotations

import time
from dataclasses import dataclass

from fleet.console import charts
from fleet.core.errors import InvalidArgument
from fleet.core.report import Report
from fleet.core.rollout import Rollout
from fleet.ledger.parks import session_state
from fleet.ledger.pools import PoolEvent, PoolView
from fleet.ledger.report import read_report
from fleet.ledger.store import Ledger

SESSION_LABEL = "fleet.session"
"""The label every session's rollout carries (as the session service sets it)."""
WINDOWS_H = (1, 6, 24, 168, 720)
"""The windows the pools and cost pages offer, in hours."""
CAP_KINDS = frozenset({"raised", "lowered", "settled"})
PAUSE_KINDS = frozenset({"paused", "resumed"})


def window_hours(text: str, default: int = 24) -> int:
    """The `window` query value in hours: one of WINDOWS_H; anything else is refused by name."""
    if not text:
        return default
    if not text.isdigit() or int(text) not in WINDOWS_H:
        raise InvalidArgument(
            f"window {text[:20]!r}: one of {', '.join(str(h) for h in WINDOWS_H)} (hours)"
        )
    return int(text)


@dataclass(frozen=True)
class PoolPage:
    view: PoolView
    gates: list[tuple[str, float]]
    """(gate, limit) of each gate that is on."""
    last: PoolEvent | None
    """The latest event: its figures are the signals its gates were last judged on."""
    events: list[PoolEvent]
    """Its pauses and resumes in the window, newest first."""
    chart: charts.Chart
    """Its cap over the window, as its controller moved it, with its pauses marked."""


def _gates(view: PoolView) -> list[tuple[str, float]]:
    g = view.pool.gates
    limits = (
        ("p95_ms", g.p95_ms),
        ("queue_age_ms", g.queue_age_ms),
        ("retry_rate", g.retry_rate),
        ("artifact_failure_rate", g.artifact_failure_rate),
    )
    return [(name, limit) for name, limit in limits if limit]


def pools(ledger: Ledger, hours: int) -> list[PoolPage]:
    """Every pool, with its events over the last `hours`."""
    now = time.time()
    since = now - hours * 3600.0
    events = ledger.pool_events(since)
    out = []
    for view in ledger.pools():
        mine = [e for e in events if e.pool == view.pool.name]
        caps = [(e.at, float(e.cap)) for e in mine if e.kind in CAP_KINDS]
        if view.pool.max_running and (not caps or caps[0][0] > since):
            first = caps[0][1] if caps else float(view.pool.max_running)
            caps.insert(0, (since, first))  # (the cap held before the window's first change)
        marks = [(e.at, f"{e.kind}: {e.message}") for e in mine if e.kind in PAUSE_KINDS]
        out.append(PoolPage(
            view, _gates(view), mine[-1] if mine else None,
            [e for e in reversed(mine) if e.kind in PAUSE_KINDS],
            charts.step_line(caps, since, now, marks),
        ))  # fmt: skip
    return out


@dataclass(frozen=True)
class CostPage:
    report: Report
    chart: charts.Chart
    """Cost per slice of the window."""


def cost(ledger: Ledger, hours: int, by_label: str) -> CostPage:
    """The cost report of the rollouts that ended in the last `hours`, by pool or label."""
    if len(by_label) > 63 or any(c.isspace() for c in by_label):
        raise InvalidArgument(f"by label {by_label[:40]!r}: a label key, or empty for by pool")
    now = time.time()
    report = read_report(ledger, hours * 3600.0, now, by_label)
    slices = [(f"{minutes:.0f} min: {n} done, {spent:.4f}", spent)
              for minutes, n, spent in report.slices]  # fmt: skip
    return CostPage(report, charts.bars(slices, report.since, report.until))


@dataclass(frozen=True)
class SessionRow:
    """A session as the list shows it: the rollout that opened it (its id is the session's),
    and its state now (a parked or resumed session is held by later rollouts)."""

    first: Rollout
    state: str
    """OPEN, PARKED, CLOSED or FAILED, as SessionService reports it."""
    host_id: str


def sessions(ledger: Ledger, tenant: str | None, limit: int = 200) -> list[SessionRow]:
    """The newest sessions of `tenant` (None: every tenant's), each with its state now."""
    found, _ = ledger.list_rollouts(limit, "", {SESSION_LABEL: "1"}, tenant=tenant)
    rows = []
    for first in found:
        park = ledger.session_park(first.id)
        now = first if park is None or park.rollout_id == first.id else ledger.get(park.rollout_id)
        rows.append(SessionRow(first, session_state(now, park), now.host_id or ""))
    return rows
