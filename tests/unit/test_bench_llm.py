"""The language-model benchmark (`benchmarks.llm`): its quick run end to end as the wrapper
runs it, its flags' checks, and its workload and admission count on a tiny model.

Figures are only checked for being measured (present, positive where they are ratios): how
fast this machine is is not the test's business.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.llm import (
    KEYS,
    LENGTH_MIX,
    running_at_once,
    workload,
)
from gateway.llm.engine import LLMEngine
from tests.llm_fixtures import CONTEXT, write_tiny_model

REPO = Path(__file__).resolve().parents[2]
RATIOS = ("batching_gain", "vs_transformers", "kv_bytes_per_token_ratio", "paged_vs_contiguous")


def bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.llm", *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def test_quick_run_ends_with_every_key_and_measured_ratios() -> None:
    done = bench("--quick", "--json", "--equivalence-prompts", "4")
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert isinstance(result, dict)
    assert set(KEYS) <= set(result), f"missing: {set(KEYS) - set(result)}"
    for key in RATIOS:
        value = result[key]
        assert isinstance(value, float | int) and not isinstance(value, bool), (key, value)
        assert math.isfinite(value) and value > 0, (key, value)
    share = result["equivalence_fp32"]
    assert share is None or 0.0 <= share <= 1.0
    # Failover and admission, measured on the gateway's engine process and CPU replica:
    # nothing lost, no token repeated, no answer out of memory, a positive failover time.
    assert result["lost"] == 0 and result["repeated_tokens"] == 0 and result["oom"] == 0
    assert isinstance(result["failover_p95_s"], float) and result["failover_p95_s"] > 0
    assert 0.0 <= result["false_refusal_rate"] <= 1.0
    # The side-by-side table came before the JSON line, with the baseline named.
    table = "\n".join(lines[:-1])
    assert "engine vs transformers" in table
    assert "paged vs contig" in table


def test_bad_flags_are_refused_naming_the_flag() -> None:
    done = bench("--dtypes", "float64", timeout=120)
    assert done.returncode == 2
    assert "--dtypes" in done.stderr and "float64" in done.stderr
    done = bench("--model", str(REPO / "no-such-model"), timeout=120)
    assert done.returncode == 2
    assert "--model" in done.stderr and "no-such-model" in done.stderr


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("bench-llm") / "tiny")


@pytest.fixture
def engine(tiny: Path) -> Iterator[LLMEngine]:
    # Room for exactly two full contexts.
    engine = LLMEngine(tiny, block_size=16, max_batch=32, num_blocks=2 * -(-CONTEXT // 16))
    yield engine
    engine.close()


def test_workload_is_mixed_fits_the_context_and_repeats_with_its_seed(engine: LLMEngine) -> None:
    prompts = workload(engine, 40, 16, seed=3)
    assert prompts == workload(engine, 40, 16, seed=3)
    assert prompts != workload(engine, 40, 16, seed=4)
    lengths = [len(p) for p in prompts]
    assert max(lengths) <= engine.context_length - 16
    # Short prompts and long ones (the tiny model's context cuts the longest to fit).
    assert min(lengths) <= LENGTH_MIX[0][2] < max(lengths)


async def test_running_at_once_counts_what_the_cache_admits(engine: LLMEngine) -> None:
    context = engine.context_length
    # 20 tokens each; the tiny model's greedy answer to it runs to max_tokens without a stop
    # token, so every admitted request is still running when the window ends.
    prompts = [list(range(10, 30))] * 8
    # Each asking for its whole context: two fit the cache at once.
    whole = await running_at_once(engine, prompts, lambda p: context - len(p), 6, 120.0)
    assert whole == 2
    # Asking for prompt + 12 tokens (two blocks each): all eight fit at once.
    paged = await running_at_once(engine, prompts, lambda p: 12, 6, 120.0)
    assert paged == 8
    # Every block came back after each run (running_at_once waits for it).
    assert engine.stats()["blocks_free"] == engine.cache.num_blocks
