"""`fleet demo`: an embedded fleet evaluates the shipped suite, with live progress and a summary."""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from fleet import resources
from fleet.agent.agent import default_host_id
from fleet.agent.capabilities import make_runtime
from fleet.client import AsyncFleet, Rollout, Smolfile, Step
from fleet.config import Paths
from fleet.core.lifecycle import FINAL, RolloutState
from fleet.core.placement import HostClass
from fleet.demo.common import print_table
from fleet.demo.evaluation import evaluate, start_gateway
from fleet.demo.suite import suite
from fleet.embedded import Fleet, embedded_fleet
from fleet.server.core import Core
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


async def _wait_hosts(fleet_core: Core, want: int, timeout_s: float) -> None:
    give_up = time.monotonic() + timeout_s
    while len(await fleet_core.db(fleet_core.ledger.hosts)) < want:
        if time.monotonic() > give_up:
            raise TimeoutError(f"agents did not register within {timeout_s:.0f}s")
        await asyncio.sleep(0.05)


DOOMED = f"{default_host_id(HostClass.CPU, 9)}-doomed"


async def _start_doomed_agent(
    fleet: Fleet, paths: Paths, machines: Path
) -> asyncio.subprocess.Process:
    """One more cpu agent, as its own process: the host the demo will lose. It joins the
    fleet as a cloud host would, with a one-use join token."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleet.cli.main", "--log-level", "error", "agent",
        "--class", "cpu", "--runtime", fleet.runtime.kind.value, "--server", fleet.address,
        "--host-id", DOOMED, "--slots", "2", "--machines-dir", str(machines),
        "--join", fleet.join_token(HostClass.CPU), "--ca", str(paths.ca / "ca.crt"),
        "--identity-dir", str(machines.parent / "doomed-identity"),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip


async def _lose_a_host(fleet: Fleet, proc: asyncio.subprocess.Process, machines: Path) -> str:
    """Kills (-9) the extra agent while it holds work.

    Its leases expire and the work runs again elsewhere: what a lost cloud host looks like.
    """
    host_id = DOOMED
    ledger = fleet.server.core.ledger
    try:
        for _ in range(600):
            held = await fleet.server.core.db(ledger.leased_to, host_id)
            if held:
                proc.kill()  # SIGKILL: no goodbye, no completion
                await proc.wait()
                return f"killed agent {host_id} (kill -9) while it held {held} rollouts"
            await asyncio.sleep(0.02)
        return f"agent {host_id} took no work before the suite ended; nothing was killed"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        runtime = make_runtime(fleet.runtime, machines)
        await runtime.reap(host_id)


async def run_demo(
    paths: Paths, timeout_s: float = 600.0, out_dir: Path = Path("fleet-demo-out"),
    episodes: int = 64, log_level: str = "error",
) -> int:  # fmt: skip
    run_id = uuid.uuid4().hex[:8]
    tty = sys.stdout.isatty()
    gateway = await start_gateway(paths, log_level)
    try:
        return await _run(paths, timeout_s, out_dir, episodes, run_id, tty, gateway, evaluate)
    finally:
        await gateway.stop()


async def _run(
    paths: Paths, timeout_s: float, out_dir: Path, episodes: int, run_id: str, tty: bool,
    gateway: Any, evaluate: Any,
) -> int:  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="fleet-demo-") as tmp:
        # Short leases so that the host the demo kills is noticed within seconds; the gateway
        # is watched for backpressure.
        config = ServerConfig(
            lease_ttl_s=3.0, heartbeat_interval_s=0.5,
            gateway_address=f"127.0.0.1:{gateway.grpc_port}",
        )  # fmt: skip
        async with embedded_fleet(
            paths, Path(tmp) / "ledger.sqlite3", config=config,
            gateway=("host", gateway.http_port), gateway_tls=True,
        ) as fleet:  # fmt: skip
            print(
                f"fleet demo {run_id}: embedded fleet on {fleet.address}, SQLite ledger, "
                "1 gpu-class + 2 cpu-class agents,\n  one more cpu-class agent in its own "
                "process, which the demo kills (-9) while it runs rollouts,\n  and the inference "
                f"gateway ({gateway.gateway.spec.name} on {gateway.gateway.batcher.primary.device})"
            )
            print(f"runtime: {fleet.runtime.kind} — {fleet.runtime.reason}")
            if fleet.runtime.kind == "namespace":
                print(
                    "  Linux namespaces on the shared kernel: weaker isolation than a microVM\n"
                    "  (rollouts that require vm isolation would wait for a smol host); a machine\n"
                    "  whose Smolfile allows egress gets its own network namespace, firewall and\n"
                    "  DNS forwarder holding it to the allowlist"
                )
            gpu = next(a for a in fleet.agents if a.caps.host_class == "gpu")
            print(
                f"gpu-class host: {gpu.caps.cuda_devices} CUDA devices, "
                f"CUDA work runs on: {gpu.caps.device}"
            )
            machines = Path(tmp) / "machines"
            doomed = await _start_doomed_agent(fleet, paths, machines)
            await _wait_hosts(fleet.server.core, len(fleet.agents) + 1, 60)
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
                loss = asyncio.create_task(_lose_a_host(fleet, doomed, machines))
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
