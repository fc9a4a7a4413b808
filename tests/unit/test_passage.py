"""The agent's sockets for warm children: a long directory path, the gateway splice, the
checkpoint relay's answers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.agent.checkpoints import CheckpointRelay
from fleet.agent.passage import (
    CHECKPOINTS_SOCKET,
    GATEWAY_SOCKET,
    MAX_LINKS,
    GatewaySplice,
    bind_unix,
)
from fleet.core.errors import Aborted, FleetError, ResourceExhausted, Unavailable
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


async def test_the_splice_carries_requests_to_the_gateway_and_answers_back(tmp_path: Path) -> None:
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
        result = answers
    finally:
        _hang_up(where)
        await splice.stop()
        server.close()

    assert result == [(200, b"POST /v1/infer ask-%d" % i) for i in range(3)]


async def test_an_unreachable_gateway_is_a_503_the_client_retries(tmp_path: Path) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    splice = GatewaySplice(long_dir(tmp_path), ("127.0.0.1", port), None)
    await splice.start()
    where = f"unix:{_short(splice.directory, GATEWAY_SOCKET)}"
    try:
        status, headers, data = await asyncio.to_thread(
            episode.call, where, "POST", "/v1/infer", b"{}"
        )
    finally:
        _hang_up(where)
        await splice.stop()

    assert status == 503 and headers["retry-after"] == "0.5"
    assert b"unreachable" in data


def test_the_relay_answers_each_refusal_with_what_it_means(tmp_path: Path) -> None:
    """A stale lease or a clash: 409; over the rollout's checkpoint budget: 413 (neither is
    worth retrying); the server out of reach: 503. A stored one is what GET answers next."""
    refusals: dict[int, FleetError] = {
        2: Aborted("stale lease"),
        3: ResourceExhausted("past their limit of 4536 bytes"),
        4: Unavailable("server unreachable"),
    }

    async def put(seq: int, data: bytes) -> None:
        if seq in refusals:
            raise refusals[seq]

    async def body() -> list[tuple[int, bytes]]:
        relay = CheckpointRelay(0, b"", put)
        await relay.start_unix(long_dir(tmp_path))
        where = f"unix:{_short(long_dir(tmp_path), CHECKPOINTS_SOCKET)}"
        try:
            answers = []
            for seq in (1, 2, 3, 4):
                status, _, data = await asyncio.to_thread(
                    episode.call, where, "PUT", f"/checkpoint?seq={seq}", b"state-%d" % seq
                )
                answers.append((status, data))
            status, _, data = await asyncio.to_thread(episode.call, where, "GET", "/checkpoint")
            return [*answers, (status, data)]
        finally:
            _hang_up(where)
            await relay.stop()

    assert asyncio.run(body()) == [
        (200, b""), (409, b"stale lease"), (413, b"past their limit of 4536 bytes"),
        (503, b"server unreachable"), (200, b"state-1"),
    ]  # fmt: skip


async def test_a_child_holds_at_most_max_links_connections_to_the_gateway(tmp_path: Path) -> None:
    """Each connection costs the agent two descriptors: past MAX_LINKS at once the next is
    refused with a 503 to retry, and once one closes a new one is carried again."""

    def ask(path: str) -> tuple[socket.socket, bytes]:
        conn = socket.socket(socket.AF_UNIX)
        conn.settimeout(10)
        conn.connect(path)
        # Refused at once, before the request went: its answer is there to read all the same.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        return conn, conn.recv(4096)

    async def gateway(method: str, target: str, _h: dict[str, str], data: bytes) -> bytes:
        return reply(200, b"pong")

    server = await asyncio.start_server(connection_handler(gateway), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    splice = GatewaySplice(long_dir(tmp_path), ("127.0.0.1", port), None)
    await splice.start()
    path = _short(splice.directory, GATEWAY_SOCKET)
    held: list[socket.socket] = []
    try:
        answers = []
        for _ in range(MAX_LINKS):
            conn, answer = await asyncio.to_thread(ask, path)
            held.append(conn)
            answers.append(answer)
        extra, refused = await asyncio.to_thread(ask, path)
        extra.close()
        held.pop().close()
        for _ in range(100):  # until the splice has seen that one go
            if len(splice._links) < MAX_LINKS:
                break
            await asyncio.sleep(0.01)
        again, carried = await asyncio.to_thread(ask, path)
        held.append(again)
    finally:
        for conn in held:
            conn.close()
        await splice.stop()
        server.close()

    assert all(a.startswith(b"HTTP/1.1 200") and a.endswith(b"pong") for a in answers)
    assert refused.startswith(b"HTTP/1.1 503") and b"its limit" in refused
    assert carried.startswith(b"HTTP/1.1 200")
