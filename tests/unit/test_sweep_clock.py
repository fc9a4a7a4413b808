"""The sweeper's clock: wall time, except for one lease after the server itself was paused,
and no judgement at all for the first lease after it started."""

from __future__ import annotations

import math

from fleet.core.sweep_clock import SweepClock

T0 = 1_900_000_000.0


def running(interval_s: float, lease_ttl_s: float, at: float = T0) -> SweepClock:
    """A clock whose server started a lease or more before `at` and swept on time since (its
    next sweep on time is at `at`)."""
    clock = SweepClock(interval_s=interval_s, lease_ttl_s=lease_ttl_s)
    sweeps = math.ceil(lease_ttl_s / interval_s) + 1
    for i in range(sweeps, 0, -1):
        clock.now(at - interval_s * i)
    assert clock.paused_s == 0.0
    return clock


def test_a_started_server_judges_no_lease_for_its_first_lease() -> None:
    """However long it was down (unknown to it), its hosts get a whole lease of its own time
    to beat again: no sweep in that lease may judge; from then on the wall clock does, so a
    lease whose host never came back expires at most one lease after the start."""
    clock = SweepClock(interval_s=0.5, lease_ttl_s=3.0)
    held = [clock.now(T0 + 0.5 * i) for i in range(6)]  # T0 .. T0 + 2.5
    assert held == [None] * 6
    assert clock.paused_s == math.inf
    assert clock.now(T0 + 3.0) == T0 + 3.0
    assert clock.paused_s == 0.0
    walls = [T0 + 3.0 + 0.5 * i for i in range(1, 10)]
    assert [clock.now(w) for w in walls] == walls


def test_a_pause_while_holding_after_start_holds_for_a_lease_from_the_resumption() -> None:
    clock = SweepClock(interval_s=1.0, lease_ttl_s=6.0)
    assert clock.now(T0) is None
    assert clock.now(T0 + 1.0) is None
    assert clock.now(T0 + 12.0) is None  # 10 s late, past the hold's end: held to T0 + 18
    assert clock.late_s == 10.0
    assert [clock.now(T0 + t) for t in (13.0, 15.0, 17.0)] == [None, None, None]
    assert clock.now(T0 + 18.0) == T0 + 18.0
    assert clock.paused_s == 0.0


def test_sweeps_on_time_judge_by_the_wall_clock() -> None:
    clock = running(0.5, 3.0)
    walls = [T0 + 0.5 * i + 0.01 * (i % 3) for i in range(20)]
    assert [clock.now(w) for w in walls] == walls
    assert clock.paused_s == 0.0


def test_a_late_sweep_sets_the_clock_back_by_its_lateness_for_one_lease() -> None:
    """A pause of 25 s with 3 s leases: for the 3 s after it, leases are judged 25 s in the
    past (a host beating before the pause keeps its lease); then by the wall clock again."""
    clock = running(0.5, 3.0)
    assert clock.now(T0) == T0
    resumed = T0 + 0.5 + 25.0
    assert clock.now(resumed) == T0 + 0.5
    assert clock.paused_s == 25.0 and clock.late_s == 25.0
    after = [clock.now(resumed + 0.5 * i) for i in range(1, 6)]  # sweeps on time again
    assert after == [T0 + 0.5 + 0.5 * i for i in range(1, 6)]
    assert clock.late_s == 0.0
    assert clock.now(resumed + 3.0) == resumed + 3.0  # a lease of the server's own time later
    assert clock.paused_s == 0.0


def test_lateness_under_a_third_of_a_lease_is_not_a_pause() -> None:
    clock = running(0.5, 15.0)
    clock.now(T0)
    assert clock.now(T0 + 0.5 + 4.9) == T0 + 5.4
    assert clock.now(T0 + 5.4 + 0.5 + 5.1) == T0 + 5.9  # (5.1 s late: over a third of 15)


def test_a_second_pause_during_the_hold_keeps_the_larger_setback_and_restarts_the_hold() -> None:
    clock = running(1.0, 6.0)
    clock.now(T0)
    assert clock.now(T0 + 11.0) == T0 + 1.0  # 10 s late: held until T0 + 17
    assert clock.now(T0 + 15.0) == T0 + 5.0  # 3 s late (over 2): the 10 s stand, held to 21
    assert clock.late_s == 3.0
    assert clock.now(T0 + 16.0) == T0 + 6.0
    assert clock.now(T0 + 21.0) == T0 + 17.0  # 4 s late as the hold ends: 4 s, held to 27
    assert [clock.now(T0 + t) for t in (22.0, 23.0, 24.0, 25.0, 26.0)] == [
        T0 + t - 4.0 for t in (22.0, 23.0, 24.0, 25.0, 26.0)
    ]
    assert clock.now(T0 + 27.0) == T0 + 27.0
    assert clock.paused_s == 0.0
