"""The server's metrics in Prometheus text format (GET /metrics on `--metrics-listen`).

Rollouts by state, completed trajectories per second (over the last minute), retries, CPU
seconds per completed trajectory, and what the router knows of the gateway: its queue depth and
whether rollouts that call it are being held (backpressure). The gateway serves its own (queue
age, batch-size histogram, device busy fraction and seconds, failovers); `fleet top` reads both.
"""

from __future__ import annotations

import asyncio
import time

from fleet.httpd import connection_handler, reply
from fleet.server.core import Core


def render(core: Core, figures: dict[str, float]) -> str:
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
    ]
    return "\n".join(lines) + "\n"


async def serve_metrics(core: Core, host: str, port: int) -> tuple[asyncio.Server, int]:
    async def route(method: str, target: str, _h: dict[str, str], _body: bytes) -> bytes:
        if target.split("?")[0] != "/metrics" or method != "GET":
            return reply(404, b"GET /metrics")
        figures = await core.db(core.ledger.figures, time.time())
        return reply(200, render(core, figures).encode(), "text/plain; version=0.0.4")

    server = await asyncio.start_server(connection_handler(route), host or None, port)
    return server, int(server.sockets[0].getsockname()[1])
