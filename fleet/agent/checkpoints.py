"""The checkpoint relay: how a hybrid rollout's machine stores its state through its agent.

It listens at 127.0.0.54:8080 inside the machine's own network namespace (the machine reaches
nothing of the agent's but this), or, for a warm parent's child, on `checkpoints.sock` in the
child's socket directory (`fleet.agent.passage`). `PUT /checkpoint?seq=N` with the state as
the body returns 200 only once the fleet server has stored it under the attempt's lease, so a
step that waits for it before its next model call never loses a handoff. `GET /checkpoint`
returns the latest one (`X-Fleet-Sequence` header; 204 when there is none), which is how a later
attempt resumes.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import structlog

from fleet.agent.passage import CHECKPOINTS_SOCKET, bind_unix
from fleet.core.errors import FleetError
from fleet.httpd import connection_handler, reply
from fleet.runtime.netns import in_netns

log = structlog.get_logger(__name__)

RELAY_ADDRESS = ("127.0.0.54", 8080)
MAX_BODY_BYTES = 1 << 20

Put = Callable[[int, bytes], Awaitable[None]]


class CheckpointRelay:
    def __init__(self, sequence: int, data: bytes, put: Put) -> None:
        self.sequence = sequence
        self.data = data
        self._put = put
        self._server: asyncio.Server | None = None

    async def start_in_netns(self, netns_path: str) -> None:
        """Listens at RELAY_ADDRESS in the machine's network namespace."""

        def bind() -> socket.socket:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(RELAY_ADDRESS)
            sock.listen(16)
            sock.setblocking(False)
            return sock

        sock = await asyncio.to_thread(in_netns, netns_path, bind)
        self._server = await asyncio.start_server(
            connection_handler(self._route, MAX_BODY_BYTES), sock=sock
        )

    async def start_unix(self, directory: Path) -> None:
        """Listens on `checkpoints.sock` in a warm child's socket directory."""
        sock = await asyncio.to_thread(bind_unix, directory, CHECKPOINTS_SOCKET)
        self._server = await asyncio.start_unix_server(
            connection_handler(self._route, MAX_BODY_BYTES), sock=sock
        )

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _route(self, method: str, target: str, _h: dict[str, str], body: bytes) -> bytes:
        url = urlsplit(target)
        if url.path != "/checkpoint":
            return reply(404, b"only /checkpoint")
        if method == "GET":
            if not self.sequence:
                return reply(204)
            return reply(200, self.data, "application/octet-stream",
                         {"X-Fleet-Sequence": str(self.sequence)})  # fmt: skip
        if method != "PUT":
            return reply(405, b"GET or PUT /checkpoint?seq=N")
        try:
            seq = int(parse_qs(url.query)["seq"][0])
        except (KeyError, ValueError):
            return reply(400, b"PUT /checkpoint?seq=N (a positive integer)")
        try:
            await self._put(seq, body)
        except FleetError as exc:
            status = 409 if exc.code in ("ABORTED", "INVALID_ARGUMENT") else 503
            return reply(status, exc.message.encode())
        if seq > self.sequence:
            self.sequence, self.data = seq, body
        return reply(200)
