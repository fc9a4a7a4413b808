"""`fleet top`'s screen from the server's and the gateway's Prometheus text."""

from __future__ import annotations

from fleet.cli.top import parse, render

GATEWAY = "fleet_gateway_queue_depth 3\nfleet_gateway_device_busy_fraction 0.25\n"


def test_the_gpus_utilization_is_shown_only_where_the_gateway_reports_it() -> None:
    without = render("unreachable", parse(GATEWAY))
    assert "queue 3 " in without and "busy 0.250   failovers 0" in without
    assert "GPU util" not in without
    with_gpu = render("unreachable", parse(GATEWAY + "fleet_gateway_gpu_utilization 0.63\n"))
    assert "busy 0.250 (GPU util 63%)   failovers 0" in with_gpu
