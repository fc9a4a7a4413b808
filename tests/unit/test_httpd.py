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


async def test_past_max_connections_a_connection_gets_a_503_until_one_closes() -> None:
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
    finally:
        for writer in opened:
            writer.close()
        server.close()

    assert all(k.startswith(b"HTTP/1.1 200") for k in kept)
    assert refused.startswith(b"HTTP/1.1 503") and b"Retry-After: 0.5" in refused
    assert again.startswith(b"HTTP/1.1 200")


async def _connect_and(
    send: bytes, *, header_timeout_s: float = 0.3, source: str = "127.0.0.1", **kw: object
) -> tuple[bytes, list[str]]:
    """One connection that sends `send` and then waits: what the server answered before it
    closed the connection (it must close it: the read below ends only at EOF)."""
    seen: list[str] = []

    async def handler(method: str, target: str, headers: dict[str, str], body: bytes) -> bytes:
        seen.append(target)
        return reply(200, b"ok")

    handle = connection_handler(
        handler, 64, header_timeout_s=header_timeout_s, idle_timeout_s=header_timeout_s,
        body_timeout_s=header_timeout_s, **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        writer.write(send)
        try:
            answer = await asyncio.wait_for(reader.read(), 30)  # EOF: the server closed it
        except ConnectionResetError:  # (closed with our bytes unread: a reset, no answer)
            answer = b""
        writer.close()
        return answer, seen
    finally:
        server.close()


def test_a_silent_connection_is_closed_after_the_header_timeout() -> None:
    assert asyncio.run(_connect_and(b"")) == (b"", [])


def test_half_sent_headers_and_a_half_sent_body_are_closed_after_their_timeouts() -> None:
    assert asyncio.run(_connect_and(b"GET /a HTTP/1.1\r\nHost: x")) == (b"", [])
    answer, seen = asyncio.run(_connect_and(b"PUT /a HTTP/1.1\r\nContent-Length: 9\r\n\r\nabc"))
    assert (answer, seen) == (b"", [])


def test_an_idle_kept_alive_connection_is_closed_after_its_answer() -> None:
    answer, seen = asyncio.run(_connect_and(b"GET /a HTTP/1.1\r\n\r\n"))
    assert seen == ["/a"] and answer.startswith(b"HTTP/1.1 200 ")


def test_chunked_bodies_are_refused_and_the_connection_closed() -> None:
    """Transfer-Encoding is not half-understood: 501, then closed, so the chunks that follow
    are never read as a next request."""
    raw = (b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"14\r\nGET /smuggled HTTP/1.1\r\n\r\n0\r\n\r\n")  # fmt: skip
    answer, seen = asyncio.run(_connect_and(raw, header_timeout_s=5))
    assert seen == [] and answer.startswith(b"HTTP/1.1 501 ") and answer.count(b"HTTP/1.1") == 1


def test_malformed_heads_are_a_400_and_closed() -> None:
    for raw in (
        b"GET /a\r\n\r\n",  # no protocol
        b"GET /a HTTP/2\r\n\r\n",
        b"GET /a HTTP/1.1\r\nno colon here\r\n\r\n",
        b"GET /a HTTP/1.1\r\n folded: x\r\n\r\n",
        b"GET /a HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nx",
        b"GET /a HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
    ):
        answer, seen = asyncio.run(_connect_and(raw, header_timeout_s=5))
        assert seen == [] and answer.startswith(b"HTTP/1.1 400 "), (raw, answer)


def test_a_peer_outside_the_allowed_networks_is_closed_unanswered() -> None:
    import ipaddress

    allow = [ipaddress.ip_network("10.0.0.0/8")]
    request = b"GET /a HTTP/1.1\r\n\r\n"
    answer, seen = asyncio.run(_connect_and(request, allow=allow, source="127.0.0.2"))
    assert (answer, seen) == (b"", [])
    # This host at the endpoint's own address is let in; so is a peer in `allow`.
    answer, seen = asyncio.run(_connect_and(request, allow=allow, source="127.0.0.1"))
    assert seen == ["/a"]
    loopback = [ipaddress.ip_network("127.0.0.0/8")]
    answer, seen = asyncio.run(_connect_and(request, allow=loopback, source="127.0.0.2"))
    assert seen == ["/a"]


async def test_connections_past_the_per_key_limit_get_a_503() -> None:
    async def handler(method: str, target: str, headers: dict[str, str], body: bytes) -> bytes:
        return reply(200, b"ok")

    handle = connection_handler(
        handler, 64, key_of=lambda headers, body: headers.get("x-who"), max_per_key=2
    )
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    answers = []
    held = []
    try:
        for who in (b"a", b"a", b"a", b"b"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nX-Who: " + who + b"\r\n\r\n")
            answers.append(await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5))
            held.append(writer)
        answers = answers
    finally:
        for writer in held:
            writer.close()
        server.close()

    assert [a[:12] for a in answers] == [b"HTTP/1.1 200", b"HTTP/1.1 200", b"HTTP/1.1 503",
                                         b"HTTP/1.1 200"]  # fmt: skip
