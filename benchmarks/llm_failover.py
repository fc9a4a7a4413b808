"""Part (5) of the language-model benchmark: failover and admission, on the gateway's own
`LanguageModel` (its primary in an engine process, its CPU replica beside it).

Failover: `streams` greedy requests at once on the primary; once every one has sent a third
of its tokens, the primary's process is killed (by its pid). Measured per stream: seconds from
the kill to its next token (from the replica), whether it completed (`lost` otherwise), and
its tokens against the same request's uninterrupted answer (`repeated_tokens`: tokens after
the first difference, so a repeated or a wrong token both count). Rounds wait for the engine
to come back.

Admission: requests of mixed prompt lengths offered at once at 0.5x to 3x of the primary's KV
capacity (the sum of their blocks over the cache's), with the gateway's default bounds on
waiting. Counted: answers that ended in an out-of-memory error (`oom`), and false refusals
(`false_refusal_rate`, over every request offered): a refusal at a load the primary's cache
holds at once (0.5x, 1x), or of a request whose blocks the primary reported free when it was
refused.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import percentile
from fleet.core.errors import ResourceExhausted, Unavailable
from gateway.breaker import CircuitBreaker
from gateway.llm.remote import EngineProcess
from gateway.llm.sampling import SamplingParams
from gateway.llm.serving import LanguageModel, Limits, Resumable
from gateway.model import DeviceFault

LOADS = (0.5, 1.0, 2.0, 3.0)


@dataclass
class Stream:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    error: str | None = None
    replica_first: float | None = None
    """When its first token from the replica came (after the primary failed under it)."""


async def _consume(lm: LanguageModel, s: Stream, params: SamplingParams, key: str) -> None:
    try:
        route, (p,) = await lm.plan([(s.prompt, params)], streaming=True)
        async for event in lm.generate(s.prompt, p, request_id=key, route=route):
            s.tokens.append(event.token_id)
            s.times.append(time.monotonic())
            if route.failovers and s.replica_first is None:
                s.replica_first = s.times[-1]
    except (DeviceFault, Resumable, Unavailable, ResourceExhausted) as exc:
        s.error = f"{type(exc).__name__}: {exc}"


async def _until(condition: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def failover(
    model_dir: Path, prompts: list[list[int]], max_tokens: int, rounds: int
) -> dict[str, Any]:
    n = len(prompts)
    context = 1 << 30
    lm = LanguageModel.open(
        model_dir, "cpu", limits=Limits(max_batch=n, replica_max_batch=n,
                                        replica_context_length=context),
    )  # fmt: skip
    lm.log_level = "error"
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    delays: list[float] = []
    lost = repeated = 0
    try:
        await lm.engine()
        reference = [Stream(p) for p in prompts]
        await asyncio.gather(*(_consume(lm, s, params, f"ref-{i}")
                               for i, s in enumerate(reference)))  # fmt: skip
        for r in range(rounds):
            primary = lm.primary
            assert isinstance(primary, EngineProcess)
            if not await _until(lambda p=primary: p.serving, 120):
                raise RuntimeError("the primary engine did not come back")
            lm.breaker = CircuitBreaker(1, 2.0)  # (each round starts on a trusted primary)
            streams = [Stream(p) for p in prompts]
            tasks = [asyncio.create_task(_consume(lm, s, params, f"r{r}-{i}"))
                     for i, s in enumerate(streams)]  # fmt: skip
            third = max(1, max_tokens // 3)

            def begun(ss: list[Stream] = streams, k: int = third) -> bool:
                return all(len(s.tokens) >= min(k, len(ref.tokens) - 1)
                           for s, ref in zip(ss, reference, strict=True))  # fmt: skip

            await _until(begun, 60)
            killed = time.monotonic()
            primary.kill()
            await asyncio.gather(*tasks)
            for s, ref in zip(streams, reference, strict=True):
                if s.error is not None or len(s.tokens) < len(ref.tokens):
                    lost += 1
                    continue
                if s.replica_first is not None:
                    delays.append(s.replica_first - killed)
                pairs = enumerate(zip(s.tokens, ref.tokens, strict=False))
                same = next((i for i, (a, b) in pairs if a != b),
                            min(len(s.tokens), len(ref.tokens)))  # fmt: skip
                repeated += len(s.tokens) - same
    finally:
        await lm.aclose()
    return {
        "failover_p95_s": percentile(delays, 0.95) if delays else None, "lost": lost,
        "repeated_tokens": repeated, "failover_samples": len(delays),
        "failover_max_s": max(delays, default=None),
    }  # fmt: skip


async def admission(
    model_dir: Path, make_prompts: Any, seed: int, max_batch: int, max_tokens: int
) -> dict[str, Any]:
    """`make_prompts(n, seed)`: n prompts of mixed lengths."""
    lm = LanguageModel.open(model_dir, "cpu", limits=Limits(max_batch=max_batch))
    lm.log_level = "error"
    rng = random.Random(seed)
    offered = refused = false_refusals = oom = 0
    by_load: dict[str, dict[str, int]] = {}
    try:
        await lm.engine()
        primary = lm.primary
        assert isinstance(primary, EngineProcess)
        await _until(lambda: bool(primary.stats_seen), 10)
        total = int(primary.stats_seen["blocks_total"])
        block = int(primary.stats_seen["block_size"])
        for load in LOADS:
            await _until(lambda: primary.stats_seen.get("blocks_free") == total, 60)
            prompts: list[list[int]] = []
            blocks = 0
            for p in make_prompts(4 * max_batch * 4, rng.randrange(1 << 30)):
                need = -(-(len(p) + max_tokens) // block)
                if blocks + need > load * total:
                    break
                prompts.append(p)
                blocks += need
            outcome = {"offered": len(prompts), "refused": 0, "false": 0, "oom": 0}

            async def one(i: int, prompt: list[int], load: float = load,
                          outcome: dict[str, int] = outcome) -> None:  # fmt: skip
                params = SamplingParams(max_tokens=max_tokens, temperature=0)
                need = -(-(len(prompt) + max_tokens) // block)
                try:
                    route, (p,) = await lm.plan([(prompt, params)], streaming=False)
                except (ResourceExhausted, Unavailable):
                    outcome["refused"] += 1
                    free = int(primary.stats_seen.get("blocks_free", 0))
                    if load <= 1.0 or free >= need:
                        outcome["false"] += 1
                    return
                try:
                    async for _ in lm.generate(prompt, p, request_id=f"a{load}-{i}", route=route):
                        pass
                except (DeviceFault, Resumable) as exc:
                    if "oom" in str(exc) or "out of memory" in str(exc).lower():
                        outcome["oom"] += 1

            await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            by_load[f"{load:g}x"] = outcome
            offered += outcome["offered"]
            refused += outcome["refused"]
            false_refusals += outcome["false"]
            oom += outcome["oom"]
    finally:
        await lm.aclose()
    return {"false_refusal_rate": false_refusals / offered if offered else None, "oom": oom,
            "admission_offered": offered, "admission_refused": refused,
            "admission_by_load": by_load}  # fmt: skip
