"""A minimal HTTP/1.1 server loop on asyncio streams, for fleet's small local endpoints.

Used where a client has only a standard library (machines calling the gateway or storing
checkpoints) and for Prometheus scrapes. Keep-alive, CRLF line ends, Content-Length bodies only,
a body limit, headers up to the stream's limit (64 KiB).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

Handler = Callable[[str, str, dict[str, str], bytes], Awaitable[bytes]]
"""(method, target, lower-cased headers, body) -> a whole response from `reply`."""

REASONS = {
    200: "OK", 204: "No Content", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
    404: "Not Found", 405: "Method Not Allowed", 409: "Conflict", 412: "Precondition Failed",
    413: "Payload Too Large", 429: "Too Many Requests", 431: "Request Header Fields Too Large",
    499: "Client Closed Request",
    500: "Internal Server Error", 503: "Service Unavailable", 504: "Gateway Timeout",
}  # fmt: skip


def reply(
    status: int,
    body: bytes = b"",
    content_type: str = "text/plain",
    headers: dict[str, str] | None = None,
) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}",
             f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]  # fmt: skip
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def retry_later(why: str) -> bytes:
    """A 503 the client retries after half a second, on a connection closed after it."""
    return reply(503, why.encode(), headers={"Retry-After": "0.5", "Connection": "close"})


def connection_handler(
    handler: Handler, max_body_bytes: int = 1 << 20, max_connections: int = 0
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """An asyncio.start_server callback that serves requests with `handler`; with
    `max_connections`, a connection past that many open at once gets a 503 to retry."""
    open_now = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal open_now
        open_now += 1
        try:
            if max_connections and open_now > max_connections:
                writer.write(retry_later(f"{max_connections} connections are open here, the limit"))
                await writer.drain()
                return
            while True:
                try:  # the request line and headers in one read (a client's next request too)
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError as exc:
                    if exc.partial.strip():
                        writer.write(reply(400, b"the request's headers were cut off"))
                    return
                except asyncio.LimitOverrunError:
                    writer.write(reply(431, b"request headers too large"))
                    return
                line, *lines = head.decode("latin-1").split("\r\n")
                method, target, *_ = [*line.split(), "", ""]
                headers: dict[str, str] = {}
                for h in lines:
                    if h:
                        key, _, value = h.partition(":")
                        headers[key.strip().lower()] = value.strip()
                length = int(headers.get("content-length", "0") or 0)
                if length > max_body_bytes:
                    writer.write(reply(413, f"body over {max_body_bytes} bytes".encode()))
                    await writer.drain()
                    return
                body = await reader.readexactly(length) if length else b""
                writer.write(await handler(method, target, headers, body))
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return
        finally:
            open_now -= 1
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    return serve
