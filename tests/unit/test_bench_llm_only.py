"""`scripts/bench-llm --only proxy`: part (6) alone, with no model loaded, for measuring the
gateway's proxy on its own (the whole benchmark takes minutes)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from benchmarks.llm import KEYS

REPO = Path(__file__).resolve().parents[2]
PROXY_KEYS = ("proxy_added_p50_ms", "proxy_tokens_s_ratio", "fallback_first_token_s",
              "burst_proxy_added_p50_ms", "burst_proxy_tokens_s_ratio")  # fmt: skip


def test_only_the_proxy_part_runs_and_its_json_line_has_every_key() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.llm", "--only", "proxy", "--quick", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert set(KEYS) <= set(result), f"missing: {set(KEYS) - set(result)}"
    for key in PROXY_KEYS:
        assert isinstance(result[key], float) and math.isfinite(result[key]), (key, result[key])
    assert result["proxy_requests"] > 0 and result["fallback_requests"] > 0
    # Both shapes of load ran: the steady streams (each stream's first and last request left
    # out of the latencies: 2 of the quick run's 4) and the bursts (3 rounds of 32).
    assert result["proxy_requests"] == 32 * 2 and result["burst_requests"] == 32 * 3
    # The other parts did not run: their keys are null, and the table holds only part (6).
    assert result["batching_gain"] is None and result["equivalence_fp32"] is None
    table = "\n".join(lines[:-1])
    assert "gateway vs direct" in table and "fallback past a refusing upstream" in table
    assert "32 sent at once (bursts)" in table
    assert "engine vs transformers" not in table


def test_only_refuses_a_part_it_does_not_know() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.llm", "--only", "kv"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--only" in done.stderr and "kv" in done.stderr
