"""The OpenAI-compatible API's requests, refusals and answers, as the wire has them.

Requests are checked strictly (no coercion of "2" into 2, no unknown fields), and a refusal
names the field at fault the way OpenAI does (`param`: `messages[1].content`), so a client
sees what to fix. A string holding a NUL character is refused wherever it is: no prompt, stop
string or tool may carry one into the tokenizer or the template.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleet.core.errors import ErrorCode, FleetError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: str
    """Checked with the rest of the conversation (`chat.check_messages`), which names the
    roles taken."""
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # Fields of an answer's message that clients send back as they received them:
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None


class StreamOptions(_Strict):
    include_usage: bool = False


class Request(_Strict):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class ChatRequest(Request):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    """Checked by `chat.check_tools`, which names the field at fault."""
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None


class CompletionRequest(Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


_MODELS = (ChatRequest, CompletionRequest, Message, ToolCall, FunctionCall, TextPart, StreamOptions)
FIELDS = frozenset(name for model in _MODELS for name in model.model_fields)
"""Every field name of a request, to tell them from the type tags in pydantic's error paths."""


@dataclass
class ApiError(Exception):
    """A refusal in OpenAI's shape."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None

    def reply(self) -> Reply:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = f"{max(self.retry_after_s, 0.0):.3f}"
        error = {"message": self.message, "type": self.type, "param": self.param,
                 "code": self.code}  # fmt: skip
        return Reply(self.status, {"error": error}, headers=headers)


FLEET_CODES: dict[ErrorCode, tuple[int, str, str]] = {
    ErrorCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    ErrorCode.FAILED_PRECONDITION: (400, "invalid_request_error", "failed_precondition"),
    ErrorCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    ErrorCode.PERMISSION_DENIED: (403, "permission_error", "permission_denied"),
    ErrorCode.NOT_FOUND: (404, "not_found_error", "not_found"),
    ErrorCode.OUT_OF_RANGE: (400, "invalid_request_error", "out_of_range"),
    ErrorCode.ALREADY_EXISTS: (409, "invalid_request_error", "conflict"),
    ErrorCode.ABORTED: (409, "invalid_request_error", "aborted"),
    ErrorCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    ErrorCode.CANCELLED: (499, "invalid_request_error", "cancelled"),
    ErrorCode.UNAVAILABLE: (503, "service_unavailable_error", "service_unavailable"),
    ErrorCode.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout"),
    ErrorCode.INTERNAL: (500, "server_error", "internal_error"),
}
_PARAM = re.compile(r"([A-Za-z_]\w*)((?:\[\d+\]|\.[\w-]+)*)")


def from_fleet(exc: FleetError) -> ApiError:
    """A fleet error as OpenAI's; a bad argument's message names its field first
    (`messages[2].content: ...`, `max_tokens must be ...`), which becomes `param`."""
    status, kind, code = FLEET_CODES.get(exc.code, (500, "server_error", "internal_error"))
    param = None
    match = _PARAM.match(exc.message)
    if status == 400 and match and match.group(1) in FIELDS:
        param = match.group(0)
    return ApiError(status, exc.message, kind, param, code, exc.retry_after_s)


def bad_field(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}", "invalid_request_error", param, code)


def _param_of(error: Any) -> str:
    """A pydantic error's location as a field path, without the union members' type tags
    (an unknown field's own name kept)."""
    path = ""
    loc = error["loc"]
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in FIELDS or (error["type"] == "extra_forbidden" and i == len(loc) - 1):
            path += f".{part}" if path else part
    return path


R = TypeVar("R", bound=BaseModel)


def parse_request(kind: type[R], body: bytes) -> R:
    """The request, or a 400 naming the first field at fault (NUL bytes refused anywhere)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"the body is not JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    nul = _nul_at(data)
    if nul is not None:
        raise bad_field(nul, "holds a NUL character (\\u0000), which no request may carry")
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        # Of a union's alternatives, the one that got furthest says best what is wrong.
        first = max(errors, key=lambda e: len(_param_of(e)))
        param = _param_of(first) or None
        text = f"{param}: {first['msg']}" if param else first["msg"]
        raise ApiError(400, text, param=param, code=first["type"]) from None
    except RecursionError:
        raise ApiError(400, "the body nests too deeply", code="invalid_json") from None


def _nul_at(data: object) -> str | None:
    """The path of the first string (or key) holding a NUL character, walked without
    recursion (a body may nest as deeply as the JSON parser allowed)."""
    stack: list[tuple[str, object]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if "\x00" in value:
                return path or "body"
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                if "\x00" in key:
                    return path or "body"
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


@dataclass
class Reply:
    """An answer for the HTTP layer: a JSON body, or server-sent events (each a `data:`
    payload, the last `[DONE]` unless the stream ended with an error event). `close` must be
    called once the events are written or abandoned: it frees the request's place."""

    status: int
    body: dict[str, Any] | None = None
    events: AsyncIterator[str] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    holds: ExitStack = field(default_factory=ExitStack)

    async def close(self) -> None:
        if self.events is not None and hasattr(self.events, "aclose"):
            await self.events.aclose()
        self.holds.close()
