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

import grpc
import structlog

from fleet.agent.passage import CHECKPOINTS_SOCKET, MAX_LINKS, bind_unix
from fleet.api.pb import host_pb2, host_pb2_grpc
from fleet.core.coalesce import Coalescer
from fleet.core.errors import FleetError, error_for
from fleet.httpd import connection_handler, reply
from fleet.runtime.netns import in_netns

log = structlog.get_logger(__name__)

RELAY_ADDRESS = ("127.0.0.54", 8080)
MAX_BODY_BYTES = 1 << 20

Put = Callable[[int, bytes], Awaitable[None]]
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
"""Server answers an agent sends its call again after (the server out of reach or slow)."""
MAX_BATCH = 256


class CheckpointSender:
    """Sends every checkpoint of this agent's machines to the server, coalesced: those that
    arrive while a call is in flight go together in the next PutCheckpoints call (one durable
    commit on the server for all of them). A call that fails as a whole (the server out of
    reach) is sent again, for up to about 4 s; a checkpoint refused alone fails only its own
    `put`. Resending is harmless: the same sequence with the same data is stored once."""

    def __init__(self, stub: host_pb2_grpc.HostServiceStub) -> None:
        self._stub = stub
        self._batched = True
        self.calls = 0
        """PutCheckpoints calls made (for tests and logs)."""
        self._coalescer: Coalescer[host_pb2.PutCheckpointRequest, None] = Coalescer(
            self._send, max_batch=MAX_BATCH
        )

    async def put(self, request: host_pb2.PutCheckpointRequest) -> None:
        await self._coalescer.submit(request)

    async def _send(self, requests: list[host_pb2.PutCheckpointRequest]) -> list[FleetError | None]:
        for attempt in range(20):
            try:
                if not self._batched:
                    return [await self._one(request) for request in requests]
                self.calls += 1
                reply = await self._stub.PutCheckpoints(
                    host_pb2.PutCheckpointsRequest(checkpoints=requests), timeout=10
                )
                return [error_for(o.code, o.message) if o.code else None for o in reply.outcomes]
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED and self._batched:
                    log.info("checkpoints_one_by_one", reason="the server has no PutCheckpoints")
                    self._batched = False
                    continue
                if exc.code() not in RETRYABLE or attempt == 19:
                    raise error_for(exc.code().name, f"checkpoints: {exc.details()}") from exc
                await asyncio.sleep(0.2)
        raise AssertionError("unreachable")

    async def _one(self, request: host_pb2.PutCheckpointRequest) -> FleetError | None:
        """PutCheckpoint alone (a server from before PutCheckpoints)."""
        try:
            await self._stub.PutCheckpoint(request, timeout=10)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in RETRYABLE:
                raise
            return error_for(exc.code().name, f"checkpoint {request.sequence}: {exc.details()}")
        return None


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
            connection_handler(self._route, MAX_BODY_BYTES, MAX_LINKS), sock=sock
        )

    async def start_unix(self, directory: Path) -> None:
        """Listens on `checkpoints.sock` in a warm child's socket directory."""
        sock = await asyncio.to_thread(bind_unix, directory, CHECKPOINTS_SOCKET)
        self._server = await asyncio.start_unix_server(
            connection_handler(self._route, MAX_BODY_BYTES, MAX_LINKS), sock=sock
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
            statuses = {"ABORTED": 409, "INVALID_ARGUMENT": 409, "RESOURCE_EXHAUSTED": 413}
            return reply(statuses.get(exc.code, 503), exc.message.encode())
        if seq > self.sequence:
            self.sequence, self.data = seq, body
        return reply(200)
