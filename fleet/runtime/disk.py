"""A machine's writable layer bounded in size, on the namespace runtime.

Where a Smolfile sets `overlay` or `storage` (GiB; the smaller where both are set), the
machine's writable layer (and, for a warm parent, its children's layers and their control
directory) lives on a filesystem of that size: a sparse ext4 file in the machine's directory,
mounted by loop at `disk/`. A write past it fails inside the machine with ENOSPC ("No space
left on device"); the host's disk holds no more for the machine than it wrote. A warm parent's
children share their parent's bound: the parent and its live children together write at most
that much (a parent serves one tenant only; a per-child disk would cost each child the 10 ms
below). Made in about 10 ms (an ext4 with no journal, its inode tables set up lazily): the
machine's layer is thrown away with it, and nothing in it outlives the host.

Without either key the machine gets the runtime's default bound (`DEFAULT_DISK_GIB` in
`namespace.py`, 10 GiB; `fleet agent --default-disk-gib`); an agent started with 0 there keeps
such layers in the machine's directory, bounded by nothing but the host's disk.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import structlog

from fleet.core.errors import FailedPrecondition
from fleet.core.smolfile import Smolfile

DEFAULT_DISK_GIB = 10
"""A namespace machine's writable layer where its Smolfile bounds none, in GiB."""

log = structlog.get_logger(__name__)

IMAGE = "disk.img"
MOUNT = "disk"


def bound_gib(smolfile: Smolfile) -> int | None:
    """The writable layer's size the Smolfile asks for, in GiB (None: no bound asked)."""
    asked = [v for v in (smolfile.overlay, smolfile.storage) if v is not None]
    return min(asked) if asked else None


def _run(argv: list[str], what: str) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FailedPrecondition(f"{what}: {exc}") from exc
    if done.returncode != 0:
        raise FailedPrecondition(f"{what}: {(done.stderr or done.stdout).strip()[-500:]}")


def _mount(image: Path, point: Path, what: str) -> None:
    _run(["mount", "-o", "loop,nosuid,nodev", str(image), str(point)], what)


def make(root: Path, gib: int) -> Path:
    """Makes and mounts `root`'s bounded disk of `gib` GiB; returns where it is mounted."""
    image, point = root / IMAGE, root / MOUNT
    point.mkdir(exist_ok=True)
    with open(image, "wb") as f:
        f.truncate(gib << 30)
    what = f"machine {root.name}: cannot make its {gib} GiB disk"
    try:
        _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal",
              "-E", "lazy_itable_init=1,nodiscard", str(image)], what)  # fmt: skip
        _mount(image, point, what)
    except FailedPrecondition:
        image.unlink(missing_ok=True)
        raise
    os.chmod(point, 0o700)
    return point


def size_gib(root: Path) -> int | None:
    """The size of `root`'s bounded disk in GiB (None: it has none)."""
    try:
        return (root / IMAGE).stat().st_size >> 30
    except OSError:
        return None


def attach(root: Path) -> Path | None:
    """For a machine found on disk (adopted after an agent restart): where its bounded disk is
    mounted, mounting it again if it is not (None: it has none)."""
    image, point = root / IMAGE, root / MOUNT
    if not image.exists():
        return None
    if not os.path.ismount(point):
        _mount(image, point, f"machine {root.name}: cannot mount its disk again")
    return point


def remove(root: Path) -> None:
    """Unmounts `root`'s bounded disk (if mounted: lazily, so a process that still holds it
    cannot stop the removal; its loop device goes with the last user) and deletes its file."""
    point = root / MOUNT
    if os.path.ismount(point):
        try:
            _run(["umount", "--lazy", str(point)], f"machine {root.name}: cannot unmount its disk")
        except FailedPrecondition as exc:  # its loop device stays until the host's next boot
            log.warning("disk_unmount_failed", machine=root.name, error=exc.message)
    (root / IMAGE).unlink(missing_ok=True)
