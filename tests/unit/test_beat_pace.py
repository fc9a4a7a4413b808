"""The heartbeat pace (`fleet.core.beat_pace`): a small fleet beats at the base interval; a
large one is asked for at most `max_per_s` beats a second, its leases lasting three of its
intervals at least; a count that wavers near a step keeps the pace."""

from __future__ import annotations

import pytest

from fleet.core.beat_pace import BEATS_PER_LEASE, Pace, pace, settle

BASE = Pace(3.0, 15.0)


@pytest.mark.parametrize("hosts", [0, 1, 299, 300])
def test_a_fleet_within_the_rate_beats_at_the_base_pace(hosts: int) -> None:
    assert pace(hosts, 3.0, 15.0, 100.0) == BASE


def test_a_larger_fleet_beats_less_often_and_holds_leases_longer() -> None:
    paced = pace(1000, 3.0, 15.0, 100.0)
    assert paced == Pace(10.0, 30.0)
    assert 1000 / paced.heartbeat_interval_s == pytest.approx(100.0)  # the rate asked for
    assert paced.lease_ttl_s == BEATS_PER_LEASE * paced.heartbeat_interval_s


def test_the_base_lease_is_a_floor() -> None:
    # 400 hosts: a 4 s interval, whose three beats (12 s) are shorter than the base lease.
    assert pace(400, 3.0, 15.0, 100.0) == Pace(4.0, 15.0)


def test_no_rate_means_the_base_pace_at_any_size() -> None:
    assert pace(1_000_000, 3.0, 15.0, 0.0) == BASE


def test_a_count_wavering_near_a_step_keeps_the_pace() -> None:
    current = pace(1000, 3.0, 15.0, 100.0)
    for hosts in (1001, 995, 1050, 920):
        assert settle(current, pace(hosts, 3.0, 15.0, 100.0)) is current
    grown = pace(1200, 3.0, 15.0, 100.0)
    assert settle(current, grown) == grown
    assert settle(current, BASE) == BASE  # (a fleet that shrank back goes back to the base)
