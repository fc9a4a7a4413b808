"""Sampling rules: the request's parameters and the per-request sampler that applies them.

The random stream belongs to the gateway, not to the device. Each sampled request owns a
`torch.Generator` on the CPU, seeded from the request's seed, and every sampled token consumes
exactly one uniform draw from it; the filtering (temperature, top-k, top-p) and the draw's
inverse-CDF lookup run on the CPU in float64. So a replica on another device, given the same
logits, picks the same token, and a replica that takes over a request mid-stream reproduces
the rest of the answer by advancing a fresh generator by the number of draws already used.

Greedy decoding (temperature 0) consumes no draws.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

from fleet.core.errors import InvalidArgument

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
SEED_MODULUS = 1 << 64


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler; checked when made, naming the field at fault.

    `max_tokens` counts every generated token, the finishing one included (and, for a
    continuation, the tokens already sent). `stop` strings are matched on the decoded text and
    never emitted; `stop_token_ids` end the answer beside the model's own stop tokens, whose
    text is not emitted either.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidArgument(f"max_tokens must be an integer, not {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be at least 1, not {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument(
                f"temperature must be a finite number >= 0, not {self.temperature!r}"
            )
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], not {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgument(f"top_k must be an integer >= 0, not {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not -(1 << 63) <= self.seed < SEED_MODULUS
        ):
            raise InvalidArgument(f"seed must be a 64-bit integer, not {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidArgument(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS}")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise InvalidArgument(f"stop[{i}] must be a non-empty string, not {s!r}")
            if len(s) > MAX_STOP_CHARS:
                raise InvalidArgument(f"stop[{i}] is longer than {MAX_STOP_CHARS} characters")
        for i, t in enumerate(self.stop_token_ids):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidArgument(f"stop_token_ids[{i}] must be a token id >= 0, not {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """One request's token choice: argmax when greedy, else one seeded draw per token.

    An unseeded sampled request gets a fresh random seed, readable as `seed`: a caller that
    wants such a request to survive a failover picks the seed itself and passes it in.
    """

    def __init__(self, params: SamplingParams, draws_used: int = 0) -> None:
        self.params = params
        self.seed = params.seed % SEED_MODULUS if params.seed is not None else secrets.randbits(63)
        self.draws = 0
        self._generator: torch.Generator | None = None
        if not params.greedy:
            self._generator = torch.Generator(device="cpu")
            self._generator.manual_seed(self.seed)
        self.skip(draws_used)

    def skip(self, draws: int) -> None:
        """Advance the stream past `draws` draws (a continuation's tokens already sampled)."""
        if draws < 0:
            raise InvalidArgument(f"rng_draws_used must be >= 0, not {draws}")
        if draws and self._generator is None:
            raise InvalidArgument(f"rng_draws_used is {draws}, but a greedy request draws none")
        for _ in range(draws):
            self._uniform()

    def _uniform(self) -> float:
        assert self._generator is not None
        self.draws += 1
        return float(torch.rand((), generator=self._generator, dtype=torch.float64))

    def sample(self, logits: torch.Tensor) -> int:
        """The next token from one row of logits (any device, any float dtype)."""
        if self._generator is None:
            return int(torch.argmax(logits))
        return self._draw(logits.detach().to("cpu", torch.float64))

    def _draw(self, logits: torch.Tensor) -> int:
        p = self.params
        probs = torch.softmax(logits / p.temperature, dim=-1)
        probs, order = torch.sort(probs, descending=True, stable=True)
        if p.top_k:
            probs, order = probs[: p.top_k], order[: p.top_k]
        if p.top_p < 1:
            # Keep the smallest head whose mass reaches top_p: every token whose predecessors
            # hold less than top_p (the first one always).
            before = torch.cumsum(probs, dim=-1) - probs
            keep = max(1, int((before < p.top_p).sum()))
            probs, order = probs[:keep], order[:keep]
        cdf = torch.cumsum(probs, dim=-1)
        target = torch.tensor([self._uniform() * float(cdf[-1])], dtype=torch.float64)
        index = min(int(torch.searchsorted(cdf, target, right=True)), len(order) - 1)
        return int(order[index])


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) under the model's own distribution (temperature 1, unfiltered), per row,
    computed in float32 whatever the model's dtype."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, tokens.view(-1, 1)).view(-1)
