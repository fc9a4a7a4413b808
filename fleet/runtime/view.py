"""What a namespace machine sees of the host, and how its directory is laid out: the
capability set it keeps, the parts of /proc and /sys it finds covered, the /etc files that make
it an ordinary box, and the layer and inputs it starts with. (Used by `namespace.py`, which
launches the machine.)"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path

import structlog

from fleet import safepath
from fleet.core.errors import FailedPrecondition, InvalidArgument
from fleet.runtime.base import MachineSpec
from fleet.runtime.cgroups import MachineCgroup

log = structlog.get_logger(__name__)

CAPABILITIES = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
)  # fmt: skip
"""What a machine's root may do (in its own user namespace): the set container runtimes grant
by default, and no more (no CAP_SYS_ADMIN, CAP_NET_ADMIN, CAP_SYS_PTRACE ...)."""
PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")
"""Under a machine's /proc, read-only: a machine's root is the host's root user (in a user
namespace, without capabilities outside it), and the kernel checks host-wide settings under
/proc/sys by that user: writable, `kernel.core_pattern` would run a program of the machine's
choosing as the host's root. bwrap covers only some of these, and not /proc/sys."""
PROC_MASKED = ("kcore", "keys", "timer_list", "sched_debug")
"""Under a machine's /proc, /dev/null in their place: the kernel's memory, the keys and the
host's timers and scheduler, nothing a workload needs."""
SYS_MASKED = ("firmware", "devices/virtual/powercap")
"""Under a machine's /sys, an empty directory in their place: firmware tables and energy
counters (a side channel), as container runtimes mask them."""


def proc_cover() -> list[str]:
    """bwrap arguments, after `--proc /proc`, for PROC_READ_ONLY and PROC_MASKED (those this
    kernel has: a bind needs its target)."""
    args: list[str] = []
    for name in PROC_READ_ONLY:
        args += ["--ro-bind-try", f"/proc/{name}", f"/proc/{name}"]
    for name in _here("/proc", PROC_MASKED):
        args += ["--dev-bind", "/dev/null", f"/proc/{name}"]  # (--ro-bind makes it nodev)
    return args


def sys_cover(cgroup: MachineCgroup) -> list[str]:
    """bwrap arguments for /sys: the host's, read-only, with SYS_MASKED hidden and only the
    machine's own cgroup (its limits, as programs read them) under /sys/fs/cgroup."""
    args = ["--ro-bind", "/sys", "/sys"]
    for name in _here("/sys", SYS_MASKED):
        args += ["--tmpfs", f"/sys/{name}", "--remount-ro", f"/sys/{name}"]
    args += ["--tmpfs", "/sys/fs/cgroup"]
    for controller, directory in cgroup.dirs.items():
        target = "/sys/fs/cgroup" if controller == "all" else f"/sys/fs/cgroup/{controller}"
        args += ["--ro-bind-try", str(directory), target]
    args += ["--remount-ro", "/sys/fs/cgroup"]
    return args


@functools.cache
def _here(base: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """Those of `names` this kernel has under `base` (they do not change while the agent runs)."""
    return tuple(name for name in names if os.path.exists(f"{base}/{name}"))


def etc_files(hostname: str, nameserver: str | None) -> dict[str, str]:
    """/etc/hosts, /etc/hostname and /etc/resolv.conf of a machine: `localhost` and its own name
    resolve; the resolver is its DNS forwarder, or none for a machine without a network."""
    hosts = (
        f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{hostname}\n"
    )
    if nameserver is not None:
        resolv = f"nameserver {nameserver}\noptions ndots:1\n"
    else:
        resolv = "# This machine has no network (its Smolfile asks for no egress).\n"
    return {"hosts": hosts, "hostname": hostname + "\n", "resolv.conf": resolv}


FORK_LIMITS = safepath.Limits(
    max_members=20_000_000, max_bytes=1 << 50, max_name=4096, max_depth=512
)
"""A fork copies its source's layer whole: the source's disk (or the host's) bounds it, not a
count; the depth bound keeps the walk's recursion finite."""
OVERLAY_XATTRS = "trusted.overlay."
"""The overlay's own marks (an opaque directory ...): a copy without them is another tree."""


def lay_out(
    root: Path, layer: Path, spec: MachineSpec, files: Mapping[str, str],
    copy_of: Path | None = None,
) -> None:  # fmt: skip
    """A new machine's directories: its `lower` link to the image, its layer (a copy of the
    writable layer `copy_of`, for a fork) with the files that make it an ordinary box
    (/etc/hosts ...), and its inputs on its own disk (so that its mount table names no host
    path).

    A layer is the machine's own: anything in it may be a link its root made to a host path.
    Everything here runs as the host's root, so every operation on it walks by directory fds
    and never follows a link (`fleet.safepath`)."""
    (root / "lower").symlink_to(spec.rootfs)
    (root / "merged").mkdir()
    for sub in ("upper", "work"):
        (layer / sub).mkdir(exist_ok=True)
    upper = layer / "upper"
    if copy_of is not None:
        try:
            copy_layer(copy_of, upper)
        except (OSError, InvalidArgument) as exc:
            raise FailedPrecondition(
                f"machine {spec.name}: cannot copy its source's layer: {exc}"
            ) from None
    place_etc(upper, spec.rootfs, files)
    for i, (host, _) in enumerate(spec.inputs):
        inputs = layer / "inputs"
        inputs.mkdir(mode=0o755, exist_ok=True)
        if os.path.isdir(host):
            safepath.copy_tree(host, inputs / str(i))
        else:
            source = Path(host)
            fd = safepath.open_file(source.parent, source.name, os.O_RDONLY)
            with os.fdopen(fd, "rb") as reader, open(inputs / str(i), "xb") as writer:
                shutil.copyfileobj(reader, writer)
                os.fchmod(writer.fileno(), stat.S_IMODE(os.fstat(fd).st_mode) & 0o777)


def place_etc(upper: Path, rootfs: Path, files: Mapping[str, str]) -> None:
    """Writes `files` into the layer's /etc, with the image's /etc's mode and times.

    A fork's layer may hold, from its source, an /etc that is a link (to a host directory, as
    the host resolves it) or an /etc/hosts that is one: a link or file where /etc belongs is
    replaced by a directory (the image's /etc then shows through it, with the fresh files), and
    whatever is at each file's name is replaced, never written through."""
    try:
        etc = safepath.open_dir(upper, "etc", create=True)
    except safepath.UnsafePath:
        log.warning("layer_etc_replaced", layer=str(upper), why="not a directory")
        safepath.remove(upper, "etc")
        etc = safepath.open_dir(upper, "etc", create=True)
    try:
        image = _image_etc(rootfs)
        if image is not None:
            os.fchmod(etc, stat.S_IMODE(image.st_mode))
        for name, text in files.items():
            safepath.remove(etc, name)
            safepath.write_bytes(etc, name, text.encode(), 0o644)
        if image is not None:  # (after the writes, which change them)
            os.utime(etc, ns=(image.st_atime_ns, image.st_mtime_ns))
    finally:
        os.close(etc)


def _image_etc(rootfs: Path) -> os.stat_result | None:
    """The image's /etc as it is (None where it is missing or a link: nothing to copy)."""
    try:
        fd = safepath.open_dir(rootfs, "etc")
    except (OSError, InvalidArgument):
        return None
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def copy_layer(src: Path, dst: Path) -> None:
    """A writable layer's copy (a fork's): files, directories and links (copied as links,
    never followed) with owners, modes and times, then the overlay's whiteouts (device 0/0)
    and the extended attributes of directories and files (the overlay's opaque marks, file
    capabilities) that `safepath.copy_tree` leaves out. The source may be in use while it is
    copied: every step holds a directory fd, so a directory swapped for a link is never
    entered, and an entry that changed between the passes is left as the first pass made it."""
    safepath.copy_tree(src, dst, limits=FORK_LIMITS, owners=True, setuid=True)
    src_fd = safepath.open_dir(src, "")
    try:
        dst_fd = safepath.open_dir(dst, "")
        try:
            _copy_marks(src_fd, dst_fd, 0)
            top = os.fstat(src_fd)  # (the layer's root is the machine's /)
            os.fchown(dst_fd, top.st_uid, top.st_gid)
            os.fchmod(dst_fd, stat.S_IMODE(top.st_mode))
            os.utime(dst_fd, ns=(top.st_atime_ns, top.st_mtime_ns))
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)


def _copy_marks(src: int, dst: int, depth: int) -> None:
    """Whiteouts and extended attributes beneath the directory fds `src` and `dst`."""
    if depth > FORK_LIMITS.max_depth:
        raise safepath.UnsafePath(f"a layer deeper than {FORK_LIMITS.max_depth} directories")
    _copy_xattrs(src, dst)
    made = False
    with os.scandir(src) as entries:
        names = [entry.name for entry in entries]
    for name in names:
        try:
            st = os.stat(name, dir_fd=src, follow_symlinks=False)
        except FileNotFoundError:
            continue
        try:
            there = os.stat(name, dir_fd=dst, follow_symlinks=False)
        except FileNotFoundError:
            there = None
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # the overlay's whiteout
            if there is None:
                os.mknod(name, stat.S_IFCHR | stat.S_IMODE(st.st_mode), 0, dir_fd=dst)
                os.chown(name, st.st_uid, st.st_gid, dir_fd=dst, follow_symlinks=False)
                made = True
        elif there is None or stat.S_IFMT(there.st_mode) != stat.S_IFMT(st.st_mode):
            continue  # (changed since it was copied, or not copied: a fifo, a socket)
        elif stat.S_ISDIR(st.st_mode):
            try:
                child_src = safepath.open_dir(src, name)
                child_dst = safepath.open_dir(dst, name)
            except (FileNotFoundError, safepath.UnsafePath):
                continue  # (swapped for something else while it was copied)
            try:
                _copy_marks(child_src, child_dst, depth + 1)
            finally:
                os.close(child_src)
                os.close(child_dst)
        elif stat.S_ISREG(st.st_mode):
            # (the name resolved beneath a directory fd; a last component is never followed)
            _copy_xattrs(f"/proc/self/fd/{src}/{name}", f"/proc/self/fd/{dst}/{name}")
    if made:  # (the whiteouts made changed it)
        mine = os.fstat(src)
        os.utime(dst, ns=(mine.st_atime_ns, mine.st_mtime_ns))


def _copy_xattrs(src: str | int, dst: str | int) -> None:
    """`src`'s extended attributes onto `dst` (paths, neither followed if a link, or fds). One
    this file system or kernel refuses is left out, but for the overlay's own."""
    follow = isinstance(src, int)  # (an fd is the file itself)
    try:
        names = os.listxattr(src, follow_symlinks=follow)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.ENOENT):
            return
        raise
    for attr in names:
        try:
            value = os.getxattr(src, attr, follow_symlinks=follow)
            os.setxattr(dst, attr, value, follow_symlinks=follow)
        except OSError:
            if attr.startswith(OVERLAY_XATTRS):
                raise
