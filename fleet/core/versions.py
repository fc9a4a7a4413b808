"""Which agent versions a server serves: its own minor version and the one before it (any
patch release of either).

An agent newer than its server may send what the server cannot read; one more than a minor
version older may lack what the server now relies on. Both are refused when they register,
with a message that says which side to upgrade.
"""

from __future__ import annotations

import re

from fleet.core.errors import FailedPrecondition

_VERSION = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?(?:[.+-]?\w+)*")


def parse(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of `1.2.3`, `1.2`, `1.2.3rc1`, `1.2.3+local`."""
    found = _VERSION.fullmatch(version.strip())
    if found is None:
        raise FailedPrecondition(f"agent version {version!r} is not MAJOR.MINOR[.PATCH]")
    return int(found[1]), int(found[2]), int(found[3] or 0)


def check_agent(agent: str, server: str, host_id: str = "") -> None:
    """Refuses an agent this server does not serve (FAILED_PRECONDITION saying what to do)."""
    who = f"agent {host_id!r}" if host_id else "the agent"
    if not agent:
        raise FailedPrecondition(
            f"{who} reports no version (it predates version reporting): upgrade the agent to "
            f"fleet {server}"
        )
    a, s = parse(agent), parse(server)
    if a[:2] > s[:2]:  # (a newer patch release speaks the same protocol)
        raise FailedPrecondition(
            f"{who} runs fleet {agent}, newer than this server's {server}: upgrade the server "
            "first (servers serve agents of their own minor version and the one before)"
        )
    if a[0] != s[0] or s[1] - a[1] > 1:
        raise FailedPrecondition(
            f"{who} runs fleet {agent}, more than one minor version older than this server's "
            f"{server}: upgrade the agent"
        )
