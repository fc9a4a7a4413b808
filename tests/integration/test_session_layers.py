"""A namespace machine's writable layer archived and unpacked (what a parked session keeps of
its machine): a new machine made from it has the files, deletions and replaced directories
the first one made; an archive `pack` could not have made is refused before anything of it
is written (real machines on the real default image, real tar)."""

from __future__ import annotations

import asyncio
import io
import tarfile
import uuid
from pathlib import Path

import pytest

from fleet.core.errors import FailedPrecondition, Unavailable
from fleet.core.smolfile import parse_smolfile
from fleet.runtime import layers
from fleet.runtime.base import MachineSpec
from fleet.runtime.namespace import NamespaceRuntime
from fleet.runtime.namespace_machine import NamespaceMachine

WRITE = (
    "mkdir -p /work && printf 'kept across the move\\n' > /work/notes.txt && "
    "chmod 0600 /work/notes.txt && ln -s /work/notes.txt /work/link && "
    "rm /etc/os-release && rm -rf /usr/share/doc && mkdir /usr/share/doc && "
    "echo only > /usr/share/doc/only"
)
READ = (
    "cat /work/notes.txt; stat -c %a /work/notes.txt; readlink /work/link; "
    "test -e /etc/os-release && echo os-release-back; ls /usr/share/doc"
)


def _spec(rootfs: Path, tmp_path: Path) -> MachineSpec:
    return MachineSpec(
        name=f"t-{uuid.uuid4().hex[:8]}", smolfile=parse_smolfile('image = "minimal"\n').spec,
        image_digest="sha256:x", rootfs=rootfs, labels={"fleet": "test", "case": tmp_path.name},
    )  # fmt: skip


async def _sh(machine: NamespaceMachine, command: str) -> str:
    done = await machine.exec(["/bin/sh", "-c", command], timeout_s=60)
    assert done.exit_code == 0, done.stderr
    return done.stdout.decode()


def test_a_machine_made_from_an_unpacked_layer_has_what_the_first_one_wrote(
    rootfs: Path, tmp_path: Path
) -> None:
    runtime = NamespaceRuntime(tmp_path / "machines")

    async def body() -> str:
        first = await runtime.create(_spec(rootfs, tmp_path))
        try:
            await _sh(first, WRITE)
            size = await first.pack_layer(tmp_path / "layer.tar", tmp_path / "scratch")
            assert size > 0
        finally:
            await first.delete()
        with pytest.raises(Unavailable, match="deleted"):  # (nothing left to pack)
            await first.pack_layer(tmp_path / "again.tar", tmp_path / "scratch")
        await asyncio.to_thread(layers.unpack, tmp_path / "layer.tar", tmp_path / "unpacked")
        second = await runtime.create(_spec(rootfs, tmp_path), copy_of=tmp_path / "unpacked")
        try:
            return await _sh(second, READ)
        finally:
            await second.delete()

    said = asyncio.run(body())
    assert said.splitlines() == ["kept across the move", "600", "/work/notes.txt", "only"]


def _archive(tmp_path: Path, *members: tuple[tarfile.TarInfo, bytes]) -> Path:
    path = tmp_path / f"hostile-{uuid.uuid4().hex[:6]}.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)
    return path


def _member(name: str, kind: bytes = tarfile.REGTYPE, **fields: object) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    for key, value in fields.items():
        setattr(info, key, value)
    return info


@pytest.mark.parametrize(
    ("members", "why"),
    [
        ([(_member("../escape"), b"x")], "not a path beneath the layer"),
        ([(_member("/etc/passwd"), b"x")], "not a path beneath the layer"),
        (
            [
                (_member("etc", tarfile.SYMTYPE, linkname="/etc"), b""),
                (_member("etc/passwd"), b"owned\n"),
            ],
            "which is not a directory",
        ),
        ([(_member("disk", tarfile.CHRTYPE, devmajor=8, devminor=0), b"")], "device"),
        ([(_member("pipe", tarfile.FIFOTYPE), b"")], "device, fifo"),
        ([(_member("shadow", tarfile.LNKTYPE, linkname="etc/shadow"), b"")], "hard link"),
    ],
)
def test_an_archive_pack_could_not_have_made_is_refused_before_anything_is_written(
    tmp_path: Path, members: list[tuple[tarfile.TarInfo, bytes]], why: str
) -> None:
    archive = _archive(tmp_path, *members)
    dest = tmp_path / "dest"
    with pytest.raises(FailedPrecondition, match=why):
        layers.unpack(archive, dest)
    assert not dest.exists() or not any(dest.iterdir())
    assert not (tmp_path / "escape").exists()
