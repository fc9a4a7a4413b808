"""Sessions against a restarted server, and the bounds on their file calls: real server,
real agent, namespace machines."""

from __future__ import annotations

import asyncio
import io
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from fleet.agent import sessions as agent_sessions
from fleet.api.pb import fleet_pb2, fleet_pb2_grpc
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from fleet.ledger.store import Ledger
from fleet.server import sessions as server_sessions
from fleet.server.app import FleetServer
from tests.integration.harness import harness, namespace_runtime, registered

SMOLFILE = 'image = "minimal"\n'


async def test_the_first_session_after_a_server_restart_becomes_ready(
    tmp_path: Path, images: ImageStore
) -> None:
    """The agent's session stream reconnects to the restarted server (same ledger, same
    address): the session opened next reaches it as ready, and runs commands."""
    async with harness(tmp_path, images) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        stub = fleet_pb2_grpc.SessionServiceStub(h.channel)
        before = await stub.OpenSession(
            fleet_pb2.OpenSessionRequest(smolfile=SMOLFILE, smolfile_name="s.smolfile")
        )
        await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=before.id))
        old = h.server
        await old.stop()
        h.server = FleetServer(
            Ledger.sqlite(tmp_path / "ledger.sqlite3"), images, old.address, old.config
        )
        await h.server.start()
        await registered(h.server, "cpu-a")
        for _ in range(100):  # (bounded: the agent's session stream is back within 10 s)
            if "cpu-a" in h.server.core.sessions.links:
                break
            await asyncio.sleep(0.1)
        try:
            s = await stub.OpenSession(
                fleet_pb2.OpenSessionRequest(
                    smolfile=SMOLFILE, smolfile_name="s.smolfile", ready_timeout_s=30
                )
            )
            outcome: object = s.state
            said = b""
            async for part in stub.Exec(fleet_pb2.ExecRequest(session_id=s.id, shell="echo up")):
                said += part.stdout
            await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=s.id))
        except grpc.aio.AioRpcError as exc:
            outcome, said = (exc.code(), exc.details()), b""

    assert outcome == "OPEN" and said == b"up\n"


async def _open(stub: fleet_pb2_grpc.SessionServiceStub) -> str:
    s = await stub.OpenSession(
        fleet_pb2.OpenSessionRequest(smolfile=SMOLFILE, smolfile_name="s.smolfile")
    )
    return str(s.id)


async def _shell(stub: fleet_pb2_grpc.SessionServiceStub, session: str, shell: str) -> int:
    code = -1
    async for part in stub.Exec(fleet_pb2.ExecRequest(session_id=session, shell=shell)):
        if part.WhichOneof("kind") == "exit":
            code = part.exit.exit_code
    return code


async def _read(
    stub: fleet_pb2_grpc.SessionServiceStub, session: str, path: str, tar: bool = False
) -> bytes:
    out = bytearray()
    request = fleet_pb2.ReadFileRequest(session_id=session, path=path, tar=tar)
    async for chunk in stub.ReadFile(request):
        out += chunk.data
    return bytes(out)


async def _write(
    stub: fleet_pb2_grpc.SessionServiceStub, session: str, path: str, data: bytes, mode: int
) -> int:
    async def chunks() -> AsyncIterator[fleet_pb2.WriteFileChunk]:
        yield fleet_pb2.WriteFileChunk(session_id=session, path=path, mode=mode)
        for offset in range(0, len(data), 1 << 20):
            yield fleet_pb2.WriteFileChunk(data=data[offset : offset + (1 << 20)])

    return int((await stub.WriteFile(chunks())).size)


async def _blocked(stub: fleet_pb2_grpc.SessionServiceStub, session: str, count: int) -> None:
    """Until `count` reads of /root/fifo wait in the session's machine (bounded: 20 s)."""
    shell = (
        'test "$(for f in /proc/[0-9]*/cmdline; do tr "\\0" " " < $f; echo; done 2>/dev/null'
        f' | grep -cE "^(head|cat) .*/root/fif[o]")" = {count}'
    )
    for _ in range(200):
        if await _shell(stub, session, shell) == 0:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{count} reads did not start waiting in {session}")


async def _refusal(stub: fleet_pb2_grpc.SessionServiceStub, session: str) -> tuple[object, str]:
    """How a small read in `session` ends: (OK, "") or its refusal."""
    try:
        await _read(stub, session, "/etc/hostname")
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.mark.sandbox
async def test_session_file_calls_in_flight_are_bounded(
    tmp_path: Path, images: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads held open (a fifo no one writes yet) count against the bounds per session, per
    tenant and per server; the call past one is RESOURCE_EXHAUSTED naming it, and once the
    held calls end, file calls are served again."""
    monkeypatch.setattr(server_sessions, "FILE_CALLS_PER_SESSION", 2)
    monkeypatch.setattr(server_sessions, "FILE_CALLS_PER_TENANT", 3)
    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU, slots=4)
        stub = fleet_pb2_grpc.SessionServiceStub(h.channel)
        a, b = await _open(stub), await _open(stub)
        for s in (a, b):
            assert await _shell(stub, s, "mkfifo /root/fifo") == 0
        held = [asyncio.create_task(_read(stub, a, "/root/fifo")) for _ in range(2)]
        await _blocked(stub, a, 2)
        per_session = await _refusal(stub, a)
        held.append(asyncio.create_task(_read(stub, b, "/root/fifo")))
        await _blocked(stub, b, 1)
        per_tenant = await _refusal(stub, b)
        for s in (a, b):
            await _shell(stub, s, "echo released > /root/fifo")
        released = await asyncio.wait_for(asyncio.gather(*held), 30)
        again = await _read(stub, a, "/etc/hostname")
        monkeypatch.setattr(server_sessions, "FILE_CALLS_PER_SERVER", 1)
        one = asyncio.create_task(_read(stub, b, "/root/fifo"))
        await _blocked(stub, b, 1)
        per_server = await _refusal(stub, a)
        await _shell(stub, b, "echo released > /root/fifo")
        await asyncio.wait_for(one, 30)
        for s in (a, b):
            await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=s))

    assert per_session[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"session {a} has 2 file calls in flight, the bound per session" in per_session[1]
    assert per_tenant[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant default has 3 session file calls in flight" in per_tenant[1]
    assert per_server[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "this server has 1 session file calls in flight" in per_server[1]
    # (the two readers of one fifo: one of them takes what was written, the other its end)
    assert b"".join(released[:2]) == released[2] == b"released\n" and again != b""


@pytest.mark.sandbox
async def test_a_host_bounds_the_stdin_it_holds_for_calls_still_arriving(
    tmp_path: Path, images: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write whose data would take the host past what it holds for calls still arriving is
    refused with RESOURCE_EXHAUSTED naming that bound; nothing is written, and a write within
    it still works."""
    monkeypatch.setattr(agent_sessions, "MAX_PENDING_STDIN_BYTES", 2 << 20)
    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        stub = fleet_pb2_grpc.SessionServiceStub(h.channel)
        s = await _open(stub)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _write(stub, s, "/root/big", b"x" * (3 << 20), 0o644)
        missing = await _shell(stub, s, "test -e /root/big")
        small = await _write(stub, s, "/root/small", b"y" * (1 << 20), 0o644)
        await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=s))

    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "over its bound of 2 MiB" in (refused.value.details() or "")
    assert missing == 1 and small == 1 << 20


def _archive(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info, body in members:
            info.size = len(body) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(body) if info.isreg() else None)
    return out.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.uid, info.gid = kind, mode, 1234, 5678
    return info


@pytest.mark.sandbox
async def test_a_directory_read_is_an_archive_fleet_made(
    tmp_path: Path, images: ImageStore
) -> None:
    """The workload puts its own `tar` first on the machine's PATH, one that sends an archive of
    its choosing: what reaches the caller is fleet's archive of it (names normalised, no owners,
    no setuid bits, no fifos), and an archive with a member outside the tree is refused
    naming it."""
    unclean = _archive(
        (_member("./bin//tool", mode=0o4755), b"#!/bin/sh\n"),
        (_member("pipe", tarfile.FIFOTYPE), b""),
        (_member("ok.txt"), b"fine\n"),
    )
    escaping = _archive((_member("ok.txt"), b"fine\n"), (_member("../escape"), b"out\n"))
    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        stub = fleet_pb2_grpc.SessionServiceStub(h.channel)
        s = await _open(stub)
        await _shell(stub, s, "mkdir -p /srv/d")
        await _write(stub, s, "/root/unclean.tar", unclean, 0o644)
        await _write(stub, s, "/root/escaping.tar", escaping, 0o644)
        fake = b'#!/bin/sh\ncat "/root/$(cat /root/which).tar"\n'
        await _write(stub, s, "/usr/local/bin/tar", fake, 0o755)
        await _write(stub, s, "/root/which", b"unclean", 0o644)
        got = await _read(stub, s, "/srv/d", tar=True)
        await _write(stub, s, "/root/which", b"escaping", 0o644)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _read(stub, s, "/srv/d", tar=True)
        await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=s))

    with tarfile.open(fileobj=io.BytesIO(got)) as tar:
        members = {m.name: (m.mode, m.uid, m.gid, m.type) for m in tar.getmembers()}
    assert members == {
        "bin/tool": (0o755, 0, 0, tarfile.REGTYPE),
        "ok.txt": (0o644, 0, 0, tarfile.REGTYPE),
    }
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "../escape" in (refused.value.details() or "")
