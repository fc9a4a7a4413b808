"""The gateway's HTTP/JSON endpoint: the same Infer call for workloads with only a stdlib.

Machines run the image's python3 without gRPC, so a step calls the gateway with `urllib`:

    POST /v1/infer   {"token", "rollout_id", "idempotency_key", "model", "revision",
                      "input": [floats], "deadline": unix seconds (optional)}
      200 {"output", "model", "revision", "device", "batch_size", "queue_ms", "degraded",
           "replayed"}
      4xx/5xx {"code", "message"}; 429 and 503 carry Retry-After (seconds, fractional)
    GET /metrics     Prometheus text (to this host's loopback only: machines get a 404)
    GET /healthz     "ok" (liveness)
    GET /readyz      each device's state after a one-token generation on it (200 ready, 503 not)

and, beside it, the OpenAI-compatible API of the gateway's language model
(`gateway.llm.openai_api`): GET /v1/models, POST /v1/chat/completions, POST /v1/completions,
authorized by the same token as `Authorization: Bearer TOKEN`. Streamed answers are
server-sent events in a chunked body, written as they are made.

HTTP/1.1 with keep-alive, parsed strictly (`fleet.httpd`); bodies over 1 MiB are refused;
headers must arrive within 10 s and a next request within 60 s. Past `connection_limit()` open
connections a new one gets a 503 to retry, and so does one past `MAX_PER_ROLLOUT` connections of
one rollout (by its token), so that one machine cannot hold them all. A connection counts against
the rollout of the token its first request carries, until it closes; one whose first request
carries no good token (`/healthz`, `/metrics`, a refused token) is closed after its answer, so
that no connection is held open uncounted. Only loopback and the
machines' address pool are answered unless told otherwise (`fleet gateway --http-allow`); other
peers are closed unanswered. Errors map from fleet's codes.
"""

from __future__ import annotations

import asyncio
import contextvars
import ipaddress
import json
import resource
import ssl
import time
import weakref
from collections.abc import Sequence
from typing import Any

import structlog

from fleet.core.errors import ErrorCode, FleetError
from fleet.core.tokens import verify
from fleet.httpd import REASONS, IPNetwork, connection_handler, is_loopback, reply
from fleet.runtime.netns import NetConfig
from gateway.llm.openai_api import ROUTES, OpenAIApi
from gateway.llm.openai_schema import Reply
from gateway.service import Gateway

log = structlog.get_logger(__name__)

MAX_BODY_BYTES = 1 << 20
MAX_PER_ROLLOUT = 32
"""Connections one rollout's machines may hold open at once."""
DEFAULT_ALLOW: tuple[IPNetwork, ...] = (
    ipaddress.ip_network("127.0.0.0/8"),
    ipaddress.ip_network("::1/128"),
    ipaddress.ip_network(NetConfig().address_pool),
)
"""Who the endpoint answers by default: this host, and machines on their links."""
HTTP_STATUS = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.PERMISSION_DENIED: 403,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.OUT_OF_RANGE: 400,
    ErrorCode.ALREADY_EXISTS: 409,
    ErrorCode.ABORTED: 409,
    ErrorCode.FAILED_PRECONDITION: 412,
    ErrorCode.RESOURCE_EXHAUSTED: 429,
    ErrorCode.CANCELLED: 499,
    ErrorCode.INTERNAL: 500,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504,
}


SINK_HIGH_WATER = 64 * 1024
"""Of a pushed stream, what may wait unsent to its client before the upstream's reads wait."""
GONE_POLL_S = 0.1
"""How often a streamed answer checks that its client is still there."""


def _json(status: int, payload: dict[str, Any], extra: dict[str, str] | None = None) -> bytes:
    return reply(status, json.dumps(payload).encode(), "application/json", extra)


_writer: contextvars.ContextVar[asyncio.StreamWriter] = contextvars.ContextVar("http_writer")
_reader: contextvars.ContextVar[asyncio.StreamReader] = contextvars.ContextVar("http_reader")
"""The connection a request came on, for answers written as they are made (`fleet.httpd`
handlers return whole responses); set per connection by `serve_http`."""


class HttpEndpoint:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.openai = OpenAIApi(
            gateway.llm, gateway.authorize, usage=gateway.usage, replays=gateway.replays,
            upstreams=gateway.upstreams,
        )  # fmt: skip

    async def _route(self, method: str, path: str, _h: dict[str, str], body: bytes) -> bytes:
        if path == "/healthz":
            return reply(200, b"ok")
        if path == "/readyz":  # (one token on each device: see gateway.readiness)
            state = await self.gateway.readiness.check()
            return _json(200 if state["ready"] else 503, state)
        if path == "/metrics" and method == "GET" and is_loopback(_h.get(":peer", "")):
            text = self.gateway.metrics_text().encode()
            return reply(200, text, "text/plain; version=0.0.4")
        if path.partition("?")[0] in ROUTES:
            self.gateway.requests["openai"] += 1
            api = await self.openai.handle(method, path.partition("?")[0], _h, body)
            try:
                if api.events is None:
                    return _json(api.status, api.body or {}, api.headers)
                await _stream(api)
                return b""  # (written already)
            finally:
                await api.close()
        if path != "/v1/infer":
            return _json(404, {"code": "NOT_FOUND", "message": f"no route {path}"})
        if method != "POST":
            return _json(405, {"code": "INVALID_ARGUMENT", "message": "POST /v1/infer"})
        try:
            fields = json.loads(body)
            if not isinstance(fields, dict) or not isinstance(fields.get("input"), list):
                raise ValueError("expected a JSON object with an 'input' list")
            values = [float(v) for v in fields["input"]]
            deadline = fields.get("deadline")
            answer = await self.gateway.infer(
                via="http", token=str(fields.get("token", "")),
                rollout_id=str(fields.get("rollout_id", "")),
                idempotency_key=str(fields.get("idempotency_key", "")),
                model=str(fields.get("model", "")), revision=str(fields.get("revision", "")),
                shape=[len(values)], values=values,
                deadline=float(deadline) if deadline is not None else None,
            )  # fmt: skip
        except (ValueError, TypeError) as exc:
            return _json(400, {"code": "INVALID_ARGUMENT", "message": f"bad request body: {exc}"})
        except FleetError as exc:
            extra = {}
            if exc.retry_after_s is not None:
                extra["Retry-After"] = f"{exc.retry_after_s:.3f}"
            return _json(HTTP_STATUS[exc.code], {"code": str(exc.code), "message": exc.message},
                         extra)  # fmt: skip
        except Exception:
            log.exception("http_infer_crashed")
            return _json(500, {"code": "INTERNAL", "message": "internal error; see the log"})
        return _json(200, {
            "output": answer.output, "model": self.gateway.spec.name,
            "revision": answer.revision, "device": answer.device,
            "batch_size": answer.batch_size, "queue_ms": answer.queue_ms,
            "degraded": answer.degraded or answer.replayed, "replayed": answer.replayed,
        })  # fmt: skip


async def _stream(answer: Reply) -> None:
    """Writes a streamed answer on the request's connection: its head, then each event as a
    chunk of a chunked body, as it is made. A client that goes away ends the writes (a
    ConnectionError, which closes the connection), and with them the generation."""
    assert answer.events is not None
    writer = _writer.get()
    head = [
        f"HTTP/1.1 {answer.status} {REASONS.get(answer.status, 'OK')}",
        "Content-Type: text/event-stream", "Cache-Control: no-cache", "Transfer-Encoding: chunked",
        *(f"{k}: {v}" for k, v in answer.headers.items()),
    ]  # fmt: skip
    head_bytes = ("\r\n".join(head) + "\r\n\r\n").encode()
    push = getattr(answer.events, "push_to", None)
    if push is None:
        writer.write(head_bytes)
        await writer.drain()
    # A client that closed its end is noticed between events too (a request queued for its
    # engine sends none for a while): the loop's sweep of open streams cancels this task's
    # wait for the next one, and with it the generation, freeing its place.
    this = asyncio.current_task()
    assert this is not None
    loop = asyncio.get_running_loop()
    watched = _Watched(this, _reader.get(None), writer)
    leavers = _leavers_of(loop)
    leavers.add(watched)

    # Events made in one turn of the loop (a relayed upstream's read often holds several) go
    # out in one send, written once the turn ends: a send per event was a system call each.
    frames: list[bytes] = []

    def flush() -> None:
        if frames and not writer.is_closing():
            writer.write(b"".join(frames))
        frames.clear()

    try:
        if push is not None:  # (a relayed upstream's: written from its connection's reads)
            sink = _Sink(writer, head_bytes)
            await push(sink)
            if not sink.ended:
                writer.write(sink.head + b"0\r\n\r\n")
            await writer.drain()
            return
        async for data in answer.events:
            event = f"data: {data}\n\n".encode()
            if not frames:
                loop.call_soon(flush)
            frames.append(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()  # (a client gone ends the writes; a slow one holds them)
        frames.append(b"0\r\n\r\n")
        flush()
        await writer.drain()
    except asyncio.CancelledError:
        if not watched.left:
            raise
        this.uncancel()
        raise ConnectionResetError("the client closed the connection mid-answer") from None
    finally:
        leavers.discard(watched)


class _Watched:
    """A streamed answer in progress: its task, and its connection's two ends."""

    __slots__ = ("left", "reader", "task", "writer")

    def __init__(
        self, task: asyncio.Task[Any], reader: asyncio.StreamReader | None,
        writer: asyncio.StreamWriter,
    ) -> None:  # fmt: skip
        self.task = task
        self.reader = reader
        self.writer = writer
        self.left = False
        """Its client closed its end: the task was cancelled for that."""

    def gone(self) -> bool:
        """The client has closed its end (the reader saw its end of input: nothing is read,
        so a request the client sends next is left for the connection's loop)."""
        reader = self.reader
        return self.writer.is_closing() or (reader is not None and reader.at_eof())


class _Leavers:
    """The loop's streamed answers, looked at together every `GONE_POLL_S` by one task while
    any is open (a watching task per stream was a task made and a timer armed per stream, ten
    times a second, on the gateway's hot path): one whose client has gone has its task
    cancelled."""

    def __init__(self) -> None:
        self.streams: set[_Watched] = set()
        self.task: asyncio.Task[None] | None = None

    def add(self, watched: _Watched) -> None:
        self.streams.add(watched)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._sweep())

    def discard(self, watched: _Watched) -> None:
        self.streams.discard(watched)

    async def _sweep(self) -> None:
        """Until no stream is left (the next one starts it again)."""
        try:
            while self.streams:
                await asyncio.sleep(GONE_POLL_S)
                for watched in [w for w in self.streams if w.gone()]:
                    self.streams.discard(watched)
                    watched.left = True
                    watched.task.cancel()
        finally:
            # (a task kept would keep its loop, the key of `_leavers`, from being collected)
            if self.task is asyncio.current_task():
                self.task = None


_leavers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Leavers] = (
    weakref.WeakKeyDictionary()
)


def _leavers_of(loop: asyncio.AbstractEventLoop) -> _Leavers:
    leavers = _leavers.get(loop)
    if leavers is None:
        leavers = _leavers[loop] = _Leavers()
    return leavers


class _Sink:
    """A streamed answer's connection, as a relay pushes its events to it (`Relay.push_to`):
    each batch of events one write, made at once, the answer's head with the first and its end
    with the last (a write each was a system call each, and a wake-up of the client)."""

    def __init__(self, writer: asyncio.StreamWriter, head: bytes) -> None:
        self.writer = writer
        self.transport = writer.transport
        self.head = head
        """Not yet written."""
        self.ended = False

    def send(self, payloads: list[str], end: bool = False) -> bool:
        if self.transport.is_closing():
            return False
        frames = [self.head] if self.head else []
        self.head = b""
        for data in payloads:
            event = f"data: {data}\n\n".encode()
            frames.append(b"%x\r\n%s\r\n" % (len(event), event))
        if end:
            frames.append(b"0\r\n\r\n")
            self.ended = True
        self.transport.write(b"".join(frames))
        return True

    def full(self) -> bool:
        return self.transport.get_write_buffer_size() > SINK_HIGH_WATER

    async def drain(self) -> None:
        await self.writer.drain()


def connection_limit() -> int:
    """Connections the endpoint holds open at once: what this process may open, less room for
    the rest of the gateway (gRPC, its engine, a restart), so that machines that open too many
    get a 503 to retry rather than leave the gateway without descriptors."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, soft - 256) if soft != resource.RLIM_INFINITY else 65536


async def serve_http(
    gateway: Gateway,
    host: str = "",
    port: int = 0,
    sock: Any = None,
    max_connections: int = 0,
    tls: ssl.SSLContext | None = None,
    allow: Sequence[IPNetwork] | None = DEFAULT_ALLOW,
    max_per_rollout: int = MAX_PER_ROLLOUT,
) -> tuple[asyncio.Server, int]:
    """Serves the endpoint on host:port, or on an already bound socket (another netns), with
    at most `max_connections` open at once (0: `connection_limit()`); over TLS with `tls`;
    answering only peers in `allow` (None: any)."""

    def rollout_of(headers: dict[str, str], body: bytes) -> str | None:
        try:
            scheme, _, bearer = headers.get("authorization", "").partition(" ")
            if scheme.lower() == "bearer":  # (the OpenAI-compatible endpoints)
                token = bearer.strip()
            else:
                token = json.loads(body).get("token", "")
            return verify(gateway.config.secret, str(token), time.time()).rollout_id
        except (FleetError, ValueError, TypeError, AttributeError):
            return None  # refused by the endpoint itself, and the connection closed

    serve_connection = connection_handler(
        HttpEndpoint(gateway)._route, MAX_BODY_BYTES, max_connections or connection_limit(),
        allow=allow, key_of=rollout_of, max_per_key=max_per_rollout,
    )  # fmt: skip

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _writer.set(writer)  # (in the connection's own task, so in a context of its own)
        _reader.set(reader)
        await serve_connection(reader, writer)

    if sock is not None:
        server = await asyncio.start_server(handle, sock=sock, ssl=tls)
    else:
        server = await asyncio.start_server(handle, host or None, port, ssl=tls)
    bound = server.sockets[0].getsockname()[1]
    log.info("gateway_http_listening", port=bound, tls=tls is not None)
    return server, int(bound)
