"""The `sandbox` marker: tests that run real namespace sandboxes (processes in a machine, its
files, cgroups, network namespaces, egress) carry it; the rest run on `fleet.testing`'s
in-memory runtime and need no root.

`tests/conftest.py` skips a marked test, saying why, on a host that cannot make a sandbox
(`unavailable`), and records whether the running test is marked, so that the harness's
namespace runtime refuses to start in a test that does not say it needs one (`require_marked`):
the marker then lists every test that needs root, and nothing else.
"""

from __future__ import annotations

import functools
import os
import subprocess

from fleet.runtime import cgroups
from fleet.runtime.namespace_machine import missing_tools

MARKER = "sandbox"

_marked = False
"""Whether the running test carries the marker."""


@functools.cache
def unavailable() -> str | None:
    """Why this host cannot run namespace sandboxes (None: it can). Asked once a session."""
    if os.geteuid() != 0:
        return "needs root (cgroups, network namespaces and loop-mounted disks)"
    missing = missing_tools()
    if missing:
        return f"needs {', '.join(missing)} on PATH (scripts/setup installs bubblewrap)"
    if cgroups.detect() is None:
        return "needs a cgroup hierarchy (v1 memory/pids/cpu, or v2) at /sys/fs/cgroup"
    # Root may still be denied namespaces (a container without CAP_SYS_ADMIN, a seccomp
    # profile): one empty sandbox says for sure.
    probe = ["bwrap", "--unshare-pid", "--unshare-net", "--ro-bind", "/", "/", "true"]
    try:
        done = subprocess.run(probe, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot make a namespace sandbox: {e}"
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip() or f"exit {done.returncode}"
        return f"cannot make a namespace sandbox: bwrap: {why}"
    return None


def entered(marked: bool) -> None:
    """A test starts (conftest's setup hook); `marked`: it carries the marker."""
    global _marked
    _marked = marked


def left() -> None:
    """The running test is done (conftest's teardown hook)."""
    global _marked
    _marked = False


def require_marked(what: str) -> None:
    """Refuses `what` (a real sandbox) to a running test not marked `sandbox`: the marker would
    then no longer name every test that needs root. Outside a test (the benchmarks use the
    harness too) there is no marker to ask for."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    if test and not _marked:
        raise AssertionError(
            f"{what} runs real sandboxes: the test {test} must carry @pytest.mark.{MARKER}"
        )
