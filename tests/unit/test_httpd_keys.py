"""fleet's HTTP server loop with per-key connection bounds, over real sockets on loopback: a
connection counts against its key however it is used, and none is held open uncounted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fleet.httpd import connection_handler, reply

HEALTH = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


def keyed(who: bytes) -> bytes:
    return b"GET /work HTTP/1.1\r\nHost: x\r\nX-Who: " + who + b"\r\n\r\n"


@asynccontextmanager
async def endpoint(max_per_key: int) -> AsyncIterator[tuple[int, list[str]]]:
    """A server whose requests name their key in X-Who (none: no key); yields its port and
    the keys of the requests its handler served."""
    served: list[str] = []

    async def handler(method: str, target: str, headers: dict[str, str], body: bytes) -> bytes:
        served.append(headers.get("x-who", "-"))
        return reply(200, b"ok")

    handle = connection_handler(
        handler, 64, key_of=lambda headers, body: headers.get("x-who"), max_per_key=max_per_key
    )
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], served
    finally:
        server.close()


async def answer(reader: asyncio.StreamReader) -> bytes:
    """One whole response, or b"" at EOF."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    except (asyncio.IncompleteReadError, ConnectionResetError):
        return b""
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return head + await asyncio.wait_for(reader.readexactly(length), 10)


async def test_a_connection_kept_alive_by_a_health_check_cannot_carry_a_key_past_its_bound() -> (
    None
):
    """Two connections of key a fill its bound; a third that opens with a health check is
    answered and closed, so it never carries a's requests, and a fourth of a gets a 503."""
    async with endpoint(max_per_key=2) as (port, served):
        held = []
        try:
            for _ in range(2):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                held.append(writer)
                writer.write(keyed(b"a"))
                assert (await answer(reader)).startswith(b"HTTP/1.1 200")
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            held.append(writer)
            writer.write(HEALTH)
            health = await answer(reader)
            writer.write(keyed(b"a"))
            smuggled = await answer(reader)  # (the server closed it: EOF)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            held.append(writer)
            writer.write(keyed(b"a"))
            over = await answer(reader)
        finally:
            for w in held:
                w.close()

    assert health.startswith(b"HTTP/1.1 200") and b"Connection: close" in health
    assert smuggled == b""
    assert over.startswith(b"HTTP/1.1 503") and b"2 connections of a are open" in over
    assert served == ["a", "a", "-"]


async def test_a_keyed_connection_stays_open_for_health_checks_and_frees_its_place() -> None:
    """Once a connection counts against a key it stays open for requests that name none;
    closing it gives the key's place back."""
    async with endpoint(max_per_key=1) as (port, served):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(keyed(b"a") + HEALTH + keyed(b"a"))
            answers = [await answer(reader) for _ in range(3)]
            reader2, writer2 = await asyncio.open_connection("127.0.0.1", port)
            writer2.write(keyed(b"a"))
            full = await answer(reader2)
            writer2.close()
        finally:
            writer.close()
        for _ in range(100):  # until the server has seen it go
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(keyed(b"a"))
            again = await answer(reader)
            writer.close()
            if again.startswith(b"HTTP/1.1 200"):
                break
            await asyncio.sleep(0.01)

    assert [a[:12] for a in answers] == [b"HTTP/1.1 200"] * 3
    assert not any(b"Connection: close" in a for a in answers)
    assert full.startswith(b"HTTP/1.1 503")
    assert served[:3] == ["a", "-", "a"]
    assert again.startswith(b"HTTP/1.1 200")
