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
from fleet.server.core import Core


def _pool_lines(core: Core, pools: list[PoolView]) -> list[str]:
    """Each pool's cap, what it runs, whether its gates pause it, and the events this server
    wrote for it (pause, resume, cap moved)."""
    if not pools and not core.pool_events:
        return []
    lines = [
        "# HELP fleet_pool_cap Leases a pool's hosts may hold at once (0: no cap).",
        "# TYPE fleet_pool_cap gauge",
        *(f'fleet_pool_cap{{pool="{v.pool.name}"}} {v.pool.max_running}' for v in pools),
        "# TYPE fleet_pool_running gauge",
        *(f'fleet_pool_running{{pool="{v.pool.name}"}} {v.running}' for v in pools),
        "# HELP fleet_pool_paused 1 while a promotion gate pauses new dispatches to the pool.",
        "# TYPE fleet_pool_paused gauge",
        *(f'fleet_pool_paused{{pool="{v.pool.name}"}} {int(v.paused_at is not None)}'
          for v in pools),
        "# HELP fleet_pool_events_total Pools paused, resumed, raised, lowered, settled here.",
        "# TYPE fleet_pool_events_total counter",
    ]  # fmt: skip
    lines += [
        f'fleet_pool_events_total{{pool="{pool}",kind="{kind}"}} {n}'
        for (pool, kind), n in sorted(core.pool_events.items())
    ]
    return lines


def render(core: Core, figures: dict[str, float], pools: list[PoolView] | None = None) -> str:
    lines = ["# TYPE fleet_rollouts gauge"]
    for key, value in sorted(figures.items()):
        if key.startswith("state_"):
            lines.append(f'fleet_rollouts{{state="{key.removeprefix("state_")}"}} {value:g}')
    completed = figures.get("state_SUCCEEDED", 0.0)
    lines += [
        "# TYPE fleet_trajectories_completed_total counter",
        f"fleet_trajectories_completed_total {completed:g}",
        "# TYPE fleet_trajectories_per_second gauge",
        f"fleet_trajectories_per_second {figures['trajectories_per_second']:.4f}",
        "# TYPE fleet_inference_trajectories_total counter",
        f"fleet_inference_trajectories_total {figures['inference_trajectories']:g}",
        "# TYPE fleet_retries_total counter",
        f"fleet_retries_total {figures['retries']:g}",
        "# TYPE fleet_cpu_seconds_per_trajectory gauge",
        f"fleet_cpu_seconds_per_trajectory {figures['cpu_seconds_per_trajectory']:.4f}",
        "# TYPE fleet_gateway_queue_depth gauge",
        f"fleet_gateway_queue_depth {core.gateway_queue_depth}",
        "# TYPE fleet_backpressure_holding gauge",
        f"fleet_backpressure_holding {int(core.hold_inference)}",
        "# HELP fleet_server_insecure 1 when the server runs without TLS or authentication",
        "# TYPE fleet_server_insecure gauge",
        f"fleet_server_insecure {int(core.security is None)}",
        "# TYPE fleet_auth_refusals_total counter",
        f"fleet_auth_refusals_total {core.auth.refusals if core.auth is not None else 0}",
        *_pool_lines(core, pools or []),
    ]
    return "\n".join(lines) + "\n"


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
            pools = await core.db(core.ledger.pools)
            events = await core.db(core.ledger.pool_events, 0.0, "", RECENT_POOL_EVENTS)
            body = json.dumps(pools_json(pools, events)).encode()
            return reply(200, body, "application/json")
        if path != "/metrics" or method != "GET":
            return reply(404, b"GET /metrics or GET /pools")
        figures = await core.db(core.ledger.figures, time.time())
        pools = await core.db(core.ledger.pools)
        return reply(200, render(core, figures, pools).encode(), "text/plain; version=0.0.4")

    server = await asyncio.start_server(connection_handler(route), host or None, port)
    return server, int(server.sockets[0].getsockname()[1])
