"""Token budgets end to end: a real gateway serving the tiny model (and one forwarding to a real
upstream process) refuses what a rollout's or a tenant's budget does not allow, with tokens
issued as the server issues them; and the budgets a submission sets, through the client and
`fleet session open`, reach the token a host is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleet.api.pb import host_pb2
from fleet.cli.main import build_parser
from fleet.client import AsyncFleet
from fleet.core.errors import InvalidArgument
from fleet.core.tokens import issue, verify
from fleet.image.store import ImageStore
from gateway.http import serve_http
from gateway.llm.budgets import FLOOR_HEADER
from gateway.llm.upstream import Upstreams
from gateway.llm.upstream_config import load_upstreams
from gateway.service import Gateway, GatewayConfig
from tests.integration.harness import SECRET, harness
from tests.integration.test_llm_upstream import serving, upstream_process
from tests.llm_fixtures import write_tiny_model

PROMPT = [10, 11, 12, 13, 14]
"""Five token ids: a prompt whose size the budgets count exactly."""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llm"))


@contextlib.asynccontextmanager
async def gateway_with_model(model_dir: Path) -> AsyncIterator[tuple[Gateway, str]]:
    """A gateway serving the tiny model on loopback: (the gateway, its API's base URL)."""
    config = GatewayConfig(secret=SECRET, device="cpu", engine="inline", llm=str(model_dir),
                           tokens_without_server=True)  # fmt: skip
    gw = await asyncio.to_thread(Gateway.build, config)
    server, port = await serve_http(gw, "127.0.0.1", 0)
    try:
        yield gw, f"http://127.0.0.1:{port}/v1"
    finally:
        server.close()
        await gw.stop()


def _client(base: str, token: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base, timeout=60,
                             headers={"authorization": f"Bearer {token}"})  # fmt: skip


def _complete(max_tokens: int | None, prompt: list[int] = PROMPT, **more: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny-test-r1", "prompt": prompt, "temperature": 0, **more}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


async def _sse(client: httpx.AsyncClient, path: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[int, list[Any]]:  # fmt: skip
    async with client.stream("POST", path, json=body, headers=headers or {}) as reply:
        if reply.status_code != 200:
            await reply.aread()
            return reply.status_code, [reply.json()]
        lines = [line[6:] async for line in reply.aiter_lines() if line.startswith("data: ")]
    return 200, [json.loads(x) if x != "[DONE]" else x for x in lines]


def _refused(reply: httpx.Response, budget: str) -> dict[str, Any]:
    """The 429 refusal's error, checked to name `budget` in OpenAI's shape."""
    assert reply.status_code == 429, reply.text
    body = reply.json()
    assert body["error"]["code"] == "budget_exceeded" and body["error"]["param"] == budget
    assert budget in body["error"]["message"] and body["fleet"]["budget"]["name"] == budget
    return dict(body["error"]) | {"figures": body["fleet"]["budget"]}


async def test_a_rollouts_budgets_and_a_tenants_minute_on_the_gateways_model(
    tiny_dir: Path,
) -> None:
    async with gateway_with_model(tiny_dir) as (gw, base):
        model = gw.llm
        assert model is not None
        complete_only = issue(SECRET, "r-c", time.time() + 600, tenant="acme",
                              max_completion_tokens=10)  # fmt: skip
        prompt_only = issue(SECRET, "r-p", time.time() + 600, tenant="acme", max_prompt_tokens=12)
        async with _client(base, complete_only) as c:
            first = await c.post("/completions", json=_complete(6))
            assert first.status_code == 200, first.text
            c1 = first.json()["usage"]["completion_tokens"]
            over = await c.post("/completions", json=_complete(10))
            # Allowed to shrink: lowered to what is left, streamed, and counted as it streams.
            status, events = await _sse(
                c, "/completions",
                _complete(10, stream=True, stream_options={"include_usage": True}),
                {FLOOR_HEADER: "1"},
            )  # fmt: skip
            assert status == 200, events
            c2 = events[-2]["usage"]["completion_tokens"]
            spent = [(await c.post("/completions", json=_complete(10),
                                   headers={FLOOR_HEADER: "1"})) for _ in range(12)]  # fmt: skip
        async with _client(base, prompt_only) as p:
            prompts = [await p.post("/completions", json=_complete(2)) for _ in range(3)]
            small = await p.post("/completions", json=_complete(2, prompt=PROMPT[:2]))
            after = await p.post("/completions", json=_complete(2, prompt=PROMPT[:1]))

        # -- the tenant's minute --
        gw.usage.budgets.tenant_tokens_per_minute = 40
        t1, t2 = (issue(SECRET, r, time.time() + 600, tenant="beta") for r in ("r-t1", "r-t2"))
        other = issue(SECRET, "r-t3", time.time() + 600, tenant="gamma")
        async with _client(base, t1) as a, _client(base, t2) as b, _client(base, other) as o:
            fits = await a.post("/completions", json=_complete(30))  # 5 + 30 may be taken
            crowded = await b.post("/completions", json=_complete(30))  # the same tenant's
            elsewhere = await o.post("/completions", json=_complete(30))
            never = await o.post("/completions", json=_complete(50))

    # The completion budget: 10 over all calls.
    assert 1 <= c1 <= 6
    refused = _refused(over, "max_completion_tokens")
    assert (
        f"max_tokens 10 would pass its completion-token budget (max_completion_tokens 10: "
        f"{c1} used, 0 held by calls in progress, {10 - c1} left)" in refused["message"]
    )
    assert refused["figures"]["used"] == c1 and over.headers.get("Retry-After") is None
    assert 1 <= c2 <= 10 - c1
    done = [r for r in spent if r.status_code == 200]
    assert all(r.json()["usage"]["completion_tokens"] <= 10 for r in done)
    assert spent[-1].status_code == 429
    assert (
        "has used its completion-token budget"
        in _refused(spent[-1], "max_completion_tokens")["message"]
    )
    used = c1 + c2 + sum(r.json()["usage"]["completion_tokens"] for r in done)
    assert used == 10  # (each call lowered to what was left: the budget is spent exactly)
    assert gw.usage.budgets.used("r-c")[1] == 10
    # The prompt budget: 12 over all calls; a prompt that would pass it is refused whole.
    assert [r.status_code for r in prompts[:2]] == [200, 200]
    assert (
        "this prompt of 5 tokens would pass its prompt-token budget (max_prompt_tokens 12: "
        "10 used" in _refused(prompts[2], "max_prompt_tokens")["message"]
    )
    assert small.status_code == 200, small.text
    assert "has used its prompt-token budget" in _refused(after, "max_prompt_tokens")["message"]
    # The tenant's minute: what one rollout took holds back its tenant's others, no one else.
    assert fits.status_code == 200, fits.text
    held = _refused(crowded, "tenant_tokens_per_minute")
    assert held["type"] == "rate_limit_error" and "tenant 'beta' has used" in held["message"]
    assert 0 < float(crowded.headers["Retry-After"]) <= 61.0
    assert held["figures"]["used"] == 5 + fits.json()["usage"]["completion_tokens"]
    assert elsewhere.status_code == 200, elsewhere.text
    assert "allow at all" in _refused(never, "tenant_tokens_per_minute")["message"]
    assert never.headers.get("Retry-After") is None


def _ask(model: str, max_tokens: int | None = None, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "stream": stream,
                            "messages": [{"role": "user", "content": "what is it?"}]}  # fmt: skip
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


async def test_upstream_calls_are_held_to_the_same_budgets(tmp_path: Path) -> None:
    """The test upstream answers four tokens whatever `max_tokens` says, and reports usage (5
    prompt, 4 completion) only in whole answers; a stream is counted by its chunks."""
    async with upstream_process(tmp_path) as up:
        config = load_upstreams([f"up=http://127.0.0.1:{up.port}/v1"],
                                [f"up=@{tmp_path / 'upstream.key'}"], [])  # fmt: skip
        async with serving(Upstreams(config)) as (gw, port, _):
            base = f"http://127.0.0.1:{port}/v1"
            token = issue(SECRET, "r-u", time.time() + 600, models=("up/echo-model",),
                          tenant="acme", max_completion_tokens=6)  # fmt: skip
            prompt_token = issue(SECRET, "r-v", time.time() + 600, models=("up/*",),
                                 max_prompt_tokens=5)  # fmt: skip
            async with _client(base, token) as c, _client(base, prompt_token) as p:
                whole = await c.post("/chat/completions", json=_ask("up/echo-model", 4))
                after_whole = gw.usage.budgets.used("r-u")
                seen = len(up.seen())
                over = await c.post("/chat/completions", json=_ask("up/echo-model", 4))
                unbounded = await c.post("/chat/completions", json=_ask("up/echo-model"))
                not_asked = len(up.seen()) == seen
                status, events = await _sse(c, "/chat/completions",
                                            _ask("up/echo-model", stream=True),
                                            {FLOOR_HEADER: "1"})  # fmt: skip
                spent = await c.post("/chat/completions", json=_ask("up/echo-model", 1))
                outside = await c.post("/chat/completions", json=_ask("up/tired", 1))
                first = await p.post("/chat/completions", json=_ask("up/echo-model"))
                second = await p.post("/chat/completions", json=_ask("up/echo-model"))
            used = gw.usage.budgets.used("r-u")
            handed, _ = gw.usage.hand_over({}, None)

    assert whole.status_code == 200, whole.text
    assert after_whole == (5, 4)
    assert "max_tokens 4 would pass its completion-token budget (max_completion_tokens 6: 4 " \
        "used, 0 held by calls in progress, 2 left)" in _refused(over, "max_completion_tokens")[
            "message"]  # fmt: skip
    assert "no max_tokens (unbounded)" in _refused(unbounded, "max_completion_tokens")["message"]
    assert not_asked  # refused calls never reached the upstream
    # Lowered to the 2 left and forwarded; the usage the gateway asked the upstream for is not
    # passed to a client that did not ask for it.
    assert status == 200 and events[-1] == "[DONE]", events
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                   if e.get("choices"))  # fmt: skip
    assert text == "the answer is 42"
    assert not any(isinstance(e, dict) and e.get("usage") for e in events)
    assert used == (5, 8)  # (the upstream took 4 where 2 were allowed: counted as it was)
    assert (
        "has used its completion-token budget"
        in _refused(spent, "max_completion_tokens")["message"]
    )
    assert outside.status_code == 403  # a model the rollout may not use: 403, not 429
    # The prompt budget: an upstream's prompt is known only from its answer.
    assert first.status_code == 200, first.text
    assert "has used its prompt-token budget" in _refused(second, "max_prompt_tokens")["message"]
    # What was counted for the budgets is what the rollout's attempt is charged.
    assert handed.tokens[("r-u", "up/echo-model")] == (5, 8)


async def test_budgets_from_the_client_and_fleet_session_open_reach_the_token(
    tmp_path: Path, images: ImageStore
) -> None:
    smolfile = tmp_path / "minimal.smolfile"
    smolfile.write_text('image = "minimal"\n')
    async with harness(tmp_path, images) as h:
        await h.register_host("h1", gateway=True)

        async def token_of_next_claim() -> str:
            for _ in range(50):
                claim = await h.hosts.ClaimWork(host_pb2.ClaimWorkRequest(
                    request_id=f"c-{time.monotonic_ns()}", host_id="h1", max_items=1, wait_s=1,
                ))  # fmt: skip
                if claim.items:
                    return str(claim.items[0].inference_token)
            raise AssertionError("nothing to claim in 50 s")

        async with AsyncFleet(h.server.address, plaintext=True) as fleet:
            await fleet.submit(smolfile, [["true"]], inference=True, tenant="acme",
                               max_prompt_tokens=1000, max_completion_tokens=50)  # fmt: skip
            submitted = await token_of_next_claim()
            with pytest.raises(InvalidArgument, match="max_prompt_tokens -5 is out of range"):
                await fleet.submit(smolfile, [["true"]], inference=True, max_prompt_tokens=-5)
        # `fleet session open` with the flags (it waits for the machine: the claim is enough).
        args = build_parser().parse_args([
            "session", "open", "-s", str(smolfile), "--server", h.server.address, "--plaintext",
            "--max-prompt-tokens", "300", "--max-completion-tokens", "20",
        ])  # fmt: skip
        opening = asyncio.create_task(args.fn(args))
        try:
            opened = await token_of_next_claim()
        finally:
            opening.cancel()
            await asyncio.gather(opening, return_exceptions=True)

    claims = verify(SECRET, submitted, time.time())
    assert (claims.tenant, claims.max_prompt_tokens, claims.max_completion_tokens) == (
        "acme", 1000, 50)  # fmt: skip
    session = verify(SECRET, opened, time.time())
    assert (session.max_prompt_tokens, session.max_completion_tokens) == (300, 20)
    assert session.tenant == "default"
