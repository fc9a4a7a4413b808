"""The gateway's relay of upstream streams, as the hot path it is: connections to an upstream
are kept and reused, chunks go on as the upstream wrote them (only `model` and `fleet` set),
and the usage the gateway asked for is counted without reaching a client that did not ask.

The upstreams are real servers on loopback in the test's own loop: the proxy benchmark's
upstream (`benchmarks.llm_upstream`, HTTP/1.1 with keep-alive, counting its connections), and a
scripted one that sends chosen payloads in awkward pieces.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks.llm_upstream import PROMPT_TOKENS, BenchUpstream
from fleet.core.tokens import issue
from gateway.llm.upstream import Upstreams
from gateway.llm.upstream_config import load_upstreams
from tests.integration.harness import SECRET
from tests.integration.test_llm_upstream import serving

TOKENS = 5
"""Tokens per answer of the benchmark upstream."""


@contextlib.asynccontextmanager
async def listening(
    handler: Any,
) -> AsyncIterator[int]:
    """`handler` served on a loopback port while inside."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        server.close()


def _key_file(tmp: Path, key: str) -> Path:
    path = tmp / "upstream.key"
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path


def _ask(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "stream": True, "max_tokens": 64,
            "messages": [{"role": "user", "content": "count"}], **extra}  # fmt: skip


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> list[str]:
    """A streamed answer's `data:` payloads, read to the body's end."""
    async with client.stream("POST", "/chat/completions", json=body) as reply:
        assert reply.status_code == 200, await reply.aread()
        return [line[6:] async for line in reply.aiter_lines() if line.startswith("data: ")]


def _text(events: Sequence[str]) -> str:
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


async def test_streams_reuse_their_upstream_connections_and_count_its_usage(
    tmp_path: Path,
) -> None:
    key = "sk-" + secrets.token_hex(24)
    upstream = BenchUpstream(key, TOKENS, 0.0)
    async with listening(upstream.handle) as port:
        config = load_upstreams(
            [f"bench=http://127.0.0.1:{port}/v1"], [f"bench=@{_key_file(tmp_path, key)}"], []
        )
        async with serving(Upstreams(config)) as (gw, gw_port, _):
            # (a budget, so that the gateway keeps what the rollout used)
            token = issue(SECRET, "r-relay", time.time() + 600, models=("bench/*",),
                          max_completion_tokens=100_000)  # fmt: skip
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{gw_port}/v1",
                headers={"authorization": f"Bearer {token}"},
                limits=httpx.Limits(max_connections=16, max_keepalive_connections=16),
                timeout=30,
            ) as client:
                one_by_one = [await _stream(client, _ask("bench/stream")) for _ in range(6)]
                after_sequential = upstream.connections
                burst = await asyncio.gather(
                    *(_stream(client, _ask("bench/stream")) for _ in range(8))
                )
                after_burst = upstream.connections
                again = await asyncio.gather(
                    *(_stream(client, _ask("bench/stream")) for _ in range(8))
                )
                after_second_burst = upstream.connections
                asked = await _stream(
                    client, _ask("bench/stream", stream_options={"include_usage": True})
                )
            used = gw.usage.budgets.used("r-relay")
            handed, _ = gw.usage.hand_over({}, None)

    expected = "".join(f" w{i}" for i in range(TOKENS))
    answers = [*one_by_one, *burst, *again]
    assert all(a[-1] == "[DONE]" and _text(a) == expected for a in answers)
    # One connection carried the six requests sent one after another; a burst opened only
    # what it needed beyond it, and the next burst opened none.
    assert after_sequential == 1
    assert after_burst <= 8
    assert after_second_burst == after_burst
    # The usage the gateway asked of the upstream was counted, and passed on only when asked.
    assert not any("usage" in json.loads(e) for a in answers for e in a[:-1])
    reported = [json.loads(e)["usage"] for e in asked[:-1] if json.loads(e).get("usage")]
    assert reported == [{"prompt_tokens": PROMPT_TOKENS, "completion_tokens": TOKENS,
                         "total_tokens": PROMPT_TOKENS + TOKENS}]  # fmt: skip
    calls = len(answers) + 1
    assert used == (PROMPT_TOKENS * calls, TOKENS * calls)
    assert handed.tokens[("r-relay", "bench/stream")] == used


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"duplicate keys in a relayed chunk: {keys}"
    return dict(pairs)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One HTTP/1.1 request as a plain upstream reads it: its head, then its body (by
    Content-Length), which it returns."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return await reader.readexactly(length)


class Scripted:
    """An upstream that answers every streamed request with `payloads`, each a `data:` line
    ending in CRLF, the body written in pieces of `piece` bytes (lines split across them)."""

    def __init__(self, payloads: Sequence[str], piece: int) -> None:
        self.payloads = payloads
        self.piece = piece

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await read_request(reader)
            body = b"".join(f"data: {p}\r\n\r\n".encode() for p in self.payloads)
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body)
            )
            for at in range(0, len(body), self.piece):
                writer.write(body[at : at + self.piece])
                await writer.drain()
                await asyncio.sleep(0.001)  # (each piece arrives on its own)
        finally:
            writer.close()


async def test_chunks_are_relayed_as_the_upstream_wrote_them(tmp_path: Path) -> None:
    key = "sk-" + secrets.token_hex(24)
    fleet_of = '"fleet"'
    payloads = [
        # Non-ASCII text, the upstream's own spacing and member order: kept as they are.
        '{"id":"c1","model":"m","choices":[{"index":0,"delta":{"role":"assistant",'
        '"content":""},"finish_reason":null}],  "z":{"b":1,"a":2}}',
        '{"id":"c1","model":"m","choices":[{"index":0,"delta":{"content":"café ☕"},'
        '"finish_reason":null}]}',
        # A nested `model` member, and a key that ends in `\"model`: not edited in place.
        '{"id":"c1","model":"m","choices":[{"index":0,"delta":{"content":" a",'
        '"model":"inner"},"finish_reason":null}]}',
        '{"id":"c1","a\\"model":"q","model":"m","choices":[{"index":0,'
        '"delta":{"content":" b"},"finish_reason":null}]}',
        # The upstream's own `fleet`, and no `model` at all: one of each member in the end.
        '{"id":"c1","model":"m",' + fleet_of + ':"theirs","choices":[{"index":0,'
        '"delta":{"content":" c"},"finish_reason":null}]}',
        '{"id":"c1","choices":[{"index":0,"delta":{"content":" d"},"finish_reason":null}]}',
        # An echo of the gateway's key: scrubbed.
        '{"id":"c1","model":"m","choices":[{"index":0,"delta":{"content":" ' + key + '"},'
        '"finish_reason":"stop"}]}',
        "[DONE]",
    ]
    async with listening(Scripted(payloads, piece=37).handle) as port:
        config = load_upstreams(
            [f"up=http://127.0.0.1:{port}/v1"], [f"up=@{_key_file(tmp_path, key)}"], []
        )
        async with serving(Upstreams(config)) as (_gw, gw_port, _):
            token = issue(SECRET, "r-text", time.time() + 600, models=("up/m",))
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{gw_port}/v1",
                headers={"authorization": f"Bearer {token}"},
                timeout=30,
            ) as client:
                events = await _stream(client, _ask("up/m"))

    assert len(events) == len(payloads) and events[-1] == "[DONE]", events
    chunks = [json.loads(e, object_pairs_hook=_no_duplicates) for e in events[:-1]]
    fleet = {"served_by": "upstream", "upstream": "up", "model": "up/m", "requested": "up/m",
             "fallbacks_tried": [], "degraded": False}  # fmt: skip
    assert all(c["model"] == "up/m" and c["fleet"] == fleet for c in chunks)
    # In place: the upstream's text, its `model` member swapped and `fleet` added at the end.
    for sent, relayed in zip(payloads[:2], events[:2], strict=True):
        swapped = sent.replace('"model":"m"', '"model": "up/m"')
        assert relayed == swapped[:-1] + f', "fleet": {json.dumps(fleet)}}}'
    assert '"content":"café ☕"' in events[1]
    assert chunks[0]["z"] == {"b": 1, "a": 2}
    # Where in place was not certain, the chunk was rewritten whole, and rightly.
    assert chunks[2]["choices"][0]["delta"]["model"] == "inner"
    assert chunks[3]['a"model'] == "q"
    assert _text(events) == "café ☕ a b c d [redacted]"
    assert not any(key in e for e in events)
