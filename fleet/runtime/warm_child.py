"""A warm parent's child on the namespace runtime: a copy-on-write fork of the parent's fork
server, run in namespaces of its own on its own overlay layer (see `fleet.runtime.warm`). What
its steps wrote is read, and what they are given is made, through `fleet.runtime.child_files`,
which follows nothing the fork server put there.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import structlog

from fleet.core.egress import EgressEvent
from fleet.core.errors import FailedPrecondition, Internal, InvalidArgument, NotFound, Unavailable
from fleet.core.rollout import MAX_OUTPUT_BYTES
from fleet.runtime import cgroups, resident, users
from fleet.runtime.base import (
    Channel,
    ExecResult,
    MachineSpec,
    Usage,
    machine_env,
    to_thread_to_the_end,
)
from fleet.runtime.child_files import open_beneath, open_dir_beneath, read_step_output
from fleet.runtime.namespace_machine import MachineMaker, NamespaceMachine
from fleet.runtime.output import OutputSink
from fleet.runtime.resident import Resident

# The file helpers have a module of their own (`fleet.runtime.child_files`); what the warm
# parent, the tests and the benchmarks reach through `fleet.runtime.warm_child` stays offered here.
__all__ = [
    "CHILD_CTL",
    "RESIDENT_SOCKET",
    "RESIDENT_START_S",
    "TAIL_CHUNK",
    "TAIL_S",
    "Parent",
    "WarmChild",
    "fitted_limit",
    "host_pid_of",
    "ns_pids",
    "open_beneath",
    "open_dir_beneath",
    "read_step_output",
]

log = structlog.get_logger(__name__)

CHILD_CTL = "/run/fleet"
"""The child's own directory (its `sockets`, read-only), as the child sees it."""
RESIDENT_SOCKET = "exec.sock"
RESIDENT_START_S = 10.0
TAIL_CHUNK = 1 << 20
TAIL_S = 0.02
"""How often a step's output files are read for a caller that shows output live."""


def ns_pids(pid: int) -> list[int]:
    """A process's pid in each pid namespace it is in, outermost first (/proc NSpid; [] when
    it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("NSpid:"):
                    return [int(field) for field in line.split()[1:]]
    except OSError:
        pass
    return []


def host_pid_of(candidates: list[int], ns_pid: int, depth: int) -> int | None:
    """The host pid of the process that is `ns_pid` in the pid namespace `depth` levels deep
    (NSpid has `depth` entries for a process right in it). The fork server's children are in
    its namespace: a process in a namespace nested below it (one the warm-up made, say) has
    an innermost pid of its own that may equal `ns_pid`, and is never taken for the child."""
    for pid in candidates:
        found = ns_pids(pid)
        if len(found) == depth and found[-1] == ns_pid:
            return pid
    return None


class Parent(Protocol):
    """What a child needs of its warm parent (`fleet.runtime.warm.NamespaceParent`): the
    parent's machine and control directory, its fork server's connections and replies, and
    the bookkeeping of its live children. Naming only this keeps this module below the
    parent's, which imports it."""

    children: set[WarmChild]

    @property
    def machine(self) -> NamespaceMachine: ...

    @property
    def runtime(self) -> MachineMaker: ...

    @property
    def ctl(self) -> Path: ...

    @property
    def own_pids(self) -> frozenset[int]: ...

    @property
    def ns_depth(self) -> int: ...

    async def call(self, request: dict[str, Any], fresh: bool = False) -> dict[str, Any]: ...

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]: ...

    def reply(self, line: bytes) -> dict[str, Any]: ...

    async def new_child(self, name: str) -> WarmChild: ...

    def fit_limit(self) -> None: ...


class WarmChild:
    """A copy-on-write child of a warm parent; each exec is a fresh fork on the child's layer."""

    def __init__(self, parent: Parent, name: str, cgroup: cgroups.MachineCgroup) -> None:
        self.parent = parent
        self._name = name
        self.cid = cgroup.name
        self.cgroup = cgroup
        self._deleted = False
        self.prepared_pid: int | None = None
        self._sockets_fd: int | None = None
        self._waiting: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        """The connection on which the fork server answers the wait for the running step."""
        self._oom_kills = 0
        """The cgroup's OOM kills as of the end of the last exec (a new group has none)."""
        self.resident: Resident | None = None
        """Its command server, once `stay_resident` started it (a session's child)."""

    @property
    def name(self) -> str:
        return self._name

    @property
    def layer(self) -> Path:
        return self.parent.ctl / "children" / self.cid

    @property
    def sockets(self) -> Path:
        """Where the agent puts the sockets this child reaches (`/run/fleet` in the child): the
        directory itself, held open (`/proc/self/fd/N`) from the first use on. The fork server
        runs the tenant's warm-up and can change its control directory: a link it put on the
        way is refused, and one it puts later cannot send the agent's sockets elsewhere."""
        if self._sockets_fd is None:
            self._sockets_fd = open_dir_beneath(
                self.parent.ctl, ("children", self.cid, "sockets"), make=True
            )
        return Path(f"/proc/self/fd/{self._sockets_fd}")

    async def _fork(self, step: dict[str, Any] | None) -> int:
        """Forks the child (set up, waiting for its step) and moves it into its cgroup."""
        reply = await self.parent.call({"op": "spawn", "id": self.cid, **(step or {})})
        return await asyncio.to_thread(self._adopt, int(reply["pid"]))

    def _adopt(self, ns_pid: int) -> int:
        """The forked child's host pid (among the parent's processes, the one whose innermost
        pid is `ns_pid`), after moving it into this child's cgroup. The parent's own processes
        (its sandbox's init and the fork server) are looked at last."""
        members = self.parent.machine.cgroup.members()
        fresh = [p for p in members if p not in self.parent.own_pids]
        depth = self.parent.ns_depth
        host_pid = host_pid_of(sorted(fresh, reverse=True), ns_pid, depth)  # the newest first
        if host_pid is None:  # (an own pid reused after its process exited: look at all)
            host_pid = host_pid_of(members, ns_pid, depth)
        if host_pid is None:
            raise Internal(f"child {self._name}: forked, but its host pid was not found")
        for procs in self.cgroup.procs_files:
            procs.write_text(str(host_pid))
        return host_pid

    async def prepare(self) -> None:
        """Forks ahead of need (the parent's pool): the next start only hands over the step."""
        self.prepared_pid = await self._fork(None)
        await self.parent.call({"op": "settle", "id": self.cid})  # (now in its own cgroup)

    async def start(
        self,
        argv: list[str],
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        stdin: bool = False,
    ) -> int:
        """Runs `argv` in a fresh fork of the parent (or the one prepared); returns its pid.
        With `stdin`, the step reads the file `put_stdin` left for it."""
        step = {
            "argv": argv, "hostname": self._name[:63],
            "env": machine_env(self.parent.machine.spec, env),
            "workdir": workdir or self.parent.machine.spec.smolfile.workdir or "/",
            "stdin": stdin,
        }  # fmt: skip
        if self.prepared_pid is not None:
            host_pid, self.prepared_pid = self.prepared_pid, None
            try:
                await self._go(step)
                return host_pid
            except Internal:  # the prepared fork died while it waited: fork afresh
                await self.wait()  # (reaped)
        host_pid = await self._fork(step)
        try:
            await self._go(step)
        except Internal as exc:
            if "is gone" not in str(exc):
                await self._stop_waiting()
                raise
            # Killed in its cgroup before its step began: `wait` reports what it died of, as
            # for a step killed while it ran.
            log.info("warm_child_gone_before_its_step", child=self._name)
        return host_pid

    async def _go(self, step: dict[str, Any]) -> None:
        """Hands the child its step, and asks, on the same connection, for its end: the fork
        server answers "go" at once and the wait when the step has ended, which `wait` reads
        (one connection and one exchange for both)."""
        reader = await self._asking_wait({"op": "go", "id": self.cid, "step": step})
        self.parent.reply(await _line(reader))

    async def wait(self) -> int:
        """The exit code of the step `start` began (or of the child, where it never ran it)."""
        reader = self._waiting[0] if self._waiting is not None else await self._asking_wait()
        line = await _line(reader)  # (cancelled, the reply stays for the next wait)
        await self._stop_waiting()
        return os.waitstatus_to_exitcode(int(self.parent.reply(line)["status"]))

    async def _asking_wait(self, *first: dict[str, Any]) -> asyncio.StreamReader:
        """A connection of its own to the fork server, carrying `first`, then the wait for this
        child's end (kept until `wait` reads its answer)."""
        await self._stop_waiting()  # (a wait for an earlier step never read)
        reader, writer = self._waiting = await self.parent.connect()
        requests = [*first, {"op": "wait", "id": self.cid}]
        writer.write("".join(json.dumps(r) + "\n" for r in requests).encode())
        return reader

    async def _stop_waiting(self) -> None:
        if self._waiting is not None:
            _, writer = self._waiting
            self._waiting = None
            await _closed(writer)

    def drop_wait(self) -> None:
        """Closes the connection a wait would be answered on (its fork server is gone)."""
        if self._waiting is not None:
            self._waiting[1].close()
            self._waiting = None

    async def exec(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        timeout_s: float,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
        on_output: OutputSink | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        if self._deleted:
            raise Unavailable(f"machine {self._name} was deleted")
        started = time.monotonic()
        oom_before = self._oom_kills
        if self.resident is not None:
            if not self.resident.alive:  # (a command killed it)
                await self.stay_resident()
            assert self.resident is not None
            try:
                code, got_out, got_err, timed_out = await self.resident.run(
                    argv, machine_env(self.parent.machine.spec, env),
                    workdir or self.parent.machine.spec.smolfile.workdir or "/", users.ROOT,
                    stdin=stdin, timeout_s=timeout_s, max_output_bytes=max_output_bytes,
                    on_output=on_output,
                )  # fmt: skip
            except resident.TooLarge:
                raise InvalidArgument(
                    f"{self._name}: the command and its environment take over "
                    f"{resident.MAX_REQUEST} bytes; write a long script to a file and run that"
                ) from None
            self._oom_kills = await asyncio.to_thread(self.cgroup.oom_kills)
            return ExecResult(
                exit_code=code, stdout=bytes(got_out.kept), stderr=bytes(got_err.kept),
                stdout_truncated=got_out.truncated, stderr_truncated=got_err.truncated,
                timed_out=timed_out, duration_s=time.monotonic() - started,
                oom_killed=self._oom_kills > oom_before,
            )  # fmt: skip
        # (A pool child's fork opened its output files when it was prepared, empty, and it has
        # had no stdin: with none to give it now, there is nothing to clear.)
        clear = ("stdout", "stderr") if self.prepared_pid is None else ()
        if clear or stdin is not None:
            await asyncio.to_thread(self._clear_outputs, stdin, clear)
        await self.start(argv, env, workdir, stdin=stdin is not None)
        timed_out = False
        waited = asyncio.ensure_future(self.wait())
        tail = None
        offsets = {"stdout": 0, "stderr": 0}  # (what the tail handed over of each)
        if on_output is not None:
            tail = asyncio.ensure_future(self._tail(on_output, waited, offsets))
        try:
            code = await asyncio.wait_for(asyncio.shield(waited), timeout_s)
        except TimeoutError:
            timed_out = True
            await asyncio.to_thread(self.cgroup.kill_all)
            code = await waited
        finally:
            if tail is not None:
                await tail
            if stdin is not None:
                await asyncio.to_thread(self._clear_outputs, None, ())
        # The rest of the output for the tail and the result's output, read in one trip.
        rest, ((out, out_cut), (err, err_cut)) = await asyncio.to_thread(
            self._last_read, offsets if on_output is not None else None, max_output_bytes
        )
        if on_output is not None:
            for stream, chunk in rest:
                on_output(stream, chunk)
        return ExecResult(
            exit_code=-int(signal.SIGKILL) if timed_out else code, stdout=out, stderr=err,
            stdout_truncated=out_cut, stderr_truncated=err_cut,
            timed_out=timed_out, duration_s=time.monotonic() - started,
            oom_killed=self._oom_kills > oom_before,
        )  # fmt: skip

    def _clear_outputs(
        self, stdin: bytes | None, outputs: tuple[str, ...] = ("stdout", "stderr")
    ) -> None:
        """The last step's output files gone (a live reader must not see them again), and this
        step's stdin in its place, a regular file made anew (nothing the fork server left
        there is followed)."""
        fd = open_dir_beneath(self.parent.ctl, ("children", self.cid), make=True)
        try:
            for name in outputs:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)
        sockets = open_dir_beneath(self.parent.ctl, ("children", self.cid, "sockets"), make=True)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink("stdin", dir_fd=sockets)
            if stdin is not None:
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                out = os.open("stdin", flags, 0o444, dir_fd=sockets)
                with os.fdopen(out, "wb") as f:
                    f.write(stdin)
        finally:
            os.close(sockets)

    async def _tail(
        self, sink: OutputSink, done: asyncio.Future[int], offsets: dict[str, int]
    ) -> None:
        """Hands `sink` what the step writes, as it writes it (read from its output files every
        TAIL_S), until the step has ended; `offsets` is how much of each file it handed over
        (the rest is read with the result, `_last_read`)."""
        while True:
            # First a wait (the step has only begun: nothing to read yet), so that a step
            # shorter than TAIL_S is read only with its result.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(done), TAIL_S)
            if done.done():
                return
            # Both files read in one trip to a worker thread.
            for stream, chunk in await asyncio.to_thread(self._read_new, dict(offsets)):
                offsets[stream] += len(chunk)
                sink(stream, chunk)

    def _last_read(
        self, offsets: dict[str, int] | None, limit: int
    ) -> tuple[list[tuple[str, bytes]], tuple[tuple[bytes, bool], tuple[bytes, bool]]]:
        """Once the step has ended: what its tail has not handed over yet (None: no tail), and
        its output as the result holds it (`_outputs`)."""
        rest = self._read_new(dict(offsets)) if offsets is not None else []
        return rest, self._outputs(limit)

    def _read_new(self, offsets: dict[str, int]) -> list[tuple[str, bytes]]:
        """What each output file holds past its offset, in chunks of at most TAIL_CHUNK."""
        got: list[tuple[str, bytes]] = []
        for stream, offset in offsets.items():
            more = True
            while more:
                parts = ("children", self.cid, stream)
                chunk, more = read_step_output(self.parent.ctl, parts, TAIL_CHUNK, offset)
                if chunk:
                    got.append((stream, chunk))
                    offset += len(chunk)
        return got

    async def fork(self, spec: MachineSpec) -> WarmChild:
        """A new child of the same parent whose layer starts as a copy of this child's (its
        files as they are now; no process carries over: each exec is a fresh fork anyway)."""
        if self._deleted:
            raise Unavailable(f"machine {self._name} was deleted")
        child = await self.parent.new_child(spec.name)
        try:
            reply = await self.parent.call(
                {"op": "copy", "from": self.cid, "id": child.cid}, fresh=True
            )
            if "error" in reply:
                raise Internal(f"{self._name}: cannot copy its layer: {reply['error']}")
        except BaseException:
            await child.delete()
            raise
        return child

    async def pack_layer(self, archive: Path, scratch: Path) -> int:
        """Not for a warm parent's child: its layer lives in its parent's fork server, which
        copies it only to another child of the same parent, so a session on one cannot park
        (it closes when idle instead)."""
        raise FailedPrecondition(
            f"machine {self._name} is a warm parent's child: its writable layer cannot be "
            "archived apart from its parent, so its session cannot be parked or moved"
        )

    def channel(self) -> Channel:
        """A child has no network of its own: the agent serves it on sockets in its
        /run/fleet."""
        return Channel("unix", self.sockets)

    async def stay_resident(self) -> None:
        """Keeps a command server running as this child's one process (the first of its PID
        namespace): later commands each cost a fork and an exec in it, instead of a fork of
        the parent that sets the child up again. It connects to a socket the agent puts in
        the child's /run/fleet."""
        if self._deleted:
            raise Unavailable(f"machine {self._name} was deleted")
        if self.resident is not None:
            if self.resident.alive:
                return
            await self.resident.close()  # (its process ended: the child may run one again)
            self.resident = None
        binary = await resident.program(self.parent.runtime.tools)
        await asyncio.to_thread(self._place, binary)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            listener.bind(f"{self.sockets}/{RESIDENT_SOCKET}")  # (through a held descriptor)
            listener.listen(1)
            listener.setblocking(False)
            await self.start(
                [f"{CHILD_CTL}/sessiond", "--connect", f"{CHILD_CTL}/{RESIDENT_SOCKET}"]
            )
            loop = asyncio.get_running_loop()
            try:
                conn, _ = await asyncio.wait_for(loop.sock_accept(listener), RESIDENT_START_S)
            except TimeoutError:
                await asyncio.to_thread(self.cgroup.kill_all)
                code = await self.wait()
                why = (await asyncio.to_thread(self._outputs, 2000))[1][0].decode(errors="replace")
                raise Unavailable(
                    f"machine {self._name}: its command server did not start (exit {code}): {why}"
                ) from None
        finally:
            listener.close()
        conn.setblocking(False)

        async def stop() -> None:
            try:
                await asyncio.wait_for(self.wait(), 5.0)
            except TimeoutError:
                await asyncio.to_thread(self.cgroup.kill_all)
                await self.wait()
            except (OSError, Internal, Unavailable):
                pass  # (the fork server or the child is gone already)

        self.resident = Resident(self._name, conn, stop)
        log.info("resident_started", machine=self._name)

    def _place(self, binary: Path) -> None:
        """The server's program in the child's /run/fleet (a regular file made anew: nothing
        the fork server left there is followed), and no stale socket where it connects."""
        sockets = open_dir_beneath(self.parent.ctl, ("children", self.cid, "sockets"), make=True)
        try:
            for name in ("sessiond", RESIDENT_SOCKET):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=sockets)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            with os.fdopen(os.open("sessiond", flags, 0o555, dir_fd=sockets), "wb") as f:
                f.write(binary.read_bytes())
        finally:
            os.close(sockets)

    async def read_file(self, path: str) -> bytes:
        result = await self.exec(["cat", "--", path], timeout_s=60)
        if result.exit_code != 0:
            raise NotFound(f"{self._name}:{path}: {result.stderr.decode(errors='replace').strip()}")
        return result.stdout

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        code = (
            "import base64, os, sys\n"
            f"open(sys.argv[1], 'wb').write(base64.b64decode({base64.b64encode(data)!r}))\n"
            f"os.chmod(sys.argv[1], {mode})\n"
        )
        result = await self.exec(["python3", "-c", code, path], timeout_s=60)
        if result.exit_code != 0:
            why = result.stderr.decode(errors="replace").strip()[-300:]
            raise InvalidArgument(f"{self._name}:{path}: cannot write: {why}")

    async def usage(self) -> Usage:
        return await asyncio.to_thread(self.cgroup.usage)

    async def egress_events(self) -> list[EgressEvent]:
        """A child's network is its loopback alone: nothing to refuse, nothing to report."""
        return []

    def _outputs(self, limit: int) -> tuple[tuple[bytes, bool], tuple[bytes, bool]]:
        """The step's stdout and stderr, at most `limit` bytes of each (and whether there was
        more). The fork server runs a tenant's warm-up and can change anything under its
        control directory, so these are opened without following a symbolic link anywhere
        below it and must be regular files: the agent reads them as the host's root, and a
        link to a host file would hand that file to the tenant as output."""
        self._oom_kills = self.cgroup.oom_kills()
        return (
            read_step_output(self.parent.ctl, ("children", self.cid, "stdout"), limit),
            read_step_output(self.parent.ctl, ("children", self.cid, "stderr"), limit),
        )

    async def delete(self) -> None:
        if self._deleted:
            return
        self._deleted = True
        if self.resident is not None:
            await self.resident.close()
        await self._stop_waiting()
        if self._sockets_fd is not None:
            os.close(self._sockets_fd)
            self._sockets_fd = None
        self.parent.children.discard(self)
        await to_thread_to_the_end(self._remove)  # (a delete marked done must finish)

    def _remove(self) -> None:
        self.cgroup.remove()
        shutil.rmtree(self.layer, True)
        self.parent.fit_limit()


async def _line(reader: asyncio.StreamReader) -> bytes:
    """The fork server's next answer ("": its connection is gone)."""
    try:
        return await reader.readline()
    except OSError:
        return b""


async def _closed(writer: asyncio.StreamWriter) -> None:
    """Closes a connection to the fork server and waits until it is (a transport left to close
    after its loop ends leaks its socket)."""
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


def fitted_limit(due: int, held: int | None, now: int | None, room: int) -> int:
    """A warm parent's next memory limit in bytes (see `NamespaceParent.fit_limit`): `due`,
    unless that is less than what it `held` plus `room`; then that, but no more than the limit
    it has `now`. Unknown usage or limit: `due`."""
    if held is None or now is None or due >= held + room:
        return due
    return max(due, min(now, held + room))
