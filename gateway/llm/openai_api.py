"""OpenAI-compatible endpoints on the gateway's language model, so an agent in a machine uses
the official `openai` package as it would against OpenAI:

    GET  /v1/models             the language models served, with their context length and limits
    POST /v1/chat/completions   messages by the model's chat template; tools and tool calls;
                                `stream` as server-sent events ending with `data: [DONE]`
    POST /v1/completions        plain prompts (text or token ids), streamed the same way

Every request carries the rollout's inference token as `Authorization: Bearer TOKEN` and is
checked as `/v1/infer` is (its signature, its expiry, the server's list of running rollouts);
an optional `x-fleet-rollout` header must then name the token's own rollout. Requests are
checked strictly, field by field; a field OpenAI defines that this gateway cannot honour (a
penalty, a JSON response format, alternatives' logprobs) is refused by name rather than
ignored, since an answer that silently differs from what was asked is worse than none.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 naming the
field for bad input, 401 for a token that is not one, 403 for another rollout's or an ended
rollout's token, 429 / 503 with `Retry-After` when refused for capacity. Every answer says who
served it: the `x-fleet-served-by` header and a `fleet` object in the JSON and in each chunk.

A generation that carries an `Idempotency-Key` header is answered once and replayed for a
retry (`gateway.llm.replay`); each answer's tokens are counted for its rollout
(`gateway.accounting`), replays not.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import ExitStack, aclosing
from typing import Any

import structlog

from fleet.core.errors import FleetError, Unauthenticated
from fleet.core.tokens import TokenClaims
from gateway.accounting import UsageBook
from gateway.llm.budgets import admit_jobs, forward_metered
from gateway.llm.chat import AnswerStream, ChatPrompt, parse_answer, render_prompt
from gateway.llm.engine import TokenEvent
from gateway.llm.jobs import Job, device_error, merge_events, run_jobs, stream_error
from gateway.llm.openai_schema import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Reply,
    Request,
    bad_field,
    from_fleet,
    parse_request,
)
from gateway.llm.replay import Replays
from gateway.llm.sampling import SamplingParams
from gateway.llm.serving import LanguageModel, Resumable, Route
from gateway.llm.upstream import Upstreams
from gateway.llm.usage import Tally, counted
from gateway.model import DeviceFault

log = structlog.get_logger(__name__)

ROUTES = ("/v1/models", "/v1/chat/completions", "/v1/completions")
ROLLOUT_HEADER = "x-fleet-rollout"
NO_FALLBACK_HEADER = "x-fleet-no-fallback"
"""`1`: fail fast (503) rather than be served by the CPU replica."""
SHRINK_HEADER = "x-fleet-max-tokens-floor"
"""N: under memory pressure the gateway may lower `max_tokens`, down to N, rather than queue
the request elsewhere or refuse it."""


class OpenAIApi:
    """The endpoints' semantics; the HTTP framing is `gateway.http`'s."""

    def __init__(
        self,
        llm: LanguageModel | None,
        authorize: Callable[[str, str], TokenClaims],
        usage: UsageBook | None = None,
        replays: Replays | None = None,
        upstreams: Upstreams | None = None,
    ) -> None:
        self.llm = llm
        self.authorize = authorize
        self.usage = usage
        """Where each answer's tokens are counted for its rollout (None: not counted)."""
        self.replays = replays if replays is not None else Replays()
        """Answers kept for their Idempotency-Key (`gateway.llm.replay`)."""
        self.upstreams = upstreams
        """Upstream models (`NAME/MODEL`), forwarded with the gateway's keys
        (`gateway.llm.upstream`)."""
        self.created = int(time.time())

    def served_by(self) -> dict[str, str]:
        """The headers that say who serves answers here."""
        if self.llm is None:
            return {}
        return self.llm.headers(None)

    async def handle(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Reply:
        """One request to one of `ROUTES`, answered in OpenAI's terms whatever goes wrong."""
        holds = ExitStack()
        try:
            want = "GET" if path == "/v1/models" else "POST"
            if method != want:
                raise ApiError(405, f"{path} takes {want}, not {method}", code="method_not_allowed")
            claims = self._claims(headers)
            log.debug("openai_request", path=path, rollout_id=claims.rollout_id)
            forward = self.upstreams.request_of(path, body) if self.upstreams else None
            if self.upstreams is not None and forward is not None:
                reply = await forward_metered(
                    self.upstreams, self.usage, path, claims, forward, headers, holds
                )
            elif path == "/v1/models":
                reply = self.models()
                if self.upstreams is not None and reply.body is not None:
                    reply.body["data"] += await self.upstreams.models(claims)
            elif path == "/v1/chat/completions":
                reply = await self.replays.answer(
                    claims.rollout_id, headers, path, body, holds,
                    lambda: self.chat(claims, parse_request(ChatRequest, body), holds, headers),
                )  # fmt: skip
            else:
                reply = await self.replays.answer(
                    claims.rollout_id, headers, path, body, holds,
                    lambda: self.completions(
                        claims, parse_request(CompletionRequest, body), holds, headers
                    ),
                )  # fmt: skip
        except ApiError as exc:
            holds.close()
            reply = exc.reply()
        except FleetError as exc:
            holds.close()
            reply = from_fleet(exc).reply()
        except (DeviceFault, Resumable) as exc:
            holds.close()
            reply = device_error(exc).reply()
        except Exception:
            holds.close()
            log.exception("openai_request_crashed", path=path)
            reply = ApiError(500, "internal error; see the gateway's log", "server_error",
                             code="internal_error").reply()  # fmt: skip
        reply.holds = holds
        for name, value in self.served_by().items():
            reply.headers.setdefault(name, value)
        return reply

    def _claims(self, headers: dict[str, str]) -> TokenClaims:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated(
                "no API key: send the rollout's inference token as 'Authorization: Bearer TOKEN'"
            )
        return self.authorize(token.strip(), headers.get(ROLLOUT_HEADER, ""))

    def _model(self, name: str) -> LanguageModel:
        lm = self.llm
        if lm is None or name != lm.model_id:
            served = f"serving {lm.model_id}" if lm else "no language model is served here"
            raise bad_field("model", f"{name!r} is not served here ({served})", "model_not_found")
        return lm

    # -- GET /v1/models --------------------------------------------------------------------

    def models(self) -> Reply:
        data = []
        if self.llm is not None:
            lm, lim = self.llm, self.llm.limits
            data.append({
                "id": lm.model_id, "object": "model", "created": self.created, "owned_by": "fleet",
                "context_length": lm.manifest.context_length,
                "limits": {
                    "context_length": lm.manifest.context_length, "max_n": lim.max_n,
                    "max_prompts": lim.max_prompts, "max_batch": lim.max_batch,
                    "max_waiting": lim.max_waiting, "max_wait_s": lim.max_wait_s,
                    "max_inflight_per_rollout": lim.max_inflight_per_rollout,
                },
                "replica": None if not lm.replica_enabled else {
                    "device": "cpu", "dtype": "float32", "max_batch": lim.replica_max_batch,
                    "max_waiting": lim.replica_max_waiting,
                    "context_length": lm.replica_context_length,
                    "continues_answers_exactly": lm.continuation_verified(),
                },
                "fleet": lm.served_by(),
            })  # fmt: skip
        return Reply(200, {"object": "list", "data": data})

    # -- shared checks ---------------------------------------------------------------------

    def _refuse_unsupported(self, req: Request) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name):
                raise bad_field(name, "penalties are not applied here; send 0 or leave it out",
                           "unsupported_value")  # fmt: skip
        if req.logit_bias:
            raise bad_field("logit_bias", "not applied here; leave it out", "unsupported_value")
        if req.n > self._model(req.model).limits.max_n:
            raise bad_field("n", f"{req.n} choices; at most {self._model(req.model).limits.max_n}")
        if req.stream_options is not None and not req.stream:
            raise bad_field("stream_options", "only taken with stream: true")

    def _sampling(
        self, lm: LanguageModel, prompt_tokens: int, req: Request, max_tokens: int | None,
        logprobs: bool, prompt_field: str, choices: int,
    ) -> list[SamplingParams]:  # fmt: skip
        """Each choice's sampling parameters; the context checked with the prompt's size."""
        context = lm.manifest.context_length
        if prompt_tokens >= context:
            raise bad_field(
                prompt_field, f"the prompt is {prompt_tokens} tokens; the model's context is "
                f"{context}, and at least one token must be left to generate",
                "context_length_exceeded",
            )  # fmt: skip
        if max_tokens is None:
            max_tokens = context - prompt_tokens
        elif prompt_tokens + max_tokens > context:
            name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else (
                "max_tokens")  # fmt: skip
            raise bad_field(name, f"a prompt of {prompt_tokens} tokens plus {max_tokens} to "
                       f"generate is {prompt_tokens + max_tokens} tokens, over the model's "
                       f"context of {context}", "context_length_exceeded")  # fmt: skip
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        temperature = 1.0 if req.temperature is None else req.temperature
        return [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                seed=None if req.seed is None else req.seed + i,
                stop=stop,
                logprobs=logprobs,
            )
            for i in range(choices)
        ]

    async def _admit(
        self, lm: LanguageModel, claims: TokenClaims, jobs: list[Job], holds: ExitStack,
        headers: dict[str, str], streaming: bool,
    ) -> Route:  # fmt: skip
        """Where the jobs go (their parameters shrunk where admission shrank them), with their
        places held."""
        no_fallback = headers.get(NO_FALLBACK_HEADER, "").strip() in ("1", "true")
        floor_text = headers.get(SHRINK_HEADER, "").strip()
        floor: int | None = None
        if floor_text:
            if not floor_text.isdigit() or int(floor_text) < 1:
                raise ApiError(400, f"header {SHRINK_HEADER}: expected a token count >= 1, not "
                               f"{floor_text[:40]!r}", param=SHRINK_HEADER)  # fmt: skip
            floor = int(floor_text)
        if self.usage is not None:  # the rollout's and its tenant's token budgets
            admit_jobs(self.usage.budgets, claims, jobs, floor, holds)
        holds.enter_context(lm.admitted(claims.rollout_id, len(jobs)))
        route, params = await lm.plan(
            [(job.prompt, job.params) for job in jobs], streaming=streaming,
            no_fallback=no_fallback, shrink_floor=floor,
        )  # fmt: skip
        for job, p in zip(jobs, params, strict=True):
            job.params = p
        return route

    def _base(self, lm: LanguageModel, kind: str, prefix: str) -> dict[str, Any]:
        return {"id": prefix + secrets.token_hex(12), "object": kind, "created": int(time.time()),
                "model": lm.model_id}  # fmt: skip

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip

    def _count(self, claims: TokenClaims, lm: LanguageModel, prompt: int, completion: int) -> None:
        """An answer's tokens, charged to its rollout (replays are not: they skip this)."""
        if self.usage is not None:
            self.usage.add_tokens(claims.rollout_id, lm.model_id, prompt, completion)

    def _counted(
        self, claims: TokenClaims, lm: LanguageModel, events: AsyncIterator[str], tally: Tally
    ) -> AsyncIterator[str]:
        return counted(events, tally, lambda p, c: self._count(claims, lm, p, c))

    def _token(self, lm: LanguageModel, token_id: int) -> str:
        return str(lm.tokenizer.decode([token_id], skip_special_tokens=False))

    def _ends_unseen(self, lm: LanguageModel, event: TokenEvent) -> bool:
        """A stop token: generated, counted, but not part of the answer's text or logprobs."""
        m = lm.manifest
        return event.finish_reason == "stop" and (
            event.token_id in m.stop_token_ids or event.token_id == m.eos_token_id
        )

    # -- POST /v1/chat/completions ---------------------------------------------------------

    async def chat(
        self, claims: TokenClaims, req: ChatRequest, holds: ExitStack, headers: dict[str, str]
    ) -> Reply:
        lm = self._model(req.model)
        self._refuse_unsupported(req)
        if req.top_logprobs:
            raise bad_field("top_logprobs", "only the chosen tokens' logprobs are reported here; "
                       "send 0 or leave it out", "unsupported_value")  # fmt: skip
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_field("top_logprobs", "only taken with logprobs: true")
        if req.response_format is not None and req.response_format.get("type") != "text":
            raise bad_field("response_format", "only {\"type\": \"text\"} is served here",
                       "unsupported_value")  # fmt: skip
        if (req.max_tokens is not None and req.max_completion_tokens is not None
                and req.max_tokens != req.max_completion_tokens):  # fmt: skip
            raise bad_field("max_completion_tokens", "differs from max_tokens; send one of them")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        prompt = render_prompt(lm.manifest, messages, req.tools, req.tool_choice)
        ids = list(lm.tokenizer.encode(prompt.text, add_special_tokens=False).ids)
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = self._sampling(lm, len(ids), req, max_tokens, bool(req.logprobs), "messages",
                                req.n)  # fmt: skip
        jobs = [Job(i, ids, p) for i, p in enumerate(params)]
        route = await self._admit(lm, claims, jobs, holds, headers, bool(req.stream))
        base = self._base(lm, "chat.completion", "chatcmpl-")
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            tally = Tally(len(ids))
            events = self._chat_stream(lm, route, jobs, prompt, base, usage, bool(req.logprobs),
                                       tally)  # fmt: skip
            return Reply(200, headers=lm.headers(route),
                         events=self._counted(claims, lm, events, tally))  # fmt: skip
        choices = await run_jobs(lm, route, jobs, base["id"])
        completion = 0
        out = []
        for job, choice in zip(jobs, choices, strict=True):
            completion += len(choice.events)
            parsed = parse_answer(lm.manifest, prompt, choice.text)
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content,
                                       "refusal": None}  # fmt: skip
            if parsed.tool_calls:
                message["tool_calls"] = parsed.tool_calls
            reason = choice.events[-1].finish_reason
            out.append({
                "index": job.index, "message": message,
                "logprobs": {"content": self._chat_logprobs(lm, choice.events), "refusal": None}
                if req.logprobs else None,
                "finish_reason": "tool_calls" if parsed.tool_calls and reason == "stop" else reason,
            })  # fmt: skip
        body = {**base, "choices": out, "usage": self._usage(len(ids), completion),
                "fleet": lm.served_by(route)}  # fmt: skip
        self._count(claims, lm, len(ids), completion)
        return Reply(200, body, headers=lm.headers(route))

    def _chat_logprobs(self, lm: LanguageModel, events: Sequence[TokenEvent]) -> list[Any]:
        entries = []
        for e in events:
            if self._ends_unseen(lm, e) or e.logprob is None:
                continue
            token = self._token(lm, e.token_id)
            entries.append({"token": token, "logprob": e.logprob,
                            "bytes": list(token.encode()), "top_logprobs": []})  # fmt: skip
        return entries

    async def _chat_stream(
        self, lm: LanguageModel, route: Route, jobs: list[Job], prompt: ChatPrompt,
        base: dict[str, Any], include_usage: bool, logprobs: bool, tally: Tally | None = None,
    ) -> AsyncIterator[str]:  # fmt: skip
        def chunk(index: int, delta: dict[str, Any], reason: str | None = None,
                  lp: list[Any] | None = None) -> str:  # fmt: skip
            choice = {"index": index, "delta": delta, "finish_reason": reason,
                      "logprobs": {"content": lp, "refusal": None} if lp else None}  # fmt: skip
            return json.dumps({**base, "object": "chat.completion.chunk", "choices": [choice],
                               "fleet": lm.served_by(route)})  # fmt: skip

        streams = {job.index: AnswerStream(lm.manifest, prompt) for job in jobs}
        completion = 0
        for job in jobs:
            yield chunk(job.index, {"role": "assistant", "content": ""})
        try:
            async with aclosing(merge_events(lm, route, jobs, base["id"])) as merged:
                async for index, event in merged:
                    completion += 1
                    if tally is not None:
                        tally.completion = completion
                    stream = streams[index]
                    released = stream.push(event.text)
                    lp = self._chat_logprobs(lm, [event]) if logprobs else None
                    if released or lp:
                        yield chunk(index, {"content": released}, lp=lp)
                    if event.finish_reason is None:
                        continue
                    rest = stream.finish()
                    delta: dict[str, Any] = {}
                    if rest.content:
                        delta["content"] = rest.content
                    if rest.tool_calls:
                        delta["tool_calls"] = [{"index": k, **c}
                                               for k, c in enumerate(rest.tool_calls)]  # fmt: skip
                    reason = event.finish_reason
                    yield chunk(
                        index,
                        delta,
                        "tool_calls" if rest.tool_calls and reason == "stop" else reason,
                    )
        except Exception as exc:  # after the answer began: an error event ends the stream
            yield json.dumps(stream_error(exc, lm.served_by(route)))
            return
        if include_usage:
            usage = self._usage(len(jobs[0].prompt), completion)
            yield json.dumps({**base, "object": "chat.completion.chunk", "choices": [],
                              "usage": usage, "fleet": lm.served_by(route)})  # fmt: skip
        yield "[DONE]"

    # -- POST /v1/completions --------------------------------------------------------------

    async def completions(
        self, claims: TokenClaims, req: CompletionRequest, holds: ExitStack,
        headers: dict[str, str],
    ) -> Reply:  # fmt: skip
        lm = self._model(req.model)
        self._refuse_unsupported(req)
        if req.echo:
            raise bad_field(
                "echo", "the prompt is not echoed here; send false", "unsupported_value"
            )
        if req.suffix:
            raise bad_field("suffix", "insertion is not served here", "unsupported_value")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_field(
                "best_of", "only best_of equal to n is served (every choice is returned)"
            )
        if req.logprobs:
            raise bad_field(
                "logprobs", "only the chosen tokens' logprobs are reported here; send 0",
                "unsupported_value",
            )  # fmt: skip
        prompts = self._prompts(lm, req.prompt)
        jobs: list[Job] = []
        prompt_tokens = 0
        for p, ids in enumerate(prompts):
            field_name = "prompt" if len(prompts) == 1 else f"prompt[{p}]"
            params = self._sampling(lm, len(ids), req, req.max_tokens, req.logprobs is not None,
                                    field_name, req.n)  # fmt: skip
            jobs += [Job(p * req.n + i, ids, sp) for i, sp in enumerate(params)]
            prompt_tokens += len(ids)
        route = await self._admit(lm, claims, jobs, holds, headers, bool(req.stream))
        base = self._base(lm, "text_completion", "cmpl-")
        want_logprobs = req.logprobs is not None
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            tally = Tally(prompt_tokens)
            events = self._completion_stream(lm, route, jobs, base, usage, prompt_tokens,
                                             want_logprobs, tally)  # fmt: skip
            return Reply(200, headers=lm.headers(route),
                         events=self._counted(claims, lm, events, tally))  # fmt: skip
        choices = await run_jobs(lm, route, jobs, base["id"])
        out = [
            {"index": job.index, "text": choice.text,
             "logprobs": self._completion_logprobs(lm, choice.events) if want_logprobs else None,
             "finish_reason": choice.events[-1].finish_reason}
            for job, choice in zip(jobs, choices, strict=True)
        ]  # fmt: skip
        completion = sum(len(c.events) for c in choices)
        body = {**base, "choices": out, "usage": self._usage(prompt_tokens, completion),
                "fleet": lm.served_by(route)}  # fmt: skip
        self._count(claims, lm, prompt_tokens, completion)
        return Reply(200, body, headers=lm.headers(route))

    def _prompts(self, lm: LanguageModel, prompt: object) -> list[list[int]]:
        """Each prompt as token ids: text is encoded as it stands (no template)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise bad_field("prompt", "expected text, token ids, or a non-empty list of either")
        if all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        limit = lm.limits.max_prompts
        if len(prompt) > limit:
            raise bad_field("prompt", f"{len(prompt)} prompts; at most {limit} in one request")
        out = []
        for p, item in enumerate(prompt):
            ids = (list(lm.tokenizer.encode(item, add_special_tokens=False).ids)
                   if isinstance(item, str) else list(item))  # fmt: skip
            if not ids:
                raise bad_field(f"prompt[{p}]" if len(prompt) > 1 else "prompt", "is empty")
            vocab = lm.tokenizer.get_vocab_size()
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_field("prompt", f"{bad} is not a token id below {vocab}")
            out.append(ids)
        return out

    def _completion_logprobs(self, lm: LanguageModel, events: Sequence[TokenEvent]) -> Any:
        tokens, logprobs, offsets = [], [], []
        at = 0
        for e in events:
            if self._ends_unseen(lm, e) or e.logprob is None:
                continue
            token = self._token(lm, e.token_id)
            tokens.append(token)
            logprobs.append(e.logprob)
            offsets.append(at)
            at += len(token)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None,
                "text_offset": offsets}  # fmt: skip

    async def _completion_stream(
        self, lm: LanguageModel, route: Route, jobs: list[Job], base: dict[str, Any],
        include_usage: bool, prompt_tokens: int, logprobs: bool, tally: Tally | None = None,
    ) -> AsyncIterator[str]:  # fmt: skip
        completion = 0
        try:
            async with aclosing(merge_events(lm, route, jobs, base["id"])) as merged:
                async for index, event in merged:
                    completion += 1
                    if tally is not None:
                        tally.completion = completion
                    lp = self._completion_logprobs(lm, [event]) if logprobs else None
                    if not event.text and event.finish_reason is None and not (lp and lp["tokens"]):
                        continue
                    choice = {"index": index, "text": event.text, "logprobs": lp,
                              "finish_reason": event.finish_reason}  # fmt: skip
                    yield json.dumps({**base, "choices": [choice], "fleet": lm.served_by(route)})
        except Exception as exc:
            yield json.dumps(stream_error(exc, lm.served_by(route)))
            return
        if include_usage:
            yield json.dumps({**base, "choices": [], "fleet": lm.served_by(route),
                              "usage": self._usage(prompt_tokens, completion)})  # fmt: skip
        yield "[DONE]"
