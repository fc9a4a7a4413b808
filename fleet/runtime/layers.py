"""A namespace machine's writable layer as one archive: what a parked session keeps of its
machine, and what a machine made later (on any host) starts from.

The layer is the overlay's upper directory: the files the machine wrote, the overlay's
whiteouts (character devices 0/0: what it deleted from the image) and its marks in extended
attributes (`trusted.overlay.opaque`: a directory it replaced whole). `pack` copies the layer
first with `view.copy_layer` (the fork's copy: it walks by directory fds and never follows a
link the machine made, while the machine may still run), then archives the copy with GNU tar
(pax, extended attributes and numeric owners kept).

`unpack` is the other way, into an empty directory that a new machine then copies as a fork
copies its source's layer (`NamespaceRuntime.create(spec, copy_of=...)`). Everything here runs
as the host's root, and the archive's content is a tenant's: before tar extracts anything,
every member is checked (a relative name with no `..`, nothing beneath a link or a file of the
same archive, a hard link only to a file earlier in it, a device only as a whiteout) and the
whole is bounded, so that extraction never writes outside the directory or makes a device.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path, PurePosixPath

import structlog

from fleet import safepath
from fleet.core.errors import FailedPrecondition
from fleet.runtime.view import copy_layer

log = structlog.get_logger(__name__)

LAYER_LIMITS = safepath.Limits(max_members=2_000_000, max_bytes=64 << 30, max_name=4096,
                               max_depth=512)  # fmt: skip
"""An archived layer, at most: as a fork's copy is bounded by its source's disk, a layer is
bounded by the disk it came from; these keep a hostile archive's walk finite."""
TAR_TIMEOUT_S = 3600.0
_TAR_FLAGS = ["--format=pax", "--xattrs", "--xattrs-include=*", "--numeric-owner"]


def _tar(argv: list[str], what: str) -> None:
    try:
        done = subprocess.run(
            ["tar", *argv], capture_output=True, text=True, timeout=TAR_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FailedPrecondition(f"{what}: {exc}") from exc
    if done.returncode != 0:
        raise FailedPrecondition(f"{what}: tar: {(done.stderr or done.stdout).strip()[-500:]}")


def pack(upper: Path, archive: Path, scratch: Path) -> int:
    """Archives the writable layer `upper` into `archive` (made anew); `scratch` (an empty or
    missing directory) holds the layer's copy meanwhile. Returns the archive's size."""
    copy = scratch / "layer"
    copy.mkdir(parents=True, mode=0o700)
    try:
        copy_layer(upper, copy)
        _tar(["--create", "--file", str(archive), *_TAR_FLAGS, "-C", str(copy), "."],
             f"cannot archive the writable layer {upper}")  # fmt: skip
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    size = archive.stat().st_size
    log.info("layer_packed", layer=str(upper), archive=str(archive), bytes=size)
    return size


def _member_path(name: str) -> PurePosixPath:
    path = PurePosixPath(name)
    parts = [p for p in path.parts if p != "."]
    if path.is_absolute() or ".." in parts:
        raise safepath.UnsafeArchive(f"member {name[:200]!r} is not a path beneath the layer")
    return PurePosixPath(*parts) if parts else PurePosixPath(".")


def check(archive: Path, limits: safepath.Limits = LAYER_LIMITS) -> int:
    """Raises UnsafeArchive unless every member of `archive` is one `pack` could have made;
    returns how many bytes of file content it holds."""
    members = 0
    total = 0
    kinds: dict[PurePosixPath, str] = {}
    with tarfile.open(archive, "r:") as tar:
        for member in tar:
            members += 1
            if members > limits.max_members:
                raise safepath.UnsafeArchive(f"more than {limits.max_members} members")
            if len(member.name.encode()) > limits.max_name:
                raise safepath.UnsafeArchive(f"a member name over {limits.max_name} bytes")
            path = _member_path(member.name)
            if len(path.parts) > limits.max_depth:
                raise safepath.UnsafeArchive(f"{member.name[:200]!r} is deeper than allowed")
            for parent in path.parents:
                if kinds.get(parent, "dir") != "dir":
                    raise safepath.UnsafeArchive(
                        f"{member.name[:200]!r} lies beneath {str(parent)!r}, which is not a "
                        "directory"
                    )
            if member.isdir():
                kind = "dir"
            elif member.isreg():
                kind = "file"
                total += member.size
                if total > limits.max_bytes:
                    raise safepath.UnsafeArchive(f"more than {limits.max_bytes} bytes of files")
            elif member.issym():
                kind = "link"
            elif member.islnk():
                if kinds.get(_member_path(member.linkname)) != "file":
                    raise safepath.UnsafeArchive(
                        f"hard link {member.name[:200]!r} names no file earlier in the archive"
                    )
                kind = "file"
            elif member.ischr() and member.devmajor == 0 and member.devminor == 0:
                kind = "whiteout"
            else:
                raise safepath.UnsafeArchive(
                    f"{member.name[:200]!r} is a device, fifo or other special file; a layer "
                    "holds only files, directories, links and whiteouts"
                )
            if path in kinds and (kinds[path] == "dir") != (kind == "dir"):
                raise safepath.UnsafeArchive(f"{member.name[:200]!r} appears twice, as two kinds")
            kinds[path] = kind
    return total


def unpack(archive: Path, dest: Path, limits: safepath.Limits = LAYER_LIMITS) -> None:
    """Unpacks a layer archived by `pack` into `dest` (an empty or missing directory), after
    `check` found every member safe (FailedPrecondition naming the first that is not)."""
    try:
        check(archive, limits)
    except safepath.UnsafeArchive as exc:
        why = exc.message
        raise FailedPrecondition(f"layer archive {archive.name} is refused: {why}") from None
    except tarfile.TarError as exc:
        raise FailedPrecondition(f"layer archive {archive.name} is unreadable: {exc}") from None
    dest.mkdir(parents=True, mode=0o700, exist_ok=True)
    if any(os.scandir(dest)):
        raise FailedPrecondition(f"cannot unpack a layer into {dest}: it is not empty")
    _tar(["--extract", "--file", str(archive), *_TAR_FLAGS, "--same-owner",
          "--same-permissions", "--no-overwrite-dir", "-C", str(dest)],
         f"cannot unpack the layer archive {archive.name}")  # fmt: skip
    log.info("layer_unpacked", archive=str(archive), into=str(dest))
