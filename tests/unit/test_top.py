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


def test_pools_show_their_cap_state_and_latest_events_with_their_numbers() -> None:
    pools = {
        "pools": [{"name": "cloud", "class": "cpu", "cap": 6, "running": 5, "slots": 32,
                   "adaptive": True, "gates": "p95<=500ms", "paused_at": 1.0,
                   "paused_why": "gateway p95 latency 812.5 ms > 500 ms"}],
        "events": [{"at": 1.0, "pool": "cloud", "kind": "paused", "cap": 6,
                    "message": "new dispatches paused: gateway p95 latency 812.5 ms > 500 ms",
                    "figures": {"p95_ms": 812.5, "attempts": 3}}],
    }  # fmt: skip
    screen = render("unreachable", parse(GATEWAY), pools)
    assert "pool cloud      cpu     5/6 of 32 slots (adaptive)   gates p95<=500ms   PAUSED: " \
        "gateway p95 latency 812.5 ms > 500 ms" in screen  # fmt: skip
    assert "cloud paused: new dispatches paused" in screen
    assert "[attempts=3 p95_ms=812.5]" in screen


def test_label_values_come_back_unescaped() -> None:
    text = '# TYPE fleet_pool_paused gauge\nfleet_pool_paused{pool="we\\"ird\\\\name"} 1.0\n'
    assert parse(text) == {'fleet_pool_paused{pool="we"ird\\name"}': 1.0}
