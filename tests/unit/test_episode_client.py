"""The in-machine HTTP client of hybrid episodes, against fleet's own HTTP server loop."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from fleet.envs import episode
from fleet.httpd import connection_handler, reply


class Server:
    """fleet.httpd on loopback in a thread; counts connections and requests."""

    def __init__(self, answer: Callable[[str, str, bytes], bytes]) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[tuple[str, str, bytes]] = []
        self.port = 0
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def handler(method: str, target: str, _h: dict[str, str], body: bytes) -> bytes:
            self.requests.append((method, target, body))
            return self.answer(method, target, body)

        serve = connection_handler(handler)

        async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            await serve(reader, writer)

        async def main() -> None:
            self._stop = asyncio.Event()
            server = await asyncio.start_server(counted, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            await self._stop.wait()
            server.close()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        self._loop.run_until_complete(main())
        self._loop.close()

    def __enter__(self) -> Server:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        _close_connections()
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    @property
    def where(self) -> str:
        return f"127.0.0.1:{self.port}"


def _close_connections() -> None:
    for sock, stream in episode._CONNECTIONS.values():
        stream.close()
        sock.close()
    episode._CONNECTIONS.clear()


@pytest.fixture(autouse=True)
def _fresh_connections() -> Iterator[None]:
    _close_connections()
    yield
    _close_connections()


def test_requests_share_one_kept_alive_connection_and_bodies_arrive_whole() -> None:
    big = b"x" * 200_000  # more than one socket read either way
    with Server(lambda m, t, b: reply(200, b[::-1], "application/json")) as server:
        for i in range(5):
            status, _, data = episode.call(
                server.where, "PUT", f"/checkpoint?seq={i}", big + b"%d" % i
            )
            assert status == 200 and data == (big + b"%d" % i)[::-1]
        assert server.connections == 1
        assert [t for _, t, _ in server.requests] == [f"/checkpoint?seq={i}" for i in range(5)]


def test_headers_come_back_lower_cased_with_the_status() -> None:
    def refuse(_m: str, _t: str, _b: bytes) -> bytes:
        return reply(429, b'{"code": "RESOURCE_EXHAUSTED"}', "application/json",
                     {"Retry-After": "0.250"})  # fmt: skip

    with Server(refuse) as server:
        status, headers, data = episode.call(server.where, "POST", "/v1/infer", b"{}")
    assert (status, headers["retry-after"], data) == (
        429,
        "0.250",
        b'{"code": "RESOURCE_EXHAUSTED"}',
    )


def _one_shot_server(replies: list[bytes]) -> tuple[str, threading.Thread]:
    """A raw server: answers the i-th connection's first request with replies[i], then closes."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        with listener:
            for answer in replies:
                conn, _ = listener.accept()
                with conn:
                    conn.recv(65536)
                    conn.sendall(answer)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return f"127.0.0.1:{listener.getsockname()[1]}", thread


def test_a_dropped_keep_alive_connection_is_retried_once_on_a_new_one() -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    where, thread = _one_shot_server([ok, ok])
    assert episode.call(where, "GET", "/checkpoint")[2] == b"ok"
    # The server closed that connection; the next call finds out and reconnects.
    assert episode.call(where, "GET", "/checkpoint")[2] == b"ok"
    thread.join(5)


def test_an_answer_that_is_not_http_is_refused_after_one_retry() -> None:
    where, thread = _one_shot_server([b"SSH-2.0-OpenSSH\r\n", b"SSH-2.0-OpenSSH\r\n"])
    with pytest.raises(episode.ProtocolError, match="not an HTTP status line"):
        episode.call(where, "GET", "/checkpoint")
    thread.join(5)
    assert where not in episode._CONNECTIONS


def test_a_body_cut_short_is_an_error_not_a_short_answer() -> None:
    cut = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"
    where, thread = _one_shot_server([cut, cut])
    with pytest.raises(ConnectionError, match="3 of 10 body bytes"):
        episode.call(where, "GET", "/checkpoint")
    thread.join(5)


def test_chunked_answers_are_refused_by_name() -> None:
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
    where, thread = _one_shot_server([chunked, chunked])
    with pytest.raises(episode.ProtocolError, match="chunked"):
        episode.call(where, "GET", "/checkpoint")
    thread.join(5)
