"""A Smolfile's `user` on the namespace runtime: who it names in the image, and the small static
program (`stepexec.c`) that runs a machine's commands as that user.

`user` is a name or a number, optionally with a group: `nobody`, `1000`, `app:staff`,
`1000:1000`. Names are looked up in the image's own `/etc/passwd` and `/etc/group` (never the
host's); the user's supplementary groups are those `/etc/group` lists it in, and its home is the
machine's `HOME`. A name the image does not have, or an id outside the machine's id range, is
refused when the machine is made.

The image's tree is the tenant's and is read here on the host, as root: the two files are read
beneath the tree's root without following a link (an `/etc` or `/etc/passwd` that is a symlink
is refused, not followed to the host's), and bounded in size.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fleet import safepath
from fleet.core.errors import FailedPrecondition, InvalidArgument

ID_RANGE = 2**32 - 1
"""Every user and group id of a machine (0 .. 2^32-2) is the host's same id, as in a rootful
container: root owns its files and can give them to any id (the last id, 2^32-1, is the
kernel's "no id" and cannot be mapped)."""

SOURCE = Path(__file__).with_name("stepexec.c")

TABLE_MAX_BYTES = 4 << 20
"""The most of an image's /etc/passwd or /etc/group read (real ones are kilobytes)."""


@dataclass(frozen=True)
class StepUser:
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    @property
    def is_root(self) -> bool:
        return self.uid == 0 and self.gid == 0

    def argv(self, helper_fd: int) -> list[str]:
        """What runs before the command: the helper, through its inherited descriptor."""
        groups = ",".join(str(g) for g in self.groups) or "-"
        return [f"/proc/self/fd/{helper_fd}", str(helper_fd), str(self.uid), str(self.gid),
                groups, "--"]  # fmt: skip


ROOT = StepUser(0, 0, (), "/root")


def _table(rootfs: Path, rel: str, value: str) -> list[list[str]]:
    """The entries of the image's `/rel` (none where it has no such file)."""
    try:
        data = safepath.read_bytes(rootfs, rel, TABLE_MAX_BYTES)
    except FileNotFoundError:
        return []
    except safepath.UnsafePath as exc:
        raise InvalidArgument(
            f"user = {value!r}: the image's /{rel} cannot be read: {exc.message} (it must be a "
            f"regular file within the image, at most {TABLE_MAX_BYTES} bytes, reached through "
            "no symlink)"
        ) from None
    text = data.decode(errors="replace")
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


def _id(text: str, what: str, value: str) -> int | None:
    if not text.isdigit():
        return None
    number = int(text)
    if number >= ID_RANGE:
        raise InvalidArgument(
            f"user = {value!r}: {what} {number} is outside the machine's ids (0..{ID_RANGE - 1})"
        )
    return number


def resolve(value: str | None, rootfs: Path) -> StepUser:
    """The user `value` names in the image at `rootfs` (root where it is unset)."""
    if value is None or value in ("", "root", "0", "root:root", "0:0"):
        return ROOT
    name, _, group = value.partition(":")
    passwd = _table(rootfs, "etc/passwd", value)
    groups = _table(rootfs, "etc/group", value)
    uid = _id(name, "uid", value)
    entry = next(
        (e for e in passwd if len(e) >= 7 and (e[0] == name or (uid is not None and e[2] == name))),
        None,
    )
    if uid is None:
        if entry is None:
            raise InvalidArgument(
                f"user = {value!r}: the image has no user {name!r} in /etc/passwd"
            )
        uid = _id(entry[2], "uid", value)
    if uid is None:
        raise InvalidArgument(f"user = {value!r}: the image's /etc/passwd entry is malformed")
    gid: int | None
    if group:
        gid = _id(group, "gid", value)
        if gid is None:
            found = next((g for g in groups if len(g) >= 3 and g[0] == group), None)
            if found is None:
                raise InvalidArgument(
                    f"user = {value!r}: the image has no group {group!r} in /etc/group"
                )
            gid = _id(found[2], "gid", value)
    elif entry is not None:
        gid = _id(entry[3], "gid", value)
    else:
        gid = uid
    if gid is None:
        raise InvalidArgument(f"user = {value!r}: the image's group entry is malformed")
    login = entry[0] if entry is not None else None
    extra = sorted(
        {
            int(g[2])
            for g in groups
            if len(g) >= 4
            and login is not None
            and login in g[3].split(",")
            and g[2].isdigit()
            and int(g[2]) < ID_RANGE
        }
        - {gid}
    )
    home = entry[5] if entry is not None and entry[5] else "/"
    return StepUser(uid, gid, (gid, *extra), home)


def helper(cache: Path) -> Path:
    """The compiled user-switching helper in `cache` (see `tool`)."""
    return tool(cache, SOURCE, "a Smolfile's `user` on the namespace runtime",
                "user-switching helper")  # fmt: skip


def tool(cache: Path, source: Path, needed_by: str, what: str) -> Path:
    """The program built from `source` in `cache` (with the host's C compiler, statically
    linked so that it runs in any image; `fleet.runtime.helpers` builds each once per host, when
    the host is prepared or the runtime is made)."""
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    binary = cache / f"{source.stem}-{digest}"
    if binary.exists():
        return binary
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FailedPrecondition(
            f"{needed_by} needs a C compiler on the host (apt-get install gcc libc6-dev) to "
            f"build its {what}"
        )
    cache.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=cache, prefix=f".{source.stem}-")
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, "-static", "-Os", "-o", temporary, str(source)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if done.returncode != 0:
            raise FailedPrecondition(
                f"cannot build the namespace runtime's {what} (a static C program; apt-get "
                f"install libc6-dev): {done.stderr.strip()[-500:]}"
            )
        os.chmod(temporary, 0o755)
        os.replace(temporary, binary)
    finally:
        Path(temporary).unlink(missing_ok=True)
    return binary


def _map_and_open(pid: int) -> int:
    base = Path(f"/proc/{pid}")
    for name in ("uid_map", "gid_map"):
        (base / name).write_text(f"0 0 {ID_RANGE}\n")
    return os.open(base / "ns" / "user", os.O_RDONLY | os.O_CLOEXEC)


async def user_namespace() -> int:
    """A new user namespace in which ids 0..ID_RANGE-1 are the host's, as a descriptor (bwrap
    joins it with `--userns`; it lives as long as the descriptor is open).

    Made by a short-lived `unshare --user` whose maps this process, root outside, writes: a
    process cannot map more than its own id from inside its namespace."""
    proc = await asyncio.create_subprocess_exec(
        "unshare", "--user", "--", "/bin/sh", "-c", "echo; read _",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, cwd="/",
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        await proc.stdout.readline()  # it is in its namespace once it speaks
        return _map_and_open(proc.pid)
    except OSError as exc:
        raise FailedPrecondition(f"cannot make a machine's user namespace: {exc}") from exc
    finally:
        proc.stdin.close()
        if proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
