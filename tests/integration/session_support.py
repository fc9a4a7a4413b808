"""What the end-to-end session tests share: a real server with agents on the namespace
runtime and a session stub (`session_fleet`), a session's shell, its listing polled until it
reaches a state, and a session that wrote a file and parked (`parked_session`). Every wait is
bounded in count."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeAlias, cast

import grpc

from fleet.api.pb import fleet_pb2, fleet_pb2_grpc
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from tests.integration.harness import Harness, harness, namespace_runtime

SMOLFILE = 'image = "minimal"\n'
WRITE = "mkdir -p /work && echo kept-$RANDOM > /work/data.txt && cat /work/data.txt"
"""Writes a file no two sessions write alike to the session's disk; prints it."""

Stub: TypeAlias = fleet_pb2_grpc.SessionServiceStub


@asynccontextmanager
async def session_fleet(
    tmp_path: Path, images: ImageStore, *hosts: str
) -> AsyncIterator[tuple[Harness, Stub]]:
    """A server with one CPU agent of the namespace runtime per name in `hosts` (four slots
    each), and a session stub on its channel."""
    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        for host in hosts:
            await h.start_agent(host, HostClass.CPU, slots=4)
        yield h, fleet_pb2_grpc.SessionServiceStub(h.channel)


def open_request(idle_timeout_s: float = 0, on_idle: str = "") -> fleet_pb2.OpenSessionRequest:
    return fleet_pb2.OpenSessionRequest(
        smolfile=SMOLFILE, smolfile_name="s.smolfile", idle_timeout_s=idle_timeout_s,
        on_idle=on_idle,
    )  # fmt: skip


async def shell(stub: Stub, session: str, command: str) -> bytes:
    """What `command` printed in the session (stdout and stderr); it must exit 0."""
    said, code = b"", None
    async for part in stub.Exec(fleet_pb2.ExecRequest(session_id=session, shell=command)):
        said += part.stdout + part.stderr
        if part.WhichOneof("kind") == "exit":
            code = part.exit.exit_code
    assert code == 0, said
    return said


async def shell_when_ready(stub: Stub, session: str, command: str) -> bytes:
    """As `shell`, once the session's machine is ready (a moved session is listed on its new
    host while its machine still starts); bounded."""
    for _ in range(240):
        try:
            return await shell(stub, session, command)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
        await asyncio.sleep(0.5)
    raise AssertionError(f"session {session} never became ready")


async def listed(stub: Stub, session: str) -> fleet_pb2.Session:
    reply: fleet_pb2.ListSessionsResponse = await stub.ListSessions(fleet_pb2.ListSessionsRequest())
    [found] = [s for s in reply.sessions if s.id == session]
    return cast(fleet_pb2.Session, found)


async def until_listed(
    stub: Stub, session: str, state: str, host_id: str = ""
) -> fleet_pb2.Session:
    """The session once ListSessions shows it `state` (on `host_id`, if given); bounded."""
    seen = None
    for _ in range(240):
        seen = await listed(stub, session)
        if seen.state == state and (not host_id or seen.host_id == host_id):
            return seen
        await asyncio.sleep(0.5)
    raise AssertionError(f"session {session} never became {state} {host_id}: last {seen}")


async def parked_session(stub: Stub) -> tuple[fleet_pb2.Session, bytes, fleet_pb2.Session]:
    """A session opened, with `WRITE` run in it, parked by its caller: (as opened, what
    `WRITE` printed, as parked)."""
    opened = await stub.OpenSession(open_request())
    written = await shell(stub, opened.id, WRITE)
    parked = await stub.ParkSession(fleet_pb2.ParkSessionRequest(session_id=opened.id))
    return opened, written, parked
