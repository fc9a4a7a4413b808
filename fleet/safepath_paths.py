"""The walking beneath a root and the operations on one path (`fleet.safepath`'s first part):
each step `os.open(name, O_NOFOLLOW | O_DIRECTORY, dir_fd=parent)` from an fd already held, the
bounds (`Limits`) and the refusals (`UnsafePath`, `UnsafeArchive`) every part raises. The rest
of fleet reaches these through `fleet.safepath`; `fleet.safepath_tree` and
`fleet.safepath_archive` stand on them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from fleet.core.errors import InvalidArgument

Root = Path | str | int
"""A tree's root: a path fleet chose (trusted, may itself be a link) or an open directory fd
(used as is, never closed here)."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_COMPONENT = 255
"""Bytes in one name component (NAME_MAX on Linux)."""


class UnsafePath(InvalidArgument):
    """A path that would leave its tree, pass through a link, or is not what it must be."""


class UnsafeArchive(InvalidArgument):
    """An archive member fleet will not place: a bad name, link, type or an exceeded bound."""


@dataclass(frozen=True)
class Limits:
    """Bounds on one archive or tree: members, bytes of file content, a path's length in
    bytes, and its depth in components."""

    max_members: int = 200_000
    max_bytes: int = 32 << 30
    max_name: int = 4096
    max_depth: int = 128


# ---------------------------------------------------------------------------------------------
# Names


def _parts(name: str, limits: Limits, *, what: str) -> tuple[str, ...]:
    """`name`'s components, normalised lexically ("./a//b/" -> ("a", "b")); () for the root."""
    if "\0" in name:
        raise UnsafePath(f"{what} {_show(name)}: contains a NUL byte")
    if name.startswith("/"):
        raise UnsafePath(f"{what} {_show(name)}: absolute names are refused")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise UnsafePath(f"{what} {_show(name)}: '..' is refused")
    encoded = len(name.encode("utf-8", "surrogateescape"))
    if encoded > limits.max_name:
        raise UnsafePath(f"{what} {_show(name)}: longer than {limits.max_name} bytes")
    if len(parts) > limits.max_depth:
        raise UnsafePath(f"{what} {_show(name)}: deeper than {limits.max_depth} components")
    for part in parts:
        if len(part.encode("utf-8", "surrogateescape")) > MAX_COMPONENT:
            raise UnsafePath(f"{what} {_show(name)}: a component is over {MAX_COMPONENT} bytes")
    return parts


def member_name(name: str, *, limits: Limits | None = None) -> PurePosixPath:
    """A tar member's name or a relative path, normalised ("./a//b" -> "a/b").

    Refuses absolute names, `..` anywhere, NUL, an empty name (or one that is only "."),
    names over `limits.max_name` bytes, components over 255 bytes and paths deeper than
    `limits.max_depth`. Lexical only: the host's file system is never consulted."""
    parts = _parts(str(name), limits or Limits(), what="path")
    if not parts:
        raise UnsafePath(f"path {_show(name)}: empty")
    return PurePosixPath(*parts)


def _rel_parts(rel: str | PurePosixPath, *, what: str = "path") -> tuple[str, ...]:
    return _parts(str(rel), Limits(), what=what)


# ---------------------------------------------------------------------------------------------
# Walking beneath a root


@contextlib.contextmanager
def _root_fd(root: Root) -> Iterator[int]:
    if isinstance(root, int):
        yield root
        return
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def _step(parent: int, name: str, shown: str, *, create: bool, mode: int) -> int:
    """The directory `name` in `parent` as a new fd; never through a link."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
    except OSError as exc:
        raise _refusal(exc, parent, name, shown) from None
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, mode, dir_fd=parent)
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        raise _refusal(exc, parent, name, shown) from None


def _show(name: str) -> str:
    """A name as an error message shows it: quoted, and cut when long."""
    return repr(name) if len(name) <= 160 else repr(name[:80]) + "..." + repr(name[-60:])


def _refusal(exc: OSError, parent: int, name: str, shown: str) -> OSError | UnsafePath:
    """What an open that met a link or a non-directory means, in words; other errors as they
    are. (O_DIRECTORY | O_NOFOLLOW on a symlink fails with ENOTDIR, hence the lstat.)"""
    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
        return exc
    st = _lstat(parent, name)
    if exc.errno == errno.ELOOP or (st is not None and stat.S_ISLNK(st.st_mode)):
        return UnsafePath(f"{_show(shown)}: is a symlink (links are never followed)")
    return UnsafePath(f"{_show(shown)}: not a directory")


def _walk(start: int, parts: tuple[str, ...], *, create: bool, mode: int) -> int:
    """A new fd of the directory `parts` beneath `start`."""
    fd = os.dup(start)
    try:
        for depth, name in enumerate(parts):
            shown = "/".join(parts[: depth + 1])
            nxt = _step(fd, name, shown, create=create, mode=mode)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Chain:
    """The open fds of one directory beneath a root and of its ancestors, kept between calls:
    an archive lists a directory's members together, so the next member's directory is
    mostly this one or shares a long prefix with it, and walking from the root each time
    (one open per component per member) would cost more than placing the members.

    Every fd here was opened by `_step`, one component at a time from the root or from an
    ancestor's fd already held, exactly as `_walk` opens them: a link or a non-directory on
    the way is refused the same, and reusing an fd reuses that walk's result. A held fd names
    its directory, not a path, so only removing or replacing the directory (or an ancestor)
    makes it wrong: entries would land in an unlinked directory, still nowhere outside. Who
    removes or replaces an entry calls `forget` with its path first. (For the trees this
    unpacks into, which nothing else writes meanwhile, that is all; a directory that another
    writer renamed away would keep receiving the members under its old path, in the place
    that writer could already write to, never through a link.)"""

    def __init__(self, top: int, *, create: bool, mode: int) -> None:
        self.top = top
        self.create = create
        self.mode = mode
        self.names: list[str] = []
        self.fds: list[int] = []

    def open(self, parts: tuple[str, ...]) -> int:
        """The fd of the directory `parts` (the root for ()), held by the chain: valid until
        the next `open`, `adopt`, `forget` or `close`, and never closed by the caller."""
        keep = 0
        common = min(len(parts), len(self.names))
        while keep < common and self.names[keep] == parts[keep]:
            keep += 1
        self._cut(keep)
        for depth in range(keep, len(parts)):
            shown = "/".join(parts[: depth + 1])
            fd = _step(self.fd, parts[depth], shown, create=self.create, mode=self.mode)
            self.names.append(parts[depth])
            self.fds.append(fd)
        return self.fd

    @property
    def fd(self) -> int:
        """The chain's end: the directory last opened (the root when the chain is empty)."""
        return self.fds[-1] if self.fds else self.top

    def adopt(self, parts: tuple[str, ...], fd: int) -> None:
        """Takes `fd` as the chain's new end: the directory `parts`, just opened by `_step`
        in the chain's end, which must be `parts[:-1]`."""
        if tuple(self.names) != parts[:-1]:
            os.close(fd)
            raise ValueError(f"{_show('/'.join(parts))}: not a child of the chain's end")
        self.names.append(parts[-1])
        self.fds.append(fd)

    def forget(self, gone: tuple[str, ...]) -> None:
        """Closes the fds of `gone` and of what lies beneath it: it is being removed or
        replaced, and what it holds must not be reached through an fd kept from before."""
        if gone and tuple(self.names[: len(gone)]) == gone:
            self._cut(len(gone) - 1)

    def close(self) -> None:
        self._cut(0)

    def _cut(self, keep: int) -> None:
        while len(self.fds) > keep:
            self.names.pop()
            os.close(self.fds.pop())


def open_dir(
    root: Root, rel: str | PurePosixPath, *, create: bool = False, mode: int = 0o755
) -> int:
    """An fd (the caller closes it) of the directory at `rel` beneath `root`; "" or "." is the
    root itself. With `create`, missing directories are made (with `mode`). A symlink or a
    non-directory anywhere on the way raises `UnsafePath`; a missing one `FileNotFoundError`."""
    parts = _rel_parts(rel)
    with _root_fd(root) as fd:
        return _walk(fd, parts, create=create, mode=mode)


@contextlib.contextmanager
def _parent(
    root: Root, rel: str | PurePosixPath, *, create: bool = False
) -> Iterator[tuple[int, str]]:
    """(fd of `rel`'s directory, `rel`'s last component); `rel` must not be the root."""
    parts = _rel_parts(rel)
    if not parts:
        raise UnsafePath(f"path {str(rel)!r}: names the root itself")
    fd = open_dir(root, PurePosixPath(*parts[:-1]) if len(parts) > 1 else "", create=create)
    try:
        yield fd, parts[-1]
    finally:
        os.close(fd)


def open_file(
    root: Root,
    rel: str | PurePosixPath,
    flags: int,
    mode: int = 0o644,
    *,
    regular: bool = True,
    parents: bool = False,
) -> int:
    """An fd (the caller closes it) of the file at `rel` beneath `root`, opened with `flags`
    plus O_NOFOLLOW: a link as the last component is refused like one on the way. With
    `regular` (the default) anything but a regular file is refused before it is read or
    written (a fifo would block, a device node would act); `parents` makes missing
    directories."""
    with _parent(root, rel, create=parents) as (parent, name):
        extra = os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_NONBLOCK if regular else 0)
        try:
            fd = os.open(name, flags | extra, mode, dir_fd=parent)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # a fifo opened for writing without a reader
                raise UnsafePath(f"{_show(str(rel))}: not a regular file") from None
            raise _refusal(exc, parent, name, str(rel)) from None
    if regular:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UnsafePath(f"{_show(str(rel))}: not a regular file")
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
    return fd


def read_bytes(root: Root, rel: str | PurePosixPath, max_bytes: int) -> bytes:
    """The regular file at `rel` beneath `root`, at most `max_bytes` (more raises
    `UnsafePath`, naming the bound)."""
    fd = open_file(root, rel, os.O_RDONLY)
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UnsafePath(f"{_show(str(rel))}: larger than {max_bytes} bytes")
    return data


def write_bytes(
    root: Root, rel: str | PurePosixPath, data: bytes, mode: int = 0o644, *, parents: bool = True
) -> None:
    """Replaces whatever is at `rel` beneath `root` (a file or a link, never written through)
    with a regular file holding `data`, atomically: written under a temporary name beside it,
    then renamed over it. A directory there is refused."""
    with _parent(root, rel, create=parents) as (parent, name):
        tmp = f".{name[:200]}.fleet-{os.getpid()}-{os.urandom(4).hex()}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                os.fchmod(handle.fileno(), stat.S_IMODE(mode))
            try:
                os.replace(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
            except IsADirectoryError:
                raise UnsafePath(f"{_show(str(rel))}: is a directory") from None
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=parent)
            raise


def _lstat(parent: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _remove_at(parent: int, name: str) -> None:
    st = _lstat(parent, name)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        # rmtree with dir_fd walks by fds and never follows a link (avoids_symlink_attacks).
        shutil.rmtree(name, dir_fd=parent)
    else:
        os.unlink(name, dir_fd=parent)


def remove(root: Root, rel: str | PurePosixPath, *, missing_ok: bool = True) -> None:
    """Unlinks the file or link at `rel` beneath `root`, or removes the directory tree there;
    links inside are removed, never followed. The root itself cannot be removed."""
    try:
        with _parent(root, rel) as (parent, name):
            if _lstat(parent, name) is None:
                raise FileNotFoundError(errno.ENOENT, "no such file or directory", str(rel))
            _remove_at(parent, name)
    except FileNotFoundError:
        if not missing_ok:
            raise


def chmod(root: Root, rel: str | PurePosixPath, mode: int) -> None:
    """Sets the mode of what is at `rel` beneath `root` ("" for the root); a link there is
    refused (its mode means nothing, and following it could reach outside)."""
    parts = _rel_parts(rel)
    with _root_fd(root) as top:
        if not parts:
            os.fchmod(top, stat.S_IMODE(mode))
            return
        parent = _walk(top, parts[:-1], create=False, mode=0o755)
        try:
            _chmod_at(parent, parts[-1], mode, str(rel))
        finally:
            os.close(parent)


def _chmod_at(parent: int, name: str, mode: int, shown: str) -> None:
    # An O_PATH fd never opens the file itself (a device node does not act on it), and the
    # /proc link changes exactly the inode it holds.
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except OSError as exc:
        raise _refusal(exc, parent, name, shown) from None
    try:
        if stat.S_ISLNK(os.fstat(fd).st_mode):
            raise UnsafePath(f"{_show(shown)}: is a symlink (links are never followed)")
        os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(mode))
    finally:
        os.close(fd)


__all__ = [
    "Limits", "UnsafeArchive", "UnsafePath", "chmod", "member_name", "open_dir", "open_file",
    "read_bytes", "remove", "write_bytes",
]  # fmt: skip
