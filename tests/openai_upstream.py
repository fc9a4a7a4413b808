"""A tiny OpenAI-compatible server for tests, run as a process of its own:

    python -m tests.openai_upstream --key-file FILE --port-file FILE --log FILE

It serves GET /v1/models and POST /v1/chat/completions (whole or streamed as server-sent
events, chunked) to callers that send `Authorization: Bearer <the key in --key-file>`, and
logs each request as a JSON line (path, model, whether the key matched, streamed or not).
What it does depends on the model asked for:

    echo-model    answers ANSWER, a token per chunk
    die-before    streamed: sends its first (role) chunk, then drops the connection before any
                  token; whole: drops the connection before answering
    die-after     streamed: sends AFTER_TOKENS tokens of ANSWER, then drops the connection
    leaky         refuses with 400, quoting the request's Authorization header in its message
    tired         refuses with 503

The chunked framing makes a dropped connection a broken answer to the client, as a server
that died mid-answer would be.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

ANSWER = ["the", " answer", " is", " 42"]
AFTER_TOKENS = 3
MODELS = ("echo-model", "die-before", "die-after", "leaky", "tired")


class Upstream:
    def __init__(self, key: str, log: Path) -> None:
        self.key = key
        self.log = log

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                if ":" in line:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            body = await reader.readexactly(length) if length else b""
            await self.answer(writer, method, path, headers, body)
        except (OSError, ValueError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            if not writer.is_closing():
                writer.close()

    def note(self, **entry: Any) -> None:
        with self.log.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    async def answer(
        self,
        writer: asyncio.StreamWriter,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes,
    ) -> None:
        auth = headers.get("authorization", "")
        ok = auth == f"Bearer {self.key}"
        request = json.loads(body) if body else {}
        model = str(request.get("model", ""))
        stream = request.get("stream") is True
        self.note(
            path=path,
            method=method,
            model=model,
            key_ok=ok,
            stream=stream,
            authorization_sent=bool(auth),
        )
        if not ok:
            return self.whole(writer, 401, {"error": {"message": "bad key", "type": "auth"}})
        if method == "GET" and path == "/v1/models":
            data = [{"id": m, "object": "model", "owned_by": "test"} for m in MODELS]
            return self.whole(writer, 200, {"object": "list", "data": data})
        if method != "POST" or path != "/v1/chat/completions":
            return self.whole(writer, 404, {"error": {"message": f"no route {path}"}})
        if model == "leaky":
            return self.whole(writer, 400, {"error": {"message": f"cannot parse; you sent {auth}"}})
        if model == "tired":
            return self.whole(writer, 503, {"error": {"message": "overloaded"}})
        if model not in MODELS:
            return self.whole(writer, 404, {"error": {"message": f"no model {model}"}})
        if not stream:
            if model == "die-before":
                writer.transport.abort()
                return None
            message = {"role": "assistant", "content": "".join(ANSWER)}
            return self.whole(
                writer,
                200,
                {
                    "id": "chatcmpl-up",
                    "object": "chat.completion",
                    "model": model,
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {
                        "prompt_tokens": 5,
                        "completion_tokens": len(ANSWER),
                        "total_tokens": 9,
                    },
                },
            )
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )

        def event(delta: dict[str, Any], reason: str | None = None) -> None:
            chunk = {
                "id": "chatcmpl-up",
                "object": "chat.completion.chunk",
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": reason}],
            }
            data = f"data: {json.dumps(chunk)}\n\n".encode()
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))

        event({"role": "assistant", "content": ""})
        await writer.drain()
        if model == "die-before":
            writer.transport.abort()
            return None
        for i, token in enumerate(ANSWER):
            if model == "die-after" and i == AFTER_TOKENS:
                await writer.drain()
                writer.transport.abort()
                return None
            event({"content": token})
            await writer.drain()
        event({}, "stop")
        done = b"data: [DONE]\n\n"
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        await writer.drain()
        return None

    @staticmethod
    def whole(writer: asyncio.StreamWriter, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--key-file", type=Path, required=True)
    parser.add_argument("--port-file", type=Path, required=True)
    parser.add_argument("--log", type=Path, required=True)
    args = parser.parse_args()
    upstream = Upstream(args.key_file.read_text().strip(), args.log)
    server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tmp = args.port_file.with_suffix(".tmp")
    tmp.write_text(str(port))
    tmp.rename(args.port_file)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
