"""`fleet top`: the server's and the gateway's metrics, refreshed in place."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import urllib.request
from typing import Any

from fleet.prom import parse


def _label(key: str) -> str:
    """The first label value of a `name{label="value"}` key."""
    return key.split('"')[1] if '"' in key else key


def _fetch(url: str) -> dict[str, float] | str:
    try:
        with urllib.request.urlopen(url, timeout=3) as reply:
            return parse(reply.read().decode())
    except OSError as exc:
        return f"unreachable ({exc})"


def _fetch_json(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=3) as reply:
            found = json.loads(reply.read().decode())
            return found if isinstance(found, dict) else None
    except (OSError, ValueError):
        return None


def _pool_lines(pools: dict[str, Any]) -> list[str]:
    """Each pool's cap and state, and the latest pauses, resumes and caps moved, each with
    the numbers that decided it."""
    lines = []
    for p in pools.get("pools", []):
        cap = f"{p['running']}/{p['cap'] or '-'}"
        state = f"PAUSED: {p['paused_why']}" if p.get("paused_at") else "dispatching"
        mode = "adaptive" if p.get("adaptive") else "fixed"
        lines.append(f"pool {p['name']:<10} {p['class']} {cap:>7} of {p['slots']} slots ({mode})"
                     f"   gates {p['gates']}   {state}")  # fmt: skip
    for e in pools.get("events", [])[-5:]:
        figures = " ".join(f"{k}={v:g}" for k, v in sorted(e.get("figures", {}).items()))
        lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(e['at']))} {e['pool']} "
                     f"{e['kind']}: {e['message']}  [{figures}]")  # fmt: skip
    return lines


def render(
    server: dict[str, float] | str, gateway: dict[str, float] | str,
    pools: dict[str, Any] | None = None,
) -> str:  # fmt: skip
    lines = [f"fleet top  {time.strftime('%H:%M:%S')}"]
    if isinstance(server, str):
        lines.append(f"server   {server}")
    else:
        states = " ".join(
            f"{_label(k).lower()} {v:g}"
            for k, v in sorted(server.items())
            if k.startswith("fleet_rollouts{")
        )
        lines += [
            f"rollouts        {states or 'none yet'}",
            f"trajectories/s  {server.get('fleet_trajectories_per_second', 0):.2f}   "
            f"retries {server.get('fleet_retries_total', 0):g}   "
            f"cpu-s/trajectory {server.get('fleet_cpu_seconds_per_trajectory', 0):.3f}   "
            f"backpressure {'HOLDING' if server.get('fleet_backpressure_holding') else 'off'}",
        ]
        if server.get("fleet_server_insecure"):
            lines.append("security        WITHOUT TLS OR AUTHENTICATION (loopback or --insecure)")
        elif "fleet_server_insecure" in server:
            lines.append(
                f"security        TLS, keys; {server.get('fleet_auth_refusals_total', 0):g} "
                "calls refused"
            )
    if pools:
        lines += _pool_lines(pools)
    if isinstance(gateway, str):
        lines.append(f"gateway  {gateway}")
    else:
        batches = gateway.get("fleet_gateway_batch_size_count", 0)
        mean = gateway.get("fleet_gateway_batch_size_sum", 0) / batches if batches else 0.0
        device_s = gateway.get("fleet_gateway_device_seconds_total", 0)
        per = ""
        if not isinstance(server, str) and server.get("fleet_inference_trajectories_total"):
            trajectories = server["fleet_inference_trajectories_total"]
            per = f"   device-s/trajectory {device_s / trajectories:.4f}"
        model = next((k for k in gateway if k.startswith("fleet_gateway_model_info{")), "")
        labels = dict(re.findall(r'(\w+)="([^"]*)"', model))
        if labels:
            lines.append(
                f"model           {labels.get('model', '?')} {labels.get('revision', '')} on "
                f"{labels.get('device', '?')} in {labels.get('dtype', '?')}"
            )
        requests = [
            (via, gateway.get(key, 0))
            for via in ("grpc", "grpc_stream", "http")
            for key in (f'fleet_gateway_requests_total{{via="{via}"}}',)
        ]
        util = gateway.get("fleet_gateway_gpu_utilization")
        gpu = f" (GPU util {util:.0%})" if util is not None else ""
        lines += [
            f"gateway         queue {gateway.get('fleet_gateway_queue_depth', 0):g} "
            f"(oldest {gateway.get('fleet_gateway_queue_oldest_seconds', 0) * 1000:.0f} ms)   "
            f"p95 {gateway.get('fleet_gateway_latency_p95_seconds', 0) * 1000:.1f} ms   "
            f"batch mean {mean:.2f}   "
            f"busy {gateway.get('fleet_gateway_device_busy_fraction', 0):.3f}{gpu}"
            f"   failovers {gateway.get('fleet_gateway_failovers_total', 0):g}   "
            f"engine restarts {gateway.get('fleet_gateway_engine_restarts_total', 0):g}   "
            f"breaker {'open' if gateway.get('fleet_gateway_breaker_open') else 'closed'}{per}",
            "requests        "
            + "   ".join(f"{via} {n:g}" for via, n in requests)
            + f"   streams open {gateway.get('fleet_gateway_streams_open', 0):g}",
        ]
    return "\n".join(lines)


async def run_top(server_url: str, gateway_url: str, interval_s: float, once: bool) -> int:
    tty = sys.stdout.isatty() and not once
    while True:
        pools_url = server_url.rsplit("/", 1)[0] + "/pools"
        server, gateway, pools = await asyncio.gather(
            asyncio.to_thread(_fetch, server_url), asyncio.to_thread(_fetch, gateway_url),
            asyncio.to_thread(_fetch_json, pools_url),
        )  # fmt: skip
        screen = render(server, gateway, pools)
        if tty:
            sys.stdout.write("\x1b[H\x1b[2J" + screen + "\n")
            sys.stdout.flush()
        else:
            print(screen, flush=True)
        if once:
            return 0 if not isinstance(server, str) else 1
        await asyncio.sleep(interval_s)
