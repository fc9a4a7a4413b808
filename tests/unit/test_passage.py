"""The agent's sockets for warm children: a long directory path, the gateway splice."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.agent.passage import GATEWAY_SOCKET, GatewaySplice, bind_unix
from fleet.envs import episode
from fleet.httpd import connection_handler, reply


def long_dir(tmp_path: Path) -> Path:
    directory = tmp_path / ("d" * 60) / ("e" * 60) / "sockets"
    assert len(str(directory / GATEWAY_SOCKET)) > 108  # past what a socket address holds
    return directory


def test_a_socket_binds_under_a_directory_path_too_long_for_an_address(tmp_path: Path) -> None:
    directory = long_dir(tmp_path)
    server = bind_unix(directory, "relay.sock")
    try:
        assert (directory / "relay.sock").is_socket()
        client = socket.socket(socket.AF_UNIX)
        client.connect(_short(directory))  # the child reaches it by a short path of its own
        client.close()
    finally:
        server.close()


def _hang_up(where: str) -> None:
    kept = episode._CONNECTIONS.pop(where, None)
    if kept is not None:
        kept[1].close()
        kept[0].close()


@pytest.fixture(autouse=True)
def _no_links_left() -> Iterator[None]:
    yield
    for link in Path("/tmp").glob(f"fleet-test-{os.getpid()}-*"):
        link.unlink()


def _short(directory: Path, name: str = "relay.sock") -> str:
    """A short path to `directory/name`, through a symlink in /tmp (as /run/fleet is for the
    child: a short path to the same directory)."""
    link = Path("/tmp") / f"fleet-test-{os.getpid()}-{abs(hash(directory)) % 10**8}"
    link.unlink(missing_ok=True)
    link.symlink_to(directory)
    return f"{link}/{name}"


def test_the_splice_carries_requests_to_the_gateway_and_answers_back(tmp_path: Path) -> None:
    async def body() -> list[tuple[int, bytes]]:
        async def gateway(method: str, target: str, _h: dict[str, str], data: bytes) -> bytes:
            return reply(200, method.encode() + b" " + target.encode() + b" " + data)

        server = await asyncio.start_server(connection_handler(gateway), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        splice = GatewaySplice(long_dir(tmp_path), ("127.0.0.1", port), None)
        await splice.start()
        where = f"unix:{_short(splice.directory, GATEWAY_SOCKET)}"
        try:
            answers = []
            for i in range(3):  # one kept-alive connection through the splice
                status, _, data = await asyncio.to_thread(
                    episode.call, where, "POST", "/v1/infer", b"ask-%d" % i
                )
                answers.append((status, data))
            return answers
        finally:
            _hang_up(where)
            await splice.stop()
            server.close()

    assert asyncio.run(body()) == [(200, b"POST /v1/infer ask-%d" % i) for i in range(3)]


def test_an_unreachable_gateway_is_a_503_the_client_retries(tmp_path: Path) -> None:
    async def body() -> tuple[int, dict[str, str], bytes]:
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()  # nothing listens there now
        splice = GatewaySplice(long_dir(tmp_path), ("127.0.0.1", port), None)
        await splice.start()
        where = f"unix:{_short(splice.directory, GATEWAY_SOCKET)}"
        try:
            return await asyncio.to_thread(episode.call, where, "POST", "/v1/infer", b"{}")
        finally:
            _hang_up(where)
            await splice.stop()

    status, headers, data = asyncio.run(body())
    assert status == 503 and headers["retry-after"] == "0.5"
    assert b"unreachable" in data
