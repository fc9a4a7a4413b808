"""What completed trajectories cost: each attempt holds one slot of its host for its wall time,
priced at the host class's hourly price shared among the host's slots, plus the gateway's device
seconds its requests took, at the gpu price (the device is the GPU host's, and a batch's time is
shared among its requests). Failed attempts and failed rollouts are paid for too; only succeeded
rollouts count as completed trajectories."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from fleet.core.errors import InvalidArgument

_PRICE = re.compile(r"(cpu|gpu)=(\d+(?:\.\d+)?)(?:/h)?")


def parse_prices(text: str) -> dict[str, float]:
    """`cpu=0.04/h,gpu=2.10/h` -> {"cpu": 0.04, "gpu": 2.1} (per host-hour)."""
    prices: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        found = _PRICE.fullmatch(part)
        if found is None:
            raise InvalidArgument(f"price {part!r}: expected CLASS=AMOUNT/h (cpu or gpu)")
        prices[found[1]] = float(found[2])
    return prices


@dataclass(frozen=True)
class AttemptCost:
    """One attempt of a rollout that ended in the report's window."""

    rollout_id: str
    succeeded: bool
    """Whether its rollout succeeded (a completed trajectory)."""
    final: bool
    """Whether this is its rollout's last attempt."""
    group: str
    host_class: str
    host_slots: int
    wall_s: float
    cpu_s: float
    peak_memory_mib: float
    device_s: float = 0.0
    ended_at: float = 0.0


@dataclass
class Group:
    """Totals for one pool (or label value)."""

    name: str
    rollouts: set[str] = field(default_factory=set)
    completed: int = 0
    attempts: int = 0
    cost: float = 0.0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    device_s: float = 0.0
    peak_memory_mib: float = 0.0

    @property
    def retries(self) -> int:
        return self.attempts - len(self.rollouts)

    @property
    def cost_per_completed(self) -> float | None:
        return self.cost / self.completed if self.completed else None

    @property
    def cpu_s_per_completed(self) -> float | None:
        return self.cpu_s / self.completed if self.completed else None

    @property
    def device_s_per_completed(self) -> float | None:
        return self.device_s / self.completed if self.completed else None


def attempt_cost(a: AttemptCost, prices: Mapping[str, float]) -> float:
    slot = a.wall_s / 3600 * prices.get(a.host_class, 0.0) / max(1, a.host_slots)
    return slot + a.device_s / 3600 * prices.get("gpu", 0.0)


def tally(attempts: Iterable[AttemptCost], prices: Mapping[str, float]) -> list[Group]:
    """Per group (the pool of the attempt's host, or a label's value), sorted by name."""
    groups: dict[str, Group] = {}
    for a in attempts:
        g = groups.setdefault(a.group, Group(a.group))
        g.rollouts.add(a.rollout_id)
        g.attempts += 1
        g.cost += attempt_cost(a, prices)
        g.cpu_s += a.cpu_s
        g.wall_s += a.wall_s
        g.device_s += a.device_s
        g.peak_memory_mib = max(g.peak_memory_mib, a.peak_memory_mib)
        if a.final and a.succeeded:
            g.completed += 1
    return [groups[name] for name in sorted(groups)]


def timeline(
    attempts: Iterable[AttemptCost], prices: Mapping[str, float], since: float, now: float,
    buckets: int = 30,
) -> list[tuple[float, int, float]]:  # fmt: skip
    """(minutes since `since` at the bucket's end, trajectories completed in it, what its
    ended attempts cost), over `buckets` equal slices of the window."""
    width = max(1e-9, (now - since) / buckets)
    done = [0] * buckets
    cost = [0.0] * buckets
    for a in attempts:
        i = min(buckets - 1, max(0, int((a.ended_at - since) / width)))
        cost[i] += attempt_cost(a, prices)
        if a.final and a.succeeded:
            done[i] += 1
    return [((i + 1) * width / 60, done[i], cost[i]) for i in range(buckets)]


def pauses(
    events: Iterable[tuple[str, float, str]], since: float, now: float
) -> dict[str, tuple[int, float]]:
    """Per pool: (times its gates paused it, seconds it spent paused) within the window, from
    its (pool, at, kind) events in order (a pause still in force counts up to `now`)."""
    out: dict[str, tuple[int, float]] = {}
    started: dict[str, float] = {}
    for pool, at, kind in events:
        count, seconds = out.get(pool, (0, 0.0))
        if kind == "paused":
            started[pool] = at
            out[pool] = (count + 1, seconds)
        elif kind == "resumed":
            begun = started.pop(pool, since)
            out[pool] = (count, seconds + at - max(begun, since))
    for pool, begun in started.items():
        count, seconds = out[pool]
        out[pool] = (count, seconds + now - max(begun, since))
    return out
