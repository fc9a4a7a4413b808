"""The language model's engine: continuous batching over a paged KV cache.

Requests arrive as async generators (`LLMEngine.generate`); the model runs in one thread of its
own, the scheduler, so the event loop never waits on a forward pass (torch releases the
interpreter lock inside its operators). Between two steps the scheduler:

1. drops aborted requests (their client went away, or `abort` was called) and returns their
   blocks to the free list;
2. admits waiting requests, oldest first, while the batch has room (`max_batch`) and the cache
   has the blocks for the request's prompt and its whole `max_tokens`; the head of the queue
   waits for blocks rather than being overtaken, so a long request is never starved;
3. runs one prefill for the newly admitted (their prompts, padded into one batch) and one
   decode step for everything already running, samples a token per sequence, and hands each
   request its event; a sequence that finished leaves the batch and frees its blocks at once.

Every request is checked up front (`check`): a prompt that does not fit the context with its
`max_tokens`, or that needs more blocks than the whole cache has, is refused before it queues,
so an admitted request always completes without running out of cache.

Continuation (failover): `generate(..., resume_from=tokens already sent)` recomputes the cache
from the prompt plus those tokens in one prefill, advances the sampler's stream by the draws
they used (one per sampled token) and rebuilds the text stream's state from them, then goes on
with the next token: what follows equals what the uninterrupted run would have produced, for
greedy decoding and for seeded sampling, given the same logits.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from fleet.core.errors import AlreadyExists, InvalidArgument, ResourceExhausted, Unavailable
from gateway.llm.detok import TextStream
from gateway.llm.kv_cache import Admission, PagedKVCache
from gateway.llm.llama import load_model
from gateway.llm.manifest import load_tokenizer
from gateway.llm.paged import StepInput, forward_step
from gateway.llm.sampling import Sampler, SamplingParams, chosen_logprobs
from gateway.model import DeviceFault

log = structlog.get_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The precisions an engine serves, by name."""

ABORTED_TOKEN = -1
"""The token id of the event that reports an abort: no token was generated."""


@dataclass
class TokenEvent:
    """One generated token and the text it releases (empty while a multi-byte character or a
    possible stop string is incomplete). The last event of an answer carries its
    `finish_reason`: "stop" (a stop token, whose text is not included, or a stop string, cut
    off with what follows), "length" (`max_tokens` reached) or "abort" (token id -1)."""

    token_id: int
    text: str
    logprob: float | None
    finish_reason: str | None


@dataclass(eq=False)
class _Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    sampler: Sampler
    text: TextStream
    stop_ids: frozenset[int]
    generated: list[int]
    """Every token of the answer so far, a continuation's resumed tokens included."""
    deliver: Callable[[list[TokenEvent] | BaseException], None]
    blocks: list[int] = field(default_factory=list)
    slots: torch.Tensor | None = None
    cached: int = 0
    """Positions whose keys and values are in the cache."""

    @property
    def tokens(self) -> int:
        """The cache positions this request may ever need: prompt + max_tokens."""
        return len(self.prompt) + self.params.max_tokens


class LLMEngine:
    def __init__(
        self,
        model_dir: Path,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_batch: int = 32,
        max_prefill_tokens: int = 4096,
        fault: Callable[[int], None] | None = None,
    ) -> None:
        """`fault` (tests, benchmarks): called on the scheduler before each step with the
        number of steps done; what it raises fails that step as a device's error would."""
        if max_batch < 1:
            raise InvalidArgument(f"max_batch must be >= 1, not {max_batch}")
        self.spec, self.model, self.manifest = load_model(model_dir, device, dtype)
        self.tokenizer = load_tokenizer(model_dir, self.manifest)
        self.device = torch.device(device)
        self.dtype = dtype
        self.context_length = self.manifest.context_length
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.fault = fault
        if num_blocks is None:  # room for a full batch of full-context sequences
            num_blocks = max_batch * -(-self.context_length // block_size)
        self.cache = PagedKVCache(
            num_layers=self.spec.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            kv_heads=self.spec.num_key_value_heads,
            head_dim=self.spec.head_dim,
            dtype=dtype,
            device=self.device,
        )
        self._model_stop_ids = frozenset(self.manifest.stop_token_ids) | {
            self.manifest.eos_token_id
        }
        self._lock = threading.Condition()
        self._incoming: deque[_Sequence] = deque()
        self._aborts: set[str] = set()
        self._live: dict[str, _Sequence] = {}
        self._closed = False
        # Owned by the scheduler thread:
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._counters = {"steps": 0, "prefill_tokens": 0, "generated_tokens": 0, "faults": 0}
        self._log = log.bind(model=self.manifest.model_id, device=str(self.device))
        self._thread = threading.Thread(target=self._run, name="llm-scheduler", daemon=True)
        self._thread.start()
        self._log.info(
            "llm_engine_started",
            blocks=num_blocks,
            block_size=block_size,
            max_batch=max_batch,
            kv_bytes_per_token=self.cache.bytes_per_token,
        )

    # -- the request side (any thread, usually the event loop's) ---------------------------

    @property
    def bytes_per_token(self) -> int:
        """KV cache bytes per cached token, measured on the preallocated tensors."""
        return self.cache.bytes_per_token

    def admission(self, prompt_tokens: int, max_tokens: int) -> Admission:
        """Blocks a request of `prompt_tokens` + `max_tokens` needs, and whether they are free
        now (a snapshot: the scheduler may lend them meanwhile)."""
        return self.cache.admission(prompt_tokens, max_tokens)

    def check(
        self, prompt_ids: Sequence[int], params: SamplingParams, resume_from: Sequence[int] = ()
    ) -> Admission:
        """Refuses a request that can never be served here, naming why; else its admission."""
        return check_request(
            prompt_ids, params, resume_from, vocab_size=self.spec.vocab_size,
            context_length=self.context_length, admission=self.cache.admission,
        )  # fmt: skip

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str,
        resume_from: Sequence[int] = (),
        rng_draws_used: int | None = None,
    ) -> AsyncGenerator[TokenEvent, None]:
        """The answer's tokens as they are made, the last one with its finish reason.

        `resume_from`: tokens of this answer already sent (elsewhere); they are not repeated,
        and generation continues after them. `rng_draws_used` defaults to one draw per resumed
        token for a sampled request (what this engine uses), none for a greedy one. Leaving the
        iteration early (the client went away) aborts the request and frees its blocks.
        """
        sequence = self._prepare(prompt_ids, params, request_id, resume_from, rng_draws_used)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[list[TokenEvent] | BaseException] = asyncio.Queue()

        def deliver(item: list[TokenEvent] | BaseException) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        sequence.deliver = deliver
        with self._lock:
            if self._closed:
                raise Unavailable("the language model engine is closed")
            if request_id in self._live:
                raise AlreadyExists(f"request {request_id!r} is already generating")
            self._live[request_id] = sequence
            self._incoming.append(sequence)
            self._lock.notify()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                for event in item:
                    finished = event.finish_reason is not None
                    yield event
        finally:
            if not finished:
                self.abort(request_id)

    def _prepare(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        resume_from: Sequence[int],
        rng_draws_used: int | None,
    ) -> _Sequence:
        self.check(prompt_ids, params, resume_from)
        stop_ids = self._model_stop_ids | frozenset(params.stop_token_ids)
        if rng_draws_used is None:
            rng_draws_used = 0 if params.greedy else len(resume_from)
        sampler = Sampler(params, draws_used=rng_draws_used)
        text = TextStream(self._decode, params.stop)
        for i, token in enumerate(resume_from):
            if token in stop_ids or text.push(token).stopped:
                raise InvalidArgument(
                    f"resume_from[{i}]: the answer already stopped at token {token}"
                )
        return _Sequence(
            request_id=request_id,
            prompt=list(prompt_ids),
            params=params,
            sampler=sampler,
            text=text,
            stop_ids=stop_ids,
            generated=list(resume_from),
            deliver=lambda item: None,
        )

    def _decode(self, ids: Sequence[int]) -> str:
        # Special tokens stay in the text: the tool-call markers are special tokens and the
        # API layer parses them. (Stop tokens never reach the text.)
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def abort(self, request_id: str) -> None:
        """Ends a request wherever it is (queued or running); its blocks are freed before the
        next step. Unknown or finished requests are ignored."""
        with self._lock:
            if request_id in self._live:
                self._aborts.add(request_id)
                self._lock.notify()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            live, incoming = len(self._live), len(self._incoming)
        return {
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "requests": live,
            "running": len(self._running),
            "waiting": len(self._waiting) + incoming,
            "blocks_total": self.cache.num_blocks,
            "blocks_free": self.cache.num_free,
            "block_size": self.cache.block_size,
            "kv_bytes_per_token": self.cache.bytes_per_token,
            "kv_bytes_per_token_theory": self.cache.theoretical_bytes_per_token,
            "max_batch": self.max_batch,
            "context_length": self.context_length,
            **self._counters,
        }

    def close(self, timeout_s: float = 30.0) -> None:
        """Stops the scheduler; requests still live end with Unavailable."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout_s)

    # -- the scheduler thread --------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._lock:
                    while not (
                        self._closed or self._incoming or self._aborts or self._running
                    ) and not (self._waiting and self._can_admit_head()):
                        self._lock.wait()
                    if self._closed:
                        break
                    self._waiting.extend(self._incoming)
                    self._incoming.clear()
                    aborts, self._aborts = self._aborts, set()
                self._drop(aborts)
                admitted = self._admit()
                if admitted or self._running:
                    self._step(admitted)
        closed = Unavailable("the language model engine is closed")
        for sequence in [*self._running, *self._waiting, *self._incoming]:
            self._end(sequence, closed)

    def _can_admit_head(self) -> bool:
        head = self._waiting[0]
        return self.cache.admission(len(head.prompt), head.params.max_tokens).fits_now

    def _drop(self, aborts: set[str]) -> None:
        if not aborts:
            return
        event = TokenEvent(ABORTED_TOKEN, "", None, "abort")
        for group in (self._running, self._waiting):
            for sequence in [s for s in group if s.request_id in aborts]:
                group.remove(sequence)
                self._end(sequence, [event])
                self._log.info("llm_request_aborted", request=sequence.request_id)

    def _admit(self) -> list[_Sequence]:
        admitted: list[_Sequence] = []
        prefill = 0
        while self._waiting and len(self._running) + len(admitted) < self.max_batch:
            head = self._waiting[0]
            need = len(head.prompt) + len(head.generated)
            if admitted and prefill + need > self.max_prefill_tokens:
                break
            if not self.cache.admission(len(head.prompt), head.params.max_tokens).fits_now:
                break
            self._waiting.popleft()
            head.blocks = self.cache.allocate(head.tokens)
            head.slots = self.cache.slot_map(head.blocks)
            admitted.append(head)
            prefill += need
        return admitted

    def _step(self, admitted: list[_Sequence]) -> None:
        decoding = list(self._running)
        try:
            if self.fault is not None:
                self.fault(self._counters["steps"])
            rows: list[tuple[_Sequence, torch.Tensor]] = []
            for group in _prefill_groups(admitted):
                batch = [self._input(s, s.prompt + s.generated, 0) for s in group]
                rows.extend(zip(group, forward_step(self.model, self.cache, batch), strict=True))
            if decoding:
                batch = [self._input(s, s.generated[-1:], s.cached) for s in decoding]
                rows.extend(zip(decoding, forward_step(self.model, self.cache, batch), strict=True))
            logits = torch.stack([r for _, r in rows])
            tokens = self._choose([s for s, _ in rows], logits)
            logprobs = chosen_logprobs(logits, tokens.to(logits.device)).tolist()
        except Exception as exc:  # the device's fault ends this batch, not the engine
            self._fault(admitted + decoding, exc)
            return
        self._counters["steps"] += 1
        self._counters["prefill_tokens"] += sum(s.cached for s in admitted)
        self._running.extend(admitted)
        for (sequence, _), token, logprob in zip(rows, tokens.tolist(), logprobs, strict=True):
            self._advance(sequence, int(token), float(logprob))

    def _input(self, sequence: _Sequence, tokens: list[int], start: int) -> StepInput:
        assert sequence.slots is not None
        sequence.cached = start + len(tokens)
        return StepInput(tokens=tokens, start=start, slots=sequence.slots)

    def _choose(self, sequences: list[_Sequence], logits: torch.Tensor) -> torch.Tensor:
        """One token per row: argmax on the device for greedy rows, the CPU sampler for the
        others (their logits moved once, together)."""
        tokens = torch.argmax(logits, dim=-1).cpu()
        sampled = [i for i, s in enumerate(sequences) if not s.params.greedy]
        if sampled:
            rows = logits[sampled].to("cpu", torch.float64)
            for row, i in zip(rows, sampled, strict=True):
                tokens[i] = sequences[i].sampler.sample(row)
        return tokens

    def _advance(self, sequence: _Sequence, token: int, logprob: float) -> None:
        sequence.generated.append(token)
        self._counters["generated_tokens"] += 1
        reported = logprob if sequence.params.logprobs else None
        if token in sequence.stop_ids:
            event = TokenEvent(token, sequence.text.finish(), reported, "stop")
        else:
            released = sequence.text.push(token)
            if released.stopped:
                event = TokenEvent(token, released.text, reported, "stop")
            elif len(sequence.generated) >= sequence.params.max_tokens:
                event = TokenEvent(
                    token, released.text + sequence.text.finish(), reported, "length"
                )
            else:
                event = TokenEvent(token, released.text, reported, None)
        if event.finish_reason is None:
            self._send(sequence, [event])
            return
        self._running.remove(sequence)
        self._end(sequence, [event])

    def _send(self, sequence: _Sequence, item: list[TokenEvent] | BaseException) -> None:
        try:
            sequence.deliver(item)
        except RuntimeError:  # the requester's event loop is closed: nobody is listening
            self.abort(sequence.request_id)

    def _end(self, sequence: _Sequence, item: list[TokenEvent] | BaseException) -> None:
        """Frees the sequence's blocks, forgets it, and sends its last event (or error)."""
        if sequence.blocks:
            self.cache.free(sequence.blocks)
            sequence.blocks, sequence.slots = [], None
        with self._lock:
            self._live.pop(sequence.request_id, None)
            self._aborts.discard(sequence.request_id)
        self._send(sequence, item)

    def _fault(self, sequences: list[_Sequence], exc: Exception) -> None:
        kind = "oom" if isinstance(exc, torch.OutOfMemoryError) else "device_error"
        self._counters["faults"] += 1
        self._log.warning("llm_step_failed", kind=kind, error=str(exc), sequences=len(sequences))
        fault = DeviceFault(kind, f"{kind} on {self.device}: {exc}")
        for sequence in sequences:
            if sequence in self._running:
                self._running.remove(sequence)
            self._end(sequence, fault)


def _prefill_groups(admitted: list[_Sequence], waste: float = 1.25) -> list[list[_Sequence]]:
    """The newly admitted, sorted by length and cut into groups prefilled together, each where
    padding to its longest would not pass `waste` times its real tokens: one prefill of 32
    prompts of mixed lengths, padded to the longest, cost seven times the work of its tokens."""
    groups: list[list[_Sequence]] = []
    group: list[_Sequence] = []
    real = 0
    for s in sorted(admitted, key=lambda s: len(s.prompt) + len(s.generated)):
        n = len(s.prompt) + len(s.generated)
        if group and n * (len(group) + 1) > waste * (real + n):
            groups.append(group)
            group, real = [], 0
        group.append(s)
        real += n
    if group:
        groups.append(group)
    return groups


def check_request(
    prompt_ids: Sequence[int],
    params: SamplingParams,
    resume_from: Sequence[int],
    *,
    vocab_size: int,
    context_length: int,
    admission: Callable[[int, int], Admission],
) -> Admission:
    """What an engine refuses before a request queues, wherever the engine runs (here or in
    its own process): token ids outside the vocabulary, a prompt that leaves no room for
    `max_tokens` in the context, a continuation already at its end, a request larger than the
    whole cache (ResourceExhausted). Returns the request's admission."""
    if not prompt_ids:
        raise InvalidArgument("prompt: at least one token is needed")
    for name, ids in (("prompt", prompt_ids), ("resume_from", resume_from)):
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise InvalidArgument(f"{name}[{i}]: {t!r} is not a token id below {vocab_size}")
    total = len(prompt_ids) + params.max_tokens
    if total > context_length:
        raise InvalidArgument(
            f"max_tokens: a prompt of {len(prompt_ids)} tokens plus max_tokens "
            f"{params.max_tokens} is {total}, over the context length {context_length}"
        )
    if len(resume_from) >= params.max_tokens:
        raise InvalidArgument(
            f"resume_from: {len(resume_from)} tokens already reach max_tokens "
            f"{params.max_tokens}; nothing is left to generate"
        )
    fits = admission(len(prompt_ids), params.max_tokens)
    if fits.blocks_total and not fits.fits_ever:
        raise ResourceExhausted(
            f"the request needs {fits.blocks_needed} KV blocks for {total} tokens; "
            f"the cache has {fits.blocks_total} in all"
        )
    return fits
