"""What a namespace machine sees of the host, and how its directory is laid out: the
capability set it keeps, the parts of /proc and /sys it finds covered, the /etc files that make
it an ordinary box, and the layer and inputs it starts with. (Used by `namespace.py`, which
launches the machine.)"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from fleet.core.errors import FailedPrecondition
from fleet.runtime.base import MachineSpec
from fleet.runtime.cgroups import MachineCgroup

CAPABILITIES = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
)  # fmt: skip
"""What a machine's root may do (in its own user namespace): the set container runtimes grant
by default, and no more (no CAP_SYS_ADMIN, CAP_NET_ADMIN, CAP_SYS_PTRACE ...)."""
PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")
"""Under a machine's /proc, read-only: a machine's root is the host's root user (in a user
namespace, without capabilities outside it), and the kernel checks host-wide settings under
/proc/sys by that user: writable, `kernel.core_pattern` would run a program of the machine's
choosing as the host's root. bwrap covers only some of these, and not /proc/sys."""
PROC_MASKED = ("kcore", "keys", "timer_list", "sched_debug")
"""Under a machine's /proc, /dev/null in their place: the kernel's memory, the keys and the
host's timers and scheduler, nothing a workload needs."""
SYS_MASKED = ("firmware", "devices/virtual/powercap")
"""Under a machine's /sys, an empty directory in their place: firmware tables and energy
counters (a side channel), as container runtimes mask them."""


def proc_cover() -> list[str]:
    """bwrap arguments, after `--proc /proc`, for PROC_READ_ONLY and PROC_MASKED (those this
    kernel has: a bind needs its target)."""
    args: list[str] = []
    for name in PROC_READ_ONLY:
        args += ["--ro-bind-try", f"/proc/{name}", f"/proc/{name}"]
    for name in _here("/proc", PROC_MASKED):
        args += ["--dev-bind", "/dev/null", f"/proc/{name}"]  # (--ro-bind makes it nodev)
    return args


def sys_cover(cgroup: MachineCgroup) -> list[str]:
    """bwrap arguments for /sys: the host's, read-only, with SYS_MASKED hidden and only the
    machine's own cgroup (its limits, as programs read them) under /sys/fs/cgroup."""
    args = ["--ro-bind", "/sys", "/sys"]
    for name in _here("/sys", SYS_MASKED):
        args += ["--tmpfs", f"/sys/{name}", "--remount-ro", f"/sys/{name}"]
    args += ["--tmpfs", "/sys/fs/cgroup"]
    for controller, directory in cgroup.dirs.items():
        target = "/sys/fs/cgroup" if controller == "all" else f"/sys/fs/cgroup/{controller}"
        args += ["--ro-bind-try", str(directory), target]
    args += ["--remount-ro", "/sys/fs/cgroup"]
    return args


@functools.cache
def _here(base: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """Those of `names` this kernel has under `base` (they do not change while the agent runs)."""
    return tuple(name for name in names if os.path.exists(f"{base}/{name}"))


def etc_files(hostname: str, nameserver: str | None) -> dict[str, str]:
    """/etc/hosts, /etc/hostname and /etc/resolv.conf of a machine: `localhost` and its own name
    resolve; the resolver is its DNS forwarder, or none for a machine without a network."""
    hosts = (
        f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{hostname}\n"
    )
    if nameserver is not None:
        resolv = f"nameserver {nameserver}\noptions ndots:1\n"
    else:
        resolv = "# This machine has no network (its Smolfile asks for no egress).\n"
    return {"hosts": hosts, "hostname": hostname + "\n", "resolv.conf": resolv}


def lay_out(
    root: Path, layer: Path, spec: MachineSpec, files: Mapping[str, str],
    copy_of: Path | None = None,
) -> None:  # fmt: skip
    """A new machine's directories: its `lower` link to the image, its layer (a copy of the
    writable layer `copy_of`, for a fork) with the files that make it an ordinary box
    (/etc/hosts ...), and its inputs on its own disk (so that its mount table names no host
    path)."""
    (root / "lower").symlink_to(spec.rootfs)
    (root / "merged").mkdir()
    for sub in ("upper", "work"):
        (layer / sub).mkdir(exist_ok=True)
    if copy_of is not None:  # owners, modes, times, links, whiteouts and xattrs as they are
        done = subprocess.run(
            ["cp", "-a", "--reflink=auto", "--", f"{copy_of}/.", str(layer / "upper")],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise FailedPrecondition(
                f"machine {spec.name}: cannot copy its source's layer: {done.stderr.strip()[-300:]}"
            )
    etc = layer / "upper" / "etc"
    etc.mkdir(exist_ok=True)
    if (spec.rootfs / "etc").is_dir():
        shutil.copystat(spec.rootfs / "etc", etc)
    for name, text in files.items():
        target = etc / name
        target.unlink(missing_ok=True)  # (a link in the image is replaced, not followed)
        target.write_text(text)
        target.chmod(0o644)
    for i, (host, _) in enumerate(spec.inputs):
        (layer / "inputs").mkdir(mode=0o755, exist_ok=True)
        if os.path.isdir(host):
            shutil.copytree(host, layer / "inputs" / str(i), symlinks=True)
        else:
            shutil.copy2(host, layer / "inputs" / str(i))
