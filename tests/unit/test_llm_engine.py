"""The paged-KV engine against the reference forward, on a tiny random model (real torch)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from fleet.core.errors import InvalidArgument, ResourceExhausted
from gateway.llm.detok import TextStream
from gateway.llm.engine import ABORTED_TOKEN, LLMEngine, TokenEvent
from gateway.llm.kv_cache import PagedKVCache, bytes_per_token
from gateway.llm.llama import greedy
from gateway.llm.paged import forward_step
from gateway.llm.sampling import Sampler, SamplingParams
from gateway.model import DeviceFault
from tests.llm_fixtures import CONTEXT, write_tiny_model

PROMPTS = [
    "The agent runs",
    "echo hello world",
    "café",
    "A quick brown fox jumps over the lazy dog and then",
    "Then it answers: the directory holds three files. The agent runs ls -la again",
]
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llm") / "tiny")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[LLMEngine]:
    engine = LLMEngine(model_dir, max_batch=8)
    yield engine
    engine.close()


def encode(engine: LLMEngine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text).ids)


def reference(engine: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    stop = set(engine.manifest.stop_token_ids) | {engine.manifest.eos_token_id}
    return greedy(engine.model, prompt, max_tokens, stop)


async def run(
    engine: LLMEngine,
    prompt: list[int],
    params: SamplingParams,
    request_id: str,
    resume_from: Sequence[int] = (),
) -> list[TokenEvent]:
    return [
        e
        async for e in engine.generate(
            prompt, params, request_id=request_id, resume_from=resume_from
        )
    ]


def ids(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events]


async def all_blocks_free(engine: LLMEngine) -> bool:
    for _ in range(500):  # up to ~5 s: the scheduler frees between steps
        if engine.stats()["blocks_free"] == engine.cache.num_blocks:
            return True
        await asyncio.sleep(0.01)
    return False


# -- the paged forward equals the reference ---------------------------------------------------


async def test_greedy_alone_matches_the_reference_forward(engine: LLMEngine) -> None:
    for i, text in enumerate(PROMPTS):
        prompt = encode(engine, text)
        events = await run(engine, prompt, GREEDY, f"alone-{i}")
        assert ids(events) == reference(engine, prompt, GREEDY.max_tokens), text
        assert events[-1].finish_reason in ("stop", "length")
        assert all(e.finish_reason is None for e in events[:-1])
    assert await all_blocks_free(engine)


async def test_greedy_in_one_batch_with_sequences_joining_midway(engine: LLMEngine) -> None:
    long_params = SamplingParams(max_tokens=80, temperature=0)
    prompts = [encode(engine, t) for t in PROMPTS]
    expected = [reference(engine, p, long_params.max_tokens) for p in prompts]
    # The longest answer runs first; the others join while it is mid-way.
    lead = max(range(len(prompts)), key=lambda i: len(expected[i]))
    assert len(expected[lead]) >= 40
    others = [i for i in range(len(prompts)) if i != lead]
    order: list[str] = []

    async def tracked(name: str, prompt: list[int], params: SamplingParams) -> list[int]:
        out: list[int] = []
        async for event in engine.generate(prompt, params, request_id=name):
            order.append(name)
            out.append(event.token_id)
        return out

    first = asyncio.create_task(tracked("first", prompts[lead], long_params))
    for _ in range(2000):  # until the first has produced a few tokens (bounded)
        if order.count("first") >= 5:
            break
        await asyncio.sleep(0.001)
    joiners = [tracked(f"join-{i}", prompts[i], GREEDY) for i in others]
    results = await asyncio.gather(first, *joiners)

    assert results[0] == expected[lead]
    for i, got in zip(others, results[1:], strict=True):
        assert got == expected[i][: GREEDY.max_tokens]
    # The joiners ran while the first was mid-answer: they shared its decode steps.
    first_done = len(order) - 1 - order[::-1].index("first")
    first_joiner_token = next(i for i, name in enumerate(order) if name != "first")
    assert 5 <= first_joiner_token < first_done
    assert await all_blocks_free(engine)


async def test_a_seeded_request_samples_the_same_alone_and_in_a_batch(engine: LLMEngine) -> None:
    prompt = encode(engine, PROMPTS[1])
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=50, seed=7)
    alone = ids(await run(engine, prompt, params, "seeded-alone"))
    crowd = [run(engine, encode(engine, t), GREEDY, f"crowd-{i}") for i, t in enumerate(PROMPTS)]
    batched, *_ = await asyncio.gather(run(engine, prompt, params, "seeded-batch"), *crowd)
    assert ids(batched) == alone
    again = ids(await run(engine, prompt, params, "seeded-again"))
    assert again == alone
    other = ids(await run(engine, prompt, SamplingParams(**{**params.__dict__, "seed": 8}), "o"))
    assert other != alone


async def test_logprobs_are_the_reference_models_own(engine: LLMEngine) -> None:
    prompt = encode(engine, PROMPTS[0])
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=True)
    events = await run(engine, prompt, params, "logprobs")
    context = list(prompt)
    for event in events:
        with torch.inference_mode():
            logits = engine.model(torch.tensor([context]))[0, -1]
        expected = float(torch.log_softmax(logits, -1)[event.token_id])
        assert event.logprob is not None and math.isclose(event.logprob, expected, abs_tol=1e-4)
        context.append(event.token_id)
    quiet = await run(engine, prompt, GREEDY, "no-logprobs")
    assert all(e.logprob is None for e in quiet)


# -- blocks, admission, abort -----------------------------------------------------------------


async def test_blocks_return_after_abort_and_when_the_client_leaves(engine: LLMEngine) -> None:
    prompt = encode(engine, PROMPTS[3])
    params = SamplingParams(max_tokens=100, temperature=0)
    events: list[TokenEvent] = []
    async for event in engine.generate(prompt, params, request_id="aborted"):
        events.append(event)
        if len(events) == 3:
            assert engine.stats()["blocks_free"] < engine.cache.num_blocks
            engine.abort("aborted")
    assert events[-1].finish_reason == "abort" and events[-1].token_id == ABORTED_TOKEN
    assert len(events) < params.max_tokens
    assert engine.stats()["blocks_free"] == engine.cache.num_blocks  # freed before the event

    stream = engine.generate(prompt, params, request_id="leaves")
    async for _ in stream:
        break
    await stream.aclose()  # the client went away
    assert await all_blocks_free(engine)
    assert engine.stats()["requests"] == 0


async def test_requests_that_cannot_fit_are_refused_up_front(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, num_blocks=4, block_size=8, max_batch=2)
    try:
        prompt = encode(engine, PROMPTS[0])
        with pytest.raises(InvalidArgument, match="context length"):
            await run(engine, prompt, SamplingParams(max_tokens=CONTEXT), "too-long")
        with pytest.raises(ResourceExhausted, match="KV blocks"):
            await run(engine, prompt, SamplingParams(max_tokens=40), "too-many-blocks")
        with pytest.raises(InvalidArgument, match=r"prompt\[1\]"):
            await run(engine, [1, 10**6], GREEDY, "bad-token")
        with pytest.raises(InvalidArgument, match="prompt"):
            await run(engine, [], GREEDY, "empty")
        assert engine.admission(len(prompt), 40).fits_ever is False
        assert engine.stats()["blocks_free"] == 4 and engine.stats()["requests"] == 0

        # Two requests that each need the whole cache: the second waits, then runs.
        need = 4 * 8 - len(prompt)
        params = SamplingParams(max_tokens=need, temperature=0)
        assert engine.admission(len(prompt), need).blocks_needed == 4
        a, b = await asyncio.gather(
            run(engine, prompt, params, "a"), run(engine, prompt, params, "b")
        )
        assert ids(a) == ids(b) == reference(engine, prompt, need)
        assert engine.stats()["blocks_free"] == 4
    finally:
        engine.close()


def test_bytes_per_cached_token_is_the_models_theory(model_dir: Path) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        cache = PagedKVCache(
            num_layers=2, num_blocks=10, block_size=16, kv_heads=2, head_dim=16,
            dtype=dtype, device="cpu",
        )  # fmt: skip
        theory = 2 * 2 * 2 * 16 * dtype.itemsize
        assert cache.bytes_per_token == cache.theoretical_bytes_per_token == theory
        assert bytes_per_token(2, 2, 16, dtype) == theory
        blocks = cache.allocate(17)  # whole blocks: 17 tokens take two
        assert len(blocks) == 2 and cache.num_free == 8
        cache.free(blocks)
        assert cache.num_free == 10
        with pytest.raises(ValueError, match="not lent"):
            cache.free(blocks)


async def test_a_device_fault_ends_its_batch_and_the_engine_serves_on(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = LLMEngine(model_dir, max_batch=4)
    try:
        prompt = encode(engine, PROMPTS[1])
        calls = 0

        def failing_step(*args: object) -> torch.Tensor:
            nonlocal calls
            calls += 1
            if calls == 3:  # a decode step, both requests in the batch
                raise torch.OutOfMemoryError("injected: no memory for the step")
            return forward_step(*args)  # type: ignore[arg-type]

        monkeypatch.setattr("gateway.llm.engine.forward_step", failing_step)
        params = SamplingParams(max_tokens=20, temperature=0)
        results = await asyncio.gather(
            run(engine, prompt, params, "f1"), run(engine, prompt, params, "f2"),
            return_exceptions=True,
        )  # fmt: skip
        assert all(isinstance(r, DeviceFault) and r.kind == "oom" for r in results), results
        assert engine.stats()["blocks_free"] == engine.cache.num_blocks
        assert engine.stats()["faults"] == 1 and engine.stats()["requests"] == 0
        after = await run(engine, prompt, params, "after")
        assert ids(after) == reference(engine, prompt, params.max_tokens)
    finally:
        engine.close()


# -- continuation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=14, temperature=0, logprobs=True),
        SamplingParams(max_tokens=14, temperature=1.1, top_p=0.9, seed=1234, logprobs=True),
        SamplingParams(max_tokens=14, temperature=0.7, top_k=20, seed=99),
    ],
    ids=["greedy", "top-p", "top-k"],
)
async def test_a_continuation_yields_exactly_the_remaining_tokens(
    engine: LLMEngine, params: SamplingParams
) -> None:
    prompt = encode(engine, PROMPTS[2])
    full = await run(engine, prompt, params, "uninterrupted")
    assert len(full) >= 6
    for cut in (1, 4, len(full) - 1):
        sent = ids(full[:cut])
        rest = await run(engine, prompt, params, f"resumed-{cut}", resume_from=sent)
        assert ids(rest) == ids(full[cut:])
        assert [e.text for e in rest] == [e.text for e in full[cut:]]
        assert [e.finish_reason for e in rest] == [e.finish_reason for e in full[cut:]]
        for a, b in zip(rest, full[cut:], strict=True):
            assert (a.logprob is None) == (b.logprob is None)
            if a.logprob is not None and b.logprob is not None:
                assert math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
    with pytest.raises(InvalidArgument, match="resume_from"):
        await run(engine, prompt, params, "nothing-left", resume_from=ids(full) * 2)


# -- stop rules -------------------------------------------------------------------------------


async def test_stop_strings_across_token_boundaries_never_leak(engine: LLMEngine) -> None:
    prompt = encode(engine, PROMPTS[0])
    params = SamplingParams(max_tokens=20, temperature=0)
    full = await run(engine, prompt, params, "no-stop")
    pieces = [engine._decode([t]) for t in ids(full)]
    text = "".join(pieces)
    # A stop string made of the end of one token's text and the start of the next's.
    cut = next(
        i for i in range(1, len(pieces) - 1)
        if pieces[i] and pieces[i + 1] and "\ufffd" not in pieces[i] + pieces[i + 1]
    )  # fmt: skip
    stop = pieces[i := cut][-1:] + pieces[i + 1][:2]
    expected = text[: text.find(stop)]
    stopped = await run(engine, prompt, SamplingParams(**{**params.__dict__, "stop": (stop,)}), "s")
    assert stopped[-1].finish_reason == "stop"
    emitted = "".join(e.text for e in stopped)
    assert emitted == expected and stop not in emitted
    assert ids(stopped) == ids(full)[: len(stopped)]


def test_text_stream_holds_back_partial_stops_and_characters() -> None:
    letters = "abcabxabcd"

    def decode(tokens: Sequence[int]) -> str:
        return "".join(letters[t] for t in tokens)

    stream = TextStream(decode, ("abcd", "xz"))
    out = [stream.push(i) for i in range(len(letters))]
    assert [r.text for r in out] == ["", "", "", "abc", "", "ab", "x", "", "", ""]
    assert out[-1].stopped and stream.released == "abcabx"

    euro = "a€b".encode()  # three bytes for €: a token per byte splits it

    def decode_bytes(tokens: Sequence[int]) -> str:
        return bytes(euro[t] for t in tokens).decode("utf-8", errors="replace")

    stream = TextStream(decode_bytes)
    texts = [stream.push(i).text for i in range(len(euro))]
    assert texts == ["a", "", "", "€", "b"] and stream.finish() == ""


async def test_stop_token_ids_end_the_answer_without_their_text(engine: LLMEngine) -> None:
    prompt = encode(engine, PROMPTS[4])
    full = await run(engine, prompt, SamplingParams(max_tokens=10, temperature=0), "full")
    stop_at = ids(full)[3]
    first = ids(full).index(stop_at)
    params = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(stop_at,))
    stopped = await run(engine, prompt, params, "stop-id")
    assert ids(stopped) == ids(full)[: first + 1]
    assert stopped[-1].finish_reason == "stop"
    assert "".join(e.text for e in stopped) == engine._decode(ids(full)[:first])


# -- sampling rules ---------------------------------------------------------------------------


def test_sampler_rules() -> None:
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0, 0.5])
    assert Sampler(SamplingParams(max_tokens=1, temperature=0)).sample(logits) == 1
    top1 = Sampler(SamplingParams(max_tokens=1, top_k=1, seed=3))
    assert [top1.sample(logits) for _ in range(5)] == [1] * 5 and top1.draws == 5
    tiny_p = Sampler(SamplingParams(max_tokens=1, top_p=0.01, seed=3))
    assert {tiny_p.sample(logits) for _ in range(5)} == {1}
    top2 = Sampler(SamplingParams(max_tokens=1, top_k=2, seed=5))
    assert {top2.sample(logits) for _ in range(50)} == {1, 2}

    # A fresh sampler advanced by n draws continues the stream exactly.
    params = SamplingParams(max_tokens=1, temperature=1.5, seed=11)
    whole = Sampler(params)
    tokens = [whole.sample(logits) for _ in range(20)]
    later = Sampler(params, draws_used=8)
    assert [later.sample(logits) for _ in range(12)] == tokens[8:]
    with pytest.raises(InvalidArgument, match="greedy"):
        Sampler(SamplingParams(max_tokens=1, temperature=0), draws_used=1)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": 1 << 64}, "seed"),
        ({"stop": ("",)}, r"stop\[0\]"),
        ({"stop_token_ids": (-1,)}, r"stop_token_ids\[0\]"),
    ],
)
def test_bad_sampling_parameters_are_refused_by_name(fields: dict[str, object], named: str) -> None:
    values: dict[str, object] = {"max_tokens": 4, **fields}
    with pytest.raises(InvalidArgument, match=named):
        SamplingParams(**values)  # type: ignore[arg-type]


# -- bfloat16 ---------------------------------------------------------------------------------


async def test_bfloat16_runs_greedy_and_sampled(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, dtype=torch.bfloat16, max_batch=4)
    try:
        assert engine.stats()["kv_bytes_per_token"] == engine.stats()["kv_bytes_per_token_theory"]
        assert engine.cache.k.dtype == torch.bfloat16
        prompt = encode(engine, PROMPTS[0])
        greedy_run, sampled = await asyncio.gather(
            run(engine, prompt, SamplingParams(max_tokens=6, temperature=0), "bf-greedy"),
            run(engine, prompt, SamplingParams(max_tokens=6, seed=1, logprobs=True), "bf-s"),
        )
        for events in (greedy_run, sampled):
            assert events[-1].finish_reason in ("stop", "length")
            assert all(0 <= t < engine.spec.vocab_size for t in ids(events))
        assert all(e.logprob is not None and e.logprob <= 0 for e in sampled)
        assert await all_blocks_free(engine)
    finally:
        engine.close()
