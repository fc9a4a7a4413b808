"""Host-side file operations on trees a tenant controls, none of which can reach outside them.

A tenant hands fleet archives (inputs, image layers, outputs made inside a machine) and trees
(a machine's root, a fork's copy). The agent and the client work on those as root or as the
user who runs them, so a tenant-made symlink, a `..` or an absolute name must never make them
touch a path beyond the tree. Every operation here works relative to a root directory (a path
fleet chose, or an open directory fd) and walks one component at a time with
`os.open(name, O_NOFOLLOW | O_DIRECTORY, dir_fd=parent)`: a symlink anywhere on the way is
refused, not followed, and a tree that changes while it is walked (a running machine swapping a
directory for a link) cannot redirect the walk, because each step starts from an fd already
held.

Archives are unpacked by fleet's own code, not `tarfile.extractall`: its `data` filter resolves
names against the host's file system and was bypassable on CPython releases before the mid-2025
fix (a symlink chain past PATH_MAX, then a hard link through it). Here `tarfile` only parses
headers; every name is normalised lexically, symlinks are created and never followed, hard
links name only regular files this archive already placed, and device nodes, setuid bits and
owners are kept only when the policy says so.

Refusals raise `UnsafePath` or `UnsafeArchive` (both `InvalidArgument`) with a message naming
the member or path and why; errors of the host itself (a full disk) stay `OSError`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import stat
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, BinaryIO, Literal, TypeVar, cast

from fleet.core.errors import InvalidArgument

Root = Path | str | int
"""A tree's root: a path fleet chose (trusted, may itself be a link) or an open directory fd
(used as is, never closed here)."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_COMPONENT = 255
"""Bytes in one name component (NAME_MAX on Linux)."""
MAX_LINK_TARGET = 4095
_CHUNK = 1 << 20
_OPAQUE = ".wh..wh..opq"
_WHITEOUT = ".wh."
_T = TypeVar("_T")


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


@dataclass(frozen=True)
class ExtractPolicy:
    """What of an archive is kept beyond names, modes and content.

    Tenant data (inputs, outputs) keeps no owners, no setuid/setgid bits and no device nodes;
    image layers keep owners and may keep setuid (a machine's own `sudo`). `links_out`
    allows symlinks whose target is absolute or climbs above the root: harmless to fleet, which
    never follows them, and what a root file system needs; without it such links are refused,
    so a downloaded tree cannot point its user at files outside it."""

    owners: bool = False
    setuid: bool = False
    devices: Literal["refuse", "skip"] = "refuse"
    whiteouts: bool = False
    links_out: bool = False
    limits: Limits = field(default_factory=Limits)


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
                    if owners:
                        os.fchown(child_dst, st.st_uid, st.st_gid)
                    os.fchmod(child_dst, keep)
                    os.utime(child_dst, ns=(st.st_atime_ns, st.st_mtime_ns))
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
            if owners:
                os.fchown(wfd, st.st_uid, st.st_gid)
            os.fchmod(wfd, mode)
            os.utime(wfd, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(wfd)
    finally:
        os.close(rfd)


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


# ---------------------------------------------------------------------------------------------
# Archives


def _open_tar(fileobj: BinaryIO, what: str) -> tarfile.TarFile:
    try:
        return tarfile.open(fileobj=fileobj, mode="r|*")
    except tarfile.TarError as exc:
        raise UnsafeArchive(f"{what}: not a readable tar: {exc}") from None


def _members(tar: tarfile.TarFile, what: str) -> Iterator[tarfile.TarInfo]:
    """The archive's members in order; a corrupt or truncated archive raises UnsafeArchive."""
    while True:
        try:
            member = tar.next()
        except tarfile.TarError as exc:
            raise UnsafeArchive(f"{what}: not a readable tar: {exc}") from None
        if member is None:
            return
        yield member


def _link_target_inside(at: tuple[str, ...], target: str) -> bool:
    """Whether a symlink at `at` pointing to `target` stays within the root, lexically."""
    if not target or target.startswith("/") or "\0" in target:
        return False
    depth = len(at) - 1  # the link's directory
    for part in target.split("/"):
        if part in ("", "."):
            continue
        depth = depth - 1 if part == ".." else depth + 1
        if depth < 0:
            return False
    return True


class _Check:
    """The rules every member passes, on extraction and on repacking alike; tracks the tree
    the archive makes so far (lexically), so that a member beneath a link or a file, a hard
    link to anything but a file the archive placed, and a directory turned into a link are
    refused before any file system is touched."""

    def __init__(self, policy: ExtractPolicy, what: str) -> None:
        self.policy = policy
        self.what = what
        self.budget = _Budget(policy.limits, what)
        self.kinds: dict[tuple[str, ...], str] = {(): "dir"}

    def member(self, m: tarfile.TarInfo) -> tuple[str, ...] | None:
        """The member's normalised name, or None when it is skipped (the root, a device under
        "skip", a whiteout marker handled by the caller)."""
        try:
            parts = _parts(m.name, self.policy.limits, what="member")
        except UnsafePath as exc:
            raise UnsafeArchive(str(exc)) from None
        shown = "/".join(parts) or "."
        self.budget.member(shown)
        if not parts:
            if not m.isdir():
                raise UnsafeArchive(
                    f"member {_show(m.name)}: names the root but is not a directory"
                )
            return None
        if m.ischr() or m.isblk() or m.isfifo():
            if self.policy.devices == "skip":
                return None
            raise UnsafeArchive(f"member {_show(shown)}: device nodes and fifos are refused")
        if not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
            raise UnsafeArchive(f"member {_show(shown)}: unsupported type {m.type!r}")
        for depth in range(1, len(parts)):
            kind = self.kinds.get(parts[:depth])
            if kind is not None and kind != "dir":
                raise UnsafeArchive(
                    f"member {_show(shown)}: its parent "
                    f"{_show('/'.join(parts[:depth]))} is a {kind}"
                )
        if self.policy.whiteouts and parts[-1].startswith(_WHITEOUT):
            return parts
        existing = self.kinds.get(parts)
        kind = "dir" if m.isdir() else "link" if m.issym() else "file"
        if existing == "dir" and kind != "dir":
            if not self.policy.whiteouts:
                raise UnsafeArchive(
                    f"member {_show(shown)}: would replace a directory with a {kind}"
                )
            self.forget(parts)  # a layer may replace a lower directory; its children go too
        if m.issym():
            if len(m.linkname) > MAX_LINK_TARGET or "\0" in m.linkname or not m.linkname:
                raise UnsafeArchive(f"member {_show(shown)}: bad symlink target")
            if not self.policy.links_out and not _link_target_inside(parts, m.linkname):
                raise UnsafeArchive(
                    f"member {_show(shown)}: symlink to {_show(m.linkname)} leaves the tree"
                )
        if m.islnk():
            target = self.hardlink_target(m, shown)
            if self.kinds.get(target) != "file":
                raise UnsafeArchive(
                    f"member {_show(shown)}: hard link to {_show(m.linkname)}, which is not a "
                    "regular file this archive placed"
                )
        if m.isreg():
            self.budget.content(shown, m.size)
        self.kinds[parts] = kind
        # A replaced directory's children are gone with it: a later member beneath does not
        # inherit them (only a non-dir can be replaced, so there are none).
        return parts

    def hardlink_target(self, m: tarfile.TarInfo, shown: str) -> tuple[str, ...]:
        try:
            target = _parts(m.linkname, self.policy.limits, what="hard link target")
        except UnsafePath as exc:
            raise UnsafeArchive(f"member {_show(shown)}: {exc}") from None
        if not target:
            raise UnsafeArchive(f"member {_show(shown)}: hard link to the root")
        return target

    def whiteout(self, parts: tuple[str, ...]) -> None:
        """Forgets what a whiteout removed, so later members may be placed there."""
        name = parts[-1]
        if name == _OPAQUE:
            return
        self.forget((*parts[:-1], name[len(_WHITEOUT) :]))

    def forget(self, gone: tuple[str, ...]) -> None:
        for key in [k for k in self.kinds if k[: len(gone)] == gone]:
            del self.kinds[key]

    def mode(self, m: tarfile.TarInfo) -> int:
        """The mode placed: no setuid/setgid (nor a file's sticky bit) unless the policy keeps
        them."""
        bits = m.mode & 0o7777
        if not self.policy.setuid:
            bits &= 0o1777 if m.isdir() else 0o777
        return bits


def extract_tar(fileobj: BinaryIO, root: Root, policy: ExtractPolicy) -> list[str]:
    """Unpacks the tar read from `fileobj` beneath `root` (made when missing) by fleet's own
    code; returns the normalised names placed, in archive order.

    Regular files, directories and symlinks (created, never followed) are placed; hard links
    only to regular files this archive already placed beneath the root (checked by inode, not
    by name); device nodes and fifos refused or skipped by `policy.devices`. A later member of
    the same name replaces an earlier file or link; a directory is replaced only by a layer
    (with `policy.whiteouts`), else refused. With
    `policy.whiteouts`, OCI whiteouts (`.wh.NAME`, `.wh..wh..opq`) remove what lower layers
    left, without following links. Directory modes are applied last, so a read-only
    directory in the archive does not stop its own members. The archive's own root entry
    ("./") is not applied to `root`, which is the caller's. Any refusal raises
    `UnsafeArchive`/`UnsafePath` naming the member; what was placed before it stays (the caller
    removes the root)."""
    what = "archive"
    check = _Check(policy, what)
    placed: list[str] = []
    inodes: dict[tuple[str, ...], tuple[int, int]] = {}
    dirs: dict[tuple[str, ...], tarfile.TarInfo] = {}
    if not isinstance(root, int):
        Path(root).mkdir(parents=True, exist_ok=True)
    with _root_fd(root) as top, _open_tar(fileobj, what) as tar:
        # Parents the archive does not list get the mode `tar` and `mkdir -p` give them.
        chain = _Chain(top, create=True, mode=0o755)
        try:
            for m in _members(tar, what):
                parts = check.member(m)
                if parts is None:
                    continue
                shown = "/".join(parts)
                parent = chain.open(parts[:-1])
                name = parts[-1]
                if policy.whiteouts and name.startswith(_WHITEOUT):
                    _apply_whiteout(chain, parts, check, inodes, dirs)
                    check.whiteout(parts)
                    continue
                if m.isdir():
                    chain.adopt(parts, _place_dir(parent, name, shown))
                    dirs[parts] = m
                else:
                    # What is there now goes (a lower layer's directory too): no fd kept of it
                    # or beneath it may be used again.
                    chain.forget(parts)
                    if m.issym():
                        _replacing(
                            functools.partial(os.symlink, m.linkname, name, dir_fd=parent),
                            parent, name, shown, dirs=policy.whiteouts,
                        )  # fmt: skip
                        if policy.owners:
                            os.chown(name, m.uid, m.gid, dir_fd=parent, follow_symlinks=False)
                    elif m.islnk():
                        target = check.hardlink_target(m, shown)
                        _place_hardlink(top, parent, name, shown, target, inodes, policy.whiteouts)
                        inodes[parts] = inodes[target]
                    else:
                        source = tar.extractfile(m)
                        if source is None:
                            raise UnsafeArchive(f"member {_show(shown)}: no content")
                        inodes[parts] = _place_file(parent, name, shown, source, m, check)
                    dirs.pop(parts, None)
                if not (m.isreg() or m.islnk()):
                    inodes.pop(parts, None)
                placed.append(shown)
        finally:
            chain.close()
        _apply_dir_modes(top, dirs, check)
    return placed


def _apply_dir_modes(top: int, dirs: dict[tuple[str, ...], tarfile.TarInfo], check: _Check) -> None:
    """Gives each directory the archive listed its owner, mode and mtime, once nothing more is
    written into it. In reverse name order every directory comes before its ancestors (a
    stricter mode set on one never stops the walk to another) and after its later siblings
    (one walk serves a whole run of them)."""
    chain = _Chain(top, create=False, mode=0o700)
    try:
        for parts in sorted(dirs, reverse=True):
            m = dirs[parts]
            # (one a later layer replaced or removed is gone, or no longer a directory)
            with contextlib.suppress(FileNotFoundError, UnsafePath):
                fd = chain.open(parts)
                if check.policy.owners:
                    os.fchown(fd, m.uid, m.gid)
                os.fchmod(fd, check.mode(m))
                _utime(fd, m.mtime)
    finally:
        chain.close()


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


def _place_file(
    parent: int, name: str, shown: str, source: IO[bytes], m: tarfile.TarInfo, check: _Check
) -> tuple[int, int]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = _replacing(
        functools.partial(os.open, name, flags, 0o600, dir_fd=parent),
        parent, name, shown, dirs=check.policy.whiteouts,
    )  # fmt: skip
    try:
        left = m.size
        try:
            while left > 0 and (chunk := source.read(min(_CHUNK, left))):
                _write_all(fd, chunk)
                left -= len(chunk)
        except tarfile.TarError as exc:
            raise UnsafeArchive(f"member {_show(shown)}: {exc}") from None
        if left:
            raise UnsafeArchive(f"member {_show(shown)}: archive ends inside its content")
        if check.policy.owners:
            os.fchown(fd, m.uid, m.gid)
        os.fchmod(fd, check.mode(m))
        _utime(fd, m.mtime)
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return st.st_dev, st.st_ino


def _place_hardlink(
    top: int,
    parent: int,
    name: str,
    shown: str,
    target: tuple[str, ...],
    inodes: dict[tuple[str, ...], tuple[int, int]],
    dirs: bool,
) -> None:
    want = inodes.get(target)
    if want is None:
        raise UnsafeArchive(
            f"member {_show(shown)}: hard link to a file this archive did not place"
        )
    tdir = _walk(top, target[:-1], create=False, mode=0o700)
    try:
        st = _lstat(tdir, target[-1])
        if st is None or (st.st_dev, st.st_ino) != want or not stat.S_ISREG(st.st_mode):
            raise UnsafeArchive(
                f"member {_show(shown)}: hard link target changed since it was placed"
            )
        link = functools.partial(
            os.link, target[-1], name, src_dir_fd=tdir, dst_dir_fd=parent, follow_symlinks=False
        )
        _replacing(link, parent, name, shown, dirs=dirs)
    finally:
        os.close(tdir)


def _apply_whiteout(
    chain: _Chain,
    parts: tuple[str, ...],
    check: _Check,
    inodes: dict[tuple[str, ...], tuple[int, int]],
    dirs: dict[tuple[str, ...], tarfile.TarInfo],
) -> None:
    """An OCI whiteout in the chain's end directory: `.wh.NAME` removes NAME; `.wh..wh..opq`
    empties its directory of what lower layers put there (this archive's own members stay)."""
    parent = chain.fd
    name = parts[-1]
    at = parts[:-1]
    if name == _OPAQUE:
        with os.scandir(parent) as entries:
            names = [e.name for e in entries]
        for entry in names:
            if (*at, entry) not in check.kinds:
                chain.forget((*at, entry))
                _remove_at(parent, entry)
        return
    gone = name[len(_WHITEOUT) :]
    if not gone or gone in (".", ".."):
        raise UnsafeArchive(f"member {_show('/'.join(parts))}: bad whiteout")
    chain.forget((*at, gone))
    _remove_at(parent, gone)
    prefix = (*at, gone)
    for table in (inodes, dirs):
        for key in [k for k in table if k[: len(prefix)] == prefix]:
            del table[key]


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


def _fresh(name: str, m: tarfile.TarInfo, mode: int) -> tarfile.TarInfo:
    """A header written by fleet: the normalised name, the kept mode, no owners."""
    info = tarfile.TarInfo(name)
    info.type = m.type if m.type not in (tarfile.AREGTYPE, tarfile.CONTTYPE) else tarfile.REGTYPE
    info.mode = mode
    info.mtime = int(m.mtime) if 0 <= m.mtime < 1 << 33 else 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def repack_tar(
    src: BinaryIO,
    out: BinaryIO,
    limits: Limits,
    *,
    devices: Literal["refuse", "skip"] = "refuse",
) -> int:
    """Reads an untrusted tar stream strictly and writes it anew to `out`; returns the bytes
    written. What comes out was made by fleet, whatever program made the input: normalised
    names, no owners, no setuid/setgid bits, no pax or vendor headers, symlinks only to
    targets inside the tree, hard links only to regular files already written, no device
    nodes or fifos (refused, or dropped with `devices="skip"`), within `limits`. Any refusal
    raises `UnsafeArchive` naming the member."""
    what = "archive"
    check = _Check(ExtractPolicy(devices=devices, limits=limits), what)
    counter = _Counter(out)
    with (
        _open_tar(src, what) as tar,
        tarfile.open(
            fileobj=cast(BinaryIO, counter), mode="w|", format=tarfile.PAX_FORMAT
        ) as writer,
    ):
        for m in _members(tar, what):
            parts = check.member(m)
            if parts is None:
                continue
            name = "/".join(parts)
            info = _fresh(name, m, check.mode(m))
            if m.issym():
                info.linkname = m.linkname
                writer.addfile(info)
            elif m.islnk():
                info.linkname = "/".join(check.hardlink_target(m, name))
                writer.addfile(info)
            elif m.isdir():
                writer.addfile(info)
            else:
                info.size = m.size
                source = tar.extractfile(m)
                if source is None:
                    raise UnsafeArchive(f"member {_show(name)}: no content")
                try:
                    writer.addfile(info, source)
                except (tarfile.TarError, OSError) as exc:
                    raise UnsafeArchive(f"member {_show(name)}: {exc}") from None
    return counter.written


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


__all__ = [
    "ExtractPolicy", "Limits", "UnsafeArchive", "UnsafePath", "chmod", "copy_tree",
    "extract_tar", "member_name", "open_dir", "open_file", "read_bytes", "remove",
    "repack_tar", "write_bytes", "write_tar",
]  # fmt: skip
