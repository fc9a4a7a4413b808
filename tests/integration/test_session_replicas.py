"""Sessions through any server replica: two replicas on one PostgreSQL ledger, each in a process
of its own, one agent given both addresses. Its link (heartbeats, claims, reports) uses the
first; a client that knows only the second opens a session there, runs a command and moves a
file both ways, because the agent keeps a session stream open to each replica. Then the first
replica is killed (SIGKILL): the session, on the same machine, still answers through the second.

Also, against scripted replicas (real gRPC servers that speak only the session stream): two
replicas that send a call under the same call id, its stdin in pieces, each get their own
answer on their own stream; a replica out of reach is logged once, however often its stream
tries again, and is told who the host is once it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import unittest.mock
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import grpc
from structlog.testing import capture_logs

import fleet.agent.agent
from fleet.agent.agent import Agent
from fleet.agent.config import AgentConfig
from fleet.agent.link import Link
from fleet.agent.sessions import SessionHost
from fleet.api.pb import host_pb2, host_pb2_grpc
from fleet.client import AsyncFleet
from fleet.client.models import Smolfile
from fleet.core.manifest import SessionSpec
from fleet.core.placement import HostClass
from fleet.core.rollout import Assignment
from fleet.core.smolfile import parse_smolfile
from fleet.image.store import ImageStore
from fleet.runtime.base import ExecResult, MachineSpec
from fleet.runtime.output import OutputSink
from fleet.server.session_moves import RESUMES_LABEL
from fleet.testing import FakeMachine, FakeRuntime
from tests.integration.harness import NAMESPACE
from tests.integration.test_replica_failover import DEAD, replica, until
from tests.pgserver import create_database, drop_database

SMOLFILE_TEXT = 'image = "minimal"\n'
SMOLFILE = Smolfile.from_text(SMOLFILE_TEXT)
PIECE = 1 << 20


class FileMachine(FakeMachine):
    """A fake machine that keeps the files written into it through a session (the server's
    write command, its data on stdin) and gives them back to its read command (`head`)."""

    async def exec(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        timeout_s: float,
        max_output_bytes: int = 1 << 20,
        on_output: OutputSink | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        if argv[:2] == ["/bin/sh", "-c"] and argv[3:4] == ["write"]:
            self.files[argv[4]] = stdin or b""
            return ExecResult(exit_code=0)
        if argv == ["cat"]:
            self._send(on_output, stdin or b"")
            return ExecResult(exit_code=0)
        if argv[:1] == ["head"]:
            data = self.files.get(argv[-1])
            if data is None:
                return ExecResult(exit_code=1, stderr=b"no such file")
            self._send(on_output, data)
            return ExecResult(exit_code=0)
        return await super().exec(
            argv, env=env, workdir=workdir, timeout_s=timeout_s,
            max_output_bytes=max_output_bytes, on_output=on_output, stdin=stdin,
        )  # fmt: skip

    async def pack_layer(self, archive: Path, scratch: Path) -> int:
        """Its files, as the layer a park stores (a resume would need the namespace runtime)."""
        self.runtime.calls.append(("pack_layer", self.name, ()))
        layer = b"".join(path.encode() + b"\0" + data for path, data in sorted(self.files.items()))
        await asyncio.to_thread(archive.write_bytes, layer)
        return len(layer)

    @staticmethod
    def _send(on_output: OutputSink | None, data: bytes) -> None:
        for offset in range(0, len(data), PIECE):
            if on_output is not None:
                on_output("stdout", data[offset : offset + PIECE])


class FileRuntime(FakeRuntime):
    def _machine(self, spec: MachineSpec, files: dict[str, bytes]) -> FakeMachine:
        machine = FileMachine(self, spec, files)
        self.machines[spec.name] = machine
        return machine


def agent(tmp: Path, images: ImageStore, servers: str, runtime: FakeRuntime) -> Agent:
    config = AgentConfig(
        server=servers, host_id="host-0", host_class=HostClass.CPU, runtime=NAMESPACE,
        machines_dir=tmp / "host-0" / "machines", images=images, slots=2, claim_wait_s=1.0,
        drain_deadline_s=5.0,
    )  # fmt: skip
    with unittest.mock.patch.object(fleet.agent.agent, "make_runtime", lambda *_: runtime):
        return Agent(config)


@contextlib.asynccontextmanager
async def running(host: Agent) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(host.run(stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_a_session_answers_through_a_replica_its_host_does_not_use_and_after_a_kill(
    tmp_path: Path, images: ImageStore, postgres: str
) -> None:
    url = create_database(postgres)
    runtime = FileRuntime()
    data = os.urandom(3 * PIECE + 5)  # (its stdin comes down the stream in pieces)
    try:
        async with (
            replica(url, images, tmp_path) as (pid_a, a),
            replica(url, images, tmp_path) as (_, b),
        ):
            host = agent(tmp_path, images, f"{a},{b}", runtime)
            link = None
            async with running(host), AsyncFleet(b, plaintext=True) as client:
                async with asyncio.timeout(90):
                    await until("the host registered", lambda: _hosts(client))
                    link = host.stub
                    assert isinstance(link, Link) and link.server == a
                    # Opened through b (it is ready once the host tells b so), claimed
                    # through a.
                    try:
                        session = await asyncio.wait_for(client.session(SMOLFILE), 60)
                    except TimeoutError:
                        raise AssertionError(
                            "no session opened through b in 60 s: its host has no stream there"
                        ) from None
                    assert session.host_id == "host-0"
                    said = await session.exec(["echo", "through", "b"])
                    assert (said.exit_code, said.stdout) == (0, b"through b\n")
                    assert await session.write_file("/work/data.bin", data) == len(data)
                    assert await session.read_file("/work/data.bin") == data
                    assert link.server == a  # (all of it without the host's link moving)
                    [machine] = runtime.machines.values()

                    os.kill(pid_a, signal.SIGKILL)
                    await until("the link on b", lambda: _on(link, b))
                    again = await session.exec(["echo", "still"])
                    assert (again.exit_code, again.stdout) == (0, b"still\n")
                    assert await session.read_file("/work/data.bin") == data
                    await session.write_file("/work/more.txt", b"more\n")
                    assert await session.read_file("/work/more.txt") == b"more\n"
                    assert list(runtime.machines.values()) == [machine]  # the same machine
                    await session.close()
    finally:
        drop_database(postgres, url)
    assert link is not None and link.replicas.moves >= 1


async def test_a_draining_hosts_session_is_parked_once_with_both_replicas_reaching_it(
    tmp_path: Path, images: ImageStore, postgres: str
) -> None:
    """Both replicas see the drain in the ledger and both reach the host, so either may move
    the session (its mover runs on every replica the host is connected to): it is parked once
    and resumed once, whichever does it and however their tries meet."""
    url = create_database(postgres)
    runtime = FileRuntime()
    try:
        async with (
            replica(url, images, tmp_path) as (_, a),
            replica(url, images, tmp_path) as (_, b),
        ):
            host = agent(tmp_path, images, f"{a},{b}", runtime)
            async with running(host), AsyncFleet(b, plaintext=True) as client:
                async with asyncio.timeout(90):
                    await until("the host registered", lambda: _hosts(client))
                    session = await client.session(SMOLFILE)
                    await session.write_file("/work/data.txt", b"kept\n")
                    await client.admin.drain("host-0", 300)
                    await until(
                        "the session's resume submitted", lambda: _resumes(client, session.id)
                    )
                    await until("its parked attempt reported", lambda: _final(client, session.id))
                    resumes = await client.list({RESUMES_LABEL: session.id})
                    parked = await client.get(session.id)
    finally:
        drop_database(postgres, url)
    assert len(resumes) == 1  # (one resume: a second mover's repeat finds it)
    assert len([c for c in runtime.calls if c[0] == "pack_layer"]) == 1  # its layer stored once
    assert parked.state == "SUCCEEDED" and resumes[0].state == "QUEUED"  # (no other host)


async def _resumes(client: AsyncFleet, session_id: str) -> bool:
    return bool(await client.list({RESUMES_LABEL: session_id}))


async def _final(client: AsyncFleet, rollout_id: str) -> bool:
    return (await client.get(rollout_id)).state in ("SUCCEEDED", "FAILED", "CANCELLED")


async def _hosts(client: AsyncFleet) -> bool:
    return len(await client.admin.hosts()) >= 1


async def _on(link: Link, server: str) -> bool:
    return link.server == server


# -- scripted replicas ---------------------------------------------------------------------------

WORK_ID = "w-1"


class Scripted(host_pb2_grpc.HostServiceServicer):  # type: ignore[misc]
    """A replica's end of a host's session stream, driven by the test: `commands` go down as
    they are put; what comes up is kept (the host's hello, the session's ready, replies)."""

    def __init__(self) -> None:
        self.commands: asyncio.Queue[host_pb2.SessionCommand] = asyncio.Queue()
        self.hello = asyncio.Event()
        self.ready = asyncio.Event()
        self.done = asyncio.Event()
        self.host_ids: list[str] = []
        self.replies: list[host_pb2.SessionReply] = []

    async def SessionCommands(
        self, replies: AsyncIterator[host_pb2.SessionReply], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[host_pb2.SessionCommand]:
        async def read() -> None:
            async for reply in replies:
                kind = reply.WhichOneof("kind")
                if kind == "host_id":
                    self.host_ids.append(reply.host_id)
                    self.hello.set()
                elif kind == "ready":
                    if reply.ready and reply.work_id == WORK_ID:
                        self.ready.set()
                else:
                    self.replies.append(reply)
                    if kind in ("exit", "error"):
                        self.done.set()

        reader = asyncio.create_task(read())
        try:
            while True:
                yield await self.commands.get()
        finally:
            reader.cancel()

    def said(self) -> tuple[bytes, list[str]]:
        """The stdout its call got, and the errors."""
        out = b"".join(r.stdout for r in self.replies if r.WhichOneof("kind") == "stdout")
        return out, [r.error for r in self.replies if r.WhichOneof("kind") == "error"]


@contextlib.asynccontextmanager
async def scripted() -> AsyncIterator[tuple[Scripted, host_pb2_grpc.HostServiceStub]]:
    """A scripted replica on a free loopback port, and a stub that reaches it."""
    servicer = Scripted()
    server = grpc.aio.server()
    host_pb2_grpc.add_HostServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield servicer, host_pb2_grpc.HostServiceStub(channel)
    finally:
        await server.stop(None)


async def _event(event: asyncio.Event, what: str) -> None:
    try:
        await asyncio.wait_for(event.wait(), 60)
    except TimeoutError:
        raise AssertionError(f"not in 60 s: {what}") from None


async def test_each_replica_gets_the_answers_to_its_own_calls_under_the_same_call_id(
    tmp_path: Path,
) -> None:
    host = SessionHost("host-0")
    machine = await FileRuntime().create(
        MachineSpec(
            name="m-1",
            smolfile=parse_smolfile(SMOLFILE_TEXT).spec,
            image_digest="sha256:x",
            rootfs=tmp_path,
        )
    )
    # (A session's hold reads only its lease's ids.)
    lease = Assignment.model_construct(work_id=WORK_ID, rollout_id="r-1")  # type: ignore[call-arg]
    data = {"a": os.urandom(PIECE + 7), "b": os.urandom(PIECE + 11)}
    stop = asyncio.Event()
    tasks: list[asyncio.Task[Any]] = []
    async with scripted() as (a, stub_a), scripted() as (b, stub_b):
        try:
            tasks.append(asyncio.create_task(host.serve(stub_a, stop, "a")))
            await _event(a.hello, "a's stream open")
            tasks.append(asyncio.create_task(host.hold(lease, machine, {}, SessionSpec())))
            await _event(a.ready, "the session ready, told to the stream open then")
            tasks.append(asyncio.create_task(host.serve(stub_b, stop, "b")))
            await _event(b.ready, "the session ready, told to a stream opened after")
            assert (a.host_ids, b.host_ids) == (["host-0"], ["host-0"])

            # The same call id from both replicas, each its own stdin, the pieces interleaved.
            for replica_, name in ((a, "a"), (b, "b")):
                first = host_pb2.SessionExec(argv=["cat"], stdin=data[name][:PIECE],
                                             stdin_follows=True)  # fmt: skip
                replica_.commands.put_nowait(
                    host_pb2.SessionCommand(call_id="c-1", work_id=WORK_ID, exec=first)
                )
            await until("both calls' first pieces held", lambda: _pending(host, 2))
            for replica_, name in ((a, "a"), (b, "b")):
                rest = host_pb2.SessionStdin(data=data[name][PIECE:], eof=True)
                replica_.commands.put_nowait(
                    host_pb2.SessionCommand(call_id="c-1", work_id=WORK_ID, stdin=rest)
                )
            await _event(a.done, "a's answer")
            await _event(b.done, "b's answer")
        finally:
            stop.set()
            host.close_all("the test ended")
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    assert a.said() == (data["a"], []) and b.said() == (data["b"], [])
    assert {r.call_id for r in a.replies + b.replies} == {"c-1"}


async def _pending(host: SessionHost, count: int) -> bool:
    return sum(len(stream.stdin) for stream in host._streams) == count


class Flaky:
    """A replica's stub whose first `down` session streams go to an address nothing listens
    on (the replica is down), and the rest to `up`."""

    def __init__(self, dead: host_pb2_grpc.HostServiceStub, up: host_pb2_grpc.HostServiceStub,
                 down: int) -> None:  # fmt: skip
        self.dead, self.up, self.down = dead, up, down
        self.tries = 0

    def SessionCommands(self, replies: AsyncIterator[host_pb2.SessionReply]) -> Any:
        self.tries += 1
        return (self.dead if self.tries <= self.down else self.up).SessionCommands(replies)


async def test_a_replica_out_of_reach_is_logged_once_and_its_stream_comes_back() -> None:
    host = SessionHost("host-0")
    stop = asyncio.Event()
    async with scripted() as (back, stub), grpc.aio.insecure_channel(DEAD) as nowhere:
        flaky = Flaky(host_pb2_grpc.HostServiceStub(nowhere), stub, down=3)
        with capture_logs() as logs:
            task = asyncio.create_task(host.serve(flaky, stop, "b"))
            try:
                await _event(back.hello, "the stream open again once its replica is back")
            finally:
                stop.set()
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    said = [e for e in logs if str(e["event"]).startswith("session_stream")]
    assert [e["event"] for e in said] == ["session_stream_lost", "session_stream_restored"]
    assert said[0]["code"] == "UNAVAILABLE" and said[0]["server"] == "b"
    assert flaky.tries == 4 and back.host_ids == ["host-0"]
