"""The namespace runtime's C helpers, built once per host before any machine needs them.

Three small programs run in every machine's sandbox: `capbound.c` cuts each command's bounding
set, `stepexec.c` switches to a Smolfile's `user`, `sessiond.c` serves a session's commands.
They are compiled with the host's C compiler (`users.tool`: statically linked, so that they run
in any image) into a tools directory (`Paths.tools`), each named by its source's hash: a
changed source is a missing program, never a stale one run by mistake.

`fleet host prepare` builds them when a host is set up (scripts/setup, the wheel's smoke run).
A runtime that finds one missing builds it when it is made, which is at an agent's start-up,
before the agent claims any work, and says so: no rollout ever waits on a compiler.
"""

from __future__ import annotations

import hashlib
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from fleet.core.errors import Unavailable
from fleet.runtime import capabilities, resident, users

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Helper:
    source: Path
    needed_by: str
    """What cannot run without it (for the error when it cannot be built)."""
    what: str


HELPERS = (
    Helper(capabilities.SOURCE, "the namespace runtime", "capability-bounding helper"),
    Helper(users.SOURCE, "a Smolfile's `user` on the namespace runtime", "user-switching helper"),
    Helper(resident.SOURCE, "a session on the namespace runtime", "resident command server"),
)


def program(tools: Path, helper: Helper) -> Path:
    """Where `helper`'s program built from its current source lives (`users.tool`'s name)."""
    digest = hashlib.sha256(helper.source.read_bytes()).hexdigest()[:16]
    return tools / f"{helper.source.stem}-{digest}"


def missing(tools: Path) -> list[Helper]:
    """The helpers whose current source has no program in `tools` (new, or changed since)."""
    return [helper for helper in HELPERS if not program(tools, helper).is_file()]


def prepare(tools: Path) -> list[Path]:
    """Builds every helper `tools` lacks; returns the programs it built (none: all were there).

    FailedPrecondition, saying what to install, where the host has no C compiler or no static
    C library; Unavailable where `tools` cannot be written or the compiler hangs."""
    built = []
    try:
        for helper in missing(tools):
            built.append(users.tool(tools, helper.source, helper.needed_by, helper.what))
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(
            f"cannot build the namespace runtime's helpers in {tools}: {exc}"
        ) from exc
    return built


def ensure(tools: Path) -> None:
    """At a runtime's making: builds what `fleet host prepare` did not, and says so."""
    started = time.monotonic()
    built = prepare(tools)
    if built:
        log.info(
            "runtime_helpers_built", tools=str(tools), built=[p.name for p in built],
            seconds=round(time.monotonic() - started, 3),
            note="built at start-up, before any work; `fleet host prepare` builds them at setup",
        )  # fmt: skip
