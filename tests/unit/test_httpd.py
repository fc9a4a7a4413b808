"""fleet's small HTTP/1.1 server loop: kept-alive requests, and what it refuses."""

from __future__ import annotations

import asyncio

from fleet.httpd import connection_handler, reply


async def exchange(raw: bytes) -> tuple[bytes, list[tuple[str, str, bytes]]]:
    """Sends `raw` on one connection, half-closes it, returns all the server answered."""
    seen: list[tuple[str, str, bytes]] = []

    async def handler(method: str, target: str, headers: dict[str, str], body: bytes) -> bytes:
        seen.append((method, target, body))
        return reply(200, headers.get("x-echo", "").encode() + body)

    server = await asyncio.start_server(connection_handler(handler, 64), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        writer.write_eof()
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        return answer, seen
    finally:
        server.close()


def test_two_requests_on_one_connection_each_get_their_answer() -> None:
    raw = (b"PUT /a HTTP/1.1\r\nX-Echo: one-\r\nContent-Length: 3\r\n\r\nabc"
           b"GET /b HTTP/1.1\r\nx-echo: two\r\n\r\n")  # fmt: skip
    answer, seen = asyncio.run(exchange(raw))
    assert seen == [("PUT", "/a", b"abc"), ("GET", "/b", b"")]
    assert answer.count(b"HTTP/1.1 200 OK") == 2
    assert answer.endswith(b"two") and b"one-abc" in answer


def test_headers_cut_off_are_a_400() -> None:
    answer, seen = asyncio.run(exchange(b"GET /a HTTP/1.1\r\nHost: x\r\n"))
    assert seen == [] and answer.startswith(b"HTTP/1.1 400 ") and b"cut off" in answer


def test_headers_past_the_limit_are_a_431() -> None:
    raw = b"GET /a HTTP/1.1\r\nX-Big: " + b"x" * 100_000 + b"\r\n\r\n"
    answer, seen = asyncio.run(exchange(raw))
    assert seen == [] and answer.startswith(b"HTTP/1.1 431 ")


def test_a_body_past_the_limit_is_a_413() -> None:
    answer, seen = asyncio.run(
        exchange(b"PUT /a HTTP/1.1\r\nContent-Length: 65\r\n\r\n" + b"x" * 65)
    )
    assert seen == [] and answer.startswith(b"HTTP/1.1 413 ")


def test_a_closed_connection_between_requests_is_no_answer_at_all() -> None:
    answer, seen = asyncio.run(exchange(b""))
    assert (answer, seen) == (b"", [])


def test_past_max_connections_a_connection_gets_a_503_until_one_closes() -> None:
    async def body() -> tuple[list[bytes], bytes, bytes]:
        async def handler(method: str, target: str, headers: dict[str, str], data: bytes) -> bytes:
            return reply(200, b"ok")

        server = await asyncio.start_server(
            connection_handler(handler, 64, max_connections=2), "127.0.0.1", 0
        )
        port = server.sockets[0].getsockname()[1]
        opened: list[asyncio.StreamWriter] = []

        async def ask() -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            opened.append(writer)
            writer.write(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
            return await asyncio.wait_for(reader.read(200), 5)

        try:
            kept = [await ask(), await ask()]  # both stay open (kept alive)
            refused = await ask()
            opened[0].close()
            await opened[0].wait_closed()
            for _ in range(100):  # until the server has seen it go
                again = await ask()
                if again.startswith(b"HTTP/1.1 200"):
                    break
                await asyncio.sleep(0.01)
            return kept, refused, again
        finally:
            for writer in opened:
                writer.close()
            server.close()

    kept, refused, again = asyncio.run(body())
    assert all(k.startswith(b"HTTP/1.1 200") for k in kept)
    assert refused.startswith(b"HTTP/1.1 503") and b"Retry-After: 0.5" in refused
    assert again.startswith(b"HTTP/1.1 200")
