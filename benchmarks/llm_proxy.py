"""Part (6) of the language-model benchmark: the gateway as a proxy in front of an
OpenAI-compatible upstream, against calling the upstream directly.

The upstream is `benchmarks.llm_upstream` in a process of its own: it streams a fixed number of
tokens per answer at a fixed pace and checks its key, so the figures measure the proxy, not a
model. The gateway runs in a process of its own too, built as `fleet gateway --upstream
bench=URL --upstream-key bench=@FILE --fallback gone/stream=bench/stream` builds it (no
language model of its own, its logs at error level as every benchmark's gateway), on loopback.
Upstream `gone` is a loopback port that is bound but never listens: connections to it are
refused, and nothing else can take the port while the benchmark holds it.

This process is the caller: `STREAMS` concurrent streamed chat completions (httpx, each
stream a client of its own, as each machine has, its connection kept alive), the same request
to the upstream directly (with its key) and through the gateway (`bench/stream`, each stream
with the inference token of a rollout of its own that names the model). Two shapes of load,
each in rounds whose sides alternate so that the machine's drift weighs on all alike:

- **Steady** (`steady`): `STREAMS` streams, each sending its next request when its last
  answer ends, their starts spread over one answer's time: `STREAMS` in flight at every
  moment, arriving and ending at moments of their own, as the calls of independent agents
  do. The issue's figures (`proxy_*`, `pipe_*`) are this shape's.
- **Bursts** (`concurrent`, `burst_*`): `STREAMS` requests sent in the same instant, the next
  round once all have ended, every stream in lock-step: the worst case for any proxy on few
  cores, since it must set up all of them at once on one event loop before the last is
  forwarded (and the upstream then sends every stream's tokens at the same instants).

Figures, each side against direct calls in the same run:

- `proxy_added_p50_ms`: the p50 of each request's latency (sent to `[DONE]`) through the
  gateway, less the direct p50; also the added p50 time to first token.
- `proxy_tokens_s_ratio`: tokens received per second of the rounds' wall time, through the
  gateway over direct.
- `pipe_added_p50_ms`: the same, through a process that only copies bytes both ways between
  the caller and the upstream (asyncio, in Python, as the gateway is): what any proxy in
  Python costs on this host before it does any work, so the gateway's figure can be read
  against the host's floor measured in the same run.
- `proxy_gateway_cpu_ms_per_request`, `pipe_cpu_ms_per_request`: CPU seconds of the gateway's
  and of the pipe's process over their rounds, per request. On a host of few cores the added
  latency is mostly the gateway's CPU queued behind other streams' (in a burst: all of their
  set-ups, then their chunks, which the upstream sends at the same instants), so these say
  how much of the added p50 is the gateway's own work and how much any Python proxy pays.
- `burst_proxy_added_p50_ms`, `burst_proxy_added_ttft_p50_ms`, `burst_pipe_added_p50_ms`,
  `burst_proxy_tokens_s_ratio`: the same, of the bursts.
- `fallback_first_token_s`: `gone/stream` asked for (its chain: `bench/stream`), `STREAMS` at
  once: the p95 from sending to the first token (p50 beside it), each answer checked to say
  it fell back. The direct time to first token of the bursts is the baseline beside it: the
  upstream's own pace (its first token comes `delay_s` after the request).

Every answer is checked whole (its tokens, `[DONE]`); a short or refused one fails the run,
naming the side and what came back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import ssl
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks import llm_upstream
from benchmarks.harness import SECRET, ServerProcess, percentile, process_cpu_s, quiet
from fleet.core.tokens import issue

STREAMS = 32
"""Concurrent streams on each side."""
UPSTREAM = "bench"
GONE = "gone"
MODEL = f"{UPSTREAM}/{llm_upstream.MODEL}"
FALLING = f"{GONE}/{llm_upstream.MODEL}"
REQUEST_TIMEOUT_S = 60.0
"""One request's bound (connect, and between two chunks)."""


@dataclass(frozen=True)
class Plan:
    """The run's sizes: `tokens` per answer, `delay_s` between two of them at the upstream;
    `steady_rounds` per side of `STREAMS` streams each sending `per_stream` requests one
    after another; `rounds` per side of `STREAMS` requests sent at once; `fallback_rounds` of
    those on the falling chain."""

    tokens: int
    delay_s: float
    rounds: int
    fallback_rounds: int
    steady_rounds: int
    per_stream: int


QUICK = Plan(tokens=16, delay_s=0.01, rounds=3, fallback_rounds=1, steady_rounds=1, per_stream=4)
FULL = Plan(tokens=64, delay_s=0.01, rounds=12, fallback_rounds=4, steady_rounds=3, per_stream=6)


# -- the servers -------------------------------------------------------------------------------


def _gateway_main(settings: dict[str, str], port: Any, http_port: Any) -> None:
    """A `ServerProcess` target: the gateway with the benchmark's upstreams, serving its HTTP
    endpoint on loopback; `port` and `http_port` both set to it once it listens."""
    quiet()
    from fleet import heap
    from gateway.http import serve_http
    from gateway.llm.upstream import Upstreams
    from gateway.llm.upstream_config import load_upstreams
    from gateway.service import Gateway, GatewayConfig

    async def main() -> None:
        config = load_upstreams(
            [f"{UPSTREAM}={settings['upstream']}", f"{GONE}={settings['gone']}"],
            [f"{UPSTREAM}=@{settings['key_file']}"],
            [f"{FALLING}={MODEL}"],
        )
        gw = Gateway.build(GatewayConfig(
            secret=SECRET, device="cpu", engine="inline", llm="none", log_level="error",
            tokens_without_server=True,  # (no fleet server polls a benchmark's gateway)
        ))  # fmt: skip
        gw.upstreams = Upstreams(config)
        server, bound = await serve_http(gw, "127.0.0.1", 0)
        heap.settle()  # (as `fleet gateway` does once it has started)
        http_port.value = bound
        port.value = bound
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def _pipe_main(upstream: str, port: Any, http_port: Any) -> None:
    """A `ServerProcess` target: a byte pipe on loopback to `upstream` (host:port), each
    connection copied both ways as it comes, nothing read into requests or events."""
    host, _, up_port = upstream.rpartition(":")

    async def copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, int(up_port))
        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))

    async def main() -> None:
        server = await asyncio.start_server(connection, "127.0.0.1", 0)
        bound = server.sockets[0].getsockname()[1]
        http_port.value = bound
        port.value = bound
        async with server:
            await server.serve_forever()

    asyncio.run(main())


@contextlib.contextmanager
def refusing_port() -> Iterator[int]:
    """A loopback port bound, never listening, while inside: every connection to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


# -- the callers -------------------------------------------------------------------------------


@dataclass
class Sample:
    """One answer: seconds from sending to its first token and to its `[DONE]`, its tokens,
    and what the gateway said it fell back from (its `x-fleet-fallbacks` header)."""

    ttft_s: float
    total_s: float
    tokens: int
    fallbacks: str


@dataclass
class Side:
    """One side's requests over every round."""

    samples: list[Sample] = field(default_factory=list)
    """The requests measured (a steady round's ramps left out)."""
    seconds: float = 0.0
    """Wall seconds of its rounds, each from its first request sent to its last answer."""
    tokens: int = 0
    """Tokens received in its rounds, every request's."""
    requests: int = 0
    """Requests sent in its rounds, every one."""
    server_cpu_s: float = 0.0
    """CPU seconds the process between caller and upstream (the gateway's, the pipe's) spent
    during its rounds."""

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def server_cpu_ms_per_request(self) -> float:
        return 1000 * self.server_cpu_s / self.requests if self.requests else 0.0

    def p(self, what: str, q: float) -> float:
        return percentile([getattr(s, what) for s in self.samples], q)


@dataclass(frozen=True)
class Caller:
    """Where one side sends its requests: each stream's client and headers, and the model.

    A client per stream, as each machine has its own: one pool shared by every stream would
    measure httpcore's pool, whose bookkeeping grows with the square of its connections."""

    name: str
    clients: tuple[httpx.AsyncClient, ...]
    model: str
    headers: tuple[dict[str, str], ...]
    """The gateway's side: each stream with its own rollout's token."""
    server_pid: int = 0
    """The process between the caller and the upstream, whose CPU is read (0: none)."""

    def body(self) -> dict[str, Any]:
        return {"model": self.model, "stream": True, "max_tokens": 512,
                "messages": [{"role": "user", "content": "count to sixty-four"}]}  # fmt: skip


async def one(caller: Caller, stream: int) -> Sample:
    """One streamed request, read to its end and checked."""
    start = time.perf_counter()
    first = 0.0
    tokens = 0
    done = False
    async with caller.clients[stream].stream(
        "POST", "/chat/completions", json=caller.body(), headers=caller.headers[stream]
    ) as reply:
        if reply.status_code != 200:
            await reply.aread()
            raise RuntimeError(f"{caller.name}: HTTP {reply.status_code}: {reply.text[:300]}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                # (read on to the body's end: a response left unread closes its connection)
                done = True
                continue
            if done:
                raise RuntimeError(f"{caller.name}: an event after [DONE]: {payload[:300]}")
            chunk = json.loads(payload)
            if "error" in chunk:
                raise RuntimeError(f"{caller.name}: the stream failed: {payload[:300]}")
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                tokens += 1
                if tokens == 1:
                    first = time.perf_counter() - start
        fallbacks = reply.headers.get("x-fleet-fallbacks", "")
    if not done:
        raise RuntimeError(f"{caller.name}: a stream ended without [DONE] after {tokens} tokens")
    return Sample(first, time.perf_counter() - start, tokens, fallbacks)


async def concurrent(caller: Caller, side: Side, expect_tokens: int) -> None:
    """`STREAMS` requests at once, added to `side`."""
    pid = caller.server_pid
    start, cpu = time.perf_counter(), process_cpu_s(pid) if pid else 0.0
    samples = await asyncio.gather(*(one(caller, i) for i in range(STREAMS)))
    side.seconds += time.perf_counter() - start
    side.server_cpu_s += (process_cpu_s(pid) - cpu) if pid else 0.0
    _check(caller, samples, expect_tokens)
    side.samples += samples
    side.tokens += sum(s.tokens for s in samples)
    side.requests += len(samples)


async def steady(caller: Caller, side: Side, plan: Plan) -> None:
    """`STREAMS` streams, each sending `plan.per_stream` requests one after another, their
    starts spread over one answer's time so that their requests come and go at their own
    moments, as independent callers' do: `STREAMS` in flight at every moment but the ramps.
    Each stream's first and last requests (sent or ended while fewer were in flight) are
    checked and counted in the tokens/s, not in the latencies."""
    pid = caller.server_pid
    spread_s = plan.tokens * plan.delay_s / STREAMS

    async def stream(i: int) -> list[Sample]:
        await asyncio.sleep(i * spread_s)
        return [await one(caller, i) for _ in range(plan.per_stream)]

    start, cpu = time.perf_counter(), process_cpu_s(pid) if pid else 0.0
    streams = await asyncio.gather(*(stream(i) for i in range(STREAMS)))
    side.seconds += time.perf_counter() - start
    side.server_cpu_s += (process_cpu_s(pid) - cpu) if pid else 0.0
    every = [sample for samples in streams for sample in samples]
    _check(caller, every, plan.tokens)
    side.samples += [sample for samples in streams for sample in samples[1:-1]]
    side.tokens += sum(s.tokens for s in every)
    side.requests += len(every)


def _check(caller: Caller, samples: list[Sample], expect_tokens: int) -> None:
    short = [s.tokens for s in samples if s.tokens != expect_tokens]
    if short:
        raise RuntimeError(f"{caller.name}: answers of {short} tokens, {expect_tokens} expected")


def _clients(stack: contextlib.AsyncExitStack, base: str) -> tuple[httpx.AsyncClient, ...]:
    """`STREAMS` clients of `base`, closed with `stack`."""
    clients = []
    tls = ssl.create_default_context()  # (unused on loopback's http://; made once, not per client)
    for _ in range(STREAMS):
        client = httpx.AsyncClient(
            base_url=base, trust_env=False, timeout=httpx.Timeout(REQUEST_TIMEOUT_S), verify=tls
        )
        stack.push_async_callback(client.aclose)
        clients.append(client)
    return tuple(clients)


async def measure(
    upstream: str, gateway: str, gateway_pid: int, pipe: str, pipe_pid: int, key: str,
    plan: Plan,
) -> dict[str, Any]:  # fmt: skip
    """The rounds, each side through its own clients, then the fallback rounds."""
    deadline = time.time() + 3600
    tokens = tuple(
        {"authorization": "Bearer " + issue(SECRET, f"bench-proxy-{i}", deadline,
                                            models=(MODEL, FALLING))}
        for i in range(STREAMS)
    )  # fmt: skip
    direct_auth = ({"authorization": f"Bearer {key}"},) * STREAMS
    steady_sides = {"direct": Side(), "proxy": Side(), "pipe": Side()}
    burst_sides = {"direct": Side(), "proxy": Side(), "pipe": Side()}
    fallback = Side()
    async with contextlib.AsyncExitStack() as stack:
        g = _clients(stack, f"http://{gateway}/v1")
        callers = {
            "direct": Caller("direct", _clients(stack, f"http://{upstream}/v1"),
                             llm_upstream.MODEL, direct_auth),
            "proxy": Caller("proxy", g, MODEL, tokens, gateway_pid),
            "pipe": Caller("pipe", _clients(stack, f"http://{pipe}/v1"),
                           llm_upstream.MODEL, direct_auth, pipe_pid),
        }  # fmt: skip
        falling = Caller("fallback", g, FALLING, tokens, gateway_pid)
        # Warm-up: connections opened and kept, on both sides and on the gateway's own pool.
        for caller in callers.values():
            await concurrent(caller, Side(), plan.tokens)
        # The sides alternate, round by round, so that the machine's drift weighs on all alike.
        for r in range(plan.steady_rounds):
            for name in ("direct", "proxy", "pipe") if r % 2 == 0 else ("pipe", "proxy", "direct"):
                await steady(callers[name], steady_sides[name], plan)
        for r in range(plan.rounds):
            for name in ("direct", "proxy", "pipe") if r % 2 == 0 else ("pipe", "proxy", "direct"):
                await concurrent(callers[name], burst_sides[name], plan.tokens)
        for _ in range(plan.fallback_rounds):
            await concurrent(falling, fallback, plan.tokens)
    unsaved = [s.fallbacks for s in fallback.samples if FALLING not in s.fallbacks.split(",")]
    if unsaved:
        raise RuntimeError(f"fallback: {len(unsaved)} answers do not say they fell back from "
                           f"{FALLING} (x-fleet-fallbacks: {unsaved[0]!r})")  # fmt: skip
    direct, proxied, piped = (steady_sides[n] for n in ("direct", "proxy", "pipe"))
    b_direct, b_proxied, b_piped = (burst_sides[n] for n in ("direct", "proxy", "pipe"))

    def added_ms(side: Side, baseline: Side, what: str = "total_s") -> float:
        return 1000 * (side.p(what, 0.5) - baseline.p(what, 0.5))

    return {
        "pipe_added_p50_ms": added_ms(piped, direct),
        "pipe_p50_s": piped.p("total_s", 0.5),
        "pipe_tokens_s_ratio": piped.rate / direct.rate,
        "proxy_added_p50_ms": added_ms(proxied, direct),
        "proxy_tokens_s_ratio": proxied.rate / direct.rate,
        "fallback_first_token_s": fallback.p("ttft_s", 0.95),
        "fallback_first_token_p50_s": fallback.p("ttft_s", 0.5),
        "proxy_added_ttft_p50_ms": added_ms(proxied, direct, "ttft_s"),
        "proxy_p50_s": proxied.p("total_s", 0.5),
        "proxy_direct_p50_s": direct.p("total_s", 0.5),
        "proxy_p95_s": proxied.p("total_s", 0.95),
        "proxy_direct_p95_s": direct.p("total_s", 0.95),
        "proxy_tokens_s": proxied.rate,
        "proxy_direct_tokens_s": direct.rate,
        "proxy_ttft_p50_s": proxied.p("ttft_s", 0.5),
        "proxy_direct_ttft_p50_s": direct.p("ttft_s", 0.5),
        "proxy_direct_ttft_p95_s": b_direct.p("ttft_s", 0.95),
        "proxy_gateway_cpu_ms_per_request": proxied.server_cpu_ms_per_request,
        "pipe_cpu_ms_per_request": piped.server_cpu_ms_per_request,
        "proxy_requests": len(proxied.samples),
        "burst_proxy_added_p50_ms": added_ms(b_proxied, b_direct),
        "burst_proxy_added_ttft_p50_ms": added_ms(b_proxied, b_direct, "ttft_s"),
        "burst_pipe_added_p50_ms": added_ms(b_piped, b_direct),
        "burst_proxy_p50_s": b_proxied.p("total_s", 0.5),
        "burst_direct_p50_s": b_direct.p("total_s", 0.5),
        "burst_pipe_p50_s": b_piped.p("total_s", 0.5),
        "burst_proxy_tokens_s_ratio": b_proxied.rate / b_direct.rate,
        "burst_proxy_gateway_cpu_ms_per_request": b_proxied.server_cpu_ms_per_request,
        "burst_requests": len(b_proxied.samples),
        "fallback_requests": len(fallback.samples),
        "proxy_tokens_per_answer": plan.tokens,
        "proxy_upstream_delay_ms": 1000 * plan.delay_s,
    }


def proxy(quick: bool) -> dict[str, Any]:
    """Part (6), end to end: the upstream and the gateway started, measured, ended."""
    plan = QUICK if quick else FULL
    key = "sk-bench-" + secrets.token_hex(24)
    with tempfile.TemporaryDirectory(prefix="bench-llm-proxy-") as tmp, refusing_port() as gone:
        key_file = Path(tmp) / "upstream.key"
        key_file.touch(0o600)
        key_file.write_text(key + "\n")
        with ServerProcess(llm_upstream.serve, key, plan.tokens, plan.delay_s) as upstream:
            settings = {
                "upstream": f"http://{upstream.address}/v1",
                "gone": f"http://127.0.0.1:{gone}/v1",
                "key_file": str(key_file),
            }
            with (
                ServerProcess(_gateway_main, settings) as gateway,
                ServerProcess(_pipe_main, upstream.address) as pipe,
            ):
                return asyncio.run(measure(upstream.address, gateway.http_address, gateway.pid,
                                           pipe.address, pipe.pid, key, plan))  # fmt: skip
