"""A namespace machine's resident command server, for a session's many small calls.

A rollout's step is one command in a sandbox set up for it (namespaces, overlay, cgroup,
system-call filter: about 10 ms of work per command on these machines). A session's caller
sends hundreds of commands, each costing that again. So a session's machine keeps one process
of its own (`sessiond.c`, started once the way any command is, in the same sandbox) that runs
each command with a fork and an exec: the agent passes it the command's stdin, stdout and
stderr as descriptors over a socket pair and reads the output from its own pipe ends, as it
does for a command run through bwrap.

What this changes for the session, on purpose: its commands share one sandbox, as they would
on an ordinary box: /tmp and /dev/shm keep their files between calls, and a process a command
leaves running in the background (`nohup server &`) keeps running until the session closes. A
command that times out has its process group killed (not the machine's whole cgroup).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import structlog

from fleet.core.errors import Unavailable
from fleet.runtime import users
from fleet.runtime.output import OutputSink

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).with_name("sessiond.c")
MAX_REQUEST = 200_000
"""A command whose argv and environment take more than this goes through bwrap instead (a
socket message of the server's holds 256 KiB)."""
GRACE_S = 0.05
"""After a command ended, how long its output may still arrive: a process it left in the
background can hold its pipes open for as long as it runs."""


async def program(tools: Path) -> Path:
    """The server's program in `tools` (built by `fleet.runtime.helpers` when the host is
    prepared or the runtime is made; `users.tool`)."""
    return await asyncio.to_thread(
        users.tool, tools, SOURCE, "a session on the namespace runtime", "resident command server"
    )


class ServedMachine(Protocol):
    """What the server needs of the machine it runs in: its name, its directory (which holds
    the system-call filter) and a way to start a process in its sandbox. Naming only this,
    not `fleet.runtime.namespace_machine.NamespaceMachine` (which starts the server), keeps
    this module below that one."""

    @property
    def name(self) -> str: ...

    @property
    def root(self) -> Path: ...

    async def spawn(
        self,
        argv: list[str],
        env: Mapping[str, str],
        workdir: str,
        filter_path: Path,
        *,
        keep_fds: tuple[int, ...] = (),
    ) -> asyncio.subprocess.Process: ...


class TooLarge(Exception):
    """The command does not fit one message to the server."""


@dataclass
class Capture:
    """A stream's output as it arrives: at most `limit` bytes kept, all handed to `sink`."""

    name: str
    limit: int
    sink: OutputSink | None
    kept: bytearray = field(default_factory=bytearray)
    truncated: bool = False

    async def pump(self, reader: asyncio.StreamReader) -> None:
        while chunk := await reader.read(65536):
            if self.sink is not None:
                self.sink(self.name, chunk)
            room = self.limit - len(self.kept)
            if room > 0:
                self.kept += chunk[:room]
            if len(chunk) > room:
                self.truncated = True


def exit_code(status: int) -> int:
    """A waitpid status as bwrap reports its command's: the exit code, or 128 + the signal."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status)


class Resident:
    """The server running in one machine, and the agent's end of its socket."""

    def __init__(self, name: str, sock: socket.socket, stop: Callable[[], Awaitable[None]]) -> None:
        self.name = name
        """The machine's."""
        self.sock = sock
        self._stop = stop
        self._seq = 0
        self._started: dict[int, asyncio.Future[int]] = {}
        self._exits: dict[int, asyncio.Future[int]] = {}
        self.gone = ""
        """Why the server is gone ("" while it runs)."""
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, machine: ServedMachine, tools: Path) -> Resident:
        binary = await program(tools)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fd = os.open(binary, os.O_RDONLY)
        try:
            proc = await machine.spawn(
                [f"/proc/self/fd/{fd}", str(theirs.fileno()), str(fd)], {}, "/",
                machine.root / "seccomp.bpf", keep_fds=(fd, theirs.fileno()),
            )  # fmt: skip
        finally:
            os.close(fd)
            theirs.close()
        ours.setblocking(False)
        log.info("resident_started", machine=machine.name)

        async def stop() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                await proc.wait()

        return cls(machine.name, ours, stop)

    @property
    def alive(self) -> bool:
        return not self.gone

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await loop.sock_recv(self.sock, 256)
                if not data:
                    break
                kind, *fields = data.rstrip(b"\0").split(b"\0")
                if kind == b"P":
                    seq, pid = int(fields[0]), int(fields[1])
                    self._exits[pid] = loop.create_future()
                    started = self._started.pop(seq, None)
                    if started is not None and not started.done():
                        started.set_result(pid)
                elif kind == b"E":
                    started = self._started.pop(int(fields[0]), None)
                    if started is not None and not started.done():
                        error = os.strerror(int(fields[1]))
                        why = f"machine {self.name}: cannot start a command: {error}"
                        started.set_exception(Unavailable(why))
                elif kind == b"X":
                    ended = self._exits.get(int(fields[0]))
                    if ended is not None and not ended.done():
                        ended.set_result(int(fields[1]))
        except (OSError, ValueError, IndexError) as exc:
            self.gone = f"its socket failed: {exc}"
        finally:
            self.gone = self.gone or "it exited"
            failure = Unavailable(f"machine {self.name}: its command server is gone ({self.gone})")
            for future in [*self._started.values(), *self._exits.values()]:
                if not future.done():
                    future.set_exception(failure)
                    future.exception()  # (retrieved: no warning when nobody waits on it)

    async def _send(self, payload: bytes, fds: list[int]) -> None:
        while True:
            try:
                socket.send_fds(self.sock, [payload], fds)
                return
            except BlockingIOError:
                await asyncio.sleep(0.001)

    async def run(
        self,
        argv: list[str],
        env: Mapping[str, str],
        cwd: str,
        user: users.StepUser,
        *,
        stdin: bytes | None,
        timeout_s: float,
        max_output_bytes: int,
        on_output: OutputSink | None,
    ) -> tuple[int, Capture, Capture, bool]:
        """(exit code, stdout, stderr, timed out) of one command."""
        if self.gone:
            raise Unavailable(f"machine {self.name}: its command server is gone")
        groups = ",".join(str(g) for g in user.groups) if not user.is_root else "-"
        words = [
            "R", str(self._seq + 1), str(user.uid), str(user.gid), groups, cwd, str(len(env)),
            *(f"{k}={v}" for k, v in env.items()), *argv,
        ]  # fmt: skip
        payload = "\0".join(words).encode() + b"\0"
        if len(payload) > MAX_REQUEST:
            raise TooLarge
        self._seq += 1
        seq = self._seq
        loop = asyncio.get_running_loop()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_w = None
        if stdin is None:
            in_r = os.open("/dev/null", os.O_RDONLY)
        else:
            in_r, in_w = os.pipe()
        started = self._started[seq] = loop.create_future()
        try:
            await self._send(payload, [in_r, out_w, err_w])
        except BaseException:
            self._started.pop(seq, None)
            for fd in (out_r, err_r, *((in_w,) if in_w is not None else ())):
                os.close(fd)
            raise
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        out = Capture("stdout", max_output_bytes, on_output)
        err = Capture("stderr", max_output_bytes, on_output)
        transports: list[asyncio.ReadTransport] = []
        pumps = []
        try:
            for fd, capture in ((out_r, out), (err_r, err)):
                reader = asyncio.StreamReader()
                protocol = asyncio.StreamReaderProtocol(reader)
                transport, _ = await loop.connect_read_pipe(
                    functools.partial(_same, protocol), os.fdopen(fd, "rb", 0)
                )
                transports.append(transport)
                pumps.append(asyncio.ensure_future(capture.pump(reader)))
            feeding = None
            if in_w is not None:
                feeding = asyncio.ensure_future(asyncio.to_thread(_feed, in_w, stdin or b""))
                in_w = None
            pid = await started
            ended = self._exits[pid]
            timed_out = False
            try:
                status = await asyncio.wait_for(asyncio.shield(ended), timeout_s)
            except TimeoutError:
                timed_out = True
                with contextlib.suppress(OSError):
                    await self._send(f"K\0{pid}\0".encode(), [])
                status = await self._ended(ended, err)
            except Unavailable:
                status = await self._ended(ended, err)
            finally:
                self._exits.pop(pid, None)
            _, late = await asyncio.wait(pumps, timeout=GRACE_S)
            for pump in late:  # (a background process holds the pipe: what came is kept)
                pump.cancel()
            if feeding is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(feeding, GRACE_S)
        finally:
            for pump in pumps:
                pump.cancel()
            for transport in transports:
                transport.close()
            if in_w is not None:
                os.close(in_w)
        code = -int(signal.SIGKILL) if timed_out else exit_code(status)
        return code, out, err, timed_out

    async def _ended(self, ended: asyncio.Future[int], err: Capture) -> int:
        """The command's status; or, where the server died under it (a command killed every
        process it could), a kill's, with a line on stderr saying so (the next call starts
        a new server)."""
        try:
            return await ended
        except Unavailable:
            err.kept += b"fleet: the machine's command server was killed while this ran\n"
            return int(signal.SIGKILL)

    async def close(self) -> None:
        self.gone = self.gone or "closed"
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        self.sock.close()  # (the server exits when its end reads nothing more)
        await self._stop()


def _same(protocol: asyncio.StreamReaderProtocol) -> asyncio.StreamReaderProtocol:
    return protocol


def _feed(fd: int, data: bytes) -> None:
    """Writes a command's stdin and closes it (what it does not read is dropped)."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        pass
    finally:
        os.close(fd)
