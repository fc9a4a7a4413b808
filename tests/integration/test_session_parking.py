"""Sessions that park and move, end to end: a real server, agents on the namespace runtime,
real files in the sessions' machines. A parked session resumed on another host has its files;
a fork of a parked session has them; a session on a draining host is resumed elsewhere; an
idle session parks (or closes, where it asked to)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import cast

import grpc
import pytest

from fleet.api.pb import fleet_pb2, fleet_pb2_grpc
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from fleet.ledger.base import DRAINING
from tests.integration.harness import Harness, harness, namespace_runtime

SMOLFILE = 'image = "minimal"\n'
WRITE = "mkdir -p /work && echo kept-$RANDOM > /work/data.txt && cat /work/data.txt"


async def _shell(stub: fleet_pb2_grpc.SessionServiceStub, session: str, shell: str) -> bytes:
    said, code = b"", None
    async for part in stub.Exec(fleet_pb2.ExecRequest(session_id=session, shell=shell)):
        said += part.stdout + part.stderr
        if part.WhichOneof("kind") == "exit":
            code = part.exit.exit_code
    assert code == 0, said
    return said


async def _shell_when_ready(
    stub: fleet_pb2_grpc.SessionServiceStub, session: str, shell: str
) -> bytes:
    """As `_shell`, once the session's machine is ready (a moved session is listed on its new
    host while its machine still starts); bounded."""
    for _ in range(240):
        try:
            return await _shell(stub, session, shell)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
        await asyncio.sleep(0.5)
    raise AssertionError(f"session {session} never became ready")


async def _listed(stub: fleet_pb2_grpc.SessionServiceStub, session: str) -> fleet_pb2.Session:
    reply: fleet_pb2.ListSessionsResponse = await stub.ListSessions(fleet_pb2.ListSessionsRequest())
    [found] = [s for s in reply.sessions if s.id == session]
    return cast(fleet_pb2.Session, found)


async def _until_listed(
    stub: fleet_pb2_grpc.SessionServiceStub, session: str, state: str, host_id: str = ""
) -> fleet_pb2.Session:
    """The session once ListSessions shows it `state` (on `host_id`, if given); bounded."""
    seen = None
    for _ in range(240):
        seen = await _listed(stub, session)
        if seen.state == state and (not host_id or seen.host_id == host_id):
            return seen
        await asyncio.sleep(0.5)
    raise AssertionError(f"session {session} never became {state} {host_id}: last {seen}")


async def _two_hosts(h: Harness) -> None:
    await h.start_agent("cpu-a", HostClass.CPU, slots=4)
    await h.start_agent("cpu-b", HostClass.CPU, slots=4)


@pytest.mark.sandbox
async def test_parked_session_resumes_elsewhere_forks_and_moves_off_a_draining_host(
    tmp_path: Path, images: ImageStore
) -> None:
    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await _two_hosts(h)
        stub = fleet_pb2_grpc.SessionServiceStub(h.channel)
        opened = await stub.OpenSession(
            fleet_pb2.OpenSessionRequest(smolfile=SMOLFILE, smolfile_name="s.smolfile")
        )
        written = await _shell(stub, opened.id, WRITE)

        parked = await stub.ParkSession(fleet_pb2.ParkSessionRequest(session_id=opened.id))
        assert (parked.id, parked.state) == (opened.id, "PARKED")
        assert parked.layer_digest.startswith("sha256:") and parked.layer_size > 0
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _shell(stub, opened.id, "true")
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "parked" in (refused.value.details() or "")
        # Parking again is answered as it stands.
        again = await stub.ParkSession(fleet_pb2.ParkSessionRequest(session_id=opened.id))
        assert (again.state, again.layer_digest) == ("PARKED", parked.layer_digest)

        # Its first host goes away: the resume can only land on the other.
        await h.stop_agent(opened.host_id)
        other = ({"cpu-a", "cpu-b"} - {opened.host_id}).pop()
        resumed = await stub.ResumeSession(
            fleet_pb2.ResumeSessionRequest(session_id=opened.id, ready_timeout_s=120)
        )
        assert (resumed.id, resumed.state, resumed.host_id) == (opened.id, "OPEN", other)
        assert await _shell(stub, opened.id, "cat /work/data.txt") == written

        # A fork of the session once parked again has its files, on a machine of its own.
        await _shell(stub, opened.id, "echo more > /work/more.txt")
        await stub.ParkSession(fleet_pb2.ParkSessionRequest(session_id=opened.id))
        forks = await stub.ForkSession(
            fleet_pb2.ForkSessionRequest(session_id=opened.id, count=1, ready_timeout_s=120)
        )
        [fork] = forks.sessions
        assert fork.id != opened.id and fork.state == "OPEN"
        seen = await _shell(stub, fork.id, "cat /work/data.txt /work/more.txt")
        assert seen == written + b"more\n"
        await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=fork.id))
        assert (await _listed(stub, opened.id)).state == "PARKED"  # the fork took nothing

        # Resumed on the one host left, which then drains: the session moves to a new host.
        resumed = await stub.ResumeSession(
            fleet_pb2.ResumeSessionRequest(session_id=opened.id, ready_timeout_s=120)
        )
        assert resumed.host_id == other
        await h.start_agent("cpu-c", HostClass.CPU, slots=4)
        await h.server.core.db(
            h.server.core.ledger.set_host_state, other, DRAINING, time.time() + 300
        )
        moved = await _until_listed(stub, opened.id, "OPEN", "cpu-c")
        assert moved.id == opened.id
        assert await _shell_when_ready(stub, opened.id, "cat /work/data.txt /work/more.txt") == seen

        closed = await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=opened.id))
        assert closed.state == "CLOSED"
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await stub.ResumeSession(fleet_pb2.ResumeSessionRequest(session_id=opened.id))
        assert gone.value.code() == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.sandbox
async def test_an_idle_session_parks_unless_it_asked_to_close(
    tmp_path: Path, images: ImageStore
) -> None:
    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU, slots=4)
        stub = fleet_pb2_grpc.SessionServiceStub(h.channel)
        parks, closes = [
            await stub.OpenSession(
                fleet_pb2.OpenSessionRequest(
                    smolfile=SMOLFILE,
                    smolfile_name="s.smolfile",
                    idle_timeout_s=3,
                    on_idle=on_idle,
                )
            )
            for on_idle in ("", "close")
        ]
        written = await _shell(stub, parks.id, WRITE)
        await _shell(stub, closes.id, WRITE)
        parked = await _until_listed(stub, parks.id, "PARKED")
        assert parked.layer_digest.startswith("sha256:")
        assert (await _until_listed(stub, closes.id, "CLOSED")).layer_digest == ""
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ResumeSession(fleet_pb2.ResumeSessionRequest(session_id=closes.id))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        resumed = await stub.ResumeSession(
            fleet_pb2.ResumeSessionRequest(session_id=parks.id, ready_timeout_s=120)
        )
        assert resumed.state == "OPEN"
        assert await _shell(stub, parks.id, "cat /work/data.txt") == written
        await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=parks.id))

        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.OpenSession(fleet_pb2.OpenSessionRequest(smolfile=SMOLFILE, on_idle="sleep"))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "on_idle" in (bad.value.details() or "")
