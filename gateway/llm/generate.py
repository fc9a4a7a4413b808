"""The gRPC `InferenceService.Generate` call: one generation by the gateway's language model,
its tokens streamed as they are made, through the same admission, failover and accounting as
the OpenAI-compatible HTTP API (`gateway.llm.openai_api`).

A request refused before its first event (bad input, a token refused, no room) ends the call
with the status the HTTP API answers as an error, with its retry hint (the API interceptor
maps fleet's errors). Once tokens were sent, a failure ends the stream with a `GenerateEnd`
whose `finish_reason` is "error"; a resumable one names the tokens sent and the last one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog

from fleet.api.pb import inference_pb2
from fleet.core.errors import FleetError, InvalidArgument, ResourceExhausted, Unavailable
from fleet.core.tokens import TokenClaims
from gateway.accounting import UsageBook
from gateway.llm.budgets import BudgetExceeded
from gateway.llm.sampling import SamplingParams
from gateway.llm.serving import LanguageModel, Resumable, Route
from gateway.model import DeviceFault

log = structlog.get_logger(__name__)


def _who(lm: LanguageModel, route: Route | None) -> dict[str, Any]:
    served = lm.served_by(route)
    return {"served_by": served["served_by"], "device": served["device"],
            "dtype": served["dtype"], "degraded": served["degraded"]}  # fmt: skip


def _prompt(lm: LanguageModel, request: inference_pb2.GenerateRequest) -> list[int]:
    if request.text and request.token_ids:
        raise InvalidArgument("text and token_ids: send one of them")
    if "\x00" in request.text:
        raise InvalidArgument("text: a NUL character is not taken")
    ids = list(request.token_ids) or list(
        lm.tokenizer.encode(request.text, add_special_tokens=False).ids
    )
    if not ids:
        raise InvalidArgument("text / token_ids: the prompt is empty")
    vocab = lm.tokenizer.get_vocab_size()
    bad = next((i for i, t in enumerate(ids) if t >= vocab), None)
    if bad is not None:
        raise InvalidArgument(f"token_ids[{bad}]: {ids[bad]} is not a token id below {vocab}")
    return ids


def _params(lm: LanguageModel, request: inference_pb2.GenerateRequest, prompt: int) -> Any:
    context = lm.manifest.context_length
    if request.max_tokens < 1:
        raise InvalidArgument("max_tokens: at least 1")
    if prompt + request.max_tokens > context:
        raise InvalidArgument(
            f"max_tokens: a prompt of {prompt} tokens plus {request.max_tokens} to generate is "
            f"{prompt + request.max_tokens}, over the model's context of {context}"
        )
    return SamplingParams(
        max_tokens=request.max_tokens, temperature=request.temperature,
        top_p=request.top_p or 1.0, seed=request.seed if request.HasField("seed") else None,
        stop=tuple(request.stop), logprobs=request.logprobs,
    )  # fmt: skip


async def generate_events(
    request: inference_pb2.GenerateRequest,
    *,
    llm: LanguageModel | None,
    authorize: Callable[[str, str], TokenClaims],
    usage: UsageBook | None,
) -> AsyncIterator[inference_pb2.GenerateEvent]:
    claims = authorize(request.token, request.rollout_id)
    if llm is None or request.model != llm.model_id:
        served = f"serving {llm.model_id}" if llm else "no language model is served here"
        raise InvalidArgument(f"model: {request.model!r} is not served here ({served})")
    lm = llm
    ids = _prompt(lm, request)
    params = _params(lm, request, len(ids))
    sent: list[int] = []
    finish = ""
    with contextlib.ExitStack() as holds:
        if usage is not None:  # the rollout's and its tenant's token budgets, as over HTTP
            try:
                (cap,) = holds.enter_context(
                    usage.budgets.admit(claims, len(ids), [params.max_tokens])
                )
            except BudgetExceeded as exc:
                raise ResourceExhausted(exc.message, retry_after_s=exc.retry_after_s) from None
            if cap is not None and cap != params.max_tokens:
                params = dataclasses.replace(params, max_tokens=cap)
        holds.enter_context(lm.admitted(claims.rollout_id, 1))
        route, (asked,) = await lm.plan(
            [(ids, params)], streaming=True, no_fallback=request.no_fallback
        )
        key = f"grpc-{secrets.token_hex(8)}"
        try:
            async for event in lm.generate(ids, asked, request_id=key, route=route):
                sent.append(event.token_id)
                finish = event.finish_reason or ""
                token = inference_pb2.GenerateToken(token_id=event.token_id, text=event.text)
                if event.logprob is not None:
                    token.logprob = event.logprob
                yield inference_pb2.GenerateEvent(token=token, **_who(lm, route))
        except (DeviceFault, Resumable, FleetError) as exc:
            if not sent:  # nothing sent: the call's status says it
                if isinstance(exc, FleetError):
                    raise
                raise Unavailable(f"the model's device failed: {exc}", retry_after_s=1.0) from exc
            code = exc.code if isinstance(exc, FleetError) else "UNAVAILABLE"
            end = inference_pb2.GenerateEnd(
                finish_reason="error", prompt_tokens=len(ids), completion_tokens=len(sent),
                error=inference_pb2.InferError(code=str(code), message=str(exc)),
                resumable=isinstance(exc, Resumable), tokens_sent=len(sent),
                last_token_id=sent[-1],
                failovers=[json.dumps(f, sort_keys=True) for f in route.failovers],
            )  # fmt: skip
            yield inference_pb2.GenerateEvent(end=end, **_who(lm, route))
            return
        finally:
            if usage is not None and sent:
                usage.add_tokens(claims.rollout_id, lm.model_id, len(ids), len(sent))
        end = inference_pb2.GenerateEnd(
            finish_reason=finish, prompt_tokens=len(ids), completion_tokens=len(sent),
            failovers=[json.dumps(f, sort_keys=True) for f in route.failovers],
        )  # fmt: skip
        yield inference_pb2.GenerateEvent(end=end, **_who(lm, route))
