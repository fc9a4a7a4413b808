"""Token budgets: a rollout's prompt and completion tokens in all, and a tenant's tokens per
minute, enforced where a model call is admitted, for the gateway's own model and upstream ones
alike.

A rollout's budgets (`fleet submit --max-prompt-tokens N --max-completion-tokens N`) ride in
its inference token's signed claims, so the gateway needs to ask nobody; they are totals over
all of the rollout's calls, its attempts included. A call is refused (429, code
`budget_exceeded`, naming the budget and the figures) when the rollout has used a budget up,
when its prompt would pass the prompt budget, or when its `max_tokens` (over all its choices)
would pass what is left of the completion budget. In that last case a client that sent
`x-fleet-max-tokens-floor: N` has `max_tokens` lowered to what is left instead, as long as that
leaves each choice at least N tokens.

Calls in progress hold what they may still take (their prompt, their `max_tokens`) until they
end, when what they used is counted instead: so concurrent calls cannot pass a budget together,
however many a rollout sends at once. An upstream's prompt is counted only by the upstream, after
it answers: the prompt budget refuses its calls once used up, and one call may pass it by its
own prompt.

A tenant's tokens per minute (`fleet gateway --tenant-tokens-per-minute N`; the tenant is in the
token's claims) count prompt and completion tokens alike over a sliding minute, kept in
one-second buckets; a call that would pass it is refused with `Retry-After` the seconds until
enough of the minute's tokens age out.

What a rollout used is kept in the gateway's memory: a restarted gateway counts from zero
again, and at most `ROLLOUTS_KEPT` rollouts are remembered (the least recently used beyond it
are forgotten, and logged).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from fleet.core.tokens import TokenClaims
from gateway.llm.openai_schema import ApiError, Reply, bad_field
from gateway.llm.sampling import SamplingParams
from gateway.llm.upstream import Upstreams
from gateway.llm.upstream_relay import EventSink, StreamUsage, usage_of

log = structlog.get_logger(__name__)

WINDOW_S = 60.0
"""The tenant budget's window."""
BUCKET_S = 1.0
"""The window's granularity: a token counts from its bucket's start until one bucket past the
window (never less than the window), so a tenant's memory is at most about 61 buckets."""
ROLLOUTS_KEPT = 100_000
"""Rollouts whose spending is remembered at once."""
FLOOR_HEADER = "x-fleet-max-tokens-floor"
"""N: a call whose `max_tokens` would pass the completion budget is lowered to what is left,
down to N per choice, rather than refused (the same header lets admission shrink a call under
memory pressure)."""
CODE = "budget_exceeded"


@dataclass
class BudgetExceeded(ApiError):
    """A refusal for a budget: OpenAI's error shape, with the figures in a `fleet` object."""

    figures: dict[str, Any] = field(default_factory=dict)

    def reply(self) -> Reply:
        answer = super().reply()
        assert answer.body is not None
        answer.body["fleet"] = {"budget": self.figures}
        return answer


class TenantWindow:
    """One tenant's tokens of the last minute, in one-second buckets (oldest first)."""

    def __init__(self) -> None:
        self.buckets: collections.deque[list[float]] = collections.deque()
        """[bucket start, tokens]."""
        self.total = 0

    def expire(self, now: float) -> None:
        while self.buckets and self.buckets[0][0] + BUCKET_S + WINDOW_S <= now:
            self.total -= int(self.buckets.popleft()[1])

    def add(self, now: float, tokens: int) -> None:
        self.expire(now)
        start = math.floor(now / BUCKET_S) * BUCKET_S
        if self.buckets and self.buckets[-1][0] == start:
            self.buckets[-1][1] += tokens
        else:
            self.buckets.append([start, tokens])
        self.total += tokens

    def wait_s(self, now: float, room: int) -> float | None:
        """Seconds until the window's tokens fit in `room` (what the limit leaves beside the
        call asking and the calls in progress); None when they already do, or when the window
        emptying is not enough (`room` < 0)."""
        if room < 0:
            return None
        self.expire(now)
        total = self.total
        for start, tokens in self.buckets:
            if total <= room:
                break
            total -= int(tokens)
            if total <= room:
                return max(start + BUCKET_S + WINDOW_S - now, 0.0)
        return None


@dataclass
class _Spent:
    """A rollout's tokens: used (answers ended), and held (calls in progress may still take)."""

    tenant: str
    prompt: int = 0
    completion: int = 0
    held_prompt: int = 0
    held_completion: int = 0
    calls: int = 0
    """Calls in progress."""


class Budgets:
    """What each rollout and tenant has used, and the checks a call passes to be admitted."""

    def __init__(
        self,
        tenant_tokens_per_minute: int = 0,
        clock: Callable[[], float] = time.monotonic,
        rollouts_kept: int = ROLLOUTS_KEPT,
    ) -> None:
        self.tenant_tokens_per_minute = tenant_tokens_per_minute
        """Each tenant's tokens per minute (0: no limit); `fleet gateway
        --tenant-tokens-per-minute`."""
        self.clock = clock
        self.rollouts_kept = rollouts_kept
        self._rollouts: collections.OrderedDict[str, _Spent] = collections.OrderedDict()
        self._tenants: dict[str, TenantWindow] = {}
        self._tenant_held: collections.Counter[str] = collections.Counter()
        self.refused: collections.Counter[str] = collections.Counter()
        """Calls refused, by budget (for the gateway's metrics)."""
        self.forgotten = 0

    def _applies(self, claims: TokenClaims) -> bool:
        return bool(
            claims.max_prompt_tokens or claims.max_completion_tokens
            or self.tenant_tokens_per_minute
        )  # fmt: skip

    def _spent(self, claims: TokenClaims) -> _Spent:
        spent = self._rollouts.get(claims.rollout_id)
        if spent is None:
            if len(self._rollouts) >= self.rollouts_kept:
                self._forget_one()
            spent = self._rollouts[claims.rollout_id] = _Spent(claims.tenant)
        self._rollouts.move_to_end(claims.rollout_id)
        return spent

    def _forget_one(self) -> None:
        """The least recently used rollout without a call in progress is forgotten."""
        for rollout_id, spent in self._rollouts.items():
            if not spent.calls:
                del self._rollouts[rollout_id]
                if not self.forgotten:
                    log.warning(
                        "budgets_forgotten", rollouts_kept=self.rollouts_kept,
                        effect="the least recently used rollouts count from zero",
                    )  # fmt: skip
                self.forgotten += 1
                return

    def used(self, rollout_id: str) -> tuple[int, int]:
        """(prompt, completion) tokens the rollout's ended calls used, as far as remembered."""
        spent = self._rollouts.get(rollout_id)
        return (spent.prompt, spent.completion) if spent is not None else (0, 0)

    def tenant_used(self, tenant: str) -> int:
        """The tenant's tokens of the last minute."""
        window = self._tenants.get(tenant)
        if window is None:
            return 0
        window.expire(self.clock())
        return window.total

    # -- counting ---------------------------------------------------------------------------

    def record(self, rollout_id: str, prompt: int, completion: int) -> None:
        """An ended answer's tokens (`UsageBook.add_tokens` passes every answer's here)."""
        spent = self._rollouts.get(rollout_id)
        if spent is None:  # (a rollout no budget applies to)
            return
        spent.prompt += prompt
        spent.completion += completion
        if self.tenant_tokens_per_minute:
            window = self._tenants.setdefault(spent.tenant, TenantWindow())
            window.add(self.clock(), prompt + completion)

    # -- admission --------------------------------------------------------------------------

    @contextmanager
    def admit(
        self, claims: TokenClaims, prompt: int | None, max_tokens: Sequence[int | None],
        floor: int | None = None,
    ) -> Iterator[list[int | None]]:  # fmt: skip
        """Admits a call of `prompt` tokens (None: not known here, an upstream's) and one
        `max_tokens` per choice (None: unbounded), or raises BudgetExceeded. Yields each
        choice's `max_tokens`, lowered where the floor allowed; what the call may take is held
        until the context ends."""
        if not self._applies(claims):
            yield list(max_tokens)
            return
        spent = self._spent(claims)
        spent.tenant = claims.tenant
        self._check_prompt(claims, spent, prompt)
        allowed = self._check_completion(claims, spent, list(max_tokens), floor)
        cost = (prompt or 0) + sum(m or 0 for m in allowed)
        self._check_tenant(claims, cost)
        held = (prompt or 0, sum(m or 0 for m in allowed))
        spent.held_prompt += held[0]
        spent.held_completion += held[1]
        spent.calls += 1
        self._tenant_held[claims.tenant] += cost
        try:
            yield allowed
        finally:
            spent.held_prompt -= held[0]
            spent.held_completion -= held[1]
            spent.calls -= 1
            self._tenant_held[claims.tenant] -= cost
            if not self._tenant_held[claims.tenant]:
                del self._tenant_held[claims.tenant]

    def _refuse(
        self, budget: str, message: str, figures: dict[str, Any], kind: str = "insufficient_quota",
        retry_after_s: float | None = None,
    ) -> BudgetExceeded:  # fmt: skip
        self.refused[budget] += 1
        log.info("budget_exceeded", budget=budget, **figures)
        return BudgetExceeded(
            429, message, kind, param=budget, code=CODE, retry_after_s=retry_after_s,
            figures={"name": budget, **figures},
        )  # fmt: skip

    def _check_prompt(self, claims: TokenClaims, spent: _Spent, prompt: int | None) -> None:
        limit = claims.max_prompt_tokens
        if not limit:
            return
        rid, used, held = claims.rollout_id, spent.prompt, spent.held_prompt
        figures = {"rollout_id": rid, "limit": limit, "used": used, "held": held,
                   "requested": prompt}  # fmt: skip
        if used + held >= limit:
            raise self._refuse("max_prompt_tokens", f"rollout {rid} has used its prompt-token "
                               f"budget (max_prompt_tokens {limit}: {used} used, {held} held by "
                               "calls in progress)", figures)  # fmt: skip
        if prompt is not None and used + held + prompt > limit:
            raise self._refuse(
                "max_prompt_tokens", f"rollout {rid}: this prompt of {prompt} tokens would pass "
                f"its prompt-token budget (max_prompt_tokens {limit}: {used} used, {held} held "
                f"by calls in progress, {limit - used - held} left)", figures,
            )  # fmt: skip

    def _check_completion(
        self, claims: TokenClaims, spent: _Spent, max_tokens: list[int | None], floor: int | None
    ) -> list[int | None]:
        limit = claims.max_completion_tokens
        if not limit:
            return max_tokens
        rid, used, held = claims.rollout_id, spent.completion, spent.held_completion
        left = limit - used - held
        asked = None if None in max_tokens else sum(m or 0 for m in max_tokens)
        figures = {"rollout_id": rid, "limit": limit, "used": used, "held": held,
                   "requested": asked}  # fmt: skip
        if left <= 0:
            raise self._refuse("max_completion_tokens", f"rollout {rid} has used its "
                               f"completion-token budget (max_completion_tokens {limit}: {used} "
                               f"used, {held} held by calls in progress)", figures)  # fmt: skip
        if asked is not None and asked <= left:
            return max_tokens
        each = left // len(max_tokens)
        if floor is not None and each >= floor:
            return [each if m is None else min(m, each) for m in max_tokens]
        what = ("no max_tokens (unbounded)" if asked is None else
                f"max_tokens {asked}" + (f" over {len(max_tokens)} choices"
                                         if len(max_tokens) > 1 else ""))  # fmt: skip
        hint = (f"send max_tokens of at most {each}" + (" per choice" if len(max_tokens) > 1
                else "") + f", or the header {FLOOR_HEADER}: N to have it lowered to what is "
                "left")  # fmt: skip
        if floor is not None:
            hint = f"{each} per choice is below the floor of {floor} that {FLOOR_HEADER} set"
        raise self._refuse(
            "max_completion_tokens", f"rollout {rid}: {what} would pass its completion-token "
            f"budget (max_completion_tokens {limit}: {used} used, {held} held by calls in "
            f"progress, {left} left); {hint}", figures,
        )  # fmt: skip

    def _check_tenant(self, claims: TokenClaims, cost: int) -> None:
        limit = self.tenant_tokens_per_minute
        if not limit:
            return
        tenant = claims.tenant
        window = self._tenants.get(tenant)
        now = self.clock()
        if window is not None:
            window.expire(now)
        used = window.total if window is not None else 0
        held = self._tenant_held[tenant]
        if used + held + cost <= limit:
            return
        wait = window.wait_s(now, limit - held - cost) if window is not None else None
        name = repr(tenant) if tenant else "(unnamed in this token)"
        figures = {"tenant": tenant, "limit": limit, "used": used, "held": held,
                   "requested": cost, "retry_after_s": wait}  # fmt: skip
        if cost > limit:
            why = (
                f"this call may take {cost} tokens, more than tenant {name}'s {limit} tokens "
                "per minute (tenant_tokens_per_minute) allow at all: lower max_tokens"
            )
        else:
            later = (f"retry in {wait:.1f} s" if wait is not None
                     else "retry when its calls in progress have ended")  # fmt: skip
            why = (f"tenant {name} has used {used} of its {limit} tokens per minute "
                   f"(tenant_tokens_per_minute; {held} held by calls in progress) and this call "
                   f"may take {cost}: {later}")  # fmt: skip
        raise self._refuse("tenant_tokens_per_minute", why, figures, "rate_limit_error",
                           retry_after_s=wait)  # fmt: skip


# -- the gateway's own model -------------------------------------------------------------------


class Job(Protocol):
    """One choice of a local call: its prompt's token ids and its sampling parameters."""

    prompt: list[int]
    params: SamplingParams


def admit_jobs(
    budgets: Budgets, claims: TokenClaims, jobs: Sequence[Job], floor: int | None,
    holds: ExitStack,
) -> None:  # fmt: skip
    """A call to the gateway's own model admitted by the budgets, held until `holds` closes;
    each job's `max_tokens` lowered where the floor allowed."""
    # The choices of one prompt share its list: each prompt counts once, as its answer does.
    prompts = {id(job.prompt): len(job.prompt) for job in jobs}
    asked = [job.params.max_tokens for job in jobs]
    allowed = holds.enter_context(budgets.admit(claims, sum(prompts.values()), asked, floor))
    for job, cap in zip(jobs, allowed, strict=True):
        if cap is not None and cap != job.params.max_tokens:
            job.params = dataclasses.replace(job.params, max_tokens=cap)


# -- upstream calls ---------------------------------------------------------------------------


class Book(Protocol):
    """Where answers' tokens are counted (`gateway.accounting.UsageBook`)."""

    budgets: Budgets

    def add_tokens(self, rollout_id: str, model: str, prompt: int, completion: int) -> None: ...


def floor_of(headers: dict[str, str]) -> int | None:
    """The `x-fleet-max-tokens-floor` header's count, or a 400 naming the header."""
    text = headers.get(FLOOR_HEADER, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ApiError(400, f"header {FLOOR_HEADER}: expected a token count >= 1, not "
                       f"{text[:40]!r}", param=FLOOR_HEADER)  # fmt: skip
    return int(text)


def _count_field(request: dict[str, Any], name: str) -> int | None:
    value = request.get(name)
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise bad_field(name, f"expected a whole number >= 1, not {json.dumps(value)[:40]}")
    return value


async def forward_metered(
    upstreams: Upstreams, book: Book | None, path: str, claims: TokenClaims,
    request: dict[str, Any], headers: dict[str, str], holds: ExitStack,
) -> Reply:  # fmt: skip
    """An upstream call admitted by the rollout's and tenant's budgets (its `max_tokens`
    lowered where the floor allowed) and forwarded; the tokens the upstream reports are counted
    in `book` once the answer ends. A stream asks the upstream for its usage
    (`stream_options.include_usage`) and drops that chunk again when its client did not ask
    for it; where an upstream reports none, its chunks that carry text are counted. The relay
    counts as it parses each chunk (`StreamUsage`): a stream's chunks are not parsed twice."""
    if book is None:
        return await upstreams.forward(path, claims, request)
    upstreams.check_allowed(claims, str(request["model"]))  # (403 before any 429)
    name = "max_completion_tokens" if "max_completion_tokens" in request else "max_tokens"
    max_tokens = _count_field(request, name)
    n = _count_field(request, "n") or 1
    allowed = holds.enter_context(
        book.budgets.admit(claims, None, [max_tokens] * n, floor_of(headers))
    )
    if allowed[0] != max_tokens:
        request = {**request, name: allowed[0]}
    streaming = request.get("stream") is True
    options = request.get("stream_options")
    wanted = isinstance(options, dict) and options.get("include_usage") is True
    if streaming and not wanted:
        request = {**request, "stream_options": {**(options or {}), "include_usage": True}}
    usage = StreamUsage(drop_usage=streaming and not wanted, model=str(request["model"]))
    reply = await upstreams.forward(path, claims, request, usage if streaming else None)
    if reply.status != 200:
        return reply
    rollout_id = claims.rollout_id

    def record(model: str, prompt: int, completion: int) -> None:
        book.add_tokens(rollout_id, model, prompt, completion)

    if reply.events is not None:
        reply.events = _Metered(reply.events, usage, record)
    elif reply.body is not None:
        prompt, completion = usage_of(reply.body)
        record(str(reply.body.get("model", request["model"])), prompt, completion)
    return reply


class _Metered:
    """A relayed stream whose tokens are recorded once, however it ends (`aclose`, which the
    HTTP layer calls whether the stream was read to its end or abandoned): the upstream's usage
    where it reported it, else a token per choice that carried text."""

    def __init__(
        self, events: AsyncIterator[str], usage: StreamUsage,
        record: Callable[[str, int, int], None],
    ) -> None:  # fmt: skip
        self.events = events
        self.usage = usage
        self.record: Callable[[str, int, int], None] | None = record

    def __aiter__(self) -> _Metered:
        return self

    async def __anext__(self) -> str:
        return await anext(self.events)

    @property
    def push_to(self) -> Callable[[EventSink], Awaitable[None]] | None:
        """The relay's own `push_to`, where the stream is a relay's (counted all the same: the
        relay counts as it parses, and `aclose` records)."""
        return getattr(self.events, "push_to", None)

    async def aclose(self) -> None:
        record, self.record = self.record, None
        try:
            if record is not None:
                usage = self.usage
                prompt, completion = usage.reported or (0, usage.carried)
                record(usage.model, prompt, completion)
        finally:
            close = getattr(self.events, "aclose", None)
            if close is not None:
                await close()
