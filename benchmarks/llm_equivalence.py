"""Does a CPU replica that takes over a request give the answer the primary would have given?

The gateway's failover continues a request that already streamed tokens on the CPU replica:
the replica recomputes the KV cache from the prompt plus the tokens sent, in one prefill, and
decodes on from there, in a batch of its own. For greedy decoding that continuation must equal
what the primary would have produced. Two things could make it differ even when both run the
same weights: the precision (a bfloat16 primary against the float32 replica), and the shape of
the work, since the primary decoded each token inside a batch of up to 32 other sequences and
prefilled the prompt padded beside others, while the replica prefilled prompt + answer alone or
beside different neighbours.

`equivalence` measures exactly that on a fixed prompt set (`prompt_set`: short, long and
near-the-context-limit prompts, chat-templated and raw, made from the shipped model's training
text generator with fixed seeds, so every run asks the same questions):

- the primary path: every prompt submitted at once to one engine (batches of up to 32),
  each answered greedily without interruption;
- the replica path: for every prompt and every cut point k (0, the middle of the primary's
  answer, ...), a continuation on a separate float32 CPU engine with `resume_from` = the
  primary's first k tokens, all submitted at once as well, so they too share batches.

A prompt counts as identical when every continuation equals the primary's answer token for
token. The result names the first mismatch (prompt, cut, position, both tokens) for diagnosis.

Run from the repository's root: `python -m benchmarks.llm_equivalence [--dtype bfloat16]`;
the last line printed is the result as JSON.
"""

# ruff: noqa: T201 (a benchmark's output is what it prints)

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import structlog
import torch
from tokenizers import Tokenizer

from fleet.core.errors import FailedPrecondition, InvalidArgument
from gateway.llm.engine import LLMEngine
from gateway.llm.manifest import ModelManifest, load_manifest, load_tokenizer, render_chat
from gateway.llm.sampling import SamplingParams
from gateway.settings import WEIGHTS_DIR

log = structlog.get_logger(__name__)

REPO = Path(__file__).resolve().parent.parent
TRANSCRIPTS = REPO / "scripts" / "llm_transcripts.py"
SHIPPED = WEIGHTS_DIR / "fleet-tiny-chat-v1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

KINDS = ("short-chat", "short-raw", "long-chat", "long-raw", "near-chat", "near-raw")
"""Prompt kinds, taken in turn: prompt i is of kind KINDS[i % 6]."""
SEED = 20_240_917
"""The prompt set's seed; the training data uses small seeds, the held-out check 10_000_000+."""
DEFAULT_CUTS = (0.0, 0.5)
"""Where the replica takes over, as a share of the primary's answer: 0.0 (the request moved
before its first token) and 0.5 (mid-stream); 1.0 is the last token that may still follow."""


@dataclass(frozen=True)
class Prompt:
    index: int
    kind: str
    ids: tuple[int, ...]


def _transcripts() -> ModuleType:
    """The training text generator (scripts/llm_transcripts.py): not a package, so loaded by
    path from the checkout this module lives in."""
    spec = importlib.util.spec_from_file_location("llm_transcripts", TRANSCRIPTS)
    if spec is None or spec.loader is None or not TRANSCRIPTS.is_file():
        raise FailedPrecondition(f"{TRANSCRIPTS}: the training text generator is missing")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prompt_set(
    model_dir: Path, n: int = 200, max_tokens: int = 32, seed: int = SEED
) -> list[Prompt]:
    """`n` prompts for the model in `model_dir`, the same on every run, each short enough that
    `max_tokens` more tokens fit its context.

    Chat prompts are tool-using conversations rendered by the model's own template, ending
    where the assistant speaks next (after a user request or after a tool's output). Raw ones
    are the rendered text cut at a token boundary, often mid-sentence. Short: one exchange or
    its beginning (tens of tokens); long: several exchanges (a few hundred); near the limit:
    as many exchanges as fit, raw ones cut at exactly context_length - max_tokens tokens.
    """
    if n < 1:
        raise InvalidArgument(f"n must be at least 1, not {n}")
    manifest = load_manifest(model_dir)
    tokenizer = load_tokenizer(model_dir, manifest)
    budget = manifest.context_length - max_tokens
    if budget < 16:
        raise InvalidArgument(
            f"max_tokens {max_tokens} leaves {budget} prompt tokens of the context length "
            f"{manifest.context_length}; at least 16 are needed"
        )
    text = _transcripts()
    prompts = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        rng = random.Random(seed * 1_000_003 + i)
        ids = _prompt(text, manifest, tokenizer, rng, kind, budget)
        prompts.append(Prompt(i, kind, tuple(ids)))
    return prompts


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def _prompt(
    text: ModuleType,
    manifest: ModelManifest,
    tokenizer: Tokenizer,
    rng: random.Random,
    kind: str,
    budget: int,
) -> list[int]:
    size, form = kind.split("-")
    exchanges = {"short": 1, "long": rng.randint(2, 4), "near": 64}[size]
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(text.SYSTEM_PROMPTS)})
    tools = [text.SHELL_TOOL]
    fitting: list[int] = []
    for _ in range(exchanges):
        turn = text.exchange(rng, rng.choice(text.TASKS)(rng))
        # Chat prompts end where the assistant answers: after the request (it should call the
        # tool) or after the tool's output (it should answer from it).
        end = rng.choice((1, 3)) if form == "chat" else 4
        ids = _encode(tokenizer, render_chat(manifest, messages + turn[:end], tools))
        if len(ids) > budget and form == "chat":
            break
        fitting = ids
        messages += turn
        if len(ids) > budget:  # raw text is cut to size below
            break
    if form == "chat":
        if not fitting:  # one request alone overflows a tiny budget: it is cut
            first = text.exchange(rng, rng.choice(text.TASKS)(rng))[:1]
            fitting = _encode(tokenizer, render_chat(manifest, first, tools))[:budget]
        return fitting
    whole = _encode(tokenizer, render_chat(manifest, messages, tools, add_generation_prompt=False))
    if size == "near":
        return whole[:budget]
    return whole[: rng.randint(max(1, len(whole) // 3), len(whole))][:budget]


# -- running the engines -------------------------------------------------------------------


async def _answer(
    engine: LLMEngine,
    prompt: Sequence[int],
    params: SamplingParams,
    request_id: str,
    resume_from: Sequence[int] = (),
) -> list[int]:
    tokens: list[int] = []
    async for event in engine.generate(
        prompt, params, request_id=request_id, resume_from=resume_from
    ):
        if event.finish_reason == "abort":
            raise RuntimeError(f"request {request_id} was aborted")
        tokens.append(event.token_id)
    return tokens


async def _answers(
    engine: LLMEngine, jobs: Sequence[tuple[str, Sequence[int], Sequence[int]]], max_tokens: int
) -> list[list[int]]:
    """Every job (request id, prompt, resumed tokens) submitted at once; their answers."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return list(await asyncio.gather(*(_answer(engine, p, params, rid, r) for rid, p, r in jobs)))


def cut_points(answer_length: int, cuts: Sequence[float]) -> list[int]:
    """The distinct places (tokens already sent) where a replica may take over an answer of
    this length: never after its last token, which may be the stop token that ended it."""
    last = max(answer_length - 1, 0)
    return sorted({min(last, round(c * last)) for c in cuts})


def equivalence(
    model_dir: Path = SHIPPED,
    *,
    primary_dtype: str = "float32",
    device: str = "cpu",
    n: int = 200,
    max_tokens: int = 32,
    cuts: Sequence[float] = DEFAULT_CUTS,
    max_batch: int = 32,
    seed: int = SEED,
) -> dict[str, Any]:
    """Greedy answers of a primary engine (`device`, `primary_dtype`) against continuations
    on a float32 CPU replica, on `prompt_set(model_dir, n, max_tokens, seed)`.

    Returns `share` (prompts whose every continuation equals the primary's answer, 0..1, also
    under `equivalence_fp32` or `equivalence_bf16` after the primary's dtype), `share_by_cut`
    (per cut point as given), counts, and `first_mismatch` (None, or the prompt's index and
    kind, the cut, the position in the answer and both tokens there).
    """
    if primary_dtype not in DTYPES:
        raise InvalidArgument(f"primary_dtype {primary_dtype!r} is not one of {', '.join(DTYPES)}")
    for c in cuts:
        if not 0.0 <= c <= 1.0:
            raise InvalidArgument(f"cuts: {c!r} is not a share of the answer in [0, 1]")
    prompts = prompt_set(model_dir, n, max_tokens, seed)
    started = time.perf_counter()
    primary = LLMEngine(model_dir, device, DTYPES[primary_dtype], max_batch=max_batch)
    try:
        answers = asyncio.run(
            _answers(primary, [(f"p{p.index}", p.ids, ()) for p in prompts], max_tokens)
        )
    finally:
        primary.close()
    primary_s = time.perf_counter() - started

    jobs: list[tuple[str, Sequence[int], Sequence[int]]] = []
    owners: list[tuple[int, int, float]] = []  # (prompt, k, the cut it stands for)
    for p, answer in zip(prompts, answers, strict=True):
        for c in cuts:
            owners.append((p.index, cut_points(len(answer), [c])[0], c))
        for k in cut_points(len(answer), cuts):
            jobs.append((f"r{p.index}-{k}", p.ids, answer[:k]))
    replica = LLMEngine(model_dir, "cpu", torch.float32, max_batch=max_batch)
    try:
        continued = asyncio.run(_answers(replica, jobs, max_tokens))
    finally:
        replica.close()
    by_job = {rid: answer for (rid, _, _), answer in zip(jobs, continued, strict=True)}

    identical = [True] * len(prompts)
    same_by_cut = {c: 0 for c in cuts}
    first: dict[str, Any] | None = None
    for index, k, c in owners:
        expected = answers[index][k:]
        got = by_job[f"r{index}-{k}"]
        if got == expected:
            same_by_cut[c] += 1
            continue
        identical[index] = False
        at = next(
            (i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
            min(len(expected), len(got)),
        )
        if first is None or (index, k) < (first["prompt"], first["cut"]):
            first = {
                "prompt": index,
                "kind": prompts[index].kind,
                "prompt_tokens": len(prompts[index].ids),
                "cut": k,
                "position": k + at,
                "primary_token": expected[at] if at < len(expected) else None,
                "replica_token": got[at] if at < len(got) else None,
            }
    share = sum(identical) / len(prompts)
    lengths = [len(p.ids) for p in prompts]
    result: dict[str, Any] = {
        "model": load_manifest(model_dir).model_id,
        "device": device,
        "primary_dtype": primary_dtype,
        "replica_dtype": "float32",
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "prompt_tokens_min": min(lengths),
        "prompt_tokens_max": max(lengths),
        "answer_tokens": sum(len(a) for a in answers),
        "continuations": len(jobs),
        "share": share,
        f"equivalence_{'fp32' if primary_dtype == 'float32' else 'bf16'}": share,
        "share_by_cut": {str(c): same_by_cut[c] / len(prompts) for c in cuts},
        "first_mismatch": first,
        "primary_s": round(primary_s, 3),
        "total_s": round(time.perf_counter() - started, 3),
    }
    log.info("llm_equivalence_measured", **{k: v for k, v in result.items() if k != "model"})
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", type=Path, default=SHIPPED)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cuts", type=float, nargs="+", default=list(DEFAULT_CUTS))
    args = parser.parse_args(argv)
    result = equivalence(
        args.model, primary_dtype=args.dtype, device=args.device, n=args.n,
        max_tokens=args.max_tokens, cuts=args.cuts,
    )  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
