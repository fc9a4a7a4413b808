"""Moving files to and from a server: inputs uploaded by content, outputs written safely.

These work on a FleetService stub and let gRPC's own errors through: `AsyncFleet` calls them
and turns those into fleet's errors in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import tarfile
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from fleet import safepath
from fleet.client import wire
from fleet.client.models import InputFile, Output, Smolfile
from fleet.core.manifest import image_of
from fleet.image.archive import flatten
from fleet.image.oci import looks_like_archive

CHUNK = 1 << 20
"""Bytes per message of an upload or download."""


def tar_directory(src: Path, out: BinaryIO) -> None:
    """A directory as a tar whose bytes depend on its content only (sorted entries, owner 0),
    so the same tree uploaded twice is stored once."""

    def reset(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(src.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(src)), recursive=False, filter=reset)


async def upload(stub: Any, src: Path, dest: str, directory: bool) -> InputFile:
    """Uploads a file, or a directory as one tar, with PutBlob; the input it makes at `dest`."""
    with tempfile.TemporaryFile() as spool:
        if directory:
            await asyncio.to_thread(tar_directory, src, spool)
            spool.seek(0)
            handle: BinaryIO = spool
        else:
            handle = src.open("rb")

        async def parts() -> AsyncIterator[Any]:
            while data := await asyncio.to_thread(handle.read, CHUNK):
                yield wire.blob_part(data)

        try:
            reply = await stub.PutBlob(parts(), timeout=3600)
        finally:
            if handle is not spool:
                handle.close()
    return InputFile(path=dest, digest=reply.digest, size=reply.size, directory=directory)


async def fetch(stub: Any, rollout_id: str, digest: str, into: BinaryIO) -> int:
    """Writes an input or output of the rollout, by digest, to `into`; returns its size."""
    size = 0
    async for chunk in stub.GetArtifact(wire.artifact_request(rollout_id, digest)):
        await asyncio.to_thread(into.write, chunk.data)
        size += len(chunk.data)
    return size


async def download_outputs(
    stub: Any, rollout_id: str, outputs: Sequence[Output], into: Path
) -> list[str]:
    """Writes each stored output under `into` (a directory's tar unpacked into a folder of its
    name); returns what it wrote.

    A directory's archive is unpacked by `fleet.safepath` (never tarfile's filter): nothing is
    written outside its folder, no link is followed, and no owners, setuid bits, device nodes
    or symlinks pointing out of the folder are made. An output that cannot be written so is
    skipped, the others are still written, and then `UnsafeArchive` names each one refused."""
    written: list[str] = []
    refused: list[str] = []
    os.makedirs(into, exist_ok=True)
    for output in outputs:
        if not output.digest:
            continue
        try:
            name = str(safepath.member_name(Path(output.path).name))
        except safepath.UnsafePath as exc:
            refused.append(f"output {output.path!r}: {exc.message}")
            continue
        with tempfile.TemporaryFile() as spool:
            await fetch(stub, rollout_id, output.digest, spool)
            spool.seek(0)
            try:
                await asyncio.to_thread(write_output, spool, into, name, output.directory)
            except (safepath.UnsafeArchive, safepath.UnsafePath) as exc:
                refused.append(f"output {output.path!r}: {exc.message}")
                continue
        written.append(str(into / name))
    if refused:
        raise safepath.UnsafeArchive(
            f"{len(refused)} output(s) not written under {into} "
            f"({len(written)} written): " + "; ".join(refused)
        )
    return written


def write_output(spool: BinaryIO, into: Path, name: str, directory: bool) -> None:
    """One output at `into/name`: a directory's archive unpacked there, a file's bytes written
    there; never through a link already at that name, never over a directory."""
    if directory:
        fd = safepath.open_dir(into, name, create=True)
        try:
            safepath.extract_tar(spool, fd, safepath.ExtractPolicy())
        finally:
            os.close(fd)
        return
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(into / name).st_mode):
            raise safepath.UnsafePath(f"{into / name}: is a directory")
        os.unlink(into / name)
    fd = safepath.open_file(into, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as out:
        while data := spool.read(CHUNK):
            out.write(data)


def archive_path(smolfile: Smolfile) -> Path | None:
    """The local archive the Smolfile's `image` names (relative to the Smolfile), or None when
    its `image` is a stored image's name or a registry reference."""
    image = image_of(smolfile.parsed)
    if not looks_like_archive(image):
        return None
    return smolfile.base / image


async def upload_image_archive(stub: Any, smolfile: Smolfile) -> str:
    """When the Smolfile's `image` is an archive path: the image flattened here and uploaded;
    its digest ("" for any other `image`)."""
    archive = archive_path(smolfile)
    if archive is None:
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rootfs.tar"
        await asyncio.to_thread(flatten, archive, out)
        entry = await upload(stub, out, "/", False)
    return entry.digest
