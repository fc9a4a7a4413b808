"""Forks of a session whose machine left links to host paths in its layer: the copy, made by
the host's root, never follows them (real server, real agent, namespace machines)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fleet.api.pb import fleet_pb2, fleet_pb2_grpc
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from tests.integration.harness import harness, namespace_runtime
from tests.integration.session_support import shell

SMOLFILE = 'image = "minimal"\n'


def _snapshot(top: Path) -> dict[str, tuple[int, bytes]]:
    """Every entry beneath (and including) `top`: its mode and, for a file, its bytes."""
    seen = {".": (os.lstat(top).st_mode, b"")}
    for path in sorted(top.rglob("*")):
        st = os.lstat(path)
        body = path.read_bytes() if stat.S_ISREG(st.st_mode) else b""
        seen[str(path.relative_to(top))] = (st.st_mode, body)
    return seen


@pytest.mark.sandbox
async def test_a_fork_never_follows_the_links_its_source_made_in_etc(
    tmp_path: Path, images: ImageStore
) -> None:
    """One session makes its /etc a link to a host directory, another its /etc/hosts a link to
    a host file (paths that mean nothing inside, everything to the host's root). Forking them
    leaves the host's directory and file byte- and mode-identical, and each fork works, with
    its own fresh /etc files; what the source deleted and an opaque directory it made stay so
    in the fork."""
    host_dir = tmp_path / "host-etc"
    host_dir.mkdir()
    for name in ("hosts", "hostname", "resolv.conf", "keep"):
        (host_dir / name).write_text(f"the host's own {name}\n")
        (host_dir / name).chmod(0o600)
    host_dir.chmod(0o700)
    host_file = tmp_path / "host-hosts"
    host_file.write_text("the host's own hosts file\n")
    host_file.chmod(0o640)
    before = (_snapshot(host_dir), _snapshot(host_file))

    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU, slots=4)
        stub = fleet_pb2_grpc.SessionServiceStub(h.channel)
        dir_link, file_link = [
            await stub.OpenSession(
                fleet_pb2.OpenSessionRequest(smolfile=SMOLFILE, smolfile_name="s.smolfile")
            )
            for _ in range(2)
        ]
        await shell(
            stub, dir_link.id,
            "rm -rf /usr/share/doc && mkdir -p /usr/share/doc && echo mine > /usr/share/doc/new"
            f" && rm /usr/bin/yes && rm -rf /etc && ln -s {host_dir} /etc",
        )  # fmt: skip
        await shell(stub, file_link.id, f"ln -sf {host_file} /etc/hosts")
        forked = []
        for source in (dir_link, file_link):
            reply = await stub.ForkSession(
                fleet_pb2.ForkSessionRequest(session_id=source.id, count=1, ready_timeout_s=60)
            )
            fork = reply.sessions[0]
            seen = await shell(
                stub, fork.id,
                "cat /etc/hostname; grep -c localhost /etc/hosts; test -L /etc || echo etc-dir;"
                " test -e /usr/bin/yes || echo yes-gone; ls /usr/share/doc",
            )  # fmt: skip
            forked.append((fork.id, seen))
            await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=fork.id))
        for source in (dir_link, file_link):
            await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=source.id))

    assert (_snapshot(host_dir), _snapshot(host_file)) == before
    (first, first_seen), (second, second_seen) = forked
    # The first fork's /etc is a directory again (the image's, with fresh files); what its
    # source removed stays removed (a whiteout), and its opaque /usr/share/doc shows only its
    # own file.
    assert first_seen.split(b"\n")[1:] == [b"2", b"etc-dir", b"yes-gone", b"new", b""]
    assert first_seen.split(b"\n")[0] != b"" and first.encode() in first_seen.split(b"\n")[0]
    # The second fork's /etc/hosts is its own file again, the link replaced.
    assert second_seen.split(b"\n")[1:3] == [b"2", b"etc-dir"]
    assert second.encode() in second_seen.split(b"\n")[0] and b"yes-gone" not in second_seen
