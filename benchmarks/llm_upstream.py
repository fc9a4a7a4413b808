"""The upstream of the proxy benchmark (`benchmarks.llm_proxy`): an OpenAI-compatible server
that streams a fixed number of tokens per answer at a fixed pace, so that what the benchmark
measures is the gateway in front of it, not a model.

It runs in a process of its own (`serve`, a `ServerProcess` target) on loopback, speaks
HTTP/1.1 with keep-alive (as vLLM and llama.cpp do, so that neither side pays a connection per
request), and answers only callers that send `Authorization: Bearer KEY`, KEY the key it was
started with: the gateway's key for it, which a direct caller holds too.

    GET  /v1/models             one model, `stream`
    POST /v1/chat/completions   `stream: true`: server-sent events in chunks, a role chunk at
                                once, then `tokens` content chunks, the i-th sent `i * delay_s`
                                after the request (an absolute schedule: a slow reader does not
                                slow the pace it is offered), a finish chunk, the usage chunk
                                when `stream_options.include_usage` asks for it (as the gateway
                                always does, for its accounting), and `[DONE]`; otherwise the
                                whole answer after `tokens * delay_s`

Its answers are built once, at start: the server costs the same whoever calls it.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

MODEL = "stream"
"""The one model it serves (as the gateway serves it: `NAME/stream`)."""
PROMPT_TOKENS = 8
"""The prompt tokens every answer reports (the request's are not counted)."""
MAX_HEAD_BYTES = 16 * 1024
MAX_BODY_BYTES = 1 << 20
IDLE_TIMEOUT_S = 60.0
"""A connection silent this long between requests is closed."""
MAX_REQUESTS_PER_CONNECTION = 100_000
"""Requests one kept-alive connection may carry (a bound on its loop)."""


def _frame(payload: bytes) -> bytes:
    """One server-sent event as one chunk of a chunked body."""
    event = b"data: " + payload + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


def _chunk(delta: dict[str, Any], reason: str | None = None) -> bytes:
    return _frame(json.dumps({
        "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
        "model": MODEL, "choices": [{"index": 0, "delta": delta, "finish_reason": reason}],
    }).encode())  # fmt: skip


def _whole(status: int, payload: dict[str, Any], close: bool = False) -> bytes:
    body = json.dumps(payload).encode()
    head = (
        f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n" + ("Connection: close\r\n" if close else "") + "\r\n"
    )
    return head.encode() + body


class BenchUpstream:
    """The server's state: its key and its answers, made once."""

    def __init__(self, key: str, tokens: int, delay_s: float) -> None:
        if tokens < 1 or delay_s < 0:
            raise ValueError(f"tokens must be >= 1 and delay_s >= 0, got {tokens}, {delay_s}")
        self.auth = f"Bearer {key}".encode()
        self.tokens = tokens
        self.delay_s = delay_s
        self.stream_head = (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        self.role = _chunk({"role": "assistant", "content": ""})
        self.token_chunks = [_chunk({"content": f" w{i}"}) for i in range(tokens)]
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": tokens,
                 "total_tokens": PROMPT_TOKENS + tokens}  # fmt: skip
        self.finish = _chunk({}, "stop") + _frame(b"[DONE]") + b"0\r\n\r\n"
        usage_chunk = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
                       "model": MODEL, "choices": [], "usage": usage}  # fmt: skip
        self.finish_with_usage = (
            _chunk({}, "stop") + _frame(json.dumps(usage_chunk).encode()) + _frame(b"[DONE]")
            + b"0\r\n\r\n"
        )  # fmt: skip
        text = "".join(f" w{i}" for i in range(tokens))
        self.answer = _whole(200, {
            "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop"}],
            "usage": usage,
        })  # fmt: skip
        self.models = _whole(200, {"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": 0, "owned_by": "bench"}]})  # fmt: skip
        self.refused = _whole(401, {"error": {"message": "bad key", "type": "auth"}}, close=True)
        self.served = 0
        self.refusals = 0
        self.connections = 0
        """Connections accepted: a caller that keeps its connections alive opens few."""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: its requests, one after another, until it closes or idles."""
        self.connections += 1
        try:
            for _ in range(MAX_REQUESTS_PER_CONNECTION):
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IDLE_TIMEOUT_S)
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
                    return
                if len(head) > MAX_HEAD_BYTES:
                    return
                line, _, rest = head.partition(b"\r\n")
                method, path, _version = line.decode("latin-1").split(" ", 2)
                headers = {}
                for h in rest.split(b"\r\n"):
                    name, sep, value = h.partition(b":")
                    if sep:
                        headers[name.strip().lower()] = value.strip()
                length = int(headers.get(b"content-length", b"0") or 0)
                if length > MAX_BODY_BYTES:
                    return
                body = await reader.readexactly(length) if length else b""
                if not await self.answer_one(writer, method, path, headers, body):
                    return
        except (OSError, ValueError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def answer_one(
        self, writer: asyncio.StreamWriter, method: str, path: str,
        headers: dict[bytes, bytes], body: bytes,
    ) -> bool:  # fmt: skip
        """Answers one request; False when the connection is to be closed after it."""
        start = time.monotonic()
        if headers.get(b"authorization") != self.auth:
            self.refusals += 1
            writer.write(self.refused)
            await writer.drain()
            return False
        if method == "GET" and path == "/v1/models":
            writer.write(self.models)
        elif method == "POST" and path == "/v1/chat/completions":
            request = json.loads(body)
            if request.get("model") != MODEL:
                asked = request.get("model")
                why = f"no model {asked!r}; this server serves {MODEL!r}"
                writer.write(_whole(404, {"error": {"message": why}}))
            elif request.get("stream") is True:
                options = request.get("stream_options")
                usage = isinstance(options, dict) and options.get("include_usage") is True
                await self.stream(writer, start, usage)
            else:
                await asyncio.sleep(self.tokens * self.delay_s)
                writer.write(self.answer)
            self.served += 1
        else:
            writer.write(_whole(404, {"error": {"message": f"no route {method} {path}"}}))
        await writer.drain()
        return headers.get(b"connection", b"").lower() != b"close"

    async def stream(self, writer: asyncio.StreamWriter, start: float, usage: bool) -> None:
        writer.write(self.stream_head + self.role)
        await writer.drain()
        for i, chunk in enumerate(self.token_chunks, 1):
            wait = start + i * self.delay_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(chunk)
            await writer.drain()
        writer.write(self.finish_with_usage if usage else self.finish)


def serve(key: str, tokens: int, delay_s: float, port: Any, _http_port: Any) -> None:
    """A `ServerProcess` target: serves on a free loopback port and sets `port` to it."""

    async def main() -> None:
        upstream = BenchUpstream(key, tokens, delay_s)
        server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0, backlog=1024)
        port.value = int(server.sockets[0].getsockname()[1])
        async with server:
            await server.serve_forever()

    asyncio.run(main())
