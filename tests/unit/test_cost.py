"""Cost per completed trajectory: slot-hours at the host class's price, failures paid for."""

from __future__ import annotations

import pytest

from fleet.core.cost import AttemptCost, parse_prices, tally
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
