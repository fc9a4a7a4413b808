"""Interactive sessions through the real server and a real agent on the namespace runtime:
open, exec (streamed output, stdin, timeouts), files both ways, idle timeout, close, another
tenant refused, a lost host's session failing with UNAVAILABLE."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from fleet.api.pb import fleet_pb2, fleet_pb2_grpc, types_pb2
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from tests.integration.harness import Harness, harness, namespace_runtime, threaded_harness

SMOLFILE = 'image = "minimal"\n'


async def open_session(stub: fleet_pb2_grpc.SessionServiceStub, **kw: object) -> fleet_pb2.Session:
    return await stub.OpenSession(
        fleet_pb2.OpenSessionRequest(smolfile=SMOLFILE, smolfile_name="s.smolfile", **kw)  # type: ignore[arg-type]
    )


async def run(
    stub: fleet_pb2_grpc.SessionServiceStub, session: str, **kw: object
) -> tuple[list[tuple[str, bytes]], types_pb2.ExecExit]:
    chunks: list[tuple[str, bytes]] = []
    exit_ = types_pb2.ExecExit()
    async for out in stub.Exec(fleet_pb2.ExecRequest(session_id=session, **kw)):  # type: ignore[arg-type]
        kind = out.WhichOneof("kind")
        if kind == "exit":
            exit_ = out.exit
        else:
            chunks.append((kind, getattr(out, kind)))
    return chunks, exit_


async def write(
    stub: fleet_pb2_grpc.SessionServiceStub, session: str, path: str, data: bytes
) -> int:
    async def chunks():  # type: ignore[no-untyped-def]
        yield fleet_pb2.WriteFileChunk(session_id=session, path=path, mode=0o600)
        for offset in range(0, len(data), 1 << 20):
            yield fleet_pb2.WriteFileChunk(data=data[offset : offset + (1 << 20)])

    reply = await stub.WriteFile(chunks())
    return int(reply.size)


async def read(stub: fleet_pb2_grpc.SessionServiceStub, session: str, path: str) -> bytes:
    out = bytearray()
    async for chunk in stub.ReadFile(fleet_pb2.ReadFileRequest(session_id=session, path=path)):
        out += chunk.data
    return bytes(out)


def sessions(h: Harness) -> fleet_pb2_grpc.SessionServiceStub:
    return fleet_pb2_grpc.SessionServiceStub(h.channel)


@pytest.mark.sandbox
async def test_a_session_runs_commands_and_moves_files_until_it_is_closed(
    tmp_path: Path, images: ImageStore
) -> None:
    big = os.urandom(5 << 20)
    script = "for i in 1 2 3; do echo out$i; echo err$i >&2; done; read line; echo got:$line"

    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        stub = sessions(h)
        s = await open_session(stub)
        chunks, done = await run(stub, s.id, shell=script, stdin=b"hello\n")
        _, state = await run(stub, s.id, shell="echo kept > /root/state")
        state_again, _ = await run(stub, s.id, argv=["cat", "/root/state"])
        _, slow = await run(stub, s.id, argv=["sleep", "30"], timeout_s=0.5)
        size = await write(stub, s.id, "/root/dir/big.bin", big)
        back = await read(stub, s.id, "/root/dir/big.bin")
        mode, _ = await run(stub, s.id, argv=["stat", "-c", "%a", "/root/dir/big.bin"])
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await read(stub, s.id, "/root/none")
        listed = await stub.ListSessions(fleet_pb2.ListSessionsRequest())
        closed = await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=s.id))
        with pytest.raises(grpc.aio.AioRpcError) as after:
            await run(stub, s.id, argv=["true"])
        rollout = await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=s.id))
        out = {
            "opened": (s.state, s.host_id),
            "chunks": chunks,
            "exit": done.exit_code,
            "state": (state.exit_code, state_again),
            "slow": (slow.timed_out, slow.exit_code),
            "size": size,
            "back": back,
            "mode": mode,
            "missing": missing.value.code(),
            "listed": [(x.id, x.state) for x in listed.sessions],
            "closed": closed.state,
            "after": (after.value.code(), after.value.details()),
            "rollout": (rollout.state, rollout.attempts),
            "machines": list((tmp_path / "machines").glob("cpu-a/*")),
        }

    assert out["opened"] == ("OPEN", "cpu-a")
    # In the order the machine wrote them, each stream whole.
    chunks = out["chunks"]
    assert b"".join(c for k, c in chunks if k == "stdout") == b"out1\nout2\nout3\ngot:hello\n"  # type: ignore[attr-defined]
    assert b"".join(c for k, c in chunks if k == "stderr") == b"err1\nerr2\nerr3\n"  # type: ignore[attr-defined]
    assert out["exit"] == 0
    assert out["state"] == (0, [("stdout", b"kept\n")])  # files persist between calls
    assert out["slow"] == (True, -9)
    assert out["size"] == len(big) and out["back"] == big
    assert out["mode"] == [("stdout", b"600\n")]
    assert out["missing"] == grpc.StatusCode.NOT_FOUND
    assert out["listed"] and out["listed"][0][1] == "OPEN"  # type: ignore[index]
    assert out["closed"] == "CLOSED"
    code, details = out["after"]  # type: ignore[misc]
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "is closed" in details
    assert out["rollout"] == (types_pb2.ROLLOUT_STATE_SUCCEEDED, 1)
    assert out["machines"] == []  # nothing left on the host


async def test_an_idle_session_is_closed(tmp_path: Path, images: ImageStore) -> None:
    async with harness(tmp_path, images) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        stub = sessions(h)
        s = await open_session(stub, idle_timeout_s=1.0, on_idle="close")
        await run(stub, s.id, argv=["true"])
        rollout = await h.wait_final(s.id, timeout_s=30)
        listed = await stub.ListSessions(fleet_pb2.ListSessionsRequest())
        error, state = rollout.error, listed.sessions[0].state

    assert "closed after 1 s without a call" in error and state == "CLOSED"


async def test_another_tenants_session_is_not_there(tmp_path: Path, images: ImageStore) -> None:
    async with harness(tmp_path, images, secure=True) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        mine = fleet_pb2_grpc.SessionServiceStub(h.connect(h.key("team-a")))
        theirs = fleet_pb2_grpc.SessionServiceStub(h.connect(h.key("team-b")))
        s = await open_session(mine, ready_timeout_s=15)
        codes = []
        for call in (
            run(theirs, s.id, argv=["true"]),
            read(theirs, s.id, "/etc/hostname"),
            theirs.CloseSession(fleet_pb2.CloseSessionRequest(session_id=s.id)),
        ):
            try:
                await call
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
        listed = await theirs.ListSessions(fleet_pb2.ListSessionsRequest())
        codes.append(grpc.StatusCode.OK if not listed.sessions else grpc.StatusCode.UNKNOWN)
        _, still = await run(mine, s.id, argv=["true"])
        codes.append(grpc.StatusCode.OK if still.exit_code == 0 else grpc.StatusCode.UNKNOWN)
        await mine.CloseSession(fleet_pb2.CloseSessionRequest(session_id=s.id))
        result = codes

    assert result == [grpc.StatusCode.NOT_FOUND] * 3 + [grpc.StatusCode.OK] * 2


async def test_a_lost_host_fails_the_sessions_next_call_with_unavailable(
    tmp_path: Path, images: ImageStore
) -> None:
    async with harness(tmp_path, images) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        stub = sessions(h)
        s = await open_session(stub)
        _, task = h.agents.pop("cpu-a")
        task.cancel()  # the agent dies: its stream ends with it
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await run(stub, s.id, argv=["true"])
        code, details = info.value.code(), info.value.details() or ""
    # What the killed agent left running ends as a process exit would end it: cancelled, and
    # its clean-up (the machine's deletion) run.
    orphans = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in orphans:
        task.cancel()
    await asyncio.gather(*orphans, return_exceptions=True)

    assert code == grpc.StatusCode.UNAVAILABLE and "host cpu-a" in details
    # Nothing of the session is left on the host: its machine (layer, disk) is gone.
    assert list((tmp_path / "machines").glob("cpu-a/*")) == []


async def fork(
    stub: fleet_pb2_grpc.SessionServiceStub, session: str, count: int, key: str = ""
) -> list[fleet_pb2.Session]:
    reply = await stub.ForkSession(
        fleet_pb2.ForkSessionRequest(
            session_id=session, count=count, ready_timeout_s=60, idempotency_key=key
        )
    )
    return list(reply.sessions)


async def out(stub: fleet_pb2_grpc.SessionServiceStub, session: str, shell: str) -> bytes:
    chunks, done = await run(stub, session, shell=shell)
    assert done.exit_code == 0, chunks
    return b"".join(c for k, c in chunks if k == "stdout")


@pytest.mark.sandbox
async def test_forks_start_from_the_sessions_files_and_go_their_own_ways(
    tmp_path: Path, images: ImageStore
) -> None:
    """ForkSession: each copy sees the source's files as they were, is a session of its own
    (its own machine, name and ledger entry on the same host), and changes in one are seen in
    no other. The same call again (its idempotency key) answers the same forks. A session that
    is closed cannot be forked."""

    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU, slots=4)
        stub = sessions(h)
        s = await open_session(stub)
        await run(
            stub,
            s.id,
            shell="mkdir -p /srv/w && echo base > /srv/w/state && "
            "ln -s state /srv/w/link && rm /etc/issue; chown 1234:5678 /srv/w/state",
        )
        a, b = await fork(stub, s.id, 2, key="two-forks")
        again = [x.id for x in await fork(stub, s.id, 2, key="two-forks")]
        seen = {
            x.id: await out(
                stub,
                x.id,
                "cat /srv/w/link; stat -c %u:%g /srv/w/state; "
                "test -e /etc/issue || echo gone; hostname",
            )
            for x in (s, a, b)
        }
        await run(stub, a.id, shell="echo changed-in-a > /srv/w/state")
        after = {x.id: await out(stub, x.id, "cat /srv/w/state") for x in (s, a, b)}
        listed = {
            x.id: x for x in (await stub.ListSessions(fleet_pb2.ListSessionsRequest())).sessions
        }
        rollout_a = await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=a.id))
        await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=s.id))
        still = await out(stub, b.id, "cat /srv/w/state")  # a fork outlives its source
        with pytest.raises(grpc.aio.AioRpcError) as closed:
            await fork(stub, s.id, 1)
        for x in (a, b):
            await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=x.id))
        r = {
            "forks": [(x.state, x.host_id) for x in (a, b)],
            "ids": {s.id, a.id, b.id},
            "seen": seen,
            "after": after,
            "listed": listed,
            "still": still,
            "labels": dict(rollout_a.labels),
            "closed": closed.value.code(),
            "machines": list((tmp_path / "machines").glob("cpu-a/*")),
            "source": s.id,
            "a": a.id,
            "b": b.id,
            "again": again,
        }

    assert r["again"] == [r["a"], r["b"]]
    assert r["forks"] == [("OPEN", "cpu-a")] * 2 and len(r["ids"]) == 3  # type: ignore[arg-type]
    seen: dict[str, bytes] = r["seen"]  # type: ignore[assignment]
    bodies = {v.rsplit(b"\n", 2)[0] for v in seen.values()}
    assert bodies == {b"base\n1234:5678\ngone"}  # files, a link, owners, a deletion: copied
    assert len({v.rsplit(b"\n", 2)[1] for v in seen.values()}) == 3  # each its own hostname
    after: dict[str, bytes] = r["after"]  # type: ignore[assignment]
    assert after[r["a"]] == b"changed-in-a\n"  # type: ignore[index]
    assert after[r["source"]] == after[r["b"]] == b"base\n"  # type: ignore[index]
    assert r["still"] == b"base\n"
    assert r["labels"]["fleet.fork_of"] == r["source"]  # type: ignore[index]
    assert {r["a"], r["b"]} <= set(r["listed"])  # type: ignore[arg-type]
    assert r["closed"] == grpc.StatusCode.FAILED_PRECONDITION
    assert r["machines"] == []


WARM_SESSION = """image = "minimal"
init = ["date +%s%N > /root/init-stamp"]

[branch]
enabled = true
"""


@pytest.mark.sandbox
async def test_warm_sessions_are_children_of_one_parent_and_fork_copy_on_write(
    tmp_path: Path, images: ImageStore
) -> None:
    """A Smolfile with `[branch] enabled` gives sessions that are a warm parent's children: its
    `init` ran once, in the parent (every session finds the same stamp), exec takes stdin and
    streams output, files move both ways, and forks copy the child's own layer."""
    big = os.urandom(3 << 20)

    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU, slots=4)
        stub = sessions(h)
        opened = [
            await stub.OpenSession(
                fleet_pb2.OpenSessionRequest(smolfile=WARM_SESSION, smolfile_name="warm.smolfile")
            )
            for _ in range(2)
        ]
        stamps = [await out(stub, x.id, "cat /root/init-stamp") for x in opened]
        one = opened[0].id
        chunks, done = await run(
            stub,
            one,
            stdin=b"from stdin\n",
            shell=("for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.1; done; cat"),
        )
        size = await write(stub, one, "/root/big.bin", big)
        back = await read(stub, one, "/root/big.bin")
        [child] = await fork(stub, one, 1)
        forked = await read(stub, child.id, "/root/big.bin")
        await run(stub, child.id, shell="echo fork > /root/mine")
        mine = await run(stub, one, shell="test -e /root/mine")
        rollout = await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=one))
        for x in (*opened, child):
            await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=x.id))
        r = {
            "stamps": stamps,
            "chunks": chunks,
            "exit": done.exit_code,
            "size": size,
            "back": back == big,
            "forked": forked == big,
            "mine": mine[1].exit_code,
            "enforced_by": rollout.egress.enforced_by,
        }

    stamps: list[bytes] = r["stamps"]  # type: ignore[assignment]
    assert stamps[0] == stamps[1] != b""  # init ran once, in the parent
    chunks: list[tuple[str, bytes]] = r["chunks"]  # type: ignore[assignment]
    assert b"".join(c for k, c in chunks if k == "stdout") == b"out1\nout2\nout3\nfrom stdin\n"
    assert b"".join(c for k, c in chunks if k == "stderr") == b"err1\nerr2\nerr3\n"
    assert len(chunks) > 2  # streamed as written, not handed over whole at the end
    assert r["exit"] == 0 and r["size"] == len(big) and r["back"] and r["forked"]
    assert r["mine"] == 1  # the fork's change is its own
    assert "not a warm parent's child" not in str(r["enforced_by"])


@pytest.mark.parametrize("smolfile", [SMOLFILE, WARM_SESSION], ids=["cold", "warm"])
@pytest.mark.sandbox
async def test_a_sessions_calls_share_one_box(
    tmp_path: Path, images: ImageStore, smolfile: str
) -> None:
    """A session's commands run through one command server in its machine, as on an ordinary
    box: /tmp keeps its files, a process left in the background keeps running (and does not
    hold the call up), and a command that kills every process it can does not end the
    session: the next call runs."""

    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        stub = sessions(h)
        s = await stub.OpenSession(
            fleet_pb2.OpenSessionRequest(smolfile=smolfile, smolfile_name="s.smolfile")
        )
        codes = []
        for shell in (
            "echo kept > /tmp/a && (sleep 300 > /dev/null 2>&1 & echo $! > /tmp/pid)",
            'test "$(cat /tmp/a)" = kept && kill -0 "$(cat /tmp/pid)"',
            "sleep 300 & echo started",  # (holds stdout: the call returns all the same)
            "kill -9 -1; true",
            "echo alive",
        ):
            _, done = await run(stub, s.id, shell=shell, timeout_s=30)
            codes.append(done.exit_code)
        await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=s.id))
        codes = codes

    assert codes[:3] == [0, 0, 0] and codes[4] == 0


@pytest.mark.sandbox
async def test_a_sessions_commands_run_as_the_smolfiles_user(
    tmp_path: Path, images: ImageStore
) -> None:
    """`user = "nobody"`: every command of the session (through its resident server) runs as
    that user with its groups and home; files it writes are its own."""

    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        stub = sessions(h)
        smolfile = 'image = "minimal"\nuser = "nobody"\n'
        s = await stub.OpenSession(
            fleet_pb2.OpenSessionRequest(smolfile=smolfile, smolfile_name="u.smolfile")
        )
        seen = await out(
            stub,
            s.id,
            "id -u; id -g; echo $HOME; touch /tmp/mine; stat -c %U /tmp/mine; "
            "touch /root/x 2>/dev/null || echo refused",
        )
        await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=s.id))
        result = seen

    assert result == b"65534\n65534\n/nonexistent\nnobody\nrefused\n"


@pytest.fixture(scope="module")
def live_fleet(tmp_path_factory: pytest.TempPathFactory, images: ImageStore) -> Iterator[str]:
    """A server and one cpu agent on a thread of their own; the server's address."""

    async def prepare(h: Harness) -> None:
        await h.start_agent("cpu-a", HostClass.CPU)

    with threaded_harness(
        tmp_path_factory.mktemp("live-sessions"), images, prepare, runtime=namespace_runtime
    ) as address:
        yield address


@pytest.mark.sandbox
def test_the_typed_client_drives_rollouts_and_sessions(live_fleet: str, tmp_path: Path) -> None:
    from fleet.client import Fleet
    from fleet.core.errors import FailedPrecondition, NotFound
    from tests.conftest import SMOLFILES

    smolfile = SMOLFILES / "minimal.smolfile"
    tmp = str(tmp_path)
    with Fleet(live_fleet, plaintext=True) as fleet:
        rollout = fleet.submit(smolfile, [["echo", "hi"], "echo $((6 * 7))"], labels={"t": "c"})
        done = fleet.wait(rollout.id, timeout_s=120)
        assert done.state == "SUCCEEDED" and [r.stdout for r in done.results] == [b"hi\n", b"42\n"]
        assert [e.state for e in fleet.watch(rollout.id)][-1] == "SUCCEEDED"
        assert rollout.id in [r.id for r in fleet.list(labels={"t": "c"})]
        keys = [f"{tmp}-many-{i}" for i in range(3)]
        many = fleet.submit_many(smolfile, [[f"echo {i}"] for i in range(3)], idempotency_keys=keys)
        assert fleet.submit_many(smolfile, [[f"echo {i}"] for i in range(3)],
                                 idempotency_keys=keys) == many  # fmt: skip
        outs = [fleet.wait(rid, timeout_s=120).results[0].stdout for rid in many]
        assert outs == [b"0\n", b"1\n", b"2\n"]
        with pytest.raises(NotFound):
            fleet.get("r-0000000000000000")
        seen: list[tuple[str, bytes]] = []
        with fleet.session(smolfile, idle_timeout_s=60) as box:
            assert box.write_file("/root/task.py", b"print(6 * 7)") == 12
            result = box.exec(
                ["python3", "/root/task.py"], on_output=lambda s, c: seen.append((s, c))
            )
            assert result.ok and result.stdout == b"42\n" and seen == [("stdout", b"42\n")]
            assert box.exec("exit 3").exit_code == 3
            assert box.read_file("/root/task.py") == b"print(6 * 7)"
            tree = Path(tmp) / "tree"
            (tree / "sub").mkdir(parents=True)
            (tree / "sub" / "a.txt").write_bytes(b"A")
            (tree / "b.bin").write_bytes(bytes(range(256)) * 4096)
            box.upload_dir(tree, "/srv/tree")
            assert box.exec("cat /srv/tree/sub/a.txt").stdout == b"A"
            back = box.download_dir("/srv/tree", Path(tmp) / "back")
            assert "sub/a.txt" in back
            assert (Path(tmp) / "back" / "b.bin").read_bytes() == (tree / "b.bin").read_bytes()
            with pytest.raises(NotFound):
                box.download_dir("/srv/none", Path(tmp) / "none")
            [copy] = box.fork()
            with copy:
                assert copy.exec(["python3", "/root/task.py"]).stdout == b"42\n"
            session_id = box.id
        assert (session_id, "CLOSED", "") in fleet.sessions()
        with pytest.raises(FailedPrecondition, match="is closed"):
            box.exec(["true"])


@pytest.mark.sandbox
async def test_the_async_client_works_the_same_from_an_event_loop(live_fleet: str) -> None:
    from fleet.client_async import AsyncFleet
    from tests.conftest import SMOLFILES

    async with AsyncFleet(live_fleet, plaintext=True) as fleet:
        async with await fleet.session(SMOLFILES / "minimal.smolfile") as box:
            await box.write_file("/root/a.txt", b"async\n")
            out = (await box.exec(["cat", "/root/a.txt"])).stdout
        rollout = await fleet.submit(SMOLFILES / "minimal.smolfile", ["true"])
        states = [e.state async for e in fleet.watch(rollout.id)]
        final, session_state = (await fleet.wait(rollout.id)).state, (await fleet.get(box.id)).state

    assert out == b"async\n"
    assert states[-1] == "SUCCEEDED" and final == "SUCCEEDED"
    assert session_state == "SUCCEEDED"  # (a closed session's rollout)


@pytest.mark.sandbox
def test_the_session_cli(live_fleet: str, tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.conftest import SMOLFILES

    def cli(*argv: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "fleet.cli.main", "session", *argv[:1], "--server",
             live_fleet, "--plaintext", *argv[1:]],
            input=stdin, capture_output=True, timeout=120,
        )  # fmt: skip

    opened = cli("open", "-s", str(SMOLFILES / "minimal.smolfile"))
    assert opened.returncode == 0, opened.stderr
    session_id = opened.stdout.decode().strip()
    (tmp_path / "in.txt").write_bytes(b"payload\n")
    assert cli("cp", str(tmp_path / "in.txt"), f"{session_id}:/root/in.txt").returncode == 0
    ran = cli("exec", session_id, "--", "sh", "-c", "tr a-z A-Z < /root/in.txt; exit 5")
    assert ran.returncode == 5 and ran.stdout == b"PAYLOAD\n"
    piped = cli("exec", "--stdin", session_id, "--", "wc", "-c", stdin=b"12345")
    assert piped.returncode == 0 and piped.stdout.strip() == b"5"
    assert cli("cp", f"{session_id}:/root/in.txt", str(tmp_path / "out.txt")).returncode == 0
    assert (tmp_path / "out.txt").read_bytes() == b"payload\n"
    (tmp_path / "dir" / "deep").mkdir(parents=True)
    (tmp_path / "dir" / "deep" / "f").write_bytes(b"deep\n")
    assert cli("cp", str(tmp_path / "dir"), f"{session_id}:/srv/dir").returncode == 0
    got = cli("cp", "-r", f"{session_id}:/srv/dir", str(tmp_path / "dir-back"))
    assert got.returncode == 0, got.stderr
    assert (tmp_path / "dir-back" / "deep" / "f").read_bytes() == b"deep\n"
    forked = cli("fork", session_id)
    assert forked.returncode == 0, forked.stderr
    copy_id = forked.stdout.decode().strip()
    assert copy_id.startswith("r-") and copy_id != session_id
    copied = cli("exec", copy_id, "--", "cat", "/root/in.txt")
    assert copied.returncode == 0 and copied.stdout == b"payload\n"
    assert cli("close", copy_id).returncode == 0
    listed = cli("list")
    assert session_id in listed.stdout.decode() and "OPEN" in listed.stdout.decode()
    closed = cli("close", session_id)
    assert closed.returncode == 0 and b"CLOSED" in closed.stdout
    refused = cli("exec", session_id, "--", "true")
    assert refused.returncode == 2 and b"is closed" in refused.stderr


@pytest.mark.sandbox
def test_a_real_inspect_ai_evaluation_runs_its_tool_calls_in_fleet_sessions(
    live_fleet: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """inspect_ai.eval with its mock model and `sandbox="fleet"`: each sample's bash tool call
    runs in a fleet session of its own, the scorer reads back the file it wrote, and the
    ledger holds one closed session per sample."""
    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample
    from inspect_ai.model import ModelOutput, ModelUsage, get_model
    from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer
    from inspect_ai.solver import TaskState, generate, use_tools
    from inspect_ai.tool import bash
    from inspect_ai.util import sandbox

    from fleet.client import Fleet
    from tests.conftest import SMOLFILES

    monkeypatch.setenv("FLEET_SERVER", live_fleet)
    monkeypatch.setenv("FLEET_KEY", "")
    monkeypatch.setenv("FLEET_HOME", str(tmp_path / "home"))  # no CA there: plain gRPC

    def agent(messages, tools, tool_choice, config):  # type: ignore[no-untyped-def]
        if messages[-1].role == "tool":
            output = ModelOutput.from_content(model="mockllm", content="done")
        else:
            word = str(messages[-1].text).split()[-1]
            command = f"echo {word} > answer.txt && hostname > where.txt"
            output = ModelOutput.for_tool_call("mockllm", "bash", {"command": command})
        # (usage given: the mock model would otherwise count tokens with an encoding it
        # downloads, and nothing is downloaded here)
        output.usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)
        return output

    @scorer(metrics=[accuracy()])
    def wrote_the_answer():  # type: ignore[no-untyped-def]
        async def score(state: TaskState, target: Target) -> Score:
            written = (await sandbox().read_file("answer.txt")).strip()
            where = (await sandbox().read_file("/root/where.txt")).strip()
            ok = written == target.text
            return Score(value=CORRECT if ok else INCORRECT, answer=written, explanation=where)

        return score

    words = ["apple", "banana", "cherry"]
    task = Task(
        dataset=[Sample(input=f"write {w}", target=w) for w in words],
        solver=[use_tools([bash(timeout=60)]), generate()],
        scorer=wrote_the_answer(),
        sandbox=("fleet", str(SMOLFILES / "minimal.smolfile")),
    )
    logs = eval(
        task, model=get_model("mockllm/model", custom_outputs=agent),
        log_dir=str(tmp_path / "logs"), display="none",
    )  # fmt: skip
    log = logs[0]
    assert log.status == "success", (
        log.error,
        [[repr(m)[:600] for m in sample.messages] for sample in (log.samples or [])],
    )
    assert log.results is not None
    assert log.results.scores[0].metrics["accuracy"].value == 1.0
    assert log.samples is not None
    hosts = {s.scores["wrote_the_answer"].explanation for s in log.samples}  # type: ignore[index]
    with Fleet(live_fleet, plaintext=True) as fleet:
        sessions = [s for s in fleet.sessions()]
        labelled = [r for r in fleet.list(labels={"fleet.session": "1"})
                    if r.labels.get("inspect.task")]  # fmt: skip
    # One session per sample, each its own machine (its hostname), all closed at the end.
    assert len(labelled) == 3 and len(hosts) == 3
    assert all(state == "CLOSED" for sid, state, _ in sessions if sid in {r.id for r in labelled})
