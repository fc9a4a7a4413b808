"""Adaptive concurrency: a pool's cap found by the throughput it gives.

Every `interval_s` the server looks at the completed trajectories per second the pool gave at
its current cap (over the interval's last part: its first `warmup` share is the pipeline
filling to the new cap). A raise from cap c to c' pays when throughput rose by at least `rise`
(10%), or by `payoff` of c'/c - 1 (what it would have risen were nothing saturated) where that
is less (large caps, small steps): while raises pay, the cap goes up by `step`. A raise that
does not pay is measured once more (one interval is noisy) and judged on the two together;
when it still does not, throughput has stopped rising and the cap backs off multiplicatively
(by `backoff`), but not below the last cap whose raise paid: the smallest cap known to give the
best throughput, where the gateway's queue (and so its latency) is shortest.
A settled cap is probed one step up every `probe_every` intervals, in case the pipeline got
faster. A tripped gate or a saturated gateway backs off at once. The cap starts at `start` and
never exceeds the slots of the pool's hosts. While no work waits for the pool the cap is not
binding, and while the pool runs more than its cap (after a back-off) its throughput is not the
cap's: nothing is learned and nothing moves.
"""

from __future__ import annotations

import enum
import math

from pydantic import BaseModel, ConfigDict, Field


class Adaptive(BaseModel):
    """How a pool's cap is sought."""

    model_config = ConfigDict(frozen=True)

    start: int = Field(default=2, ge=1)
    step: int = Field(default=2, ge=1)
    backoff: float = Field(default=0.7, gt=0, lt=1)
    interval_s: float = Field(default=10.0, gt=0)
    """How long the pool runs at a cap before its throughput there is judged."""
    warmup: float = Field(default=0.4, ge=0, lt=1)
    """The share of an interval not counted: the pipeline filling to its new cap."""
    rise: float = Field(default=0.1, ge=0)
    """The throughput gain that makes a raise pay."""
    payoff: float = Field(default=0.5, gt=0, le=1)
    """...or this share of the proportional gain (c'/c - 1), where that is less."""
    probe_every: int = Field(default=6, ge=1)
    """A settled cap tries one step up after this many intervals."""


class Phase(enum.StrEnum):
    RAISING = "raising"
    SETTLED = "settled"


class Control(BaseModel):
    """What the controller remembers between decisions (kept in the ledger, with the pool)."""

    model_config = ConfigDict(frozen=True)

    phase: Phase = Phase.RAISING
    last_rate: float | None = None
    """Throughput at the cap before this one (None: none measured since the last change)."""
    last_cap: int = 0
    """That cap."""
    doubt: float | None = None
    """The throughput of this cap's first interval, when its raise did not pay (it is measured
    once more before the cap backs off)."""
    best_cap: int = 0
    """The last cap whose raise paid (0: none yet)."""
    held: int = 0
    """Intervals spent settled."""
    since: float = 0.0
    """When the current cap took effect (its throughput is counted from then)."""


class Observation(BaseModel):
    model_config = ConfigDict(frozen=True)

    rate: float
    """Completed trajectories per second on the pool's hosts since the cap took effect."""
    ceiling: int
    """The slots of the pool's ready hosts."""
    waiting: bool
    """Work for the pool's class waited (the cap was binding)."""
    running: int = 0
    """Leases the pool's hosts hold now."""
    saturated: str = ""
    """Why the pipeline is past its limit (a tripped gate, the gateway's backpressure), or ""."""


class Decision(BaseModel):
    model_config = ConfigDict(frozen=True)

    kind: str
    """raised, lowered, settled, held."""
    cap: int
    why: str


def decide(
    settings: Adaptive, cap: int, control: Control, seen: Observation, now: float
) -> tuple[int, Control, Decision]:
    """The next cap, what to remember, and the decision as an event says it."""
    ceiling = max(1, seen.ceiling)
    rate = f"{seen.rate:.2f}/s at cap {cap}"
    if seen.saturated:
        new = max(1, min(ceiling, math.floor(cap * settings.backoff)))
        # What paid before may not pay now: the search starts again from the lower cap.
        state = Control(phase=Phase.SETTLED, best_cap=new, since=now)
        return new, state, Decision(kind="lowered", cap=new, why=f"{seen.saturated}; {rate}")
    if cap > ceiling:
        state = control.model_copy(update={"since": now, "last_rate": None})
        return (
            ceiling,
            state,
            Decision(
                kind="lowered", cap=ceiling, why=f"the pool's hosts have {ceiling} slots; {rate}"
            ),
        )
    if not seen.waiting:
        state = control.model_copy(update={"since": now})
        return cap, state, Decision(kind="held", cap=cap, why=f"no work waited; {rate}")
    if seen.running > cap:
        state = control.model_copy(update={"since": now})
        why = f"{seen.running} running, over the cap: not yet the cap's throughput"
        return cap, state, Decision(kind="held", cap=cap, why=why)
    if control.phase == Phase.SETTLED:
        if control.held + 1 < settings.probe_every or cap >= ceiling:
            state = control.model_copy(update={"held": control.held + 1, "since": now})
            return cap, state, Decision(kind="held", cap=cap, why=f"settled; {rate}")
        new = min(ceiling, cap + settings.step)
        state = Control(
            phase=Phase.RAISING, last_rate=seen.rate, last_cap=cap, best_cap=cap, since=now
        )
        return new, state, Decision(kind="raised", cap=new, why=f"probing; {rate}")
    last = control.last_rate
    gain = cap / control.last_cap - 1 if control.last_cap else 1.0
    needed = min(settings.rise, settings.payoff * gain)
    measured = seen.rate if control.doubt is None else (seen.rate + control.doubt) / 2
    if last is None or (measured >= last * (1 + needed) and measured > 0):
        said = "first measure" if last is None else f"{measured:.2f}/s, up from {last:.2f}/s"
        best = control.best_cap if last is None else cap
        if cap >= ceiling:
            state = Control(phase=Phase.SETTLED, best_cap=cap, since=now)
            why = f"{rate} ({said}); at the hosts' {ceiling} slots"
            return cap, state, Decision(kind="settled", cap=cap, why=why)
        new = min(ceiling, cap + settings.step)
        state = Control(
            phase=Phase.RAISING, last_rate=seen.rate, last_cap=cap, best_cap=best, since=now
        )
        return new, state, Decision(kind="raised", cap=new, why=f"{rate} ({said})")
    if control.doubt is None:
        state = control.model_copy(update={"doubt": seen.rate, "since": now})
        why = f"{rate}, not {needed:.0%} over {last:.2f}/s yet: measured once more"
        return cap, state, Decision(kind="held", cap=cap, why=why)
    floor = control.best_cap or 1
    new = min(cap, max(floor, math.floor(cap * settings.backoff)))
    state = Control(phase=Phase.SETTLED, best_cap=new, since=now)
    why = (
        f"throughput stopped rising: {measured:.2f}/s at cap {cap} over two intervals, "
        f"{last:.2f}/s at cap {control.last_cap}"
    )
    return new, state, Decision(kind="settled" if new == cap else "lowered", cap=new, why=why)
