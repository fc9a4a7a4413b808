"""Tar streams from outside fleet, read strictly: unpacked beneath a root, or written anew.

`extract_tar` places an archive's members (an input, an image layer, a downloaded output) by
the walking of `fleet.safepath_paths` and the placing of `fleet.safepath_tree`; `repack_tar` turns a
stream a machine made into one fleet made. Both check every member by the same rules (`_Check`)
before anything is placed or written. `fleet.safepath` offers these; fleet imports them from
there.
"""

from __future__ import annotations

import contextlib
import functools
import os
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, BinaryIO, Literal, cast

from fleet.safepath_paths import (
    Limits,
    Root,
    UnsafeArchive,
    UnsafePath,
    _Chain,
    _lstat,
    _parts,
    _remove_at,
    _root_fd,
    _show,
    _walk,
)
from fleet.safepath_tree import (
    _CHUNK,
    _Budget,
    _Counter,
    _place_dir,
    _replacing,
    _utime,
    _write_all,
)

MAX_LINK_TARGET = 4095
_OPAQUE = ".wh..wh..opq"
_WHITEOUT = ".wh."


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


__all__ = ["MAX_LINK_TARGET", "ExtractPolicy", "extract_tar", "repack_tar"]
