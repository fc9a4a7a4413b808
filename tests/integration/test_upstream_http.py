"""The gateway's HTTP/1.1 client for its upstreams (`gateway.llm.upstream_http`), against real
servers on loopback that answer as each test scripts them: plain and over TLS, each framing of
a body, kept and closed connections, the bounds, and a pushed body read slower than it comes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from fleet.core.tokens import issue
from fleet.identity.ca import CertificateAuthority
from fleet.identity.tls import ServerTls, server_ssl_context
from gateway.http import GONE_POLL_S, serve_http
from gateway.llm.upstream import Upstreams
from gateway.llm.upstream_config import load_upstreams
from gateway.llm.upstream_http import (
    ConnectFailed,
    ConnectTimedOut,
    Disconnected,
    Pool,
    ProtocolBroken,
    ReadTimedOut,
    Response,
    TlsFailed,
    TooLarge,
    UpstreamError,
)
from gateway.llm.upstream_relay import Relay, StreamUsage
from gateway.service import Gateway, GatewayConfig
from tests.integration.harness import SECRET

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Server"], Awaitable[None]]


class Server:
    """A loopback server answering each request with `script`, counting its connections and
    keeping each request's head as it came."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def read_request(self, reader: asyncio.StreamReader) -> bool:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return False
        self.heads.append(head)
        length = 0
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        self.bodies.append(await reader.readexactly(length) if length else b"")
        return True

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        task = asyncio.current_task()
        assert task is not None
        self.tasks.append(task)
        try:
            await self.script(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(
    script: Script, tls: ssl.SSLContext | None = None
) -> AsyncIterator[tuple[Server, str]]:
    server = Server(script)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0, ssl=tls)
    port = listener.sockets[0].getsockname()[1]
    try:
        yield server, f"{'https' if tls else 'http'}://127.0.0.1:{port}/v1"
    finally:
        listener.close()
        for writer in server.writers:
            writer.transport.abort()
        for task in server.tasks:
            task.cancel()
        await asyncio.gather(*server.tasks, return_exceptions=True)
        await listener.wait_closed()


def pool_of(url: str, **kw: object) -> Pool:
    settings: dict[str, object] = {
        "max_connections": 4, "connect_timeout_s": 5.0, "head_timeout_s": 5.0,
    }  # fmt: skip
    settings.update(kw)
    return Pool(url, {"authorization": "Bearer sk-test"}, **settings)  # type: ignore[arg-type]


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


HEAD_CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


async def keep_answering(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, s: Server
) -> None:
    """Each request on the connection answered with a Content-Length body naming its number."""
    n = 0
    while await s.read_request(reader):
        n += 1
        body = b'{"n": %d}' % n
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()


async def test_requests_reuse_a_kept_connection_and_say_who_they_are() -> None:
    async with serving(keep_answering) as (server, url):
        pool = pool_of(url)
        try:
            for n in (1, 2, 3):
                response = await pool.request("POST", "/chat/completions", b'{"a": 1}')
                assert (response.status, await response.read(1000)) == (200, b'{"n": %d}' % n)
                response.release()
        finally:
            pool.close()
    assert server.connections == 1
    head = server.heads[0].decode()
    assert head.startswith("POST /v1/chat/completions HTTP/1.1\r\n")
    lowered = head.lower()
    for line in (
        "host: 127.0.0.1:",
        "authorization: bearer sk-test",
        "accept-encoding: identity",
        "content-length: 8",
    ):
        assert line in lowered, (line, head)
    assert server.bodies == [b'{"a": 1}'] * 3


async def test_a_response_left_unread_closes_its_connection() -> None:
    async def slow_body(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, s: Server
    ) -> None:
        n = 0
        while await s.read_request(reader):
            n += 1
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.write(b'{"n": %d}' % n)
            await writer.drain()

    async with serving(slow_body) as (server, url):
        pool = pool_of(url)
        try:
            response = await pool.request("GET", "/models")
            response.release()  # (its body not yet read: the connection cannot be trusted)
            response = await pool.request("GET", "/models")
            assert await response.read(1000) == b'{"n": 1}'  # (a new connection's first)
            response.release()  # (read to its end: kept)
            response = await pool.request("GET", "/models")
            assert await response.read(1000) == b'{"n": 2}'
            response.release()
        finally:
            pool.close()
    assert server.connections == 2


async def test_each_framing_of_a_body_is_read_to_its_end() -> None:
    async def framings(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, s: Server
    ) -> None:
        while await s.read_request(reader):
            path = s.heads[-1].split(b" ")[1]
            if path.endswith(b"/chunked"):
                writer.write(HEAD_CHUNKED + chunked(b"data: 1\n\n", b"data: 2\n\n"))
            else:  # (neither length nor chunks: the body ends with the connection)
                writer.write(b"HTTP/1.1 200 OK\r\n\r\nto the end")
                await writer.drain()
                return

    async with serving(framings) as (_server, url):
        pool = pool_of(url)
        try:
            response = await pool.request("GET", "/chunked")
            assert await response.read(1000) == b"data: 1\n\ndata: 2\n\n"
            assert response.complete and response.keep_alive
            response.release()
            response = await pool.request("GET", "/until-close")
            assert await response.read(1000) == b"to the end"
            assert response.complete and not response.keep_alive
            response.release()
        finally:
            pool.close()


async def test_what_goes_wrong_is_said_in_words() -> None:
    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, s: Server) -> None:
        await s.read_request(reader)
        path = s.heads[-1].split(b" ")[1]
        if path.endswith(b"/garbage"):
            writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        elif path.endswith(b"/cut"):
            writer.write(HEAD_CHUNKED + b"9\r\ndata: 1\n\n\r\n")
            await writer.drain()
            writer.transport.abort()
            return
        elif path.endswith(b"/big"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5000\r\n\r\n" + b"x" * 5000)
        elif path.endswith(b"/silent"):
            await asyncio.sleep(30)
        await writer.drain()
        await asyncio.sleep(1)

    async with serving(broken) as (_server, url):
        pool = pool_of(url, head_timeout_s=0.5)
        try:
            with pytest.raises(ProtocolBroken):
                await pool.request("GET", "/garbage")
            response = await pool.request("GET", "/cut")
            assert await response.readany() == b"data: 1\n\n"
            with pytest.raises(Disconnected) as cut:
                await response.readany()
            assert cut.value.why == "it closed the connection mid-answer"
            response.release()
            response = await pool.request("GET", "/big")
            with pytest.raises(TooLarge):
                await response.read(1000, strict=True)
            response.release()
            with pytest.raises(ReadTimedOut):
                await pool.request("GET", "/silent")
        finally:
            pool.close()
    # A port bound but not listening: the connection is refused.
    with contextlib.closing(__import__("socket").socket()) as unused:
        unused.bind(("127.0.0.1", 0))
        pool = pool_of(f"http://127.0.0.1:{unused.getsockname()[1]}/v1")
        with pytest.raises(ConnectFailed) as refused:
            await pool.request("GET", "/models")
        assert refused.value.why == "connection refused or unreachable"
        pool.close()


async def test_a_request_waits_for_a_free_connection_within_the_connect_bound() -> None:
    async with serving(keep_answering) as (_server, url):
        pool = pool_of(url, max_connections=1, connect_timeout_s=0.3)
        try:
            held = await pool.request("GET", "/models")
            with pytest.raises(ConnectTimedOut):
                await pool.request("GET", "/models")
            pool.connect_timeout_s = 5.0
            waiting = asyncio.ensure_future(pool.request("GET", "/models"))
            await asyncio.sleep(0.2)
            assert not waiting.done()  # (the one connection is still held)
            await held.read(1000)
            held.release()
            response = await asyncio.wait_for(waiting, 5)  # (handed the one freed)
            assert response.status == 200
            assert await response.read(1000) == b'{"n": 2}'
            response.release()
        finally:
            pool.close()


async def test_tls_is_verified_against_the_trusted_authorities(tmp_path: Path) -> None:
    ca = CertificateAuthority.init(tmp_path / "ca")
    tls = server_ssl_context(ServerTls.issue(ca, ["127.0.0.1"]))
    async with serving(keep_answering, tls) as (server, url):
        trusting = pool_of(url, tls=ssl.create_default_context(cadata=ca.pem.decode()))
        try:
            response = await trusting.request("POST", "/chat/completions", b"{}")
            assert (response.status, await response.read(100)) == (200, b'{"n": 1}')
            response.release()
        finally:
            trusting.close()
        system = pool_of(url)  # (the system's authorities: this one is not among them)
        try:
            with pytest.raises(TlsFailed) as refused:
                await system.request("POST", "/chat/completions", b"{}")
            assert "certificate" in refused.value.why
        finally:
            system.close()
    assert server.heads and server.heads[0].startswith(b"POST /v1/chat/completions")


async def test_a_pushed_body_read_slower_than_it_comes_holds_the_upstream_back() -> None:
    pieces = [b"data: %d %s\n\n" % (i, b"x" * 4000) for i in range(200)]

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, s: Server) -> None:
        await s.read_request(reader)
        writer.write(HEAD_CHUNKED)
        for piece in pieces:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await s.read_request(reader)  # (the connection kept for the next request)

    async with serving(flood) as (server, url):
        pool = pool_of(url)
        try:
            response = await pool.request("GET", "/stream")
            received = bytearray()
            paused_seen = False
            ended: asyncio.Future[UpstreamError | None] = asyncio.get_running_loop().create_future()
            transport = response.connection.transport
            assert transport is not None

            def sink(piece: bytes) -> None:
                nonlocal paused_seen
                received.extend(piece)
                if len(received) > 100_000 and not paused_seen:
                    paused_seen = True
                    response.pause_reading()
                    asyncio.get_running_loop().call_later(0.2, response.resume_reading)

            response.push(sink, ended.set_result)
            assert await asyncio.wait_for(ended, 30) is None
            assert bytes(received) == b"".join(pieces)
            assert paused_seen
            response.release()
            assert pool.idle and server.connections == 1
        finally:
            pool.close()


async def test_the_rest_of_a_stream_is_read_after_its_end_so_the_connection_is_kept() -> None:
    async def two_packets(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, s: Server
    ) -> None:
        while await s.read_request(reader):
            writer.write(HEAD_CHUNKED + b"e\r\ndata: [DONE]\n\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(b"0\r\n\r\n")  # (the body's end, in a later packet)
            await writer.drain()

    async with serving(two_packets) as (server, url):
        pool = pool_of(url)
        try:
            for _ in range(2):
                response = await pool.request("GET", "/stream")
                assert await response.readany() == b"data: [DONE]\n\n"
                response.release_after_end()
                for _ in range(50):
                    if response.finished:
                        break
                    await asyncio.sleep(0.05)
                assert response.finished
        finally:
            pool.close()
    assert server.connections == 1


class SlowClient:
    """A relay's sink (`EventSink`) that reads slower than the upstream sends: full after every
    `every`-th write until `drain` has waited a while; or gone after `gone_after` writes."""

    def __init__(self, every: int = 0, gone_after: int = 0) -> None:
        self.events: list[str] = []
        self.ends = 0
        self.writes = 0
        self.every = every
        self.gone_after = gone_after
        self.behind = False
        self.held = 0
        self.paused_seen: list[bool] = []
        self.response: Response | None = None

    def send(self, payloads: list[str], end: bool = False) -> bool:
        if self.gone_after and self.writes >= self.gone_after:
            return False
        self.writes += 1
        self.events += payloads
        self.ends += end
        if self.every and self.writes % self.every == 0:
            self.behind = True
        return True

    def full(self) -> bool:
        return self.behind

    async def drain(self) -> None:
        self.held += 1
        await asyncio.sleep(0.05)
        transport = self.response.connection.transport if self.response else None
        self.paused_seen.append(transport is not None and not transport.is_reading())
        self.behind = False


def sse(payloads: list[bytes]) -> bytes:
    return b"".join(b"data: " + p + b"\n\n" for p in payloads)


TOKENS = [b'{"model": "m", "choices": [{"index": 0, "delta": {"content": "t%d"}}]}' % i
          for i in range(300)]  # fmt: skip


async def streaming(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, s: Server) -> None:
    """Each request answered with a role chunk, then the tokens ten at a time a few ms apart
    (so that the relay reads them in many pieces), then [DONE]."""
    while await s.read_request(reader):
        writer.write(HEAD_CHUNKED)
        role = b'{"model": "m", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}'
        bodies = [sse([role])] + [sse([t]) for t in TOKENS] + [sse([b"[DONE]"])]
        for n, body in enumerate(bodies):
            writer.write(b"%x\r\n%s\r\n" % (len(body), body))
            await writer.drain()
            if n % 10 == 0:
                await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
        await writer.drain()


async def relay_of(pool: Pool) -> Relay:
    response = await pool.request("POST", "/chat/completions", b"{}")
    relay = Relay(response, "up/m", {"served_by": "upstream"}, lambda text: text, StreamUsage())
    await relay.first_token()
    return relay


async def test_a_pushed_relay_waits_for_a_slow_client_and_loses_nothing() -> None:
    async with serving(streaming) as (server, url):
        pool = pool_of(url)
        try:
            for _ in range(2):  # (the second on the connection the first gave back)
                relay = await relay_of(pool)
                client = SlowClient(every=2)
                client.response = relay.response
                await asyncio.wait_for(relay.push_to(client), 30)
                deltas = [json.loads(e)["choices"][0]["delta"] for e in client.events[:-1]]
                assert deltas[0] == {"role": "assistant"}
                texts = [delta["content"] for delta in deltas[1:]]
                assert texts == [f"t{i}" for i in range(300)]
                assert client.events[-1] == "[DONE]" and client.ends == 1
                assert client.held > 0 and all(client.paused_seen)  # (the upstream held back)
                assert relay.sent == 300
                await relay.aclose()
        finally:
            pool.close()
    assert server.connections == 1


async def test_a_pushed_relay_whose_client_goes_closes_the_upstream_connection() -> None:
    async with serving(streaming) as (server, url):
        pool = pool_of(url)
        try:
            relay = await relay_of(pool)
            client = SlowClient(gone_after=1)
            with pytest.raises(ConnectionResetError):
                await asyncio.wait_for(relay.push_to(client), 30)
            assert relay.response.finished and not pool.idle  # (closed, not kept)
            await relay.aclose()
            relay = await relay_of(pool)  # (a new connection for the next request)
            await relay.aclose()
        finally:
            pool.close()
    assert server.connections == 2


def silent_after_a_token(ended: asyncio.Queue[int]) -> Script:
    """Each request answered with a role chunk and one token, then nothing (an upstream that
    thinks for a long while); `ended` gets the connection's number once the gateway closes
    its end."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, s: Server) -> None:
        number = s.connections
        await s.read_request(reader)
        writer.write(HEAD_CHUNKED)
        role = b'{"model": "m", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}'
        body = sse([role, TOKENS[0]])
        writer.write(b"%x\r\n%s\r\n" % (len(body), body))
        await writer.drain()
        while await reader.read(4096):  # (b"" once the gateway has closed its end)
            pass
        ended.put_nowait(number)

    return script


async def test_clients_gone_while_their_upstream_is_silent_end_their_relays_alone() -> None:
    """Three streams relayed from an upstream that falls silent after their first token; two
    clients leave: the gateway notices between events (no event is coming to fail a write)
    and closes those two upstream connections, and only those; the third goes on."""
    ended: asyncio.Queue[int] = asyncio.Queue()

    async def next_ended() -> int:
        return await asyncio.wait_for(ended.get(), 20)

    async with serving(silent_after_a_token(ended)) as (server, url):
        ups = Upstreams(load_upstreams([f"up={url}"]))
        gw = Gateway.build(GatewayConfig(secret=SECRET, device="cpu", engine="inline",
                                         llm="none", tokens_without_server=True))  # fmt: skip
        gw.upstreams = ups
        http, port = await serve_http(gw, "127.0.0.1", 0)
        clients: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        try:
            for n in range(3):
                token = issue(SECRET, f"r-{n}", time.time() + 600, models=("up/m",))
                body = json.dumps(
                    {
                        "model": "up/m",
                        "stream": True,
                        "messages": [{"role": "user", "content": "hi"}],
                    }
                ).encode()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
                    b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n%s"
                    % (token.encode(), len(body), body)
                )
                await asyncio.wait_for(reader.readuntil(b'"t0"'), 30)  # (its first token)
                clients.append((reader, writer))
            assert server.connections == 3 and ended.empty()
            for _, writer in clients[:2]:
                writer.close()
            assert sorted([await next_ended(), await next_ended()]) == [1, 2]
            await asyncio.sleep(10 * GONE_POLL_S)  # (many sweeps later: the third stays)
            assert ended.empty() and not clients[2][1].is_closing()
            clients[2][1].close()
            assert await next_ended() == 3
        finally:
            for _, writer in clients:
                writer.close()
            http.close()
            await ups.aclose()
            await gw.stop()
