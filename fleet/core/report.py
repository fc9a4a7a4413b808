"""`fleet report`'s figures, made once from what the ledger holds, whoever asks for them: the
command on the server's machine (`--db`) or AdminService's Report for an operator elsewhere.

Both print and chart the same `Report`, so a remote report reads as a local one; only its
figures travel, never the attempts they are summed from (a busy hour has many thousands).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from fleet.core.cost import AttemptCost, Group, pauses, tally, timeline

PAUSES_BEFORE_S = 86400.0
"""Pool events this long before the window are read too: a pause begun before it counts in it."""


@dataclass
class Totals(Group):
    """A group's totals as they arrive from a server: how many rollouts, not which."""

    rollout_count: int = 0

    @property
    def retries(self) -> int:
        return self.attempts - self.rollout_count


class PoolMark(Protocol):
    """A pool event as the report uses it: which pool, when, what it did, its cap after."""

    @property
    def pool(self) -> str: ...
    @property
    def at(self) -> float: ...
    @property
    def kind(self) -> str: ...
    @property
    def cap(self) -> int: ...


@dataclass(frozen=True)
class Report:
    """What completed trajectories cost over [since, until], by pool or by `by_label`."""

    since: float
    until: float
    by_label: str
    prices: Mapping[str, float]
    groups: list[Group]
    slices: list[tuple[float, int, float]]
    """(minutes from `since` to the slice's end, trajectories completed, cost), in order."""
    paused: dict[str, tuple[int, float]]
    """Per pool: (times its gates paused it, seconds paused) within the window."""
    caps: list[tuple[str, float, int]] = field(default_factory=list)
    """(pool, at, cap) of the window's events that set a cap, in order (resumes set none)."""

    @property
    def by(self) -> str:
        return f"label {self.by_label}" if self.by_label else "pool"


def build(
    attempts: Iterable[AttemptCost], prices: Mapping[str, float], events: Iterable[PoolMark],
    since: float, until: float, by_label: str = "",
) -> Report:  # fmt: skip
    """The report of `attempts` (those ended in the window) and the pools' events (from
    `PAUSES_BEFORE_S` before it), priced at `prices`."""
    attempts, events = list(attempts), list(events)
    return Report(
        since=since, until=until, by_label=by_label, prices=dict(prices),
        groups=list(tally(attempts, prices)),
        slices=timeline(attempts, prices, since, until),
        paused=pauses([(e.pool, e.at, e.kind) for e in events], since, until),
        caps=[(e.pool, e.at, e.cap) for e in events if e.at >= since and e.kind != "resumed"],
    )  # fmt: skip
