"""`fleet demo` as a whole process: the LLM-agent evaluation (the shipped language model on the
shipped tasks, each episode an inference rollout in its own machine) and the gridworld suite.

Run as `python -m fleet.demo`, which takes `fleet demo`'s flags (fleet.demo.cli)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.demo.tasks import QUICK, TASKS, score
from tests.conftest import REPO

DEMO = [sys.executable, "-m", "fleet.demo"]
SUMMARY_KEYS = {
    "score", "random_baseline_score", "tokens_per_trajectory", "cost_per_trajectory",
    "failovers", "lost", "repeated",
}  # fmt: skip


def demo(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DEMO, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "FLEET_SERVER": ""},
    )  # fmt: skip


@pytest.mark.sandbox
def test_the_llm_agent_suite_runs_every_episode_through_the_gateway(tmp_path: Path) -> None:
    """Quick mode: one task per family, each an episode whose agent loop runs in its machine;
    the host scores the answers, every model call an episode reports was admitted by the
    gateway under that episode's rollout, and one host is lost mid-run without losing or
    repeating an episode."""
    out = demo("--quick", "--json", "--price", "2.5", "--out", str(tmp_path / "out"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    summary = json.loads(text.strip().splitlines()[-1])
    assert set(summary) >= SUMMARY_KEYS
    assert summary["suite"] == "llm-agent" and summary["tasks"] == len(QUICK)
    assert summary["lost"] == 0 and summary["repeated"] == 0
    assert summary["calls_not_admitted"] == 0
    assert isinstance(summary["failovers"], int) and summary["failovers"] >= 0

    tasks = {t.name: t for t in TASKS}
    episodes = summary["episodes"]
    assert sorted(e["task"] for e in episodes) == sorted(QUICK)
    assert len({e["rollout_id"] for e in episodes}) == len(QUICK)
    for e in episodes:
        # The scorer's verdict, recomputed here from the answer the machine reported.
        assert e["correct"] == score(tasks[e["task"]], e["answer"]), e
        # Every model call the episode made reached the gateway under its own rollout (a
        # retried episode's lost attempt made calls too).
        assert e["turns"] >= 1 and e["admitted_calls"] >= e["turns"], e
    assert summary["model_calls"] == sum(e["turns"] for e in episodes)
    correct = sum(e["correct"] for e in episodes)
    assert summary["score"] == round(correct / len(QUICK), 4)
    assert summary["score"] > summary["random_baseline_score"]
    assert summary["tokens_per_trajectory"] > 0
    assert summary["cost_per_trajectory"] == round(summary["tokens_per_trajectory"] * 2.5e-6, 8)
    assert summary["latency_ms"]["p50"] > 0 and summary["batch_size_mean"] >= 1

    assert "llm-agent evaluation" in text and "host loss:" in text
    assert "failover drill: at " in text
    assert "ended the primary engine process (pid " in text  # (the episodes after it: lost 0)
    charts = list((tmp_path / "out").glob("demo-*.png"))
    assert len(charts) == 1 and charts[0].read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.sandbox
def test_the_gridworld_suite_still_runs(tmp_path: Path) -> None:
    """`--suite gridworld`: the scripted suite with a host lost on purpose, then the policy's
    evaluation through the gateway (16 episodes in quick mode)."""
    out = demo("--suite", "gridworld", "--quick", "--out", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "runtime:" in text and "summary" in text
    counts = {
        line.rsplit(None, 1)[0].strip(): line.rsplit(None, 1)[1]
        for line in text.splitlines()
        if line.startswith(("rollouts ", "completed", "failed", "retried"))
    }
    assert counts["rollouts"] == "24"
    assert counts["completed (succeeded)"] == "22" and counts["failed"] == "2"
    assert "host loss: killed agent" in text and int(counts["retried (more than one attempt)"]) >= 1
    assert "gpu-class on" in text and "cpu-class on" in text
    # The evaluation: every action from the gateway, a PNG chart written.
    rows = {
        line[:36].strip(): line[36:].strip()
        for line in text.split("\nevaluation\n", 1)[1].splitlines()
        if line and not line.startswith("-")
    }
    assert rows["episodes evaluated"] == "16 of 16"
    assert 0.0 <= float(rows["success rate"]) <= 1.0
    assert int(rows["actions served by the gateway"]) >= 16
    charts = list((tmp_path / "out").glob("demo-*.png"))
    assert len(charts) == 1 and charts[0].read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_bad_flags_are_refused_before_anything_starts() -> None:
    out = demo("--suite", "gridworld", "--json", timeout=120)
    assert out.returncode == 2
    assert "fleet demo --json: the JSON summary is the llm-agent suite's" in out.stderr
    out = demo("--suite", "mlp", timeout=120)
    assert out.returncode == 2 and "invalid choice: 'mlp'" in out.stderr
