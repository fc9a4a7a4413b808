"""Per-machine cgroups for the namespace runtime: memory, cpu and pids limits, v1 or v2.

Each machine gets one cgroup (one per controller on v1 hosts) that all of its processes join
before they become the sandbox, so a limit covers everything the machine runs, an out-of-memory
kill is counted where the agent can read it, and deleting the machine kills and removes the
whole group.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from fleet.core.errors import Unavailable
from fleet.runtime.base import Usage

log = structlog.get_logger(__name__)

ROOT = Path("/sys/fs/cgroup")
DEFAULT_PIDS_MAX = 4096
CPU_PERIOD_US = 100_000


@dataclass(frozen=True)
class Limits:
    memory_mib: int
    cpus: int
    pids_max: int = DEFAULT_PIDS_MAX


def detect(root: Path = ROOT) -> str | None:
    """'v2' on a unified hierarchy, 'v1' where the v1 controllers are mounted, else None."""
    if (root / "cgroup.controllers").exists():
        return "v2"
    if all((root / c / "cgroup.procs").exists() for c in ("memory", "pids", "cpu")):
        return "v1"
    return None


def all_machines_cpu_seconds(root: Path = ROOT) -> float | None:
    """CPU time used by every machine this host has run, live or deleted (None where it cannot
    be read): the `fleet` parent group's own account, which keeps what removed groups used."""
    version = detect(root)
    if version is None:
        return None
    return MachineCgroup("", version, root).cpu_seconds()


@functools.lru_cache(maxsize=8)
def _v1_controllers(root: Path) -> tuple[str, ...]:
    """The v1 hierarchies a machine's group is made in (read once per root: a machine's group
    is named on the event loop, for every machine)."""
    controllers: tuple[str, ...] = ("memory", "pids", "cpu")
    # CPU time is accounted by cpuacct, a hierarchy of its own on some v1 hosts.
    if (root / "cpuacct").is_dir() and not (root / "cpu" / "cpuacct.usage").exists():
        controllers += ("cpuacct",)
    return controllers


class MachineCgroup:
    """The cgroup(s) of one machine (`name` empty: the `fleet` group that holds them all)."""

    def __init__(self, name: str, version: str, root: Path = ROOT) -> None:
        self.name = name
        self.version = version
        self._root = root
        # (Each path made from one string: a machine's group is named on the event loop, and
        # pathlib's `/` parses at every step.)
        if version == "v2":
            self.dirs = {"all": Path(f"{root}/fleet/{name}")}
        else:
            self.dirs = {c: Path(f"{root}/{c}/fleet/{name}") for c in _v1_controllers(root)}

    @property
    def procs_files(self) -> list[Path]:
        """Where a process writes its pid to join (every controller on v1)."""
        return [d / "cgroup.procs" for d in self.dirs.values()]

    def create(self, limits: Limits) -> None:
        try:
            if self.version == "v2":
                parent = self.dirs["all"].parent
                parent.mkdir(exist_ok=True)
                for level in (parent.parent, parent):
                    (level / "cgroup.subtree_control").write_text("+memory +pids +cpu")
                d = self.dirs["all"]
                d.mkdir(exist_ok=True)
                (d / "memory.max").write_text(str(limits.memory_mib * 1024 * 1024))
                if (d / "memory.swap.max").exists():
                    (d / "memory.swap.max").write_text("0")
                (d / "pids.max").write_text(str(limits.pids_max))
                (d / "cpu.max").write_text(f"{limits.cpus * CPU_PERIOD_US} {CPU_PERIOD_US}")
            else:
                for d in self.dirs.values():
                    d.mkdir(parents=True, exist_ok=True)
                self._set_v1_memory(limits.memory_mib * 1024 * 1024)
                (self.dirs["pids"] / "pids.max").write_text(str(limits.pids_max))
                cpu = self.dirs["cpu"]
                (cpu / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                (cpu / "cpu.cfs_quota_us").write_text(str(limits.cpus * CPU_PERIOD_US))
        except OSError as exc:
            self.remove()
            raise Unavailable(f"cannot set up cgroup for machine {self.name}: {exc}") from exc

    def set_memory_limit(self, mib: int) -> None:
        """Changes the memory limit (OSError where the group holds more than `mib` now)."""
        self.set_memory_limit_bytes(mib * 1024 * 1024)

    def set_memory_limit_bytes(self, limit: int, now: int | None = None) -> None:
        """Changes the memory limit; `now`: the limit it has, where the caller just read it."""
        if self.version == "v2":
            (self.dirs["all"] / "memory.max").write_text(str(limit))
        else:
            self._set_v1_memory(limit, now)

    def _set_v1_memory(self, limit: int, now: int | None = None) -> None:
        """memory.limit_in_bytes, and memory.memsw.limit_in_bytes (memory and swap together)
        to the same, where the kernel accounts swap: v1's memory limit alone bounds only what
        is resident, so on a host with swap a machine could hold its limit in memory and as
        much again in swap (v2: `memory.swap.max` 0). The kernel refuses a memsw limit below
        the memory limit, so a raise writes memsw first and a cut writes it last."""
        mem = self.dirs["memory"]
        resident, both = mem / "memory.limit_in_bytes", mem / "memory.memsw.limit_in_bytes"
        if not both.exists():
            resident.write_text(str(limit))
            return
        if limit > (now if now is not None else int(resident.read_text())):
            both.write_text(str(limit))
            resident.write_text(str(limit))
        else:
            resident.write_text(str(limit))
            both.write_text(str(limit))

    def memory_limit_bytes(self) -> int | None:
        """The group's memory limit now (None where it cannot be read, or there is none)."""
        return self._memory_figure("memory.max", "memory.limit_in_bytes")

    def memory_usage_bytes(self) -> int | None:
        """Memory charged to the group now (None where it cannot be read)."""
        return self._memory_figure("memory.current", "memory.usage_in_bytes")

    def memory_peak_bytes(self) -> int | None:
        """The most memory charged to the group at once (None where the kernel keeps no
        such figure: v2 before Linux 5.19)."""
        return self._memory_figure("memory.peak", "memory.max_usage_in_bytes")

    def _memory_figure(self, v2_file: str, v1_file: str) -> int | None:
        if self.version == "v2":
            source = self.dirs["all"] / v2_file
        else:
            source = self.dirs["memory"] / v1_file
        try:
            return int(source.read_text())
        except (OSError, ValueError):  # (v2's "max": no limit)
            return None

    def oom_kills(self) -> int:
        """How many processes the kernel killed for exceeding the memory limit."""
        if self.version == "v2":
            source = self.dirs["all"] / "memory.events"
        else:
            source = self.dirs["memory"] / "memory.oom_control"
        try:
            for line in source.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except OSError:
            pass
        return 0

    def pids_limit_hits(self) -> int:
        """How many forks the process limit refused (pids.events, v1 and v2 alike)."""
        directory = self.dirs.get("all") or self.dirs.get("pids")
        try:
            for line in (directory / "pids.events").read_text().splitlines():  # type: ignore[operator]
                key, _, value = line.partition(" ")
                if key == "max":
                    return int(value)
        except (OSError, TypeError, ValueError):
            pass
        return 0

    def usage(self) -> Usage:
        """CPU seconds and peak memory (MiB) of the machine so far, read in one go."""
        peak = self.memory_peak_bytes()
        return Usage(self.cpu_seconds(), None if peak is None else peak / (1 << 20))

    def cpu_seconds(self) -> float | None:
        """CPU time the machine's processes used so far (None where it cannot be read)."""
        try:
            if self.version == "v2":
                for line in (self.dirs["all"] / "cpu.stat").read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "usage_usec":
                        return int(value) / 1e6
                return None
            where = self.dirs.get("cpuacct", self.dirs["cpu"])
            return int((where / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return None

    def members(self) -> list[int]:
        """The processes in the group, read from one controller only (a process joins every
        controller's group at once: see `procs_files`); [] when it cannot be read."""
        try:
            return [int(p) for p in self.procs_files[0].read_text().split()]
        except OSError:
            return []

    def pids(self) -> list[int]:
        found: set[int] = set()
        for procs in self.procs_files:
            with contextlib.suppress(OSError):
                found.update(int(p) for p in procs.read_text().split())
        return sorted(found)

    def kill_all(self) -> None:
        """SIGKILL every process in the group, until none is left (bounded)."""
        for _ in range(50):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        log.warning("cgroup_processes_survived", machine=self.name, pids=self.pids())

    def remove(self) -> None:
        """Removes the group, killing whatever is still in it first. A group whose processes
        have all exited (the usual end of a machine) goes at once: listing members costs the
        kernel a sorted list per read (on v1, one per controller), paid only for a group that
        refuses removal because something is still in it."""
        killed = False
        for d in self.dirs.values():
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if not killed:
                        self.kill_all()
                        killed = True
                    else:
                        time.sleep(0.02)  # the last processes are still exiting

    def children(self) -> list[MachineCgroup]:
        """Cgroups of a warm parent's children (named `<parent>.<id>`), e.g. left by a kill."""
        found: set[str] = set()
        for d in self.dirs.values():
            for sub in d.parent.glob(f"{self.name}.*") if d.parent.exists() else []:
                found.add(sub.name)
        return [MachineCgroup(name, self.version, self._root) for name in sorted(found)]

    def exists(self) -> bool:
        return any(d.exists() for d in self.dirs.values())
