"""An upstream that goes silent mid-stream: the gateway bounds the silence (`read_timeout_s`)
while its relay waits for the next chunk, whatever the stream sent before. Silent before the
first token, the chain moves on to its next model unseen; after it, the stream ends with a
resumable error; an upstream that is slow but never silent that long is relayed to its end.

The upstreams are real servers on loopback in the test's own loop: one that streams a role
chunk, then `tokens` content chunks `gap_s` apart, then stays silent (its connection open) for
longer than any bound here; and the proxy benchmark's upstream as the fallback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
from pathlib import Path

import httpx

from benchmarks.llm_upstream import BenchUpstream
from fleet.core.tokens import issue
from gateway.llm.upstream import Upstreams
from gateway.llm.upstream_config import load_upstreams
from tests.integration.harness import SECRET
from tests.integration.test_llm_upstream import serving
from tests.integration.test_llm_upstream_relay import (
    _ask,
    _key_file,
    _stream,
    _text,
    listening,
    read_request,
)

READ_TIMEOUT_S = 0.5
"""The gateway's bound on an upstream's silence in these tests."""
SILENT_S = 20.0
"""How long the stalling upstream stays silent: far past the bound, well within the client's."""
CLIENT_TIMEOUT_S = 15.0


def _event(payload: str) -> bytes:
    """One server-sent event as one chunk of a chunked body."""
    event = f"data: {payload}\n\n".encode()
    return b"%x\r\n%s\r\n" % (len(event), event)


def _delta(delta: dict[str, str], reason: str | None = None) -> str:
    choice = {"index": 0, "delta": delta, "finish_reason": reason}
    return json.dumps({"id": "c1", "object": "chat.completion.chunk", "model": "m",
                       "choices": [choice]})  # fmt: skip


class Stalling:
    """Streams its head, a role chunk a moment later, and `tokens` content chunks `gap_s`
    apart; then, with `finish`, the answer's end, else silence for SILENT_S with the
    connection open."""

    def __init__(self, tokens: int, gap_s: float = 0.0, finish: bool = False) -> None:
        self.tokens = tokens
        self.gap_s = gap_s
        self.finish = finish
        self.requests = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await read_request(reader)
            self.requests += 1
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            await writer.drain()
            await asyncio.sleep(0.05)  # (the head and the first chunk arrive apart)
            writer.write(_event(_delta({"role": "assistant", "content": ""})))
            await writer.drain()
            for i in range(self.tokens):
                await asyncio.sleep(self.gap_s)
                writer.write(_event(_delta({"content": f" t{i}"})))
                await writer.drain()
            if self.finish:
                await asyncio.sleep(self.gap_s)
                writer.write(_event(_delta({}, "stop")) + _event("[DONE]") + b"0\r\n\r\n")
                await writer.drain()
            else:
                await asyncio.sleep(SILENT_S)
        finally:
            writer.close()


def _client(port: int, token: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}/v1",
        headers={"authorization": f"Bearer {token}"},
        timeout=CLIENT_TIMEOUT_S,
    )


async def _streamed_alone(tmp_path: Path, upstream: Stalling, rollout: str) -> list[str]:
    """The events a machine gets asking model `up/m` of `upstream` (its only upstream)
    through a gateway whose read bound is READ_TIMEOUT_S."""
    key = "sk-" + secrets.token_hex(24)
    async with listening(upstream.handle) as port:
        config = load_upstreams(
            [f"up=http://127.0.0.1:{port}/v1"], [f"up=@{_key_file(tmp_path, key)}"], []
        )
        config = dataclasses.replace(config, read_timeout_s=READ_TIMEOUT_S)
        async with serving(Upstreams(config)) as (_gw, gw_port, _):
            token = issue(SECRET, rollout, time.time() + 600, models=("up/m",))
            async with _client(gw_port, token) as client:
                return await asyncio.wait_for(_stream(client, _ask("up/m")), CLIENT_TIMEOUT_S)


async def test_an_upstream_silent_after_its_first_token_ends_the_stream_resumably(
    tmp_path: Path,
) -> None:
    events = await _streamed_alone(tmp_path, Stalling(tokens=2), "r-stall")

    assert _text(events[:-1]) == " t0 t1"
    last = json.loads(events[-1])
    assert last["error"]["code"] == "resumable", last
    assert "read timed out" in last["error"]["message"]
    assert (last["fleet"]["tokens_sent"], last["fleet"]["last_token"]) == (2, " t1")
    assert "[DONE]" not in events


async def test_an_upstream_silent_before_its_first_token_falls_back(tmp_path: Path) -> None:
    key = "sk-" + secrets.token_hex(24)
    stalling = Stalling(tokens=0)
    fallback = BenchUpstream(key, 3, 0.0)
    async with listening(stalling.handle) as port, listening(fallback.handle) as bench_port:
        config = load_upstreams(
            [f"up=http://127.0.0.1:{port}/v1", f"bench=http://127.0.0.1:{bench_port}/v1"],
            [f"up=@{_key_file(tmp_path, key)}", f"bench=@{_key_file(tmp_path, key)}"],
            ["up/m=bench/stream"],
        )
        config = dataclasses.replace(config, read_timeout_s=READ_TIMEOUT_S)
        async with serving(Upstreams(config)) as (_gw, gw_port, _):
            token = issue(SECRET, "r-stall", time.time() + 600, models=("up/m",))
            async with _client(gw_port, token) as client:
                events = await asyncio.wait_for(_stream(client, _ask("up/m")), CLIENT_TIMEOUT_S)

    assert stalling.requests == 1 and fallback.served == 1
    assert events[-1] == "[DONE]" and _text(events) == " w0 w1 w2"
    fleet = json.loads(events[0])["fleet"]
    assert fleet["model"] == "bench/stream" and fleet["degraded"] is True
    assert [t["model"] for t in fleet["fallbacks_tried"]] == ["up/m"]
    assert "read timed out" in fleet["fallbacks_tried"][0]["error"]


async def test_an_upstream_slower_than_the_bound_in_all_but_silent_for_less_is_relayed(
    tmp_path: Path,
) -> None:
    # Each gap is under the bound; the answer as a whole takes several times the bound.
    gap_s = READ_TIMEOUT_S / 2
    slow = Stalling(tokens=6, gap_s=gap_s, finish=True)
    events = await _streamed_alone(tmp_path, slow, "r-slow")

    assert events[-1] == "[DONE]", events
    assert _text(events) == " t0 t1 t2 t3 t4 t5"
