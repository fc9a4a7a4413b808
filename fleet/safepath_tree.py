"""Whole trees beneath a root, walked by fds: copied into another root (a fork's layer), or
written as a tar (an output, a session's directory read).

These stand on the walking of `fleet.safepath_paths` (every directory opened one component at
a time, never through a link) and are offered by `fleet.safepath`; fleet imports them from
there. The placing of one
entry (a directory made or reused, a file or link replacing what was at its name) is here too,
because unpacking an archive (`fleet.safepath_archive`) places its members the same way.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import stat
import tarfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import BinaryIO, TypeVar, cast

from fleet.safepath_paths import (
    Limits,
    Root,
    UnsafeArchive,
    UnsafePath,
    _lstat,
    _refusal,
    _rel_parts,
    _root_fd,
    _show,
    _step,
    _walk,
)

_CHUNK = 1 << 20
_T = TypeVar("_T")


# ---------------------------------------------------------------------------------------------
# Copying a tree


def copy_tree(
    src_root: Root,
    dst_root: Root,
    *,
    limits: Limits | None = None,
    owners: bool = False,
    setuid: bool = False,
) -> None:
    """Copies the tree beneath `src_root` into `dst_root` (made when missing): directories,
    regular files and symlinks (copied as links, never followed). Device nodes, fifos and
    sockets are skipped; setuid/setgid bits dropped unless `setuid`; owners kept only with
    `owners`. An existing entry in the destination is replaced, a directory merged into."""
    bounds = limits or Limits()
    budget = _Budget(bounds, "tree")
    if not isinstance(dst_root, int):
        Path(dst_root).mkdir(parents=True, exist_ok=True)
    with _root_fd(src_root) as src, _root_fd(dst_root) as dst:
        _copy_dir(src, dst, (), bounds, budget, owners, setuid)


def _copy_dir(
    src: int,
    dst: int,
    at: tuple[str, ...],
    limits: Limits,
    budget: _Budget,
    owners: bool,
    setuid: bool,
) -> None:
    if len(at) > limits.max_depth:
        raise UnsafePath(f"{'/'.join(at)}: deeper than {limits.max_depth} components")
    with os.scandir(src) as entries:
        names = sorted(e.name for e in entries)
    for name in names:
        shown = "/".join((*at, name))
        st = _lstat(src, name)
        if st is None:
            continue
        budget.member(shown)
        keep = _keep_mode(st.st_mode, setuid)
        if stat.S_ISDIR(st.st_mode):
            child_src = _step(src, name, shown, create=False, mode=0o700)
            try:
                child_dst = _place_dir(dst, name, shown)
                try:
                    _copy_dir(child_src, child_dst, (*at, name), limits, budget, owners, setuid)
                    _keep_metadata(child_dst, st, keep, owners)
                finally:
                    os.close(child_dst)
            finally:
                os.close(child_src)
        elif stat.S_ISLNK(st.st_mode):
            link = functools.partial(os.symlink, os.readlink(name, dir_fd=src), name, dir_fd=dst)
            _replacing(link, dst, name, shown, dirs=False)
            if owners:
                os.chown(name, st.st_uid, st.st_gid, dir_fd=dst, follow_symlinks=False)
        elif stat.S_ISREG(st.st_mode):
            budget.content(shown, st.st_size)
            _copy_file(src, dst, name, shown, st, keep, owners)


def _copy_file(
    src: int, dst: int, name: str, shown: str, st: os.stat_result, mode: int, owners: bool
) -> None:
    rflags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    wflags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        rfd = os.open(name, rflags, dir_fd=src)
    except OSError as exc:
        raise _refusal(exc, src, name, shown) from None
    try:
        if not stat.S_ISREG(os.fstat(rfd).st_mode):
            raise UnsafePath(f"{_show(shown)}: changed while it was copied")
        os.set_blocking(rfd, True)
        create = functools.partial(os.open, name, wflags, 0o600, dir_fd=dst)
        wfd = _replacing(create, dst, name, shown, dirs=False)
        try:
            copied = 0
            while copied < st.st_size and (chunk := os.read(rfd, min(_CHUNK, st.st_size - copied))):
                _write_all(wfd, chunk)
                copied += len(chunk)
            _keep_metadata(wfd, st, mode, owners)
        finally:
            os.close(wfd)
    finally:
        os.close(rfd)


def _keep_metadata(fd: int, st: os.stat_result, mode: int, owners: bool) -> None:
    """A copied entry given its source's mode (`mode`, as kept), times and, with `owners`,
    owner."""
    if owners:
        os.fchown(fd, st.st_uid, st.st_gid)
    os.fchmod(fd, mode)
    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))


def _clear(parent: int, name: str, shown: str, *, dirs: bool = False) -> None:
    """Makes room for a non-directory `name`: an existing file or link goes; a directory goes
    with `dirs` (an image layer replacing a lower one's), else is refused (tenant data may not
    turn a directory into something else)."""
    st = _lstat(parent, name)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        if not dirs:
            raise UnsafeArchive(f"member {_show(shown)}: would replace a directory")
        shutil.rmtree(name, dir_fd=parent)
        return
    os.unlink(name, dir_fd=parent)


def _utime(fd: int, mtime: float) -> None:
    """Sets an archive's mtime; one the host cannot represent is left as it is."""
    with contextlib.suppress(OverflowError, ValueError, OSError):
        os.utime(fd, (mtime, mtime))


def _write_all(fd: int, data: bytes) -> None:
    """Writes all of `data` to `fd` (unbuffered: most members are one chunk, and a file
    object per member would cost more than its content)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _keep_mode(mode: int, setuid: bool) -> int:
    bits = stat.S_IMODE(mode)
    if not setuid:
        bits &= 0o777 if not stat.S_ISDIR(mode) else 0o1777
    return bits


class _Budget:
    """Counts members and content bytes against `Limits`."""

    def __init__(self, limits: Limits, what: str) -> None:
        self.limits = limits
        self.what = what
        self.members = 0
        self.bytes = 0

    def member(self, name: str) -> None:
        self.members += 1
        if self.members > self.limits.max_members:
            raise UnsafeArchive(
                f"{self.what}: more than {self.limits.max_members} members (at {_show(name)})"
            )

    def content(self, name: str, size: int) -> None:
        if size < 0:
            raise UnsafeArchive(f"member {_show(name)}: negative size")
        self.bytes += size
        if self.bytes > self.limits.max_bytes:
            raise UnsafeArchive(
                f"{self.what}: more than {self.limits.max_bytes} bytes of content "
                f"(at {_show(name)})"
            )


def _replacing(make: Callable[[], _T], parent: int, name: str, shown: str, *, dirs: bool) -> _T:
    """`make()`, which creates `name` in `parent` and fails when something is there; then
    `_clear` makes room and it runs again. Trying first spares a lookup per member where the
    tree is new, as it mostly is."""
    try:
        return make()
    except FileExistsError:
        _clear(parent, name, shown, dirs=dirs)
    return make()


def _place_dir(parent: int, name: str, shown: str) -> int:
    """An fd of the directory `name` in `parent`, made when missing; a file or link there (an
    earlier member's or a lower layer's) is replaced."""
    try:
        os.mkdir(name, 0o700, dir_fd=parent)
    except FileExistsError:
        st = _lstat(parent, name)
        if st is not None and not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=parent)
    return _step(parent, name, shown, create=True, mode=0o700)


# ---------------------------------------------------------------------------------------------
# Writing a tree as a tar


class _Counter:
    """A write-only stream that counts what passes through it."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.written = 0

    def write(self, data: bytes) -> int:
        self.out.write(data)
        self.written += len(data)
        return len(data)

    def flush(self) -> None:
        self.out.flush()


def write_tar(
    root: Root,
    rel: str | PurePosixPath,
    out: BinaryIO,
    limits: Limits,
    *,
    owners: bool = False,
) -> int:
    """Writes a tar of the tree at `rel` beneath `root` to `out`; returns the bytes written.
    Walked by fds: symlinks are stored as links, never followed; files seen again under
    another name are stored as hard links; device nodes, fifos and sockets are left out;
    setuid/setgid bits dropped; owners stored only with `owners`. A file that changes while it
    is read is stored at the size it had when opened (padded or cut)."""
    counter = _Counter(out)
    budget = _Budget(limits, "tree")
    seen: dict[tuple[int, int], str] = {}
    with (
        _root_fd(root) as top,
        tarfile.open(
            fileobj=cast(BinaryIO, counter), mode="w|", format=tarfile.PAX_FORMAT
        ) as writer,
    ):
        start = _walk(top, _rel_parts(rel), create=False, mode=0o755)
        try:
            _tar_dir(writer, start, (), limits, budget, seen, owners)
        finally:
            os.close(start)
    return counter.written


def _tar_dir(
    writer: tarfile.TarFile,
    fd: int,
    at: tuple[str, ...],
    limits: Limits,
    budget: _Budget,
    seen: dict[tuple[int, int], str],
    owners: bool,
) -> None:
    if len(at) > limits.max_depth:
        raise UnsafePath(f"{'/'.join(at)}: deeper than {limits.max_depth} components")
    with os.scandir(fd) as entries:
        names = sorted(e.name for e in entries)
    for name in names:
        parts = (*at, name)
        shown = "/".join(parts)
        if len(shown.encode("utf-8", "surrogateescape")) > limits.max_name:
            raise UnsafePath(f"{_show(shown)}: longer than {limits.max_name} bytes")
        st = _lstat(fd, name)
        if st is None:
            continue
        kind = stat.S_IFMT(st.st_mode)
        if kind not in (stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK):
            continue
        budget.member(shown)
        info = tarfile.TarInfo(shown)
        info.mode = _keep_mode(st.st_mode, False)
        info.mtime = int(st.st_mtime) if 0 <= st.st_mtime < 1 << 33 else 0
        info.uid, info.gid = (st.st_uid, st.st_gid) if owners else (0, 0)
        if kind == stat.S_IFDIR:
            info.type = tarfile.DIRTYPE
            writer.addfile(info)
            child = _step(fd, name, shown, create=False, mode=0o700)
            try:
                _tar_dir(writer, child, parts, limits, budget, seen, owners)
            finally:
                os.close(child)
        elif kind == stat.S_IFLNK:
            info.type = tarfile.SYMTYPE
            info.linkname = os.readlink(name, dir_fd=fd)
            writer.addfile(info)
        else:
            _tar_file(writer, fd, name, shown, info, budget, seen)


def _tar_file(
    writer: tarfile.TarFile,
    parent: int,
    name: str,
    shown: str,
    info: tarfile.TarInfo,
    budget: _Budget,
    seen: dict[tuple[int, int], str],
) -> None:
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent
        )
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOENT):
            return  # replaced by a link or gone since it was listed
        raise
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return
        os.set_blocking(fd, True)
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in seen:
            info.type = tarfile.LNKTYPE
            info.linkname = seen[key]
            writer.addfile(info)
            return
        seen[key] = shown
        budget.content(shown, st.st_size)
        info.type = tarfile.REGTYPE
        info.size = st.st_size
        writer.addfile(info, _Exactly(handle, st.st_size))


class _Exactly:
    """A file read as exactly `size` bytes: cut when it grew, zero-padded when it shrank
    (tarfile needs the size its header promised)."""

    def __init__(self, handle: BinaryIO, size: int) -> None:
        self.handle = handle
        self.left = size

    def read(self, n: int = -1) -> bytes:
        want = self.left if n < 0 else min(n, self.left)
        data = self.handle.read(want)
        if len(data) < want:
            data += b"\0" * (want - len(data))
        self.left -= len(data)
        return data


__all__ = ["copy_tree", "write_tar"]
