"""The language-model benchmark (`benchmarks.llm`): its quick run end to end as the wrapper
runs it, its flags' checks, and its workload and admission count on a tiny model.

Figures are only checked for being measured (present, positive where they are ratios): how
fast this machine is is not the test's business.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks import llm_upstream
from benchmarks.llm import (
    KEYS,
    LENGTH_MIX,
    running_at_once,
    workload,
)
from benchmarks.llm_proxy import refusing_port
from gateway.llm.engine import LLMEngine
from tests.llm_fixtures import CONTEXT, write_tiny_model

REPO = Path(__file__).resolve().parents[2]
RATIOS = ("batching_gain", "vs_transformers", "kv_bytes_per_token_ratio", "paged_vs_contiguous",
          "proxy_tokens_s_ratio")  # fmt: skip
PROXY_SECONDS = ("fallback_first_token_s", "fallback_first_token_p50_s", "proxy_p50_s",
                 "proxy_direct_p50_s", "proxy_ttft_p50_s", "proxy_direct_ttft_p50_s")  # fmt: skip


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
    # The proxy: both sides and the fallback measured (every answer was checked whole by the
    # benchmark itself, the fallback's to say it fell back); the added latency is a difference
    # of two measured p50s, so only its being a number is the test's business.
    for key in PROXY_SECONDS:
        assert isinstance(result[key], float) and result[key] > 0, (key, result[key])
    assert math.isfinite(result["proxy_added_p50_ms"])
    assert result["proxy_requests"] > 0 and result["fallback_requests"] > 0
    # The side-by-side table came before the JSON line, with the baseline named.
    table = "\n".join(lines[:-1])
    assert "engine vs transformers" in table
    assert "paged vs contig" in table
    assert "gateway vs direct" in table and "fallback past a refusing upstream" in table


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


# -- the proxy benchmark's upstream ----------------------------------------------------------


@pytest.fixture
async def bench_upstream() -> AsyncIterator[tuple[str, list[int]]]:
    """`benchmarks.llm_upstream` on loopback (in this process: what it serves is the test's
    business here, not its pace), 5 tokens one per 10 ms, key `sk-good`: its base URL, and a
    list that grows by one with each connection it accepts."""
    upstream = llm_upstream.BenchUpstream("sk-good", 5, 0.01)
    accepted: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        await upstream.handle(reader, writer)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1", accepted


async def _events(client: httpx.AsyncClient, key: str, stream: bool = True) -> list[str]:
    body = {"model": llm_upstream.MODEL, "stream": stream, "messages": []}
    headers = {"authorization": f"Bearer {key}"}
    async with client.stream("POST", "/chat/completions", json=body, headers=headers) as reply:
        if reply.status_code != 200:
            await reply.aread()
            return [f"HTTP {reply.status_code}: {reply.text}"]
        return [line[6:] async for line in reply.aiter_lines() if line.startswith("data: ")]


async def test_bench_upstream_streams_its_tokens_on_one_connection_and_checks_the_key(
    bench_upstream: tuple[str, list[int]],
) -> None:
    url, accepted = bench_upstream
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as client:
        first = await _events(client, "sk-good")
        second = await _events(client, "sk-good")
        whole = await client.post(
            "/chat/completions", headers={"authorization": "Bearer sk-good"},
            json={"model": llm_upstream.MODEL, "messages": []},
        )  # fmt: skip
        # All three on one kept-alive connection.
        assert len(accepted) == 1
        refused = await _events(client, "sk-bad")
        unkeyed = await client.get("/models")
    assert first == second
    assert first[-1] == "[DONE]"
    chunks = [json.loads(e) for e in first[:-1]]
    texts = [c["choices"][0]["delta"].get("content") for c in chunks]
    assert texts == ["", " w0", " w1", " w2", " w3", " w4", None]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert whole.status_code == 200
    assert whole.json()["choices"][0]["message"]["content"] == " w0 w1 w2 w3 w4"
    assert refused[0].startswith("HTTP 401") and "bad key" in refused[0]
    assert unkeyed.status_code == 401


def test_bench_upstream_refuses_a_plan_it_cannot_stream() -> None:
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        llm_upstream.BenchUpstream("sk", 0, 0.01)


def test_the_refusing_port_refuses_connections_while_held() -> None:
    with refusing_port() as port, socket.socket() as s:
        s.settimeout(5)
        with pytest.raises(ConnectionRefusedError):
            s.connect(("127.0.0.1", port))
