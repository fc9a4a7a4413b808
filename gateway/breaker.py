"""The circuit breaker in front of the primary device.

CLOSED: batches go to the primary. `failure_threshold` consecutive faults (allocation failure,
device error, failed health probe of an idle primary: `Batcher._probe`) open it. OPEN: batches
go to the CPU replica; after `open_s` the breaker lets one probe batch through (HALF_OPEN). A
probe that succeeds closes it; one that fails opens it again for another `open_s`.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


ALLOWED: dict[BreakerState, frozenset[BreakerState]] = {
    BreakerState.CLOSED: frozenset({BreakerState.OPEN}),
    BreakerState.OPEN: frozenset({BreakerState.HALF_OPEN}),
    BreakerState.HALF_OPEN: frozenset({BreakerState.CLOSED, BreakerState.OPEN}),
}


HISTORY_KEPT = 256


@dataclass
class Transition:
    at: float
    before: BreakerState
    after: BreakerState
    reason: str


@dataclass
class CircuitBreaker:
    failure_threshold: int = 3
    """Consecutive primary faults that open the breaker."""
    open_s: float = 2.0
    """How long it stays open before a half-open probe."""
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    probing: bool = False
    history: collections.deque[Transition] = field(
        default_factory=lambda: collections.deque(maxlen=HISTORY_KEPT)
    )
    """The latest transitions, oldest first (a flapping device must not grow it forever)."""

    def _move(self, to: BreakerState, now: float, reason: str) -> None:
        if to not in ALLOWED[self.state]:
            raise RuntimeError(f"breaker cannot go from {self.state} to {to}")
        self.history.append(Transition(now, self.state, to, reason))
        self.state = to

    def use_primary(self, now: float) -> bool:
        """Whether the next batch goes to the primary (a half-open probe counts as one)."""
        if self.state == BreakerState.OPEN and now - self.opened_at >= self.open_s:
            self._move(BreakerState.HALF_OPEN, now, f"open for {self.open_s:g}s: probing")
        if self.state == BreakerState.CLOSED:
            return True
        if self.state == BreakerState.HALF_OPEN and not self.probing:
            self.probing = True
            return True
        return False

    def success(self, now: float) -> None:
        self.failures = 0
        if self.state == BreakerState.HALF_OPEN:
            self.probing = False
            self._move(BreakerState.CLOSED, now, "probe succeeded")

    def failure(self, now: float, reason: str) -> None:
        self.failures += 1
        if self.state == BreakerState.HALF_OPEN:
            self.probing = False
            self.opened_at = now
            self._move(BreakerState.OPEN, now, f"probe failed: {reason}")
        elif self.state == BreakerState.CLOSED and self.failures >= self.failure_threshold:
            self.opened_at = now
            many = f"{self.failures} faults in a row" if self.failures > 1 else "a fault"
            self._move(BreakerState.OPEN, now, f"{many}: {reason}")
