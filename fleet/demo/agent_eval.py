"""The LLM-agent evaluation (`fleet demo`, suite `llm-agent`): the shipped language model as a
tool-using agent on the shipped task suite (`fleet.demo.tasks`), every episode an inference
rollout of its own.

Each episode is a copy-on-write child of its host's warm parent
(`smolfiles/llm-agent-episode.smolfile`), whose warm-up loaded the agent's program
(`fleet.demo.agent`). The loop runs inside the machine, so tool calls run where the task's
files are and nothing of the machine leaves it but the answer; every model call goes through
the gateway with the rollout's own token, and the gateway batches the calls of all running
episodes. The host scores the answers (the machine never sees an expected answer) and computes
the random baseline from the random agent's answers made in the same machines.

The gateway's admissions are counted per rollout while the evaluation runs, so the summary can
say that every model call an episode reports reached the gateway under that episode's rollout.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from fleet import resources
from fleet.client import AsyncFleet, Rollout, Smolfile, Step
from fleet.core.lifecycle import RolloutState
from fleet.demo import agent
from fleet.demo.chart import line_chart
from fleet.demo.common import print_table
from fleet.demo.evaluation import GatewayHandle
from fleet.demo.tasks import AgentTask, score
from gateway.llm.remote import EngineProcess

log = structlog.get_logger(__name__)

SMOLFILE = resources.smolfile("llm-agent-episode")
SUITE_LABEL = "llm-agent"
EPISODE_TIMEOUT_S = 120.0
SideTask = Callable[[], Coroutine[Any, Any, str]]
"""What runs beside the episodes (the demo's host loss), saying what it did."""


class AdmissionTally:
    """Model calls the gateway's language model admitted, per rollout, while installed.

    The count is taken where the gateway admits a request (`LanguageModel.admitted`, after the
    rollout's token was checked), so a call counted here reached the gateway under that
    rollout's identity."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()

    @contextmanager
    def installed(self, llm: Any) -> Iterator[AdmissionTally]:
        admitted = llm.admitted

        @contextmanager
        def counting(rollout_id: str, sequences: int) -> Iterator[None]:
            with admitted(rollout_id, sequences):
                self.calls[rollout_id] += 1
                yield

        llm.admitted = counting
        try:
            yield self
        finally:
            del llm.admitted  # (the instance attribute: the class's method shows again)


def engine_figures(llm: Any) -> dict[str, int]:
    """The language model's counters: decode steps, generated tokens, sequences running now
    and failovers, summed over its engines (its primary and its CPU replica)."""
    try:
        stats = llm.stats()
    except Exception:  # (an engine process between restarts answers nothing useful)
        return {"steps": 0, "generated_tokens": 0, "running": 0, "failovers": 0}
    engines = [e for e in (stats.get("primary"), stats.get("replica")) if isinstance(e, dict)]
    return {
        "steps": sum(int(e.get("steps", 0)) for e in engines),
        "generated_tokens": sum(int(e.get("generated_tokens", 0)) for e in engines),
        "running": sum(int(e.get("running", 0)) for e in engines),
        # Requests the replica served because the primary could not: moved mid-answer,
        # begun again there, or routed there while the primary was down.
        "failovers": sum(
            int(stats.get(f"requests_{k}", 0)) for k in ("failover", "failover_restart", "replica")
        ),
    }


async def _kill_primary_midway(gateway: GatewayHandle) -> str:
    """The failover drill, called once when half the episodes have finished: it ends the
    language model's primary engine process (by its pid), as a crashed device would. Answers
    being generated go on on the CPU replica from the tokens already made; new requests go
    there until the engine is back. Says what it did."""
    llm = gateway.gateway.llm
    primary = llm.primary if llm is not None else None
    if not isinstance(primary, EngineProcess) or primary.pid is None:
        return "skipped: the primary engine is not a running process of its own"
    pid = primary.pid
    primary.kill()
    log.info("failover_drill", pid=pid, model=llm.model_id if llm else None)
    return f"ended the primary engine process (pid {pid}); the CPU replica served meanwhile"


@dataclass
class Episode:
    """One task's outcome: its rollout, what the machine reported, and the scorer's verdicts."""

    task: AgentTask
    rollout: Rollout | None = None
    result: dict[str, Any] | None = None
    correct: bool = False
    random_correct: float = 0.0
    admitted_calls: int = 0
    results_seen: int = 0
    """Episode results the rollout's steps printed (one; more would be a repeat)."""


@dataclass
class AgentReport:
    """What the evaluation measured; `summary()` is the `--json` line."""

    model: str
    episodes: list[Episode]
    wall_s: float
    rollouts_per_task: dict[str, int]
    steps: int
    generated_tokens: int
    max_running: int
    failovers: int
    price_per_mtok: float | None = None
    samples: list[tuple[float, int, int]] = field(default_factory=list)

    def latencies_ms(self) -> list[float]:
        return [ms for e in self.episodes if e.result for ms in e.result["latencies_ms"]]

    def summary(self) -> dict[str, Any]:
        n = len(self.episodes)
        answered = [e for e in self.episodes if e.result is not None]
        tokens = [e.result["prompt_tokens"] + e.result["completion_tokens"]
                  for e in answered if e.result]  # fmt: skip
        per_trajectory = statistics.fmean(tokens) if tokens else 0.0
        latencies = self.latencies_ms()
        return {
            "suite": SUITE_LABEL,
            "model": self.model,
            "tasks": n,
            "score": round(sum(e.correct for e in self.episodes) / max(1, n), 4),
            "random_baseline_score": round(
                sum(e.random_correct for e in self.episodes) / max(1, n), 4
            ),
            "tokens_per_trajectory": round(per_trajectory, 1),
            "cost_per_trajectory": (
                round(per_trajectory * self.price_per_mtok / 1e6, 8)
                if self.price_per_mtok is not None else None
            ),
            "model_calls": len(latencies),
            "latency_ms": {f"p{q}": round(percentile(latencies, q / 100), 2)
                           for q in (50, 90, 99)},
            "batch_size_mean": round(self.generated_tokens / max(1, self.steps), 2),
            "batch_size_max": self.max_running,
            "failovers": self.failovers,
            "lost": sum(1 for e in self.episodes if e.result is None),
            "repeated": sum(max(0, self.rollouts_per_task.get(e.task.name, 0) - 1)
                            + max(0, e.results_seen - 1) for e in self.episodes),
            "retried": sum(1 for e in self.episodes if e.rollout and e.rollout.attempts > 1),
            "calls_not_admitted": sum(
                max(0, e.result["turns"] - e.admitted_calls) for e in answered if e.result
            ),
            "wall_s": round(self.wall_s, 2),
            "episodes": [
                {"task": e.task.name, "rollout_id": e.rollout.id if e.rollout else None,
                 "answer": e.result.get("answer") if e.result else None, "correct": e.correct,
                 "random_correct": round(e.random_correct, 4),
                 "turns": e.result["turns"] if e.result else 0,
                 "admitted_calls": e.admitted_calls,
                 "commands": e.result["commands"] if e.result else []}
                for e in self.episodes
            ],
        }  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _parse_results(rollout: Rollout) -> list[dict[str, Any]]:
    """The episode results its last step printed: one JSON object per line."""
    if rollout.state != RolloutState.SUCCEEDED or not rollout.results:
        return []
    out = []
    for line in rollout.results[-1].stdout.decode(errors="replace").splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                log.warning("episode_result_unreadable", rollout_id=rollout.id, line=line[:200])
    return out


def _bar(done: int, total: int, extra: str, width: int = 32) -> str:
    filled = width * done // max(total, 1)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} episodes  {extra}"


async def run_agents(
    connect: Callable[[], AsyncFleet], handle: GatewayHandle, run_id: str,
    tasks: list[AgentTask], timeout_s: float, on_submitted: SideTask | None,
    price_per_mtok: float | None = None,
) -> AgentReport | None:  # fmt: skip
    """Submits one episode per task, follows them to the end, and scores them; None if they
    did not all finish within `timeout_s`. `on_submitted` runs beside the episodes (the
    demo's host loss) and its line is printed when they are done."""
    llm = handle.gateway.llm
    model = llm.model_id
    tty = sys.stdout.isatty()
    await llm.engine()  # started before the clock: the first episodes do not wait for it
    smolfile = await asyncio.to_thread(Smolfile.load, SMOLFILE, f"smolfiles/{SMOLFILE.name}")
    warm_up = Step(name="warm-up", argv=["python3", "-c", agent.source()], timeout_s=120)
    labels = {"demo": run_id, "suite": SUITE_LABEL}
    before = engine_figures(llm)
    samples: list[tuple[float, int, int]] = []
    max_running = 0
    with AdmissionTally().installed(llm) as tally:
        async with connect() as client:
            started = time.monotonic()
            for seed, task in enumerate(tasks):
                payload = json.dumps({**task.to_json(), "model": model, "seed": seed})
                await client.submit(
                    smolfile,
                    [warm_up, Step(name="episode", argv=agent.episode_step(),
                                   env={"FLEET_TASK": payload}, timeout_s=EPISODE_TIMEOUT_S)],
                    idempotency_key=f"agent-{run_id}-{task.name}",
                    labels={**labels, "task": task.name},
                    versions={"policy": model, "environment": "fleet-agent-tasks-v1",
                              "evaluator": "agent-score-v1"},
                    inference=True, tenant="demo",
                )  # fmt: skip
            side = asyncio.create_task(on_submitted()) if on_submitted else None
            drill: str | None = None
            rollouts: list[Rollout] = []
            last = ""
            while True:
                rollouts = await client.list(labels)
                done = sum(1 for r in rollouts if r.final)
                figures = engine_figures(llm)
                max_running = max(max_running, figures["running"])
                samples.append((time.monotonic() - started, done, figures["running"]))
                if drill is None and done * 2 >= len(tasks):
                    drill = f"at {done}/{len(tasks)} episodes, {await _kill_primary_midway(handle)}"
                line = _bar(done, len(tasks), f"sequences decoding {figures['running']:>3}")
                if tty:
                    print("\r" + line, end="", flush=True)
                elif line.split("  sequences")[0] != last.split("  sequences")[0]:
                    print(line, flush=True)
                last = line
                if done >= len(tasks):
                    break
                if time.monotonic() - started > timeout_s:
                    print(f"\nfleet demo: episodes not finished after {timeout_s:.0f}s")
                    if side is not None:
                        side.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await side  # (it ends the host it started)
                    return None
                await asyncio.sleep(0.25)
            if tty:
                print()
            wall = time.monotonic() - started
            print(f"failover drill: {drill}")
            if side is not None:
                print(f"host loss: {await side}")
    after = engine_figures(llm)
    by_task: dict[str, list[Rollout]] = collections.defaultdict(list)
    for r in rollouts:
        by_task[r.labels.get("task", "")].append(r)
    episodes = []
    for task in tasks:
        episode = Episode(task)
        mine = by_task.get(task.name, [])
        if mine:
            episode.rollout = mine[0]
            results = [x for r in mine for x in _parse_results(r)]
            episode.results_seen = len(results)
            episode.result = results[0] if results else None
            episode.admitted_calls = sum(tally.calls.get(r.id, 0) for r in mine)
        if episode.result is not None:
            episode.correct = score(task, episode.result.get("answer"))
            draws = episode.result.get("random_answers") or []
            episode.random_correct = sum(score(task, a) for a in draws) / max(1, len(draws))
        episodes.append(episode)
    return AgentReport(
        model=model, episodes=episodes, wall_s=wall,
        rollouts_per_task={name: len(rs) for name, rs in by_task.items()},
        steps=after["steps"] - before["steps"],
        generated_tokens=after["generated_tokens"] - before["generated_tokens"],
        max_running=max_running, failovers=after["failovers"] - before["failovers"],
        price_per_mtok=price_per_mtok, samples=samples,
    )  # fmt: skip


def print_report(report: AgentReport, out_dir: Path, run_id: str) -> Path:
    """The episodes, one line each, the summary table and the chart; returns the chart's path."""
    s = report.summary()
    print()
    print("episodes")
    for e in report.episodes:
        r = e.result or {}
        verdict = "lost" if e.result is None else ("pass" if e.correct else "fail")
        command = (r.get("commands") or ["-"])[0]
        print(f"  {verdict:<4}  {e.task.name:<20} {command[:40]:<40} -> "
              f"{(r.get('answer') or '')[:50]!r}")  # fmt: skip
    cost = s["cost_per_trajectory"]
    rows = [
        ("model", s["model"]),
        ("episodes scored", f"{s['tasks'] - s['lost']} of {s['tasks']}"),
        ("score", f"{s['score']:.3f}"),
        ("random baseline score", f"{s['random_baseline_score']:.3f}"),
        ("tokens per trajectory", f"{s['tokens_per_trajectory']:.1f}"),
        ("cost per trajectory", "-" if cost is None else f"{cost:.8f}"),
        ("model calls", str(s["model_calls"])),
        ("model call latency p50 / p90 / p99",
         "{p50:.0f} / {p90:.0f} / {p99:.0f} ms".format(**s["latency_ms"])),
        ("engine batch size (mean / max)",
         f"{s['batch_size_mean']:.2f} / {s['batch_size_max']}"),
        ("failovers", str(s["failovers"])),
        ("lost episodes", str(s["lost"])),
        ("repeated episodes", str(s["repeated"])),
        ("retried episodes", str(s["retried"])),
        ("calls not seen by the gateway", str(s["calls_not_admitted"])),
        ("wall time", f"{s['wall_s']:.2f} s"),
    ]  # fmt: skip
    print_table("llm-agent evaluation", rows, 24)
    chart = out_dir / f"demo-{run_id}.png"
    out_dir.mkdir(parents=True, exist_ok=True)
    throughput = [
        ((t0 + t1) / 2, (d1 - d0) / max(t1 - t0, 1e-6))
        for (t0, d0, _), (t1, d1, _) in zip(report.samples, report.samples[4:], strict=False)
    ]
    running = [(t, float(n)) for t, _, n in report.samples]
    line_chart(
        chart, [throughput or [(0.0, 0.0)], running or [(0.0, 0.0)]],
        titles=["Completed episodes", "Sequences the engine decodes together"],
        y_labels=["episodes / s", "sequences"], x_label="seconds since the episodes started",
    )  # fmt: skip
    print(f"chart: {chart}\n  top: episodes/s; bottom: the engine's running batch; "
          f"x: 0 to {report.wall_s:.1f} s")  # fmt: skip
    return chart
