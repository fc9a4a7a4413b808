"""The gateway's OpenAI-compatible API through the official `openai` client: a real gateway
(its HTTP endpoint on loopback, the per-rollout tokens and running list) serving a tiny random
language model in the shipped layout, and the shipped model itself for a tool call.

The gateway runs on an event loop of its own thread, as it would in its own process, so the
tests call it with the synchronous client an agent in a machine would use.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
import torch

from fleet.core.tokens import issue, sign_running
from gateway.http import MAX_PER_ROLLOUT, serve_http
from gateway.llm.chat import SHELL_TOOL
from gateway.llm.llama import load_model
from gateway.llm.manifest import load_tokenizer, render_chat
from gateway.llm.serving import ENV, SHIPPED, Limits
from gateway.service import Gateway, GatewayConfig
from gateway.settings import WEIGHTS_DIR
from tests.llm_fixtures import CONTEXT, write_tiny_model

SECRET = b"s" * 32
TINY = "tiny-test-r1"
T = TypeVar("T")


@dataclass
class Served:
    gateway: Gateway
    base_url: str
    loop: asyncio.AbstractEventLoop
    clients: list[openai.OpenAI] = field(default_factory=list)

    def on_loop(self, fn: Callable[[], T]) -> T:
        """Runs `fn` on the gateway's loop (its state belongs to that thread)."""
        done: Future[T] = Future()

        def call() -> None:
            try:
                done.set_result(fn())
            except BaseException as exc:
                done.set_exception(exc)

        self.loop.call_soon_threadsafe(call)
        return done.result(timeout=30)

    def client(self, rollout: str = "r-a", token: str | None = None, **kw: Any) -> Any:
        """The official client with a rollout's token (typed loosely: the tests send what the
        client's types would not let through, to see it refused)."""
        token = issue(SECRET, rollout, time.time() + 600) if token is None else token
        client = openai.OpenAI(base_url=self.base_url, api_key=token, max_retries=0, **kw)
        self.clients.append(client)
        return client


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llm"))


def _serve(model: str) -> Iterator[Served]:
    """A gateway serving the language model `model` (FLEET_GATEWAY_LLM), on a thread."""
    loop = asyncio.new_event_loop()
    ready: Future[tuple[Gateway, Any, int]] = Future()

    async def start() -> None:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(ENV, model)
            config = GatewayConfig(
                secret=SECRET, device="cpu", engine="inline", tokens_without_server=True
            )
            gateway = await asyncio.to_thread(Gateway.build, config)
        server, port = await serve_http(gateway, "127.0.0.1", 0)
        ready.set_result((gateway, server, port))

    thread = threading.Thread(target=loop.run_forever, name="gateway-loop", daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=120)
    gateway, server, port = ready.result()
    served = Served(gateway, f"http://127.0.0.1:{port}/v1", loop)
    try:
        yield served
    finally:
        for client in served.clients:
            client.close()

        async def stop() -> None:
            server.close()
            await gateway.stop()
            # Connections still open (a client's keep-alive) end with the loop.
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


@pytest.fixture(scope="module")
def served(tiny_dir: Path) -> Iterator[Served]:
    yield from _serve(str(tiny_dir))


def reference_greedy(model_dir: Path, prompt_text: str, max_tokens: int) -> tuple[list[int], str]:
    """The answer by the plain reference forward, one token at a time, stopping as the model's
    manifest says: what the gateway's greedy answer must equal."""
    _spec, model, manifest = load_model(model_dir, "cpu", torch.float32)
    tokenizer = load_tokenizer(model_dir, manifest)
    ids = list(tokenizer.encode(prompt_text, add_special_tokens=False).ids)
    stops = {*manifest.stop_token_ids, manifest.eos_token_id}
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(max_tokens):
            token = int(model(torch.tensor([ids + out]))[0, -1].argmax())
            out.append(token)
            if token in stops:
                return out, tokenizer.decode(out[:-1], skip_special_tokens=False)
    return out, tokenizer.decode(out, skip_special_tokens=False)


MESSAGES = [{"role": "user", "content": "The agent runs ls -la and reads the output."}]


def test_a_chat_completion_is_the_models_greedy_answer(served: Served, tiny_dir: Path) -> None:
    """The official client's chat completion: the template's prompt, the reference model's
    greedy tokens, usage counting both, and who served it in the header and the body."""
    raw = served.client().chat.completions.with_raw_response.create(
        model=TINY,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
    )
    answer = raw.parse()
    lm = served.gateway.llm
    assert lm is not None
    manifest = lm.manifest
    prompt = render_chat(manifest, MESSAGES)
    tokens, text = reference_greedy(tiny_dir, prompt, 12)

    choice = answer.choices[0]
    assert choice.message.content == text
    assert choice.finish_reason == ("stop" if len(tokens) < 12 else "length")
    assert choice.message.tool_calls is None
    assert answer.model == TINY
    tokenizer = lm.tokenizer
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert answer.usage.completion_tokens == len(tokens)
    assert raw.headers["x-fleet-served-by"] == (
        "primary; device=cpu; model=tiny-test-r1; dtype=float32"
    )
    assert raw.headers["x-fleet-degraded"] == "0"
    assert raw.headers["x-fleet-admission"] == "primary"
    assert (answer.model_extra or {})["fleet"] == {
        "model": TINY, "name": "tiny-test", "revision": "r1", "device": "cpu",
        "dtype": "float32", "degraded": False, "served_by": "primary", "admission": "primary",
    }  # fmt: skip


def test_a_streamed_chat_reassembles_to_the_same_answer(served: Served) -> None:
    """Server-sent chunks, each saying who served it, ending with usage; their deltas join to
    the non-streamed greedy answer."""
    client = served.client()
    whole = client.chat.completions.create(
        model=TINY,
        messages=MESSAGES,
        max_tokens=40,
        temperature=0,
    )
    chunks = list(client.chat.completions.create(
        model=TINY, messages=MESSAGES, max_tokens=40, temperature=0,
        stream=True, stream_options={"include_usage": True},
    ))  # fmt: skip

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert len([c for c in chunks if c.choices]) > 2  # (one chunk per token, not one blob)
    assert chunks[0].choices[0].delta.role == "assistant"
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == whole.choices[0].finish_reason and not any(reasons[:-1])
    assert chunks[-1].usage == whole.usage and not chunks[-1].choices
    assert all((c.model_extra or {})["fleet"]["device"] == "cpu" for c in chunks)


def test_n_choices_are_independent_seeded_sequences(served: Served) -> None:
    """n=3 sampled with seed 7: three sequences, the i-th the same as one request with seed
    7+i; the whole request repeats exactly."""
    client = served.client()
    ask = {"model": TINY, "messages": MESSAGES, "max_tokens": 16, "temperature": 1.0}
    many = client.chat.completions.create(n=3, seed=7, **ask)
    again = client.chat.completions.create(n=3, seed=7, **ask)
    alone = [
        client.chat.completions.create(seed=7 + i, **ask).choices[0].message.content
        for i in range(3)
    ]

    texts = [c.message.content for c in sorted(many.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(many.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert texts == alone
    assert texts == [c.message.content for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # (sampled: the seeds differ, so do the answers)


def test_models_lists_the_language_model_with_its_context(served: Served) -> None:
    models = served.client().models.list().data
    assert [m.id for m in models] == [TINY]
    extra = models[0].model_extra or {}
    assert extra["context_length"] == CONTEXT
    assert extra["limits"]["context_length"] == CONTEXT
    assert extra["limits"]["max_inflight_per_rollout"] == Limits().max_inflight_per_rollout


def test_a_completion_continues_the_prompt_with_logprobs(served: Served, tiny_dir: Path) -> None:
    """POST /v1/completions: the prompt as written (no template), the reference's greedy
    continuation, and one logprob per token of it."""
    prompt = "echo hello world"
    answer = served.client().completions.create(
        model=TINY, prompt=prompt, max_tokens=8, temperature=0, logprobs=0
    )
    tokens, text = reference_greedy(tiny_dir, prompt, 8)
    choice = answer.choices[0]
    assert choice.text == text
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    seen = len(tokens) - (choice.finish_reason == "stop")  # (a stop token has none)
    assert len(choice.logprobs.token_logprobs) == seen
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)

    streamed = served.client().completions.create(
        model=TINY, prompt=prompt, max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text


LONG = " ".join(["word"] * 400)
BAD_TOOL = {
    "type": "function",
    "function": {"name": "run shell!", "parameters": {"type": "object"}},
}
BAD_SCHEMA = {"type": "function", "function": {"name": "shell", "parameters": {"type": "array"}}}
BAD_REQUIRED = {
    "type": "function",
    "function": {"name": "shell", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["cmd"],
    }},
}  # fmt: skip
BAD_TYPE = {"type": "function", "function": {"name": "shell", "parameters": {
    "type": "object", "properties": {"command": {"type": "text"}},
}}}  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"model": "gpt-4o"}, "model", "model_not_found"),
        ({"max_tokens": 1000}, "max_tokens", "context_length_exceeded"),
        ({"messages": [{"role": "user", "content": LONG}]}, "messages", "context_length_exceeded"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", None),
        ({"messages": [{"role": "user"}]}, "messages[0].content", None),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", None),
        ({"messages": [{"content": "hi"}]}, "messages[0].role", "missing"),
        ({"messages": []}, "messages", None),
        ({"messages": [{"role": "tool", "content": "out"}]}, "messages[0].tool_call_id", None),
        ({"messages": [{"role": "user", "content": "a\x00b"}]}, "messages[0].content", None),
        ({"stop": ["\x00"]}, "stop[0]", None),
        ({"max_tokens": -1}, "max_tokens", None),
        ({"max_tokens": 0}, "max_tokens", None),
        ({"temperature": 3.5}, "temperature", None),
        ({"top_p": 0}, "top_p", None),
        ({"n": 99}, "n", None),
        ({"n": "2"}, "n", None),
        ({"tools": [BAD_TOOL]}, "tools[0].function.name", None),
        ({"tools": [BAD_SCHEMA]}, "tools[0].function.parameters.type", None),
        ({"tools": [BAD_REQUIRED]}, "tools[0].function.parameters.required", None),
        ({"tools": [BAD_TYPE]}, "tools[0].function.parameters.properties.command.type", None),
        ({"tools": [SHELL_TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice.function.name", None),
        ({"tool_choice": "required"}, "tool_choice", None),
        ({"presence_penalty": 0.5}, "presence_penalty", "unsupported_value"),
        ({"logprobs": True, "top_logprobs": 3}, "top_logprobs", "unsupported_value"),
        ({"frobnicate": True}, "frobnicate", "extra_forbidden"),
    ],
)  # fmt: skip
def test_bad_requests_get_an_openai_shaped_400_naming_the_field(
    served: Served, fields: dict[str, Any], param: str, code: str | None
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:  # (sent as given, unchecked)
        served.client().chat.completions.create(model=TINY, messages=MESSAGES, extra_body=fields)
    error = caught.value.body
    assert caught.value.status_code == 400
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(param)
    if code is not None:
        assert error["code"] == code


def test_malformed_bodies_are_400s_not_500s(served: Served) -> None:
    token = issue(SECRET, "r-a", time.time() + 60)
    url = served.base_url + "/chat/completions"
    headers = {"Authorization": f"Bearer {token}"}
    for body in (b"{", b"[1, 2]", b"\xff\xfe", b"[" * 5000 + b"]" * 5000, b'{"model": 1}'):
        got = httpx.post(url, content=body, headers=headers)
        assert got.status_code == 400, (body[:20], got.text)
        assert set(got.json()["error"]) == {"message", "type", "param", "code"}
    completions = served.base_url + "/completions"
    for prompt, param in (([], "prompt"), ([999999], "prompt"), ("", "prompt")):
        got = httpx.post(completions, headers=headers, json={"model": TINY, "prompt": prompt})
        assert got.status_code == 400 and got.json()["error"]["param"] == param, got.text


def test_tokens_of_nobody_other_rollouts_and_ended_rollouts_are_refused(served: Served) -> None:
    """401 without a token or with one the fleet did not sign; 403 for a token scoped to
    another rollout than the request names, for an expired one, and for a rollout the
    server's list says has ended."""
    ask = {"model": TINY, "messages": MESSAGES, "max_tokens": 2}
    for token in ("not-a-token", issue(b"k" * 32, "r-a", time.time() + 60)):
        with pytest.raises(openai.AuthenticationError) as unauth:
            served.client(token=token).chat.completions.create(**ask)
        assert unauth.value.status_code == 401
    bare = httpx.post(served.base_url + "/chat/completions", json=ask)  # (no Authorization)
    assert bare.status_code == 401
    assert bare.json()["error"]["type"] == "authentication_error"
    other = served.client("r-a", default_headers={"x-fleet-rollout": "r-b"})
    with pytest.raises(openai.PermissionDeniedError) as denied:
        other.chat.completions.create(**ask)
    assert "scoped to rollout r-a, not to r-b" in denied.value.message
    expired = served.client(token=issue(SECRET, "r-a", time.time() - 1))
    with pytest.raises(openai.PermissionDeniedError):
        expired.models.list()

    before = time.time() - 5
    ended = served.client(token=issue(SECRET, "r-ended", time.time() + 600, before))
    live = served.client("r-live")
    ended.chat.completions.create(**ask)  # (no list yet: served)
    as_of = time.time()
    gw = served.gateway
    served.on_loop(
        lambda: gw.note_running(["r-live"], as_of, sign_running(SECRET, ["r-live"], as_of))
    )
    try:
        with pytest.raises(openai.PermissionDeniedError) as gone:
            ended.chat.completions.create(**ask)
        assert "rollout r-ended is not running" in gone.value.message
        body = gone.value.body
        assert isinstance(body, dict) and body["type"] == "permission_error"
        assert live.chat.completions.create(**ask).choices
    finally:
        served.on_loop(lambda: setattr(gw, "running_as_of", 0.0))


def test_over_capacity_is_a_429_with_retry_after(served: Served) -> None:
    lm = served.gateway.llm
    assert lm is not None
    served.on_loop(lambda: setattr(lm, "limits", replace(lm.limits, max_inflight_per_rollout=2)))
    try:
        with pytest.raises(openai.RateLimitError) as refused:
            served.client().chat.completions.create(
                model=TINY,
                messages=MESSAGES,
                max_tokens=2,
                n=3,
            )
        assert float(refused.value.response.headers["retry-after"]) > 0
        body = refused.value.body
        assert isinstance(body, dict) and body["type"] == "rate_limit_error"
        assert "limit of 2" in refused.value.message
    finally:
        served.on_loop(lambda: setattr(lm, "limits", Limits()))
    assert (
        served.client()
        .chat.completions.create(
            model=TINY,
            messages=MESSAGES,
            max_tokens=2,
            n=2,
        )
        .choices
    )


def test_connections_count_against_the_bearer_tokens_rollout(served: Served) -> None:
    """Kept-alive connections of one rollout, known by its Bearer token, are bounded as
    /v1/infer's are: past MAX_PER_ROLLOUT the next gets a 503 to retry; another rollout's
    connection is still served."""
    host, port = served.base_url.removeprefix("http://").removesuffix("/v1").split(":")

    def models(rollout: str) -> tuple[http.client.HTTPConnection, int]:
        token = issue(SECRET, rollout, time.time() + 60)
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {token}"})
        reply = conn.getresponse()
        reply.read()
        return conn, reply.status

    held = [models("r-many") for _ in range(MAX_PER_ROLLOUT)]
    try:
        assert {status for _, status in held} == {200}
        extra, status = models("r-many")
        extra.close()
        assert status == 503
        other, status = models("r-other")
        other.close()
        assert status == 200
    finally:
        for conn, _ in held:
            conn.close()


def test_a_client_that_leaves_mid_stream_frees_its_cache(served: Served) -> None:
    lm = served.gateway.llm
    assert lm is not None
    stream = served.client().chat.completions.create(
        model=TINY, messages=MESSAGES, max_tokens=150, temperature=0.8, seed=1,
        stream=True, stop=[],
    )  # fmt: skip
    engine = lm.primary
    assert engine is not None
    next(iter(stream))
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = served.on_loop(engine.stats)
        if stats["requests"] == 0 and stats["blocks_free"] == stats["blocks_total"]:
            break
        time.sleep(0.05)
    assert stats["requests"] == 0 and stats["blocks_free"] == stats["blocks_total"]


@pytest.fixture(scope="module")
def shipped() -> Iterator[Served]:
    directory = WEIGHTS_DIR / SHIPPED
    assert (directory / "manifest.toml").is_file(), f"the shipped model is missing: {directory}"
    yield from _serve("auto")


ASK_TOOL = [{"role": "user", "content": "How many words are in 'apple river stone'?"}]


def test_the_shipped_model_calls_a_tool_through_the_openai_client(shipped: Served) -> None:
    """The shipped model, offered the shell tool, answers with a call in OpenAI's form, whole
    and streamed; given the tool's output it answers in words."""
    client = shipped.client()
    models = [m.id for m in client.models.list().data]
    assert models == [SHIPPED]
    answer = client.chat.completions.create(
        model=SHIPPED,
        messages=ASK_TOOL,
        tools=[SHELL_TOOL],
        temperature=0,
        max_tokens=96,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function"
    call = calls[0]
    assert call.function.name == "shell" and call.id.startswith("call_")
    command = json.loads(call.function.arguments)["command"]
    assert isinstance(command, str) and command

    chunks = list(client.chat.completions.create(
        model=SHIPPED, messages=ASK_TOOL, tools=[SHELL_TOOL], temperature=0,
        max_tokens=96, stream=True,
    ))  # fmt: skip
    streamed = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [
        (call.function.name, call.function.arguments)
    ]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    follow = [*ASK_TOOL, choice.message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "3"}]  # fmt: skip
    final = client.chat.completions.create(
        model=SHIPPED,
        messages=follow,
        tools=[SHELL_TOOL],
        temperature=0,
        max_tokens=64,
    )
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_every_fleet_error_has_an_openai_status() -> None:
    from fleet.core.errors import ErrorCode
    from gateway.llm.openai_schema import FLEET_CODES

    assert set(FLEET_CODES) == set(ErrorCode)
