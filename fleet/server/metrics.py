"""The server's metrics in Prometheus text format (GET /metrics on `--metrics-listen`).

Rollouts by state, completed trajectories per second (over the last minute), retries, CPU
seconds per completed trajectory, and what the router knows of the gateway: its queue depth and
whether rollouts that call it are being held (backpressure). The gateway serves its own (queue
age, batch-size histogram, device busy fraction and seconds, failovers); `fleet top` reads both.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fleet.httpd import connection_handler, reply
from fleet.ledger.pools import PoolView
from fleet.prom import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    counter,
    exposition,
    gauge,
)
from fleet.server.core import Core


def _pool_families(core: Core, pools: list[PoolView]) -> list[Metric]:
    """Each pool's cap, what it runs, whether its gates pause it, and the events this server
    wrote for it (pause, resume, cap moved)."""
    if not pools and not core.pool_events:
        return []
    cap = GaugeMetricFamily(
        "fleet_pool_cap", "Leases a pool's hosts may hold at once (0: no cap).", labels=["pool"]
    )
    running = GaugeMetricFamily("fleet_pool_running", "Leases a pool's hosts hold now.",
                                labels=["pool"])  # fmt: skip
    paused = GaugeMetricFamily(
        "fleet_pool_paused", "1 while a promotion gate pauses new dispatches to the pool.",
        labels=["pool"],
    )  # fmt: skip
    for v in pools:
        cap.add_metric([v.pool.name], v.pool.max_running)
        running.add_metric([v.pool.name], v.running)
        paused.add_metric([v.pool.name], int(v.paused_at is not None))
    events = CounterMetricFamily(
        "fleet_pool_events_total", "Pools paused, resumed, raised, lowered, settled here.",
        labels=["pool", "kind"],
    )  # fmt: skip
    for (pool, kind), n in sorted(core.pool_events.items()):
        events.add_metric([pool, kind], n)
    return [cap, running, paused, events]


def families(core: Core, figures: dict[str, float], pools: list[PoolView]) -> list[Metric]:
    rollouts = GaugeMetricFamily("fleet_rollouts", "Rollouts by state.", labels=["state"])
    for key, value in sorted(figures.items()):
        if key.startswith("state_"):
            rollouts.add_metric([key.removeprefix("state_")], value)
    refusals = core.auth.refusals if core.auth is not None else 0
    return [
        rollouts,
        counter("fleet_trajectories_completed_total", "Rollouts that succeeded.",
                figures.get("state_SUCCEEDED", 0.0)),
        gauge("fleet_trajectories_per_second", "Completed trajectories per second over the "
              "last minute.", figures["trajectories_per_second"]),
        counter("fleet_inference_trajectories_total", "Work items that called the gateway, "
                "done.", figures["inference_trajectories"]),
        counter("fleet_retries_total", "Attempts beyond the first of succeeded rollouts.",
                figures["retries"]),
        gauge("fleet_cpu_seconds_per_trajectory", "CPU seconds per completed trajectory.",
              figures["cpu_seconds_per_trajectory"]),
        gauge("fleet_gateway_queue_depth", "The gateway's queue, as the router last read it.",
              core.gateway_queue_depth),
        gauge("fleet_backpressure_holding", "1 while rollouts that call the gateway are held.",
              int(core.hold_inference)),
        gauge("fleet_server_insecure", "1 when the server runs without TLS or authentication",
              int(core.security is None)),
        counter("fleet_auth_refusals_total", "Calls refused by authentication.", refusals),
        *_pool_families(core, pools),
    ]  # fmt: skip


def render(core: Core, figures: dict[str, float], pools: list[PoolView] | None = None) -> str:
    return exposition(families(core, figures, pools or []))


RECENT_POOL_EVENTS = 12
"""Pool events GET /pools lists (the newest)."""


def pools_json(pools: list[PoolView], events: list[Any]) -> dict[str, Any]:
    """The pools, their gates' state and their latest events, for `fleet top`."""
    return {
        "pools": [
            {
                "name": v.pool.name, "class": v.pool.host_class.value, "cap": v.pool.max_running,
                "running": v.running, "slots": v.slots, "adaptive": v.pool.adaptive is not None,
                "gates": v.pool.gates.describe(), "paused_at": v.paused_at,
                "paused_why": v.paused_why,
            }
            for v in pools
        ],
        "events": [
            {"at": e.at, "pool": e.pool, "kind": e.kind, "cap": e.cap, "message": e.message,
             "figures": e.figures}
            for e in events
        ],
    }  # fmt: skip


async def serve_metrics(core: Core, host: str, port: int) -> tuple[asyncio.Server, int]:
    async def route(method: str, target: str, _h: dict[str, str], _body: bytes) -> bytes:
        path = target.split("?")[0]
        if path == "/pools" and method == "GET":
            pools = await core.read(core.ledger.pools)
            events = await core.read(core.ledger.pool_events, 0.0, "", RECENT_POOL_EVENTS)
            body = json.dumps(pools_json(pools, events)).encode()
            return reply(200, body, "application/json")
        if path != "/metrics" or method != "GET":
            return reply(404, b"GET /metrics or GET /pools")
        figures = await core.read(core.ledger.figures, time.time())
        pools = await core.read(core.ledger.pools)
        return reply(200, render(core, figures, pools).encode(), "text/plain; version=0.0.4")

    server = await asyncio.start_server(connection_handler(route), host or None, port)
    return server, int(server.sockets[0].getsockname()[1])
