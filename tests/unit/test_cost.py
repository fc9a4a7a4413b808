"""Cost per completed trajectory: slot-hours at the host class's price, failures paid for."""

from __future__ import annotations

import pytest

from fleet.core.cost import AttemptCost, parse_prices, pauses, tally, timeline
from fleet.core.errors import InvalidArgument


def test_prices_parse_and_malformed_ones_are_refused() -> None:
    assert parse_prices("cpu=0.04/h,gpu=2.10/h") == {"cpu": 0.04, "gpu": 2.1}
    assert parse_prices("") == {}
    with pytest.raises(InvalidArgument, match="CLASS=AMOUNT"):
        parse_prices("tpu=3/h")


def test_failed_attempts_are_paid_for_and_only_successes_count() -> None:
    def a(rid: str, ok: bool, final: bool, wall: float, group: str = "cloud") -> AttemptCost:
        return AttemptCost(rid, ok, final, group, "cpu", 4, wall, wall / 2, 100.0)

    rows = [
        a("r1", True, False, 3600),  # a first attempt that failed, its rollout succeeded later
        a("r1", True, True, 3600),
        a("r2", False, True, 3600),  # a rollout that failed: paid for, not completed
        a("r3", True, True, 1800, "local"),
    ]
    cloud, local = tally(rows, {"cpu": 0.04})
    assert (cloud.name, cloud.completed, cloud.attempts, cloud.retries) == ("cloud", 1, 3, 1)
    assert cloud.cost == pytest.approx(3 * 0.04 / 4)  # three slot-hours of a 4-slot host
    assert cloud.cost_per_completed == pytest.approx(0.03)
    assert cloud.cpu_s_per_completed == pytest.approx(3 * 1800)
    assert (local.completed, local.cost) == (1, pytest.approx(0.005))


def test_device_seconds_are_paid_at_the_gpu_price() -> None:
    row = AttemptCost("r1", True, True, "cloud", "cpu", 2, 3600, 10.0, 50.0, device_s=1800)
    [g] = tally([row], {"cpu": 0.04, "gpu": 2.0})
    assert g.cost == pytest.approx(0.04 / 2 + 1.0)
    assert g.device_s_per_completed == 1800


def test_the_timeline_and_the_pauses_of_a_window() -> None:
    rows = [
        AttemptCost(f"r{i}", True, True, "cloud", "cpu", 1, 60, 1, 1, ended_at=100 + 60 * i)
        for i in range(4)
    ]
    slices = timeline(rows, {"cpu": 3.6}, since=100, now=340, buckets=4)
    assert [(t, n) for t, n, _ in slices] == [(1.0, 1), (2.0, 1), (3.0, 1), (4.0, 1)]
    assert slices[0][2] == pytest.approx(60 / 3600 * 3.6)
    events = [("cloud", 50, "paused"), ("cloud", 130, "resumed"), ("cloud", 200, "paused"),
              ("edge", 300, "raised")]  # fmt: skip
    # 30 s of the first pause fall in the window, the second is still in force at 340.
    assert pauses(events, since=100, now=340) == {"cloud": (2, 170.0)}
