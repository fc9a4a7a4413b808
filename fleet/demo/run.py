"""`fleet demo`: an embedded fleet evaluates a shipped suite, with live progress and a summary.

Two suites. `llm-agent` (the default) evaluates the gateway's language model as a tool-using
agent on the shipped tasks (`fleet.demo.agent_eval`), losing a host on purpose mid-run.
`gridworld` runs the 24-rollout suite of scripted gridworld episodes with the same host loss,
then evaluates the gridworld policy through the gateway (`fleet.demo.evaluation`).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from fleet import resources
from fleet.client import AsyncFleet, Rollout, Smolfile, Step
from fleet.config import Paths
from fleet.core.errors import InvalidArgument
from fleet.core.lifecycle import FINAL, RolloutState
from fleet.demo import tasks as agent_tasks
from fleet.demo.agent_eval import print_report, run_agents
from fleet.demo.common import SUITES, print_table
from fleet.demo.evaluation import GatewayHandle, evaluate, start_gateway
from fleet.demo.hosts import lose_a_host, start_doomed_agent, wait_hosts
from fleet.demo.suite import suite
from fleet.embedded import Fleet, embedded_fleet
from fleet.server.settings import ServerConfig

SMOLFILES = resources.smolfiles()


def _bar(done: int, total: int, failed: int, running: int, width: int = 32) -> str:
    filled = int(width * done / total) if total else width
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} done, {running} running, "
        f"{failed} failed"
    )


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


QUICK_EPISODES = 16
"""Gridworld episodes a `--quick` run evaluates (the full run: `episodes`)."""


async def run_demo(
    paths: Paths, timeout_s: float = 600.0, out_dir: Path = Path("fleet-demo-out"),
    episodes: int = 64, log_level: str = "error", suite: str = "llm-agent", quick: bool = False,
    json_out: bool = False, price_per_mtok: float | None = None,
) -> int:  # fmt: skip
    """Runs one suite; 0 when it ran to the end (whatever the score), 1 when it did not."""
    if suite not in SUITES:
        raise InvalidArgument(f"fleet demo --suite {suite!r}: one of {', '.join(SUITES)}")
    if json_out and suite != "llm-agent":
        raise InvalidArgument(
            "fleet demo --json: the JSON summary is the llm-agent suite's; the gridworld suite "
            "prints its tables only"
        )
    if price_per_mtok is not None and price_per_mtok < 0:
        raise InvalidArgument(f"fleet demo --price: {price_per_mtok} is negative")
    run_id = uuid.uuid4().hex[:8]
    tty = sys.stdout.isatty()
    gateway = await start_gateway(paths, log_level)
    try:
        if suite == "llm-agent":
            return await _run_agents(
                paths, timeout_s, out_dir, run_id, gateway, quick, json_out, price_per_mtok
            )
        if quick:
            episodes = min(episodes, QUICK_EPISODES)
        return await _run(paths, timeout_s, out_dir, episodes, run_id, tty, gateway, evaluate)
    finally:
        await gateway.stop()


def _server_config(gateway: GatewayHandle) -> ServerConfig:
    # Short leases so that the host the demo kills is noticed within seconds; the gateway is
    # watched for backpressure.
    return ServerConfig(
        lease_ttl_s=3.0, heartbeat_interval_s=0.5,
        gateway_address=f"127.0.0.1:{gateway.grpc_port}",
    )  # fmt: skip


def _introduce(fleet: Fleet, run_id: str, gateway: GatewayHandle, what: str) -> None:
    print(
        f"fleet demo {run_id}: embedded fleet on {fleet.address}, SQLite ledger, "
        "1 gpu-class + 2 cpu-class agents,\n  one more cpu-class agent in its own "
        "process, which the demo kills (-9) while it runs rollouts,\n  and the inference "
        f"gateway ({what} on {gateway.gateway.batcher.primary.device})"
    )
    print(f"runtime: {fleet.runtime.kind} — {fleet.runtime.reason}")
    if fleet.runtime.kind == "namespace":
        print(
            "  Linux namespaces on the shared kernel: weaker isolation than a microVM\n"
            "  (rollouts that require vm isolation would wait for a smol host); a machine\n"
            "  whose Smolfile allows egress gets its own network namespace, firewall and\n"
            "  DNS forwarder holding it to the allowlist"
        )


async def _run_agents(
    paths: Paths, timeout_s: float, out_dir: Path, run_id: str, gateway: GatewayHandle,
    quick: bool, json_out: bool, price_per_mtok: float | None,
) -> int:  # fmt: skip
    llm = gateway.gateway.llm
    if llm is None:
        raise InvalidArgument(
            "fleet demo --suite llm-agent needs the gateway's language model, and it serves "
            "none here (FLEET_GATEWAY_LLM=none, or the shipped weights are missing); "
            "--suite gridworld needs none"
        )
    tasks = agent_tasks.suite(quick)
    # The engine starts (seconds: its process, its weights) while the fleet starts; the
    # episodes wait for it (`run_agents`), not for the fleet's start.
    warming = asyncio.create_task(llm.engine())
    try:
        with tempfile.TemporaryDirectory(prefix="fleet-demo-") as tmp:
            async with embedded_fleet(
                paths, Path(tmp) / "ledger.sqlite3", config=_server_config(gateway),
                gateway=("host", gateway.http_port), gateway_tls=True,
            ) as fleet:  # fmt: skip
                _introduce(fleet, run_id, gateway, llm.model_id)
                machines = Path(tmp) / "machines"
                doomed = await start_doomed_agent(fleet, paths, machines, gateway.http_port)
                await wait_hosts(fleet.server.core, len(fleet.agents) + 1, 60)
                print(
                    f"\nevaluating {llm.model_id} as a tool-using agent on {len(tasks)} tasks, "
                    "one episode each in its own machine;\n  every model call goes through the "
                    "gateway with the episode's token, every tool call runs in its machine"
                )
                await warming
                report = await run_agents(
                    lambda: AsyncFleet(fleet.address, auth=fleet.auth), gateway, run_id, tasks,
                    timeout_s, lambda: lose_a_host(fleet, doomed, machines), price_per_mtok,
                )  # fmt: skip
    finally:
        if not warming.done():  # (the fleet did not start)
            warming.cancel()
    if report is None:
        return 1
    await asyncio.to_thread(print_report, report, out_dir, run_id)
    if json_out:
        print(json.dumps(report.summary()), flush=True)
    return 0


async def _run(
    paths: Paths, timeout_s: float, out_dir: Path, episodes: int, run_id: str, tty: bool,
    gateway: Any, evaluate: Any,
) -> int:  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="fleet-demo-") as tmp:
        async with embedded_fleet(
            paths, Path(tmp) / "ledger.sqlite3", config=_server_config(gateway),
            gateway=("host", gateway.http_port), gateway_tls=True,
        ) as fleet:  # fmt: skip
            _introduce(fleet, run_id, gateway, gateway.gateway.spec.name)
            gpu = next(a for a in fleet.agents if a.caps.host_class == "gpu")
            print(
                f"gpu-class host: {gpu.caps.cuda_devices} CUDA devices, "
                f"CUDA work runs on: {gpu.caps.device}"
            )
            machines = Path(tmp) / "machines"
            doomed = await start_doomed_agent(fleet, paths, machines)
            await wait_hosts(fleet.server.core, len(fleet.agents) + 1, 60)
            items = suite()
            started = time.monotonic()
            async with AsyncFleet(fleet.address, auth=fleet.auth) as client:
                ids: dict[str, str] = {}
                smolfiles = {
                    name: Smolfile.load(SMOLFILES / name, f"smolfiles/{name}")
                    for name in sorted({item.smolfile for item in items})
                }
                for item in items:
                    submitted = await client.submit(
                        smolfiles[item.smolfile],
                        [Step(argv=argv, env=env, timeout_s=t, name=n)
                         for n, argv, env, t in item.steps],
                        idempotency_key=f"demo-{run_id}-{item.name}",
                        labels={"demo": run_id, "suite": "demo", "name": item.name},
                        versions={"policy": "scripted-v1", "environment": "gridworld-8x8",
                                  "evaluator": "score-v1"},
                        tenant="demo",
                    )  # fmt: skip
                    ids[submitted.id] = item.name
                loss = asyncio.create_task(lose_a_host(fleet, doomed, machines))
                print(
                    f"submitted {len(ids)} rollouts "
                    f"({sum(1 for i in items if 'gpu' in i.smolfile)} need the gpu class)"
                )
                last_line = ""
                rollouts: list[Rollout] = []
                while True:
                    rollouts = await client.list({"demo": run_id})
                    done = sum(1 for r in rollouts if r.final)
                    failed = sum(1 for r in rollouts if r.state == RolloutState.FAILED)
                    running = sum(1 for r in rollouts if r.state == RolloutState.RUNNING)
                    line = _bar(done, len(ids), failed, running)
                    if tty:
                        print("\r" + line, end="", flush=True)
                    elif line != last_line:
                        print(line, flush=True)
                    last_line = line
                    if done == len(ids):
                        break
                    if time.monotonic() - started > timeout_s:
                        print(f"\nfleet demo: not finished after {timeout_s:.0f}s", file=sys.stderr)
                        return 1
                    await asyncio.sleep(0.2)
                if tty:
                    print()
                wall = time.monotonic() - started
                print(f"host loss: {await loss}")
            _summary(rollouts, ids, wall)
            left = max(60.0, timeout_s - wall)
            return int(await evaluate(
                lambda: AsyncFleet(fleet.address, auth=fleet.auth), gateway, run_id, out_dir,
                episodes, left,
            ))  # fmt: skip


def _summary(rollouts: list[Rollout], names: dict[str, str], wall_s: float) -> None:
    by_state = {s: sum(1 for r in rollouts if r.state == s) for s in FINAL}
    latencies = [
        (r.finished_at - r.created_at).total_seconds()
        for r in rollouts
        if r.finished_at is not None and r.created_at is not None
    ]
    retried = sum(1 for r in rollouts if r.attempts > 1)
    served: dict[str, int] = {}
    for r in rollouts:
        klass, runtime = r.host_class or "unspecified", r.runtime or "unspecified"
        key = f"{klass}-class on {runtime} runtime, device {r.device}"
        served[key] = served.get(key, 0) + 1
    rows = [
        ("rollouts", str(len(rollouts))),
        ("completed (succeeded)", str(by_state[RolloutState.SUCCEEDED])),
        ("failed", str(by_state[RolloutState.FAILED])),
        ("cancelled", str(by_state[RolloutState.CANCELLED])),
        ("retried (more than one attempt)", str(retried)),
        ("p50 rollout latency", f"{_pct(latencies, 0.5):.2f} s"),
        ("p95 rollout latency", f"{_pct(latencies, 0.95):.2f} s"),
        ("mean rollout latency", f"{statistics.fmean(latencies) if latencies else 0:.2f} s"),
        ("wall time", f"{wall_s:.2f} s"),
        ("rollouts per second", f"{len(rollouts) / wall_s:.2f}"),
    ]
    print_table("summary", rows, 10)
    print("served by")
    for key, count in sorted(served.items()):
        print(f"  {count:>3}  {key}")
    failures = [r for r in rollouts if r.state != RolloutState.SUCCEEDED]
    if failures:
        print("not succeeded:")
        for r in sorted(failures, key=lambda r: names.get(r.id, r.id)):
            print(f"  {names.get(r.id, r.id):<24} {r.state}: {r.error}")
