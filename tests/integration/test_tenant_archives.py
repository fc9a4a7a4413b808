"""Archives a tenant hands fleet write nothing outside where they belong: an input's tar on the
agent's host, a directory output's stream (made by whatever `tar` the workload put on the
machine's PATH) on the downloader's machine; and a step that prints without end cannot fill
the agent's disk."""

from __future__ import annotations

import asyncio
import os
import stat
import tarfile
from pathlib import Path

import pytest

from fleet.agent import files
from fleet.api.pb import fleet_pb2, fleet_pb2_grpc, host_pb2, types_pb2
from fleet.cli import client
from fleet.core.errors import FleetError
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from fleet.safepath import UnsafeArchive
from tests.hostile_tars import Entry, chain_escape, tar_bytes
from tests.integration.harness import harness, namespace_runtime, request

HOST_FILE = b"a file of the host, not the tenant's\n"
NOT_OK = {types_pb2.ROLLOUT_STATE_FAILED, types_pb2.ROLLOUT_STATE_QUARANTINED}


def sentinel_beside(root: Path) -> Path:
    """`root/outside/sentinel`, which a hostile archive unpacked below `root` aims at."""
    (root / "outside").mkdir()
    sentinel = root / "outside" / "sentinel"
    sentinel.write_bytes(HOST_FILE)
    return sentinel


@pytest.mark.sandbox
async def test_a_hostile_input_tar_writes_nothing_outside_its_staging_directory(
    tmp_path: Path, images: ImageStore
) -> None:
    """The agent stages a directory input at `<tmp>/inputs/<work id>/0` (three levels below
    `<tmp>`): a symlink chain past PATH_MAX then a hard link through it, an absolute name and
    a `..` name are each refused, and the host file they aim at stays as it was."""
    sentinel = sentinel_beside(tmp_path)
    tars = {
        "chain": tar_bytes(chain_escape(3, "outside/sentinel", b"written by a tenant\n")),
        "absolute": tar_bytes([Entry(str(sentinel), data=b"written by a tenant\n")]),
        "dotdot": tar_bytes([Entry("ok.txt"), Entry("../../../outside/sentinel", data=b"x")]),
    }
    finals = {}
    async with harness(tmp_path, images, secure=True, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        async with h.connect(h.key("team-a")) as channel:
            stub = fleet_pb2_grpc.FleetServiceStub(channel)
            for name, data in tars.items():
                archive = tmp_path / f"{name}.tar"
                archive.write_bytes(data)
                entry = await client.upload(stub, archive, "/data/in", False)
                entry.directory = True  # the bytes as a directory's tar, as a client sends one
                req = request('image = "minimal"\n', ["ls", "-R", "/data/in"])
                req.inputs.append(entry)
                rid = (await stub.SubmitRollout(req)).rollout.id
                finals[name] = await h.wait_final(rid)

    assert sentinel.read_bytes() == HOST_FILE
    assert sorted(os.listdir(tmp_path / "outside")) == ["sentinel"]
    for name, final in finals.items():
        assert final.state in NOT_OK, (name, final.error)
        assert "input /data/in: refused" in final.error, (name, final.error)
    assert "'..' is refused" in finals["dotdot"].error
    assert "absolute names are refused" in finals["absolute"].error


STAND_IN_TAR = r"""
set -e
mkdir -p /out/evil /out/good /out/strip /usr/local/bin
echo fine > /out/good/a.txt
cat > /usr/local/bin/tar <<'EOF'
#!/bin/sh
# fleet runs: tar -cf - -C PATH .
case "$4" in
  /out/evil) exec cat /in/evil.tar ;;
  /out/strip) exec cat /in/strip.tar ;;
esac
exec /bin/tar "$@"
EOF
chmod 755 /usr/local/bin/tar
"""


@pytest.mark.sandbox
async def test_a_stand_in_tar_in_the_machine_does_not_make_the_stored_archive(
    tmp_path: Path, images: ImageStore
) -> None:
    """The workload puts its own `tar` first on the machine's PATH. A stream that escapes is
    refused with an error on that output alone; one with a setuid-root file, a device node
    and a fifo is stored as fleet rewrote it (no setuid bit, no owner, no device, no fifo);
    an honest output beside them is stored as usual; and the download writes nothing
    outside its folder."""
    got = tmp_path / "got"
    got.mkdir()
    sentinel = sentinel_beside(tmp_path)  # two levels above got/evil
    evil = tmp_path / "evil.tar"
    evil.write_bytes(tar_bytes(chain_escape(2, "outside/sentinel", b"written by a tenant\n")))
    strip = tmp_path / "strip.tar"
    strip.write_bytes(
        tar_bytes([
            Entry("./", tarfile.DIRTYPE, mode=0o755),
            Entry("./su", data=b"#!/bin/sh\n", mode=0o4755, uid=0),
            Entry("./null", tarfile.CHRTYPE, mode=0o666),
            Entry("./pipe", tarfile.FIFOTYPE, mode=0o644),
            Entry("./again", tarfile.LNKTYPE, link="./su"),
            Entry("./near", tarfile.SYMTYPE, link="su"),
        ])
    )  # fmt: skip
    async with harness(tmp_path, images, secure=True, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        async with h.connect(h.key("team-a")) as channel:
            stub = fleet_pb2_grpc.FleetServiceStub(channel)
            req = request('image = "minimal"\n', ["sh", "-c", STAND_IN_TAR])
            req.inputs.append(await client.upload(stub, evil, "/in/evil.tar", False))
            req.inputs.append(await client.upload(stub, strip, "/in/strip.tar", False))
            req.outputs.extend(["/out/evil", "/out/good", "/out/strip"])
            rid = (await stub.SubmitRollout(req)).rollout.id
            final = await h.wait_final(rid)
            written = await client.download(stub, final, got)

    assert final.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, final.error
    by_path = {o.path: o for o in final.outputs}
    assert by_path["/out/evil"].digest == "", "a stream that escapes is never stored"
    assert "refused" in by_path["/out/evil"].error and "link" in by_path["/out/evil"].error
    assert by_path["/out/good"].digest and by_path["/out/strip"].digest
    assert sorted(Path(w).name for w in written) == ["good", "strip"]
    assert (got / "good" / "a.txt").read_text() == "fine\n"
    su = got / "strip" / "su"
    assert su.read_bytes() == b"#!/bin/sh\n" and stat.S_IMODE(su.stat().st_mode) == 0o755
    assert (got / "strip" / "again").stat().st_ino == su.stat().st_ino
    assert os.readlink(got / "strip" / "near") == "su"
    assert sorted(os.listdir(got / "strip")) == ["again", "near", "su"]
    assert sentinel.read_bytes() == HOST_FILE
    assert sorted(os.listdir(tmp_path / "outside")) == ["sentinel"]


async def test_the_client_refuses_a_hostile_stored_archive_and_writes_the_rest(
    tmp_path: Path, images: ImageStore
) -> None:
    """A host that stores whatever it likes (a compromised agent, an older one that stored the
    machine's stream as it came): `download` writes the honest output, refuses the hostile
    one naming it, and writes nothing outside its folder."""
    got = tmp_path / "got"
    got.mkdir()
    sentinel = sentinel_beside(tmp_path)
    evil = tar_bytes(chain_escape(2, "outside/sentinel", b"written by a tenant\n"))
    async with harness(tmp_path, images) as h:
        await h.register_host("h1")
        req = request()
        req.outputs.extend(["/out/evil", "/out/ok.txt"])
        rid = (await h.fleet.SubmitRollout(req)).rollout.id
        claim = await h.hosts.ClaimWork(
            host_pb2.ClaimWorkRequest(request_id="c", host_id="h1", max_items=1, wait_s=5)
        )
        [item] = claim.items
        outputs = []
        for path, data, directory in (("/out/evil", evil, True), ("/out/ok.txt", b"ok\n", False)):
            parts = [
                host_pb2.ArtifactPart(work_id=item.work_id, fencing_token=item.fencing_token),
                host_pb2.ArtifactPart(data=data),
            ]
            stored = await h.hosts.PutArtifact(iter(parts))
            outputs.append(
                types_pb2.OutputArtifact(
                    path=path, digest=stored.digest, size=stored.size, directory=directory
                )
            )
        await h.hosts.CompleteWork(
            host_pb2.CompleteWorkRequest(
                request_id="r", host_id="h1", work_id=item.work_id,
                fencing_token=item.fencing_token, outcome=types_pb2.OUTCOME_SUCCEEDED,
                outputs=outputs,
            )
        )  # fmt: skip
        final = await h.wait_final(rid)
        with pytest.raises(UnsafeArchive) as refused:
            await client.download(h.fleet, final, got)

    assert "output '/out/evil'" in refused.value.message and "1 written" in refused.value.message
    assert (got / "ok.txt").read_bytes() == b"ok\n"
    assert sentinel.read_bytes() == HOST_FILE
    assert sorted(os.listdir(tmp_path / "outside")) == ["sentinel"]


@pytest.mark.sandbox
async def test_a_sessions_download_dir_refuses_a_hostile_stream(
    tmp_path: Path, images: ImageStore
) -> None:
    """`Session.download_dir` reads a tar the session's machine makes with its own `tar`:
    a stand-in that sends an escaping archive is refused (by the server, which rewrites what
    a machine sends, or else by the client's own unpacking), and nothing outside the folder
    is written."""
    from fleet.client import Fleet
    from tests.conftest import SMOLFILES

    sentinel = sentinel_beside(tmp_path)
    evil = tar_bytes(chain_escape(2, "outside/sentinel", b"written by a tenant\n"))
    stand_in = b"#!/bin/sh\nexec cat /root/evil.tar\n"

    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU)

        def drive() -> str:
            with (
                Fleet(h.server.address, plaintext=True) as fleet,
                fleet.session(SMOLFILES / "minimal.smolfile", idle_timeout_s=60) as box,
            ):
                box.write_file("/root/evil.tar", evil)
                box.write_file("/usr/local/bin/tar", stand_in, 0o755)
                try:
                    box.download_dir("/srv", tmp_path / "got" / "srv")
                except FleetError as exc:
                    return exc.message
                return ""

        refusal = await asyncio.to_thread(drive)

    assert "link" in refusal
    assert sentinel.read_bytes() == HOST_FILE
    assert sorted(os.listdir(tmp_path / "outside")) == ["sentinel"]


@pytest.mark.sandbox
async def test_a_steps_spooled_output_stops_at_its_bound_and_says_so(
    tmp_path: Path, images: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the bound at 1 MiB, a step that prints 3 MiB keeps the first MiB on the agent's
    disk and as `step-0.stdout`, which ends with a line saying where and how much was cut;
    the output's `error` says it too."""
    monkeypatch.setattr(files, "MAX_STEP_STREAM_BYTES", 1 << 20, raising=False)
    code = "import sys; sys.stdout.write(''.join(f'{i:07d}\\n' for i in range(3 << 17)))"
    expected = "".join(f"{i:07d}\n" for i in range(3 << 17)).encode()
    async with harness(tmp_path, images, secure=True, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        async with h.connect(h.key("team-a")) as channel:
            stub = fleet_pb2_grpc.FleetServiceStub(channel)
            rid = (
                await stub.SubmitRollout(request('image = "minimal"\n', ["python3", "-c", code]))
            ).rollout.id
            final = await h.wait_final(rid)
            await client.download(stub, final, tmp_path / "got")
            kept = (tmp_path / "got" / "step-0.stdout").read_bytes()
            again = await stub.GetRollout(fleet_pb2.GetRolloutRequest(id=rid))

    assert final.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, final.error
    head, _, tail = kept.partition(b"\n[fleet: ")
    assert head == expected[: 1 << 20]
    assert (
        tail
        == (
            f"cut at {1 << 20} bytes (fleet keeps at most that much of a step's stream): "
            f"{len(expected) - (1 << 20)} more bytes were not kept]\n"
        ).encode()
    )
    [log] = [o for o in again.outputs if o.path == "step-0.stdout"]
    assert log.size == len(kept) and "cut at 1048576 bytes" in log.error
