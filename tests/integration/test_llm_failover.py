"""The language model's failover under controlled pressure, with the real engine process.

A real gateway (its HTTP endpoint on loopback, per-rollout tokens) serves a tiny random model
in the shipped layout, its primary in an engine process of its own (`gateway.llm.worker`) and
its CPU replica in the gateway's process. Faults are real where they can be on a CPU host: the
engine process is killed by its pid, or it stops stepping (a hang); an allocation failure is
raised inside the engine's step (`--inject-fault`), where a CUDA allocator would raise it.

What every test holds: no accepted request disappears, and a stream moved to the replica
carries on from the next token (none repeated, none missing) with exactly the tokens the
uninterrupted primary would have produced.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fleet.api.pb import inference_pb2, inference_pb2_grpc
from fleet.core.tokens import issue
from gateway.http import serve_http
from gateway.llm.remote import EngineProcess
from gateway.llm.serving import ENV, LanguageModel, Limits
from gateway.service import Gateway, GatewayConfig, serve
from tests.llm_fixtures import write_tiny_model

SECRET = b"s" * 32
TINY = "tiny-test-r1"
MESSAGES = [{"role": "user", "content": "echo hello world"}]
"""A prompt the tiny model answers at length (80 tokens and more without a stop)."""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llm"))


class Served:
    def __init__(self, gateway: Gateway, lm: LanguageModel, port: int) -> None:
        self.gateway, self.lm = gateway, lm
        self.base = f"http://127.0.0.1:{port}/v1"
        self.http = httpx.AsyncClient(timeout=60)

    def headers(self, rollout: str = "r-a", **extra: str) -> dict[str, str]:
        token = issue(SECRET, rollout, time.time() + 600)
        return {"Authorization": f"Bearer {token}", **extra}

    async def chat(self, **body: Any) -> httpx.Response:
        extra = body.pop("headers", {})
        ask = {"model": TINY, "messages": MESSAGES, "temperature": 0, **body}
        return await self.http.post(f"{self.base}/chat/completions", json=ask,
                                    headers=self.headers(**extra))  # fmt: skip

    @asynccontextmanager
    async def stream(self, **body: Any) -> AsyncIterator[tuple[httpx.Response, Any]]:
        extra = body.pop("headers", {})
        ask = {"model": TINY, "messages": MESSAGES, "temperature": 0, "stream": True,
               "logprobs": True, **body}  # fmt: skip
        async with self.http.stream("POST", f"{self.base}/chat/completions", json=ask,
                                    headers=self.headers(**extra)) as reply:  # fmt: skip

            async def events() -> AsyncIterator[dict[str, Any]]:
                async for line in reply.aiter_lines():
                    if line.startswith("data: ") and line[6:] != "[DONE]":
                        yield json.loads(line[6:])

            yield reply, events()


@asynccontextmanager
async def serving(tiny: Path, limits: Limits | None = None, **lm: Any) -> AsyncIterator[Served]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV, "none")  # (the model below is set up by the test)
        config = GatewayConfig(secret=SECRET, device="cpu", engine="inline",
                               tokens_without_server=True)  # fmt: skip
        gateway = await asyncio.to_thread(Gateway.build, config)
    model = LanguageModel.open(tiny, "cpu", limits=limits or Limits(), engine_kind="process", **lm)
    model.hang_s = 3.0  # (the hang test waits this long; margin for a loaded machine)
    gateway.llm = model
    server, port = await serve_http(gateway, "127.0.0.1", 0)
    served = Served(gateway, model, port)
    try:
        yield served
    finally:
        await served.http.aclose()
        server.close()
        await gateway.stop()
        # Connections still open (a client's keep-alive) end with the test's loop.
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)


async def until(condition: Callable[[], object], timeout_s: float = 10.0) -> bool:
    """Whether `condition` came true within `timeout_s` (checked every 20 ms)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def process_of(served: Served) -> EngineProcess:
    primary = served.lm.primary
    assert isinstance(primary, EngineProcess)
    return primary


def tokens_of(chunks: list[dict[str, Any]]) -> list[str]:
    """The streamed answer's tokens, as their logprob entries name them, in order."""
    out = []
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            for entry in (choice.get("logprobs") or {}).get("content") or []:
                out.append(entry["token"])
    return out


async def uninterrupted(served: Served, max_tokens: int) -> tuple[str, list[str]]:
    """The primary's own answer, streamed without a fault: what every failover must equal."""
    async with served.stream(max_tokens=max_tokens) as (reply, events):
        assert reply.status_code == 200
        chunks = [c async for c in events]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert all(c["fleet"]["served_by"] == "primary" for c in chunks)
    return text, tokens_of(chunks)


async def test_a_killed_engine_mid_stream_continues_on_the_replica_with_identical_tokens(
    tiny_dir: Path,
) -> None:
    async with serving(tiny_dir) as served:
        want_text, want_tokens = await uninterrupted(served, 60)
        assert len(want_tokens) >= 30  # (a random model does not stop early)
        primary = process_of(served)
        killed_pid = primary.pid
        assert killed_pid is not None
        chunks: list[dict[str, Any]] = []
        async with served.stream(max_tokens=60) as (reply, events):
            assert reply.headers["x-fleet-served-by"].startswith("primary; device=cpu")
            async for chunk in events:
                chunks.append(chunk)
                if len(tokens_of(chunks)) == 10:
                    primary.kill()  # the engine process, by its pid
        assert "error" not in chunks[-1], chunks[-1]
        got = tokens_of(chunks)
        assert got == want_tokens  # none repeated, none missing, the same ones
        text = "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in chunks if c["choices"])  # fmt: skip
        assert text == want_text
        last = chunks[-1]["fleet"]
        assert last["served_by"] == "replica" and last["degraded"] is True
        assert last["failovers"][0]["from"] == "primary"
        assert last["failovers"][0]["after_tokens"] >= 10
        # The engine was started again, as a new process.
        assert await until(lambda: primary.pid not in (None, killed_pid), 60)


async def test_an_allocation_failure_before_generation_is_served_by_the_replica(
    tiny_dir: Path,
) -> None:
    async with serving(tiny_dir) as reference:
        want = (await reference.chat(max_tokens=40)).json()
    # The engine's first step (the prefill) fails as an allocator out of memory would.
    async with serving(tiny_dir, inject_fault="oom@0") as served:
        reply = await served.chat(max_tokens=40)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["choices"][0]["message"] == want["choices"][0]["message"]
        assert answer["fleet"]["served_by"] == "replica"
        assert answer["fleet"]["failovers"][0]["error"] == "oom"
        assert reply.headers["x-fleet-degraded"] == "1"
        # An out-of-memory fault keeps the engine (only a device error ends it).
        assert process_of(served).serving


async def test_memory_taken_between_check_and_allocation_moves_the_stream_mid_answer(
    tiny_dir: Path,
) -> None:
    async with serving(tiny_dir) as reference:
        _, want = await uninterrupted(reference, 50)
    # Step 12 fails for want of memory, after the request was admitted and began streaming.
    async with serving(tiny_dir, inject_fault="oom@12") as served:
        async with served.stream(max_tokens=50) as (reply, events):
            chunks = [c async for c in events]
        assert reply.status_code == 200
        assert "error" not in chunks[-1], chunks[-1]
        assert tokens_of(chunks) == want
        assert chunks[-1]["fleet"]["failovers"][0]["error"] == "oom"


async def test_a_hung_engine_is_judged_hung_and_its_stream_continues(tiny_dir: Path) -> None:
    async with serving(tiny_dir) as reference:
        _, want = await uninterrupted(reference, 40)
    async with serving(tiny_dir, inject_fault="hang@8") as served:
        async with served.stream(max_tokens=40) as (_reply, events):
            chunks = [c async for c in events]
        assert tokens_of(chunks) == want
        failover = chunks[-1]["fleet"]["failovers"][0]
        assert "hung" in failover["message"]


async def test_a_long_request_is_routed_before_allocation(tiny_dir: Path) -> None:
    """With the primary's cache held by a long stream, a request that cannot have its blocks
    goes to the replica before any is taken, one past the replica's shorter context is refused
    (429, the reason, when to retry), and one whose client allows it is shrunk to fit."""
    limits = Limits(max_batch=1, max_waiting=0, replica_context_length=100)
    # (A busy primary: the long stream holds its blocks for seconds, not for one beat.)
    async with serving(tiny_dir, limits, inject_fault="slow@0") as served:
        await served.lm.engine()
        primary = process_of(served)
        async with served.stream(max_tokens=150) as (_reply, events):
            first = await anext(events)
            assert first["fleet"]["served_by"] == "primary"
            while not tokens_of([first]):  # (its first token: it runs, its blocks are taken)
                first = await anext(events)
            # (until the engine's beat shows the blocks taken)
            stats = primary.stats
            assert await until(lambda: stats()["blocks_free"] < stats()["blocks_total"] - 8)
            routed = await served.chat(max_tokens=60)
            assert routed.status_code == 200, routed.text
            assert routed.headers["x-fleet-admission"] == "replica"
            assert routed.json()["fleet"]["served_by"] == "replica"
            assert "queue is full" in routed.json()["fleet"].get("reason", "queue is full")
            refused = await served.chat(max_tokens=120)
            assert refused.status_code == 429, refused.text
            assert "Retry-After" in refused.headers
            assert "replica's context is 100" in refused.json()["error"]["message"]
            shrunk = await served.chat(max_tokens=120, headers={"x-fleet-max-tokens-floor": "1"})
            assert shrunk.status_code == 200, shrunk.text
            assert shrunk.headers["x-fleet-admission"] == "shrink"
            assert shrunk.json()["usage"]["completion_tokens"] < 120
            async for _ in events:
                pass
        assert served.lm.counters["replica"] == 1 and served.lm.counters["refuse"] == 1


async def test_no_fallback_asked_gets_a_503_while_the_primary_is_down(tiny_dir: Path) -> None:
    async with serving(tiny_dir) as served:
        await served.lm.engine()
        primary = process_of(served)
        primary.kill()
        assert await until(lambda: not primary.serving)
        refused = await served.chat(max_tokens=8, headers={"x-fleet-no-fallback": "1"})
        assert refused.status_code == 503, refused.text
        assert "Retry-After" in refused.headers
        assert "no fallback" in refused.json()["error"]["message"]
        fallen = await served.chat(max_tokens=8)
        assert fallen.status_code == 200
        assert fallen.json()["fleet"]["served_by"] == "replica"


async def test_cancelled_while_queued_for_the_replica_frees_its_place(tiny_dir: Path) -> None:
    limits = Limits(replica_max_batch=1, replica_context_length=190)
    async with serving(tiny_dir, limits) as served:
        await served.lm.engine()
        process_of(served).kill()
        assert await until(lambda: not process_of(served).serving)
        replica = served.lm.replica
        assert replica is not None
        replica.fault = lambda _steps: time.sleep(0.05)  # (busy: the first stream lasts)
        async with served.stream(max_tokens=150) as (_r1, running):
            # The first token means the replica's one slot is taken (the role chunk may come
            # before the engine admitted the request).
            while not tokens_of([await anext(running)]):
                pass
            async with served.stream(max_tokens=20) as (queued, _events):
                assert queued.headers["x-fleet-served-by"].startswith("replica")
                assert await until(lambda: replica.stats()["requests"] == 2)
                assert replica.stats()["waiting"] == 1
            # The queued request's client went away: its place is freed before it ran.
            assert await until(lambda: replica.stats()["requests"] == 1)
            assert replica.stats()["waiting"] == 0


async def test_an_unverified_precision_ends_a_stream_with_a_resumable_error(
    tiny_dir: Path,
) -> None:
    """A bfloat16 primary's answer is not continued by the float32 replica: the stream ends
    with an error naming the last token sent; a whole answer (not streamed) starts again on
    the replica instead, so no answer mixes precisions."""
    async with serving(tiny_dir, dtype="bfloat16", inject_fault="device@6") as served:
        assert not served.lm.continuation_verified()
        async with served.stream(max_tokens=30) as (_reply, events):
            chunks = [c async for c in events]
        end = chunks[-1]
        assert end["error"]["code"] == "resumable"
        sent = tokens_of(chunks)
        assert end["fleet"]["tokens_sent"] >= len(sent) > 0
        assert end["fleet"]["last_token_index"] == end["fleet"]["tokens_sent"] - 1
        # Not streamed: the answer starts again, whole, on the replica. (The restarted
        # primary fails at its step 6 again; wait for it and for the breaker's probe.)
        lm = served.lm
        ready = lambda: process_of(served).serving and lm.breaker.use_primary(time.monotonic())  # noqa: E731
        assert await until(ready, 60)
        lm.breaker.probing = False  # (the probe is the next request's)
        whole = await served.chat(max_tokens=30)
        assert whole.status_code == 200, whole.text
        body = whole.json()
        assert body["fleet"]["served_by"] == "replica"
        assert body["fleet"]["failovers"][0]["after_tokens"] > 0
        assert lm.counters["failover_restart"] == 1
    async with serving(tiny_dir) as reference:  # float32 from the start: the same answer
        want = (await reference.chat(max_tokens=30)).json()
    assert body["choices"][0]["message"] == want["choices"][0]["message"]


async def test_readiness_runs_a_token_on_each_device(tiny_dir: Path) -> None:
    async with serving(tiny_dir) as served:
        states = await served.lm.probe()
        assert states["primary"]["ok"] is True and states["replica"]["ok"] is True
        process_of(served).kill()
        assert await until(lambda: not process_of(served).serving)
        states = await served.lm.probe(timeout_s=1.0)
        assert states["primary"]["ok"] is False and states["replica"]["ok"] is True


async def test_readyz_and_grpc_health_say_whether_inference_works(tiny_dir: Path) -> None:
    """/readyz answers each device's state after a token on it; the gRPC health service says
    SERVING once a check passed, and /healthz stays a liveness answer."""
    async with serving(tiny_dir) as served:
        server, port = await serve(served.gateway, "127.0.0.1:0")
        try:
            ready = await served.http.get(served.base.removesuffix("/v1") + "/readyz")
            assert ready.status_code == 200, ready.text
            state = ready.json()
            assert state["ready"] is True and state["degraded"] is False
            assert state["devices"]["primary"]["ok"] and state["devices"]["replica"]["ok"]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                ask = health_pb2.HealthCheckRequest(service="fleet.v1.InferenceService")

                async def serving_now() -> bool:
                    answer = await stub.Check(ask)
                    return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

                deadline = time.monotonic() + 30
                while not await serving_now():
                    assert time.monotonic() < deadline, "health never said SERVING"
                    await asyncio.sleep(0.1)
            process_of(served).kill()
            assert await until(lambda: not process_of(served).serving)
            served.gateway.readiness.fresh_s = 0.0
            degraded = (await served.http.get(served.base.removesuffix("/v1") + "/readyz")).json()
            assert degraded["ready"] is True and degraded["degraded"] is True
            assert degraded["devices"]["primary"]["ok"] is False
            live = await served.http.get(served.base.removesuffix("/v1") + "/healthz")
            assert live.status_code == 200
        finally:
            await server.stop(1)


async def test_grpc_generate_streams_the_same_tokens_and_survives_a_killed_engine(
    tiny_dir: Path,
) -> None:
    """InferenceService.Generate: the tokens of /v1/completions for the same prompt, streamed;
    through a killed primary, the same tokens; bad input and a foreign token refused."""
    async with serving(tiny_dir) as served:
        server, port = await serve(served.gateway, "127.0.0.1:0")
        try:
            ask = {"model": TINY, "prompt": "echo hello world", "max_tokens": 40,
                   "temperature": 0, "logprobs": 0}  # fmt: skip
            http = await served.http.post(f"{served.base}/completions", json=ask,
                                          headers=served.headers())  # fmt: skip
            assert http.status_code == 200, http.text
            want = http.json()["choices"][0]
            token = served.headers()["Authorization"].removeprefix("Bearer ")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = inference_pb2_grpc.InferenceServiceStub(channel)
                request = inference_pb2.GenerateRequest(
                    token=token, model=TINY, text="echo hello world", max_tokens=40
                )
                events = [e async for e in stub.Generate(request)]
                tokens = [e.token for e in events if e.HasField("token")]
                assert "".join(t.text for t in tokens) == want["text"]
                end = events[-1].end
                assert end.finish_reason == want["finish_reason"]
                assert end.completion_tokens == len(tokens)
                assert events[0].served_by == "primary"
                # The primary killed after 8 tokens: the rest from the replica, the same.
                got: list[inference_pb2.GenerateEvent] = []
                async for event in stub.Generate(request):
                    got.append(event)
                    if len(got) == 8:
                        process_of(served).kill()
                again = [e.token.token_id for e in got if e.HasField("token")]
                assert again == [t.token_id for t in tokens]
                assert got[-1].end.failovers and got[-1].served_by == "replica"
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await anext(aiter(stub.Generate(inference_pb2.GenerateRequest(
                        token=token, model=TINY, text="hi", max_tokens=0))))  # fmt: skip
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "max_tokens" in (refused.value.details() or "")
                with pytest.raises(grpc.aio.AioRpcError) as foreign:
                    await anext(aiter(stub.Generate(inference_pb2.GenerateRequest(
                        token="not-a-token", model=TINY, text="hi", max_tokens=4))))  # fmt: skip
                assert foreign.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            await server.stop(1)
