"""The pure rules behind pools: gates with their recovery margin, the adaptive controller."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from fleet.core.adaptive import Adaptive, Control, Observation, Phase, decide
from fleet.core.gates import Gates, Signals, breaches, judge


def test_gates_judge_each_signal_with_its_number_and_limit() -> None:
    gates = Gates(p95_ms=500, retry_rate=0.1, min_attempts=10)
    assert judge(gates, Signals(p95_ms=None, attempts=0), paused=False) == ("stay", [])
    verdict, why = judge(gates, Signals(p95_ms=501.0, attempts=20, retried=3), paused=False)
    assert verdict == "pause"
    assert why == [
        "gateway p95 latency 501.0 ms > 500 ms",
        "retry rate 15.0% (3 of 20 attempts in 60s) > 10.0%",
    ]
    # Too few attempts to be a rate.
    assert breaches(gates, Signals(attempts=9, retried=9)) == []
    # Paused: it resumes only under 80% of every limit.
    assert judge(gates, Signals(p95_ms=450.0), paused=True)[0] == "stay"
    assert judge(gates, Signals(p95_ms=399.0), paused=True) == ("resume", [])
    # A pool without gates is never paused, whatever its signals say.
    worst = Signals(p95_ms=1e9, queue_age_ms=1e9, attempts=100, retried=100, artifact_failures=100)
    assert judge(Gates(), worst, paused=False) == ("stay", [])
    assert gates.describe() == "p95<=500ms retries<=10% over 60s"


def test_gates_refuse_impossible_limits() -> None:
    with pytest.raises(ValidationError, match="less than or equal to 1"):
        Gates(retry_rate=1.5)
    with pytest.raises(ValidationError, match="over a day"):
        Gates(window_s=90_000)
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        Gates(p95_ms=-1)


def test_the_controller_climbs_while_it_pays_and_returns_to_the_last_cap_that_did() -> None:
    settings = Adaptive(start=2, step=2, probe_every=2)
    cap, control = 2, Control()

    def run(rate: float) -> str:
        nonlocal cap, control
        cap, control, decision = decide(
            settings, cap, control, Observation(rate=rate, ceiling=20, waiting=True), 0.0
        )
        return decision.kind

    # 6 -> 8 did not pay (3.05 is not 10% over 3.0): measured once more, then backed off to 6.
    assert [run(r) for r in (1.0, 2.0, 3.0, 3.05, 3.0)] == [
        "raised", "raised", "raised", "held", "lowered"
    ]  # fmt: skip
    assert (cap, control.phase) == (6, Phase.SETTLED)
    assert [run(3.0), run(3.0)] == ["held", "raised"]  # a probe after `probe_every`
    assert cap == 8
    assert run(4.0) == "raised" and cap == 10  # the pipeline got faster: it climbs on
    # One bad interval is not the end of a climb: the second says it paid after all.
    assert [run(3.9), run(5.5)] == ["held", "raised"] and cap == 12


def test_the_controller_backs_off_when_saturated_and_holds_when_no_work_waits() -> None:
    settings = Adaptive(backoff=0.5)
    cap, control, decision = decide(
        settings, 10, Control(), Observation(rate=5, ceiling=20, waiting=True,
                                             saturated="gate tripped"), 1.0
    )  # fmt: skip
    assert (cap, decision.kind, control.best_cap) == (5, "lowered", 5)
    assert "gate tripped" in decision.why
    cap, _, decision = decide(settings, 5, control, Observation(rate=0, ceiling=20,
                                                                waiting=False), 2.0)  # fmt: skip
    assert (cap, decision.kind) == (5, "held")
    # After a back-off the pool still runs more than its cap: its throughput is not the cap's.
    cap, _, decision = decide(settings, 5, control, Observation(rate=9, ceiling=20, waiting=True,
                                                                running=9), 3.0)  # fmt: skip
    assert (cap, decision.kind) == (5, "held") and "9 running, over the cap" in decision.why


@given(
    cap=st.integers(1, 500), ceiling=st.integers(0, 400), rate=st.floats(0, 1e4),
    last=st.none() | st.floats(0, 1e4), best=st.integers(0, 500),
    phase=st.sampled_from(list(Phase)), held=st.integers(0, 10), waiting=st.booleans(),
    saturated=st.sampled_from(["", "gateway saturated"]),
)  # fmt: skip
def test_the_cap_stays_between_one_and_the_hosts_slots(
    cap: int, ceiling: int, rate: float, last: float | None, best: int, phase: Phase,
    held: int, waiting: bool, saturated: str,
) -> None:  # fmt: skip
    control = Control(phase=phase, last_rate=last, best_cap=min(best, cap), held=held)
    seen = Observation(rate=rate, ceiling=ceiling, waiting=waiting, saturated=saturated)
    new, _, decision = decide(Adaptive(), cap, control, seen, 0.0)
    assert 1 <= new <= max(1, ceiling)
    assert decision.cap == new
    if saturated:
        assert new <= cap
