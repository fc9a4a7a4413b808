"""The gateway's HTTP/1.1 client for its upstreams: a pool of kept-alive connections per
upstream, each an asyncio protocol whose responses are parsed by llhttp (`httptools`, the
parser of Node.js, compiled).

Why not a general client: the gateway's hot path is a chunk per token per stream, relayed while
a burst of other streams waits on the same event loop, so what each chunk and each request
costs is the latency the proxy adds. A general client hands every chunk through a stream
reader, a future and a task wake-up before the relay sees it, and builds a request from a URL,
cookies, a proxy's settings and a header mapping each time. Here a request is one write of
bytes made ready per upstream, and a response's body can be pushed (`Response.push`): each
piece goes to the relay inside the connection's own `data_received`, which writes the relayed
events to the client there and then, with no task woken in between.

What it does and does not do, on purpose: HTTP/1.1 only; TLS (the stdlib's, verified against the
system's CA store) for `https` upstreams; bodies framed by Content-Length, by chunks or by the
connection's end; `Accept-Encoding: identity` always (a compressed stream could not be relayed
as it comes); no redirects followed, no proxy or `.netrc` from the environment, no cookies. A
connection idle longer than `KEEPALIVE_S` is closed rather than reused (a server may be closing
it at that moment, and a request is never sent twice), and one whose response was not read to
its end is closed, never reused.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools
import structlog

log = structlog.get_logger(__name__)

KEEPALIVE_S = 15.0
"""How long an idle connection is kept for the next request."""
HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024
"""Of a body read by `readany`, what may wait unread before the connection stops reading (and
what lets it read again): an upstream faster than its reader is held back by TCP."""
DRAIN_BYTES = 64 * 1024
DRAIN_S = 1.0
"""After a stream's `[DONE]`, what of the body's rest is read (its end, normally in the same
packet) so that the connection can be kept (`Response.release_after_end`); past either bound the
connection is closed instead."""


class UpstreamError(Exception):
    """A request that could not be made, or an answer that broke off; `why` says which in words
    (never the URL, which the exception's text does not hold either)."""

    why = "it failed"


class ConnectFailed(UpstreamError):
    why = "connection refused or unreachable"


class TlsFailed(UpstreamError):
    why = "its TLS failed (certificate or handshake)"


class ConnectTimedOut(UpstreamError):
    why = "connect timed out, or no free connection to it"


class ReadTimedOut(UpstreamError):
    why = "read timed out"


class Disconnected(UpstreamError):
    why = "it closed the connection mid-answer"


class ProtocolBroken(UpstreamError):
    why = "it broke the protocol (not HTTP/1.1 as sent?)"


class TooLarge(UpstreamError):
    why = "its answer is too large"


@dataclass(frozen=True)
class Origin:
    """Where an upstream's requests go: `url`'s scheme, host and port, and its path, which every
    request's path is put under."""

    tls: bool
    host: str
    port: int
    base: str
    authority: str
    """The Host header's value."""

    @classmethod
    def of(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http:// or https:// URL with a host, not {url!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        host = parts.hostname
        shown = f"[{host}]" if ":" in host else host
        authority = shown if port == (443 if tls else 80) else f"{shown}:{port}"
        return cls(tls, host, port, parts.path.rstrip("/"), authority)


class Response:
    """One request's response on its connection: `status` and `headers` once its head has
    arrived (`Pool.request` returns then), its body read by `readany`/`read`, or pushed
    (`push`). Exactly one of `release`, `release_after_end` or `close` ends it; until then it
    holds one of the pool's connections."""

    def __init__(self, connection: _Connection) -> None:
        self.connection = connection
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self._raw_headers: list[tuple[bytes, bytes]] = []
        loop = asyncio.get_running_loop()
        self.head: asyncio.Future[None] = loop.create_future()
        self._body: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self.complete = False
        self.keep_alive = False
        self.error: UpstreamError | None = None
        self.finished = False
        """Released or closed: the connection is no longer this response's."""
        self._sink: Callable[[bytes], None] | None = None
        self._pushing: list[bytes] = []
        """Pieces for the sink from the read in progress, given to it in one call at its end
        (`flush`): a read that holds several chunks is one write to the client."""
        self._on_end: Callable[[UpstreamError | None], None] | None = None
        self._until_close = False
        """A body that ends with the connection (neither Content-Length nor chunks)."""
        self._paused = False
        self._drained = 0

    # -- llhttp's callbacks (from `feed_data`, within the connection's `data_received`) --------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        headers = {n.decode("latin-1").lower(): v.decode("latin-1") for n, v in self._raw_headers}
        self.headers = headers
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self._until_close = (
            not chunked and "content-length" not in headers and self.status not in (204, 304)
        )
        if not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self._sink is not None:
            self._pushing.append(body)
            return
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused:
            self._paused = True
            self.connection.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.flush()
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive() and not self._until_close
        self._end(None)

    # -- from the connection ---------------------------------------------------------------

    def flush(self) -> None:
        """What the read in progress brought for the sink, given to it."""
        pieces = self._pushing
        if pieces:
            self._pushing = []
            sink = self._sink
            if sink is not None:
                sink(pieces[0] if len(pieces) == 1 else b"".join(pieces))

    def broken(self, why: str) -> None:
        """What arrived is not a response this client can read: the connection is closed."""
        self.fail(ProtocolBroken(why))

    def lost(self) -> None:
        """The connection closed (by the upstream, or by this side)."""
        if self.complete or self.error is not None:
            return
        if self._until_close and self.head.done():
            self.complete = True  # (its end was the connection's)
            self._end(None)
            return
        self._set_error(Disconnected("the connection closed"))

    # -- reading -----------------------------------------------------------------------------

    async def readany(self) -> bytes:
        """The body's next piece as it arrived; b"" at its end; the error it broke off with."""
        while not self._body:
            if self.error is not None:
                raise self.error
            if self.complete:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        piece = self._body.popleft()
        self._buffered -= len(piece)
        if self._paused and self._buffered < LOW_WATER:
            self._paused = False
            self.connection.resume_reading()
        return piece

    async def read(self, limit: int, strict: bool = False) -> bytes:
        """The body to its end, at most its first `limit` bytes; with `strict`, TooLarge for a
        body longer than that."""
        out = bytearray()
        while len(out) <= limit:
            piece = await self.readany()
            if not piece:
                return bytes(out)
            out += piece
        if strict:
            raise TooLarge(f"over {limit} bytes")
        return bytes(out[:limit])

    def push(
        self, sink: Callable[[bytes], None], end: Callable[[UpstreamError | None], None]
    ) -> None:
        """From now on each piece of the body goes to `sink` as it arrives (what arrived before
        first), and `end` is called once when the body ends (None) or breaks off (its error).
        Both are called from the connection's `data_received`: they must not block."""
        if self._body:
            data = b"".join(self._body)
            self._body.clear()
            self._buffered = 0
            sink(data)
        if self._paused:
            self._paused = False
            self.connection.resume_reading()
        if self.complete or self.error is not None:
            end(self.error)
            return
        self._sink, self._on_end = sink, end

    def pause_reading(self) -> None:
        self.connection.pause_reading()

    def resume_reading(self) -> None:
        self.connection.resume_reading()

    def fail(self, error: UpstreamError) -> None:
        """Ends the body with `error` (a watch's timeout, a broken frame): the connection is
        closed, and whoever reads or is pushed to hears of it."""
        if self.complete or self.error is not None:
            return
        self._set_error(error)
        self.connection.close()

    # -- ending ------------------------------------------------------------------------------

    def release(self) -> None:
        """The connection goes back to its pool when this response was read to its end and the
        upstream keeps it; else it is closed (an answer left unread must not be read by the
        next request)."""
        if self.finished:
            return
        if self.complete and self.keep_alive and self.error is None:
            self._finish(keep=True)
        else:
            self.close()

    def release_after_end(self) -> None:
        """As `release`, but a body not yet at its end is read on, and dropped, for up to
        DRAIN_BYTES and DRAIN_S first (a stream's `[DONE]` usually comes in the packet before
        its end): the connection is kept when it ends within them."""
        if self.finished:
            return
        if self.complete or self.error is not None:
            self.release()
            return
        self._drained = 0
        timer = asyncio.get_running_loop().call_later(DRAIN_S, self.close)

        def drop(piece: bytes) -> None:
            self._drained += len(piece)
            if self._drained > DRAIN_BYTES:
                self.close()

        def ended(_error: UpstreamError | None) -> None:
            timer.cancel()
            self.release()

        self._sink, self._on_end = None, None
        self.push(drop, ended)

    def close(self) -> None:
        """Ends the response and closes its connection (never reused)."""
        if self.finished:
            return
        self._finish(keep=False)

    def _finish(self, keep: bool) -> None:
        self.finished = True
        self._sink = self._on_end = None
        self.connection.done(self, keep)

    def _set_error(self, error: UpstreamError) -> None:
        self.error = error
        if not self.head.done():
            self.head.set_exception(error)
            self.head.exception()  # (retrieved: a head nobody awaits any more is not logged)
        self._end(error)

    def _end(self, error: UpstreamError | None) -> None:
        end = self._on_end
        self._sink = self._on_end = None
        if end is not None:
            end(error)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Connection(asyncio.Protocol):
    """One connection to an upstream, carrying one request at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.open = True
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (a stream transport: not necessarily asyncio's own class, under another event loop)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # (bytes while no request is out: nothing can be trusted)
            self.close()
            return
        try:
            response.parser.feed_data(data)
            response.flush()
        except httptools.HttpParserUpgrade:
            response.broken("it asked to switch protocols")
        except httptools.HttpParserError as exc:
            response.broken(f"its answer is not HTTP/1.1 as expected ({exc})")

    def eof_received(self) -> bool:
        return False  # (the transport closes; `connection_lost` follows)

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self.pool.forget(self)
        if self.response is not None:
            self.response.lost()

    def pause_reading(self) -> None:
        if self.transport is not None and self.open:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and self.open:
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def done(self, response: Response, keep: bool) -> None:
        """`response` has ended: this connection goes back to the pool (`keep`), or closes."""
        if self.response is response:
            self.response = None
        if keep and self.open:
            self.pool.give_back(self)
        else:
            self.close()
            self.pool.forget(self)
        self.pool.slots.release()


class _Slots:
    """At most `n` connections taken at once; the rest wait, first come first served. (An
    asyncio.Semaphore asks every waiter whether it was cancelled on each acquire: a cost per
    request that grows with the burst, on the gateway's hot path.)"""

    def __init__(self, n: int) -> None:
        self.free = n
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self, timeout_s: float) -> None:
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                await waiter  # (its slot handed over by `release`)
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()  # (handed over as the wait ended: passed on)
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self.waiters.remove(waiter)
            raise

    def release(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.free += 1


class Pool:
    """Up to `max_connections` connections open to one upstream at once, each kept alive
    between requests; a request waits for a free one within `connect_timeout_s` (with the
    connect itself), and for its response's head within `head_timeout_s`."""

    def __init__(
        self,
        url: str,
        headers: dict[str, str],
        max_connections: int,
        connect_timeout_s: float,
        head_timeout_s: float,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.origin = origin = Origin.of(url)
        self.tls = (tls or ssl.create_default_context()) if origin.tls else None
        lines = [f"host: {origin.authority}", "accept-encoding: identity"]
        lines += [f"{k}: {v}" for k, v in headers.items() if k.lower() != "accept-encoding"]
        self._fixed = ("\r\n".join(lines) + "\r\n").encode("latin-1")
        self.connect_timeout_s = connect_timeout_s
        self.head_timeout_s = head_timeout_s
        self.slots = _Slots(max_connections)
        self.idle: list[_Connection] = []
        self.open: set[_Connection] = set()
        self.closed = False

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        head_timeout_s: float | None = None,
        headers: bytes = b"",
    ) -> Response:
        """The response to `method` `path` (under the upstream's own path) with `body`, its
        head arrived; its body still to be read. UpstreamError for what went wrong, in words."""
        if self.closed:
            raise ConnectFailed("the pool is closed")
        try:
            await self.slots.acquire(self.connect_timeout_s)
        except TimeoutError:
            raise ConnectTimedOut("no free connection") from None
        try:
            connection = await self._connection()
        except BaseException:
            self.slots.release()
            raise
        response = Response(connection)
        connection.response = response
        target = self.origin.base + path
        head = (
            f"{method} {target} HTTP/1.1\r\ncontent-length: {len(body)}\r\n".encode("latin-1")
            + self._fixed
            + headers
            + b"\r\n"
        )
        assert connection.transport is not None
        connection.transport.write(head + body)
        if not connection.open:  # (closed by the upstream as it was taken)
            response.lost()
        try:
            async with asyncio.timeout(
                self.head_timeout_s if head_timeout_s is None else head_timeout_s
            ):
                await response.head
        except TimeoutError:
            response.close()
            raise ReadTimedOut("no answer's head in time") from None
        except BaseException:
            response.close()
            raise
        return response

    async def _connection(self) -> _Connection:
        """A kept connection not idle too long, else a new one."""
        now = time.monotonic()
        while self.idle:
            connection = self.idle.pop()
            if connection.open and now - connection.idle_since < KEEPALIVE_S:
                return connection
            connection.close()
            self.open.discard(connection)
        loop = asyncio.get_running_loop()
        origin = self.origin
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, protocol = await loop.create_connection(
                    lambda: _Connection(self),
                    origin.host,
                    origin.port,
                    ssl=self.tls,
                    server_hostname=origin.host if self.tls is not None else None,
                )
        except TimeoutError:
            raise ConnectTimedOut("connect timed out") from None
        except ssl.SSLError as exc:
            raise TlsFailed(type(exc).__name__) from None
        except OSError as exc:
            raise ConnectFailed(type(exc).__name__) from None
        assert isinstance(protocol, _Connection)
        self.open.add(protocol)
        return protocol

    def give_back(self, connection: _Connection) -> None:
        if self.closed:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        self.idle.append(connection)

    def forget(self, connection: _Connection) -> None:
        self.open.discard(connection)
        if connection in self.idle:
            self.idle.remove(connection)

    def close(self) -> None:
        """Closes every connection; responses in progress break off."""
        self.closed = True
        for connection in list(self.open):
            connection.close()
        self.idle.clear()
