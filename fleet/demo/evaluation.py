"""The demo's second part: evaluate the shipped policy on gridworld episodes through the gateway.

Each episode is a rollout that steps the environment itself and asks the gateway (on this host)
for every action, storing a checkpoint after each one: a copy-on-write child of its host's warm
parent, which loaded the environment and the client once
(`smolfiles/gridworld-episode.smolfile`). The gateway batches the actions of all running
episodes. The report gives the evaluation result and the pipeline's figures, and a PNG chart of
throughput and gateway queue depth over time.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fleet import resources
from fleet.client import AsyncFleet, Rollout, Smolfile, Step
from fleet.core.lifecycle import RolloutState
from fleet.demo.chart import line_chart
from fleet.demo.common import print_table
from fleet.embedded import GatewayHandle as GatewayHandle
from fleet.embedded import start_gateway as start_gateway
from fleet.envs.episode import source, warm_step

NEAR_GATEWAY = 8
"""Episodes that ask to run on the GPU host, next to the gateway, for the latency comparison."""
SMOLFILE = resources.smolfile("gridworld-episode")


def _write_chart(path: Path, panels: list[list[tuple[float, float]]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    line_chart(
        path, panels, titles=["Completed trajectories", "Gateway queue"],
        y_labels=["trajectories / s", "requests queued"],
        x_label="seconds since the evaluation started",
    )  # fmt: skip


def _bar(done: int, total: int, extra: str, width: int = 32) -> str:
    filled = width * done // max(total, 1)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} episodes  {extra}"


async def evaluate(
    connect: Callable[[], AsyncFleet], handle: GatewayHandle, run_id: str, out_dir: Path,
    episodes: int, timeout_s: float,
) -> int:  # fmt: skip
    gw = handle.gateway
    spec = gw.spec
    print()
    print(
        f"evaluating {spec.name} {spec.revision} (sha256 {spec.sha256[:12]}…) on {episodes} "
        f"gridworld episodes;\n  the gateway serves it on {gw.batcher.primary.device} and "
        "batches the actions of every running episode"
    )
    tty = sys.stdout.isatty()
    samples: list[tuple[float, int, int]] = []
    served_before, busy_before = gw.batcher.metrics.served, gw.batcher.metrics.busy_s
    sizes_before = dict(gw.batcher.metrics.batch_sizes)
    async with connect() as client:
        ids: dict[str, int] = {}
        started = time.monotonic()
        # The first `near` episodes ask to run next to the gateway (on the GPU host's agent);
        # the rest run on CPU-class hosts, as cloud hosts would.
        near = min(NEAR_GATEWAY, episodes // 4)
        smolfile = await asyncio.to_thread(Smolfile.load, SMOLFILE, f"smolfiles/{SMOLFILE.name}")
        warm_up = Step(name="warm-up", argv=["python3", "-c", source()], timeout_s=120)
        for seed in range(episodes):
            submitted = await client.submit(
                smolfile,
                [warm_up, Step(name="episode", argv=warm_step(seed), timeout_s=300)],
                idempotency_key=f"eval-{run_id}-{seed}",
                labels={"demo": run_id, "suite": "gridworld-eval", "seed": str(seed)},
                versions={"policy": f"{spec.name}@{spec.revision}",
                          "environment": "gridworld-7x7", "evaluator": "episode-return-v1"},
                inference=True, near_gateway=seed < near, tenant="demo",
            )  # fmt: skip
            ids[submitted.id] = seed
        rollouts: list[Rollout] = []
        last = ""
        while True:
            rollouts = await client.list({"demo": run_id, "suite": "gridworld-eval"})
            done = sum(1 for r in rollouts if r.final)
            samples.append((time.monotonic() - started, done, gw.batcher.queue_depth))
            line = _bar(done, episodes, f"gateway queue {gw.batcher.queue_depth:>3}")
            if tty:
                print("\r" + line, end="", flush=True)
            elif line.split("  gateway")[0] != last.split("  gateway")[0]:
                print(line, flush=True)
            last = line
            if done == episodes:
                break
            if time.monotonic() - started > timeout_s:
                print(f"\nfleet demo: evaluation not finished after {timeout_s:.0f}s")
                return 1
            await asyncio.sleep(0.25)
        if tty:
            print()
    wall = time.monotonic() - started
    results = []
    for r in rollouts:
        if r.state == RolloutState.SUCCEEDED and r.results:
            results.append(json.loads(r.results[-1].stdout))
    by_place: dict[str, list[float]] = {}
    for r in rollouts:
        if r.state == RolloutState.SUCCEEDED and r.results:
            place = "gpu" if r.host_class == "gpu" else "cpu"
            by_place.setdefault(place, []).append(json.loads(r.results[-1].stdout)["action_ms"])
    m = gw.batcher.metrics
    sizes = {k: v - sizes_before.get(k, 0) for k, v in m.batch_sizes.items()}
    batches = sum(sizes.values())
    actions = m.served - served_before
    rows = [
        ("episodes evaluated", f"{len(results)} of {episodes}"),
        ("success rate", f"{sum(r['success'] for r in results) / max(1, len(results)):.3f}"),
        ("mean return", f"{statistics.fmean(r['return'] for r in results) if results else 0:.3f}"),
        ("trajectories per second", f"{len(results) / wall:.2f}"),
        ("actions served by the gateway", str(actions)),
        ("gateway batch size (mean / max)",
         f"{actions / max(1, batches):.2f} / {max((k for k, v in sizes.items() if v), default=0)}"),
        ("device busy fraction", f"{(m.busy_s - busy_before) / wall:.3f}"),
        ("device", gw.batcher.primary.device),
        ("retried episodes", str(sum(1 for r in rollouts if r.attempts > 1))),
        ("ms per action, cpu-class hosts",
         f"{statistics.fmean(by_place['cpu']):.2f}" if by_place.get("cpu") else "-"),
        (f"ms per action, next to the gateway ({len(by_place.get('gpu', []))})",
         f"{statistics.fmean(by_place['gpu']):.2f}" if by_place.get("gpu") else "-"),
        ("ms storing each checkpoint",
         f"{statistics.fmean(r.get('checkpoint_ms', 0.0) for r in results):.2f}"
         if results else "-"),
        ("failovers to the CPU replica", str(m.failovers)),
        ("wall time", f"{wall:.2f} s"),
    ]  # fmt: skip
    print_table("evaluation", rows, 12)
    chart = out_dir / f"demo-{run_id}.png"
    throughput = []
    for (t0, d0, _), (t1, d1, _) in zip(samples, samples[4:], strict=False):
        throughput.append(((t0 + t1) / 2, (d1 - d0) / max(t1 - t0, 1e-6)))
    queue = [(t, float(q)) for t, _, q in samples]
    await asyncio.to_thread(_write_chart, chart, [throughput or [(0.0, 0.0)], queue])
    peak = max((v for _, v in throughput), default=0.0)
    print(
        f"chart: {chart}\n  top: trajectories/s (peak {peak:.1f}); bottom: gateway queue depth "
        f"(peak {max((q for _, _, q in samples), default=0)}); x: 0 to {wall:.1f} s"
    )
    return 0
