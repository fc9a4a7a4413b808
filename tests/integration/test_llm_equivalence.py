"""A CPU replica's continuation equals the primary's answer, token for token (float32).

Real engines with the shipped model: the primary answers 200 fixed prompts (short, long, near
the context limit; chat-templated and raw) all at once, in batches of 32; a second float32
engine continues each answer from the start and from its middle, with the cache recomputed from
prompt + tokens already sent, all at once as well. The bfloat16 primary's figure is measured
and logged, not asserted: it is the precision the replica does not reproduce.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import structlog
import torch

from benchmarks import llm_equivalence
from benchmarks.llm_equivalence import KINDS, SHIPPED, cut_points, equivalence, prompt_set
from gateway.llm import engine as engine_module
from gateway.llm.kv_cache import PagedKVCache
from gateway.llm.llama import Llama
from gateway.llm.manifest import load_manifest
from gateway.llm.paged import StepInput, forward_step

log = structlog.get_logger(__name__)

N = 200
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def fp32() -> dict[str, Any]:
    return equivalence(SHIPPED, primary_dtype="float32", n=N, max_tokens=MAX_TOKENS)


def test_the_prompt_set_is_fixed_and_spans_the_context() -> None:
    context = load_manifest(SHIPPED).context_length
    prompts = prompt_set(SHIPPED, N, MAX_TOKENS)
    assert len(prompts) == N >= 200
    assert prompts == prompt_set(SHIPPED, N, MAX_TOKENS), "the same prompts on every call"
    assert prompts[:12] == prompt_set(SHIPPED, 12, MAX_TOKENS), "a prefix of the set is a set"
    kinds = {k: len(range(i, N, len(KINDS))) for i, k in enumerate(KINDS)}
    assert Counter(p.kind for p in prompts) == kinds, "the kinds taken in turn"
    assert len({p.ids for p in prompts}) == N, "no prompt is repeated"
    lengths = {k: [len(p.ids) for p in prompts if p.kind == k] for k in KINDS}
    budget = context - MAX_TOKENS
    assert all(len(p.ids) <= budget for p in prompts), "every answer fits the context"
    assert max(lengths["short-chat"] + lengths["short-raw"]) <= 128
    assert min(lengths["near-chat"]) >= budget - 160
    assert set(lengths["near-raw"]) == {budget}, "raw prompts reach the limit exactly"
    assert max(lengths["long-chat"]) > 200


def test_cut_points_never_resume_past_the_last_token() -> None:
    assert cut_points(0, (0.0, 0.5)) == [0]
    assert cut_points(1, (0.0, 0.5, 1.0)) == [0]
    assert cut_points(9, (0.0, 0.5, 1.0)) == [0, 4, 8]


def test_fp32_replica_continues_every_answer_identically(fp32: dict[str, Any]) -> None:
    assert fp32["prompts"] == N
    assert fp32["first_mismatch"] is None, fp32["first_mismatch"]
    assert fp32["share"] == fp32["equivalence_fp32"] == 1.0
    assert fp32["share_by_cut"] == {"0.0": 1.0, "0.5": 1.0}
    # The comparison is not vacuous: answers have tokens, and most were cut mid-stream too.
    assert fp32["answer_tokens"] >= 2 * N
    assert fp32["continuations"] >= N + N // 2


def test_bf16_primary_is_measured(fp32: dict[str, Any]) -> None:
    """bfloat16 rounds differently from the float32 replica: the share is reported only."""
    bf16 = equivalence(SHIPPED, primary_dtype="bfloat16", n=36, max_tokens=MAX_TOKENS)
    share = bf16["equivalence_bf16"]
    assert isinstance(share, float) and 0.0 <= share <= 1.0
    assert set(bf16["share_by_cut"]) == {"0.0", "0.5"}
    log.info("llm_equivalence_bf16", share=share, by_cut=bf16["share_by_cut"],
             first_mismatch=bf16["first_mismatch"], fp32=fp32["share"])  # fmt: skip


def test_a_batch_dependent_step_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measure sees what it is for: logits that depend on what else is in the batch
    (here a nudge that grows with the batch) make answers differ, and the first is named."""

    def batch_dependent(
        model: Llama, cache: PagedKVCache, batch: Sequence[StepInput]
    ) -> torch.Tensor:
        logits = forward_step(model, cache, batch)
        nudge = torch.Generator().manual_seed(len(batch))
        return logits + 2.0 * torch.randn(logits.shape[-1], generator=nudge)

    monkeypatch.setattr(engine_module, "forward_step", batch_dependent)
    result = llm_equivalence.equivalence(SHIPPED, n=24, max_tokens=16)
    assert result["share"] < 1.0
    mismatch = result["first_mismatch"]
    assert mismatch is not None
    assert mismatch["primary_token"] != mismatch["replica_token"]
    assert 0 <= mismatch["prompt"] < 24 and mismatch["position"] >= mismatch["cut"]
