"""A minimal HTTP/1.1 server loop on asyncio streams, for fleet's small local endpoints.

Used where a client has only a standard library (machines calling the gateway or storing
checkpoints) and for Prometheus scrapes. Keep-alive, CRLF line ends, Content-Length bodies only
(Transfer-Encoding is refused, never half-understood), strict request lines and headers, a body
limit, headers up to the stream's limit (64 KiB), and timeouts on every read, so that a silent
or half-sent connection is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import Awaitable, Callable, Sequence

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

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


class _Refused(Exception):
    """A request that is not HTTP as this server speaks it: answered, then the connection is
    closed (after a framing error nothing on it can be trusted)."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
CLOSE_AFTER = frozenset({400, 401, 403, 404, 405, 411, 413, 431, 501})
"""Statuses after which the connection is closed: a client that sends a bad or unauthorised
request holds no connection open."""


def parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    """(method, target, lower-cased headers) of a request's head, parsed strictly: one request
    line `METHOD TARGET HTTP/1.x`, `name: value` lines without folding, Content-Length at most
    once and digits only, no Transfer-Encoding (bodies are Content-Length only)."""
    text = head.decode("latin-1")
    line, *lines = text[:-4].split("\r\n")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[0] or not set(parts[0]) <= _TOKEN or not parts[1]:
        raise _Refused(400, "malformed request line")
    if parts[2] not in ("HTTP/1.1", "HTTP/1.0"):
        raise _Refused(400, f"unsupported protocol {parts[2][:20]!r}")
    headers: dict[str, str] = {}
    for h in lines:
        name, sep, value = h.partition(":")
        if not sep or not name or not set(name) <= _TOKEN:
            raise _Refused(400, "malformed header line")
        key = name.lower()
        value = value.strip(" \t")
        if key == "content-length" and (key in headers or not value.isdigit()):
            raise _Refused(400, "Content-Length must be given once, as digits")
        headers[key] = value
    if "transfer-encoding" in headers:
        raise _Refused(501, "Transfer-Encoding is not supported: send a Content-Length")
    return parts[0], parts[1], headers


KeyOf = Callable[[dict[str, str], bytes], str | None]
"""(headers, body) of a connection's first request -> whose it is (None: nobody's yet)."""


def connection_handler(
    handler: Handler,
    max_body_bytes: int = 1 << 20,
    max_connections: int = 0,
    *,
    header_timeout_s: float = 10.0,
    idle_timeout_s: float = 60.0,
    body_timeout_s: float = 30.0,
    allow: Sequence[IPNetwork] | None = None,
    key_of: KeyOf | None = None,
    max_per_key: int = 0,
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """An asyncio.start_server callback that serves requests with `handler`.

    A connection past `max_connections` open at once gets a 503 to retry. With `key_of` and
    `max_per_key`, a connection counts against the key its first request names (`key_of` is
    asked once per connection, off the hot path of the requests after it), for as long as it
    stays open: past `max_per_key` open for that key it gets a 503 to retry. A first request
    that names no key (a health check, a refused token) is answered and the connection closed,
    so that no connection is held open uncounted: kept alive, it could carry a key's requests
    past the key's bound. A connection from
    outside `allow` is closed unanswered (unless it comes from the endpoint's own address: this
    host itself). Headers must arrive within `header_timeout_s` of their first byte, the next
    request within `idle_timeout_s`, a body within `body_timeout_s`; past them the connection
    is closed. `handler` sees the peer's address as the pseudo-header `:peer`."""
    open_now = 0
    per_key: dict[str, int] = {}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal open_now
        open_now += 1
        key: str | None = None
        peer = _peer(writer)
        try:
            if allow is not None and not _allowed(peer, allow) and peer != _local(writer):
                return  # (a peer at the endpoint's own address is this host itself)
            if max_connections and open_now > max_connections:
                writer.write(retry_later(f"{max_connections} connections are open here, the limit"))
                await writer.drain()
                return
            first = True
            while True:
                start = b""
                # (asyncio.timeout rather than wait_for, which makes a task per read: three per
                # request on the gateway's path)
                try:
                    async with asyncio.timeout(header_timeout_s if first else idle_timeout_s):
                        start = await reader.readexactly(1)
                    async with asyncio.timeout(header_timeout_s):
                        head = start + await reader.readuntil(b"\r\n\r\n")
                except TimeoutError:
                    return  # silent or slow: closed without an answer
                except asyncio.IncompleteReadError as exc:
                    if (start + exc.partial).strip():
                        writer.write(reply(400, b"the request's headers were cut off"))
                    return
                except asyncio.LimitOverrunError:
                    writer.write(reply(431, b"request headers too large"))
                    return
                try:
                    method, target, headers = parse_head(head)
                    length = int(headers.get("content-length", "0") or 0)
                    if length > max_body_bytes:
                        raise _Refused(413, f"body over {max_body_bytes} bytes")
                except _Refused as exc:
                    writer.write(
                        reply(exc.status, str(exc).encode(), headers={"Connection": "close"})
                    )
                    await writer.drain()
                    return
                body = b""
                try:
                    if length:
                        async with asyncio.timeout(body_timeout_s):
                            body = await reader.readexactly(length)
                except TimeoutError:
                    return
                unkeyed = False
                if key is None and key_of is not None and max_per_key:
                    key = key_of(headers, body)  # (counted from here until it closes)
                    if key is None:
                        unkeyed = True
                    else:
                        per_key[key] = per_key.get(key, 0) + 1
                        if per_key[key] > max_per_key:
                            writer.write(retry_later(
                                f"{max_per_key} connections of {key} are open here, the limit"
                            ))  # fmt: skip
                            await writer.drain()
                            return
                first = False
                headers[":peer"] = peer
                response = await handler(method, target, headers, body)
                if unkeyed:
                    response = _closing(response)
                writer.write(response)
                await writer.drain()
                if (
                    unkeyed
                    or headers.get("connection", "").lower() == "close"
                    or _status(response) in CLOSE_AFTER
                ):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return
        finally:
            open_now -= 1
            if key is not None:
                per_key[key] -= 1
                if per_key[key] <= 0:
                    del per_key[key]
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):  # (ssl.SSLError is an OSError)
                await writer.wait_closed()

    return serve


def _peer(writer: asyncio.StreamWriter) -> str:
    name = writer.get_extra_info("peername")
    return str(name[0]) if isinstance(name, tuple) and name else ""


def _local(writer: asyncio.StreamWriter) -> str:
    name = writer.get_extra_info("sockname")
    return str(name[0]) if isinstance(name, tuple) and name else ""


def _allowed(peer: str, allow: Sequence[IPNetwork]) -> bool:
    if not peer:  # a Unix socket: whoever reaches it was let in by its file's permissions
        return True
    try:
        address = ipaddress.ip_address(peer.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return any(address.version == net.version and address in net for net in allow)


def _closing(response: bytes) -> bytes:
    """`response` saying `Connection: close` (the server closes the connection after it)."""
    head, sep, body = response.partition(b"\r\n\r\n")
    if not sep or b"\r\nconnection:" in head.lower():
        return response
    return head + b"\r\nConnection: close" + sep + body


def _status(response: bytes) -> int:
    if not response:  # (a streamed answer, written already)
        return 0
    try:
        return int(response[9:12])
    except ValueError:
        return 0


def is_loopback(peer: str) -> bool:
    """Whether a `:peer` is this host's loopback (or a Unix socket)."""
    return _allowed(peer, LOOPBACK)


LOOPBACK: tuple[IPNetwork, ...] = (
    ipaddress.ip_network("127.0.0.0/8"),
    ipaddress.ip_network("::1/128"),
)
