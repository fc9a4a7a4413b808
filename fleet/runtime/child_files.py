"""A warm child's files in its parent's control directory, read and made by the agent as the
host's root without following anything put there. The fork server runs a tenant's warm-up and
can change anything under that directory, so every component below it is opened with
O_NOFOLLOW from a descriptor of the one above, and what the agent reads must be a regular file.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from fleet.core.errors import Internal


def open_dir_beneath(base: Path, parts: tuple[str, ...], make: bool = False) -> int:
    """A descriptor of the directory base/parts..., following no symbolic link at any of
    `parts` (`base` itself is the agent's own; a link is refused with Internal), made where
    missing with `make`."""
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts:
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
            try:
                inner = os.open(part, flags, dir_fd=fd)
            except FileNotFoundError:
                if not make:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                inner = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = inner
    except OSError as exc:
        os.close(fd)
        if isinstance(exc, FileNotFoundError):
            raise
        raise Internal(f"{'/'.join(parts)} under {base} was replaced: {exc.strerror}") from exc
    return fd


def open_beneath(base: Path, parts: tuple[str, ...], flags: int) -> int:
    """A descriptor of base/parts..., following no symbolic link at any of `parts`."""
    fd = open_dir_beneath(base, parts[:-1])
    try:
        return os.open(parts[-1], flags | os.O_NOFOLLOW, dir_fd=fd)
    finally:
        os.close(fd)


def read_step_output(
    base: Path, parts: tuple[str, ...], limit: int, offset: int = 0
) -> tuple[bytes, bool]:
    """At most `limit` bytes of a regular file under `base` (see `open_beneath`) from
    `offset` on, and whether it held more; (b"", False) when there is none. Anything else
    there is refused."""
    try:
        fd = open_beneath(base, parts, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return b"", False
    except OSError as exc:  # ELOOP (a link), ENOTDIR: not what the child was given
        raise Internal(f"step output {'/'.join(parts)} was replaced: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Internal(f"step output {'/'.join(parts)} was replaced: not a regular file")
        handle.seek(offset)
        data = handle.read(limit + 1)
    return data[:limit], len(data) > limit
