"""Warm parents on the namespace runtime: a fork server per parent, copy-on-write children.

The parent is a namespace machine whose one long-running process is `zygote.py` (the fork
server): it runs the warm-up once, then forks a child per step. Each child shares the parent's
memory pages until it writes them, runs in its own user/mount/UTS/IPC namespaces on its own
overlay layer (over the parent's layer and the image: branching copies no files), under the
full system-call filter with a cold machine's capabilities (as the warm-up runs too), and in
its own cgroup, which the agent moves it into before it may start. Deleting a child kills its
cgroup and removes its layer; children go before their parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog

from fleet.core.errors import Internal, InvalidArgument, Unavailable
from fleet.runtime import cgroups, seccomp
from fleet.runtime.base import Machine, MachineSpec, machine_env
from fleet.runtime.namespace import SOCKET_LINKS, NamespaceRuntime
from fleet.runtime.namespace_machine import KEPT, LAUNCH_ENV, NamespaceMachine
from fleet.runtime.warm_child import (
    WarmChild,
    _closed,
    fitted_limit,
    ns_pids,
)

log = structlog.get_logger(__name__)

CHILD_ALLOWANCE_MIB = 4
"""What a warm parent's memory limit grows by for each live child (see `fit_limit`)."""

ZYGOTE = Path(__file__).with_name("zygote.py")


def _descendant_running(pid: int, program: bytes, marker: bytes) -> int | None:
    """The first process under `pid` (itself included) running `program` (its argv[0]) with
    `marker` among its arguments."""
    todo = [pid]
    while todo:
        current = todo.pop(0)
        try:
            argv = Path(f"/proc/{current}/cmdline").read_bytes().split(b"\0")
            if argv[0].endswith(program) and marker in argv[1:]:
                return current
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return None


class NamespaceParent:
    """A warm parent: its fork server, and the children it has."""

    carries_memory = True
    """Children are forks of the fork server that ran the warm-up."""

    def __init__(self, runtime: NamespaceRuntime, machine: NamespaceMachine) -> None:
        self.runtime = runtime
        self.machine = machine
        self.spec = machine.spec
        self.ctl = machine.layer / "ctl"  # the children's layers: on the parent's disk
        self.children: set[WarmChild] = set()
        self.pool_size = 0
        self._pool: list[WarmChild] = []
        self._refills: set[asyncio.Task[None]] = set()
        self._proc: asyncio.subprocess.Process | None = None
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()
        self.own_pids: frozenset[int] = frozenset()
        """The host pids of the parent's own processes (its sandbox's init, the fork server),
        once the fork server is ready: never a child's."""
        self.ns_depth = 0
        """How deep the fork server's pid namespace is (its children's NSpid length)."""
        self._held_up = False  # its limit is above its due (`fit_limit`): said once, not each time
        # Unix socket paths are limited to 108 bytes: reach the socket through a short link.
        self._link = SOCKET_LINKS / uuid.uuid4().hex[:12]

    @classmethod
    async def create(
        cls, runtime: NamespaceRuntime, machine: NamespaceMachine, warmup: str,
        timeout_s: float = 300.0, pool_size: int = 0,
    ) -> NamespaceParent:  # fmt: skip
        """Starts the parent; `pool_size` children are kept forked ahead of need."""
        if not machine.user.is_root:
            await machine.delete()
            raise InvalidArgument(
                f"user = {machine.spec.smolfile.user!r}: a warm parent ([branch]) runs its "
                "children as root on the namespace runtime; remove `user` or `[branch]`"
            )
        parent = cls(runtime, machine)
        parent.pool_size = pool_size
        try:
            await parent._start(warmup, timeout_s)
            await parent._refill()
        except BaseException:
            await parent.delete()
            raise
        return parent

    async def _start(self, warmup: str, timeout_s: float) -> None:
        ctl, root = self.ctl, self.machine.root
        await asyncio.to_thread(self._prepare, warmup)
        self._proc = await self.machine.spawn(
            ["python3", "-u", "/run/fleet/zygote.py"],
            machine_env(self.machine.spec, None), "/", root / "zygote.bpf",
            extra=["--bind", str(ctl), "/run/fleet",
                   "--ro-bind", str(self.machine.spec.rootfs), "/run/fleet/lower",
                   "--ro-bind", str(self.machine.layer / "upper"), "/run/fleet/parent-upper"],
            stdin=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert self._proc.stdout is not None and self._proc.stderr is not None
        try:
            line = await asyncio.wait_for(self._proc.stdout.readline(), timeout_s)
            if line.strip() == b"map-ids":  # its own user namespace: every id mapped, by us
                await self._map_fork_server_ids()
                line = await asyncio.wait_for(self._proc.stdout.readline(), timeout_s)
        except TimeoutError:
            line = b""
        if line.strip() == b"warm-up-failed":  # it prints the traceback, then exits
            try:
                err = await asyncio.wait_for(self._proc.stderr.read(), 30)
            finally:
                self._kill()
            raise InvalidArgument(
                f"warm parent {self.machine.name}: its warm-up raised: "
                f"{err.decode(errors='replace')[-800:]}"
            )
        if line.strip() != b"ready":
            err = b""
            if self._proc.returncode is not None or not line:
                self._kill()
                err = await self._proc.stderr.read()
            raise Unavailable(
                f"warm parent {self.machine.name}: its warm-up did not finish: "
                f"{err.decode(errors='replace')[-800:] or 'no output'}"
            )
        self.own_pids = frozenset(await asyncio.to_thread(self.machine.cgroup.members))
        self.ns_depth = await self._fork_server_depth()
        # The branch point: one throwaway child takes the first-fork costs (the kernel's and
        # the cgroup controllers' lazy set-up), so a rollout's first child does not.
        probe = await self.branch("branch-point")
        await probe.start(["python3", "-c", "pass"])
        code = await probe.wait()
        await probe.delete()
        if code != 0:
            raise Unavailable(f"warm parent {self.machine.name}: a probe child exited {code}")
        log.info("warm_parent_ready", machine=self.machine.name)

    async def _map_fork_server_ids(self) -> None:
        """Maps every id in the user namespace the fork server just made (its mounts locked
        there), written from the machine's own namespace (the only place allowed to), then
        lets it go on."""
        assert self._proc is not None and self._proc.stdin is not None
        pid = await asyncio.to_thread(
            _descendant_running, self._proc.pid, b"python3", b"/run/fleet/zygote.py"
        )
        if pid is None or self.machine.userns is None:
            raise Unavailable(f"warm parent {self.machine.name}: its fork server is gone")
        script = (
            'for m in uid_map gid_map; do echo "0 0 4294967295" > "/proc/$1/$m" || exit 1; done'
        )
        mapper = await asyncio.create_subprocess_exec(
            "nsenter", f"--user=/proc/{os.getpid()}/fd/{self.machine.userns}", "--",
            "/bin/sh", "-c", script, "map", str(pid),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            env=LAUNCH_ENV, cwd="/",
        )  # fmt: skip
        _, err = await mapper.communicate()
        if mapper.returncode != 0:
            raise Unavailable(
                f"warm parent {self.machine.name}: cannot map its fork server's ids: "
                f"{err.decode(errors='replace').strip()[-300:]}"
            )
        self._proc.stdin.write(b"\n")
        await self._proc.stdin.drain()

    async def _fork_server_depth(self) -> int:
        """The fork server's pid namespace depth, from the process listening on its socket
        (the kernel names it to a connecting peer, in this process's own namespace)."""
        _reader, writer = await asyncio.open_unix_connection(str(self._link / "zygote.sock"))
        try:
            sock = writer.get_extra_info("socket")
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid = struct.unpack("3i", creds)[0]
        finally:
            await _closed(writer)
        depth = len(await asyncio.to_thread(ns_pids, pid))
        if depth == 0:
            raise Unavailable(f"warm parent {self.machine.name}: its fork server is gone")
        return depth

    def _prepare(self, warmup: str) -> None:
        """The fork server's files: itself, the warm-up, both system-call filters and the
        capabilities a machine keeps."""
        ctl, root = self.ctl, self.machine.root
        for sub in ("children", "lower", "parent-upper"):
            (ctl / sub).mkdir(parents=True, exist_ok=True)
        SOCKET_LINKS.mkdir(parents=True, exist_ok=True)
        self._link.symlink_to(ctl)
        shutil.copyfile(ZYGOTE, ctl / "zygote.py")
        (ctl / "warmup.py").write_text(warmup)
        (ctl / "child.bpf").write_bytes(seccomp.program())
        (ctl / "caps").write_text(f"{KEPT:x}\n")
        (root / "zygote.bpf").write_bytes(seccomp.program(allow=seccomp.ZYGOTE_ALLOWS))

    async def call(self, request: dict[str, Any], fresh: bool = False) -> dict[str, Any]:
        """One request to the fork server (a wait gets a connection of its own)."""
        if fresh:
            reader, writer = await self.connect()
            try:
                writer.write((json.dumps(request) + "\n").encode())
                return dict(json.loads(await reader.readline()))
            finally:
                await _closed(writer)
        async with self._lock:
            try:
                if self._conn is None:
                    self._conn = await self.connect()
                reader, writer = self._conn
                writer.write((json.dumps(request) + "\n").encode())
                line = await reader.readline()
            except OSError:
                line = b""
            if not line and self._conn is not None:
                await _closed(self._conn[1])
                self._conn = None  # the next call connects afresh
        return self.reply(line)

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection of its own to the fork server (it serves each in a thread of its own)."""
        return await asyncio.open_unix_connection(str(self._link / "zygote.sock"))

    def reply(self, line: bytes) -> dict[str, Any]:
        """A reply of the fork server's, read as a line ("": it is gone, or its connection)."""
        if not line:
            raise Unavailable(f"warm parent {self.machine.name}: its fork server is gone")
        reply = dict(json.loads(line))
        if "error" in reply:
            raise Internal(f"warm parent {self.machine.name}: {reply['error']}")
        return reply

    async def branch(self, name: str) -> WarmChild:
        """A new child: one of the pool's, already forked, when there is one."""
        if self._pool:
            child = self._pool.pop(0)
            child._name = name
            self._refills.add(asyncio.get_running_loop().create_task(self._refill()))
            return child
        return await self.new_child(name)

    async def _refill(self) -> None:
        try:
            while len(self._pool) < self.pool_size and self._proc is not None:
                child = await self.new_child("pool")
                await child.prepare()
                self._pool.append(child)
        except Exception:  # the pool is an optimisation: a failed refill leaves it shorter
            log.exception("warm_pool_refill_failed", machine=self.machine.name)

    async def new_child(self, name: str) -> WarmChild:
        """A new child in a cgroup of its own, forked when it is prepared or first run (a
        child's `fork` asks for one too)."""
        cid = f"{self.machine.root.name}.{uuid.uuid4().hex[:8]}"
        cgroup = cgroups.MachineCgroup(cid, self.runtime.cgroup_version)
        limits = cgroups.Limits(
            memory_mib=self.machine.spec.smolfile.memory_mib_effective,
            cpus=self.machine.spec.smolfile.cpus_effective,
        )
        child = WarmChild(self, name, cgroup)
        self.children.add(child)

        def create() -> None:
            try:
                cgroup.create(limits)
            except BaseException:
                self.children.discard(child)
                raise
            self.fit_limit()

        await asyncio.to_thread(create)
        return child

    def fit_limit(self) -> None:
        """The parent's memory limit: its Smolfile's, plus CHILD_ALLOWANCE_MIB per live child.

        A page the fork server writes after a fork is copied for it, and the children go on
        mapping the original, which stays charged to the parent's cgroup (the kernel charges a
        page where it was first touched, and moves no charges). So the parent's cgroup holds
        about 1-2 MiB per live child (measured with the gridworld warm-up) besides the warm
        state itself; without the allowance a pool of 48 children exhausted a 256 MiB parent.

        Lowered, it stops one allowance above what the parent holds now. Lowered to just
        above it, the parent's next fork would find no room and the kernel would kill the fork
        server (lowered below it, cgroup v2 kills at once; v1 refuses the write). It is never
        raised on account of what the parent holds, only of its children: a warm-up that keeps
        allocating meets the limit it has.
        """
        cgroup = self.machine.cgroup
        mib = self.machine.spec.smolfile.memory_mib_effective
        due = (mib + CHILD_ALLOWANCE_MIB * len(self.children)) * 1024 * 1024
        held, now = cgroup.memory_usage_bytes(), cgroup.memory_limit_bytes()
        limit = fitted_limit(due, held, now, CHILD_ALLOWANCE_MIB * 1024 * 1024)
        if (limit != due) != self._held_up:
            self._held_up = limit != due
            log.info("warm_parent_limit_held_up" if self._held_up else "warm_parent_limit_due",
                     machine=self.machine.name, due_mib=due >> 20, held_mib=(held or 0) >> 20,
                     limit_mib=limit >> 20)  # fmt: skip
        try:
            cgroup.set_memory_limit_bytes(limit, now)
        except OSError as exc:  # lowering below what it holds now: it stays higher for now
            log.info("warm_parent_limit_kept", machine=self.machine.name,
                     wanted_mib=limit >> 20, error=str(exc))  # fmt: skip

    def _kill(self) -> None:
        """Kills the fork server; the connections to it go too, its children's waits among
        them (their transports close on the loop's next turn)."""
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None
        for child in self.children:
            child.drop_wait()

    async def delete(self) -> None:
        for task in self._refills:
            task.cancel()
        await asyncio.gather(*self._refills, return_exceptions=True)
        self._pool.clear()
        for child in list(self.children):  # children go before their parent
            await child.delete()
        if self._conn is not None:
            await _closed(self._conn[1])
            self._conn = None
        self._kill()
        if self._proc is not None:
            await self._proc.wait()
        await asyncio.to_thread(self._link.unlink, True)
        await self.machine.delete()


class WarmNamespaceRuntime(NamespaceRuntime):
    """The namespace runtime with warm parents: a fork server in the parent's sandbox that
    loaded the warm-up, and children forked from it (their Python state carried)."""

    forks_children = True

    async def create_parent(
        self, spec: MachineSpec, warmup: str, pool_size: int,
        prepare: Callable[[Machine], Awaitable[None]],
    ) -> NamespaceParent:  # fmt: skip
        # The parent itself reaches nothing: its children get the gateway as a socket.
        machine = await self.create(spec.model_copy(update={"gateway": None}))
        try:
            await prepare(machine)
        except BaseException:
            await machine.delete()
            raise
        return await NamespaceParent.create(self, machine, warmup, pool_size=pool_size)
