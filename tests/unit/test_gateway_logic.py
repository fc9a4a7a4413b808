"""The gateway's pure decisions: the breaker's transitions and memory admission."""

from __future__ import annotations

import pytest

from gateway.admission import MemoryModel, admissible
from gateway.breaker import BreakerState, CircuitBreaker


def test_breaker_opens_after_consecutive_faults_only() -> None:
    """A success in between resets the count; the threshold-th fault in a row opens it."""
    b = CircuitBreaker(failure_threshold=3, open_s=1.0)
    b.failure(0.0, "x")
    b.failure(0.1, "x")
    b.success(0.2)
    b.failure(0.3, "x")
    b.failure(0.4, "x")
    assert b.state == BreakerState.CLOSED and b.use_primary(0.5)
    b.failure(0.5, "oom")
    assert b.state == BreakerState.OPEN and not b.use_primary(0.6)


def test_breaker_probes_once_half_open_then_closes_or_reopens() -> None:
    b = CircuitBreaker(failure_threshold=1, open_s=1.0)
    b.failure(0.0, "device error")
    assert not b.use_primary(0.9)
    assert b.use_primary(1.0) and b.state == BreakerState.HALF_OPEN  # the probe
    assert not b.use_primary(1.0)  # one probe at a time
    b.failure(1.1, "still broken")
    assert b.state == BreakerState.OPEN and not b.use_primary(1.5)
    assert b.use_primary(2.2)
    b.success(2.3)
    assert b.state == BreakerState.CLOSED
    assert [(t.before, t.after) for t in b.history] == [
        (BreakerState.CLOSED, BreakerState.OPEN),
        (BreakerState.OPEN, BreakerState.HALF_OPEN),
        (BreakerState.HALF_OPEN, BreakerState.OPEN),
        (BreakerState.OPEN, BreakerState.HALF_OPEN),
        (BreakerState.HALF_OPEN, BreakerState.CLOSED),
    ]


def test_breaker_refuses_illegal_moves() -> None:
    b = CircuitBreaker()
    with pytest.raises(RuntimeError, match="cannot go from closed to half_open"):
        b._move(BreakerState.HALF_OPEN, 0.0, "no")


MODEL = MemoryModel(weights_bytes=1000, activation_bytes_per_sample=100, headroom_bytes=500)


@pytest.mark.parametrize(
    ("capacity", "in_use", "wanted", "observed", "admit"),
    [
        (10_000, 0, 50, None, 50),  # fits whole
        (5_000, 0, 64, None, 35),  # shrunk to what is free: (5000-1000-500)//100
        (5_000, 2_000, 64, None, 15),  # other batches hold memory
        (10_000, 0, 64, 2_500, 20),  # the driver says less is free than predicted
        (1_400, 0, 8, None, 0),  # not even one sample
    ],
)
def test_admission_shrinks_batches_to_what_fits(
    capacity: int, in_use: int, wanted: int, observed: int | None, admit: int
) -> None:
    decision = admissible(MODEL, capacity, in_use, wanted, observed)
    assert decision.admit == admit
    if admit:
        used = MODEL.weights_bytes + MODEL.headroom_bytes + in_use + MODEL.batch_bytes(admit)
        assert used <= capacity
    else:
        assert "no room" in decision.reason
