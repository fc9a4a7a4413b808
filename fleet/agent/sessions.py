"""An agent's interactive sessions: machines held for a caller's calls instead of a plan.

A session's attempt creates its machine as any rollout's does, then, instead of running steps,
holds it (`SessionHost.hold`) until the caller closes or parks it, it has been idle for its
`idle_timeout_s` (then it parks, or closes where its `on_idle` says so or its machine cannot
park), or its lease ends (deadline, cancel, lost lease). Parking stores the machine's writable
layer as an artifact of the attempt (`SESSION_LAYER_OUTPUT`) and ends the attempt; a resume
starts a new machine from it on any host. No process carries over. The server's calls come
down one stream the agent keeps open (`HostService.SessionCommands`): each command names the
session's lease (work id) and a call id; output chunks and the exit go back up tagged with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from fleet.api.pb import host_pb2, types_pb2
from fleet.core.errors import FailedPrecondition, FleetError
from fleet.core.manifest import OutputArtifact, SessionSpec
from fleet.core.rollout import Assignment
from fleet.runtime.base import Machine

log = structlog.get_logger(__name__)

MAX_SESSION_OUTPUT_BYTES = 256 << 20
"""A call's stdout (a file read) or stderr, or its stdin (a file written), at most."""
MAX_PENDING_STDIN_BYTES = 512 << 20
"""The stdin of all calls still arriving on this host together, at most: each is held whole
until its last piece, so this bounds what many calls at once (file writes) hold here."""
RECONNECT_S = 1.0

ParkLayer = Callable[[], Awaitable[OutputArtifact]]
"""Stores the session's layer as an artifact of its attempt (FleetError where it cannot)."""


@dataclass
class _Held:
    rollout_id: str
    machine: Machine
    spec: SessionSpec
    env: dict[str, str]
    last_used: float = field(default_factory=time.monotonic)
    busy: int = 0
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""
    park: ParkLayer | None = None
    layer: OutputArtifact | None = None
    """The layer it was parked with (stored), once parked."""
    parking: asyncio.Lock = field(default_factory=asyncio.Lock)


class SessionHost:
    """This host's end of the session stream, and the sessions it holds."""

    def __init__(self, host_id: str) -> None:
        self.host_id = host_id
        self._held: dict[str, _Held] = {}
        self._replies: asyncio.Queue[host_pb2.SessionReply] = asyncio.Queue()
        self._calls: set[asyncio.Task[None]] = set()
        self._stdin: dict[str, tuple[host_pb2.SessionCommand, bytearray]] = {}
        """Calls whose stdin is still arriving, by call id."""
        self.log = log.bind(host_id=host_id)

    async def hold(
        self, a: Assignment, machine: Machine, env: Mapping[str, str], spec: SessionSpec,
        park: ParkLayer | None = None,
    ) -> tuple[str, OutputArtifact | None]:  # fmt: skip
        """Holds the session's machine until it is closed, parked or idle; returns why it
        ended, and the layer stored where it parked (`park` stores it; None: it cannot)."""
        await machine.stay_resident()
        held = _Held(a.rollout_id, machine, spec, dict(env), park=park)
        self._held[a.work_id] = held
        self._replies.put_nowait(host_pb2.SessionReply(work_id=a.work_id, ready=True))
        self.log.info("session_ready", work_id=a.work_id, rollout_id=a.rollout_id)
        try:
            while not held.closed.is_set():
                idle = time.monotonic() - held.last_used
                if held.busy == 0 and idle >= spec.idle_timeout_s:
                    await self._idle(held, a.work_id)
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        held.closed.wait(), max(0.05, min(1.0, spec.idle_timeout_s - idle))
                    )
            return held.reason or "closed", held.layer
        finally:
            self._held.pop(a.work_id, None)
            self._replies.put_nowait(host_pb2.SessionReply(work_id=a.work_id, ready=False))

    async def _idle(self, held: _Held, work_id: str) -> None:
        """An idle session parks (its `on_idle`), or closes where it asked to or cannot."""
        idle = f"{held.spec.idle_timeout_s:g} s without a call"
        held.reason = f"closed after {idle}"
        if held.spec.on_idle != "park" or held.park is None:
            return
        try:
            await self._park(held)
            held.reason = f"parked after {idle}"
        except FleetError as exc:
            self.log.warning("session_not_parked", work_id=work_id, error=exc.message)
            held.reason = f"closed after {idle} (it could not park: {exc.message})"

    async def _park(self, held: _Held) -> OutputArtifact:
        """The session's layer stored (once, whoever asks first: a park call or idleness)."""
        async with held.parking:
            if held.layer is None:
                if held.park is None:
                    raise FailedPrecondition("this host's runtime cannot park its sessions")
                held.layer = await held.park()
            return held.layer

    def machine_of(self, rollout_id: str) -> Machine | None:
        """The machine of an open session held here (a fork's source), or None."""
        for held in self._held.values():
            if held.rollout_id == rollout_id and not held.closed.is_set():
                return held.machine
        return None

    async def serve(self, stub: Any, stop: asyncio.Event) -> None:
        """Keeps the session stream open (reconnecting) until `stop`."""
        while not stop.is_set():
            call = None
            try:
                # Each stream its own queue: a stream that ended may still have its reader
                # waiting on the old one, which would take (and lose) the next reply, such as
                # the ready of the first session opened after the server restarted.
                self._replies = asyncio.Queue()
                self._stdin.clear()  # (calls of a stream that ended: their server gave up)
                call = stub.SessionCommands(self._outgoing(self._replies))
                async for command in call:
                    self._start(command)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    self.log.warning("session_stream_lost", code=exc.code().name,
                                     error=exc.details())  # fmt: skip
            finally:
                # Ended or cancelled (the agent stopping): the call's task that feeds it our
                # replies ends too, instead of waiting on the queue until the process exits.
                if call is not None:
                    call.cancel()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), RECONNECT_S)

    async def _outgoing(
        self, replies: asyncio.Queue[host_pb2.SessionReply]
    ) -> AsyncIterator[host_pb2.SessionReply]:
        """One stream's replies: who this is, the sessions held now (again, after a
        reconnect), then what `replies` gets. A session held from here on says it is ready
        on this queue too (at worst twice, which is harmless)."""
        yield host_pb2.SessionReply(host_id=self.host_id)
        for work_id in list(self._held):
            yield host_pb2.SessionReply(work_id=work_id, ready=True)
        while True:
            yield await replies.get()

    def _start(self, command: host_pb2.SessionCommand) -> None:
        op = command.WhichOneof("op")
        if op == "exec" and command.exec.stdin_follows:
            self._stdin[command.call_id] = (command, bytearray(command.exec.stdin))
            return
        if op == "stdin":
            pending = self._stdin.get(command.call_id)
            if pending is None:
                self._reply(command, error="stdin for a call that is not waiting for it")
                return
            held = sum(len(data) for _, data in self._stdin.values())
            if held + len(command.stdin.data) > MAX_PENDING_STDIN_BYTES:
                del self._stdin[command.call_id]
                self.log.warning("session_stdin_refused", work_id=command.work_id,
                                 held_bytes=held, bound=MAX_PENDING_STDIN_BYTES)  # fmt: skip
                self._reply(
                    command,
                    error=f"resource exhausted: this host holds {held >> 20} MiB of stdin for "
                    "calls still arriving, and this call's next piece would take it over its "
                    f"bound of {MAX_PENDING_STDIN_BYTES >> 20} MiB: retry when fewer calls "
                    "write at once",
                )
                return
            pending[1].extend(command.stdin.data)
            if len(pending[1]) > MAX_SESSION_OUTPUT_BYTES:
                del self._stdin[command.call_id]
                self._reply(
                    command,
                    error=f"resource exhausted: stdin over {MAX_SESSION_OUTPUT_BYTES >> 20} MiB, "
                    "the bound per call",
                )
                return
            if not command.stdin.eof:
                return
            del self._stdin[command.call_id]
            command = pending[0]
            command.exec.stdin = bytes(pending[1])
        task = asyncio.create_task(self._run(command))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    def _reply(self, command: host_pb2.SessionCommand, **kind: Any) -> None:
        self._replies.put_nowait(
            host_pb2.SessionReply(call_id=command.call_id, work_id=command.work_id, **kind)
        )

    async def _run(self, command: host_pb2.SessionCommand) -> None:
        held = self._held.get(command.work_id)
        if held is None or held.closed.is_set():
            self._reply(command, error=f"no open session under lease {command.work_id} here")
            return
        if command.WhichOneof("op") == "close":
            held.reason = command.close.reason or "closed by its caller"
            held.closed.set()
            self._reply(command, exit=types_pb2.ExecExit(exit_code=0))
            return
        if command.WhichOneof("op") == "park":
            await self._park_call(command, held)
            return
        if held.parking.locked():
            self._reply(command, error="the session is parking: resume it to run commands")
            return
        ex = command.exec
        held.busy += 1
        held.last_used = time.monotonic()
        try:
            result = await held.machine.exec(
                list(ex.argv),
                env={**held.env, **dict(ex.env)},
                workdir=ex.cwd or None,
                timeout_s=ex.timeout_s or 600.0,
                max_output_bytes=min(ex.max_output_bytes or MAX_SESSION_OUTPUT_BYTES,
                                     MAX_SESSION_OUTPUT_BYTES),
                on_output=lambda stream, chunk: self._reply(command, **{stream: chunk}),
                stdin=ex.stdin if ex.stdin else None,
            )  # fmt: skip
        except Exception as exc:  # the machine is gone, or the call was malformed
            self._reply(command, error=f"{type(exc).__name__}: {exc}")
            return
        finally:
            held.busy -= 1
            held.last_used = time.monotonic()
        self._reply(
            command,
            exit=types_pb2.ExecExit(
                exit_code=result.exit_code, timed_out=result.timed_out,
                oom_killed=result.oom_killed, duration_s=result.duration_s,
                stdout_truncated=result.stdout_truncated,
                stderr_truncated=result.stderr_truncated,
            ),
        )  # fmt: skip

    async def _park_call(self, command: host_pb2.SessionCommand, held: _Held) -> None:
        """A park: the layer stored, the answer sent, then the session ends (its attempt
        reports the layer among its outputs)."""
        held.busy += 1  # (not idle meanwhile: the layer is stored once)
        try:
            layer = await self._park(held)
        except FleetError as exc:
            self._reply(command, error=f"cannot park: {exc.message}")
            return
        except Exception as exc:
            self.log.exception("session_park_failed", work_id=command.work_id)
            self._reply(command, error=f"cannot park: {type(exc).__name__}: {exc}")
            return
        finally:
            held.busy -= 1
        self.log.info("session_parked", work_id=command.work_id, digest=layer.digest,
                      bytes=layer.size)  # fmt: skip
        self._reply(command, parked=host_pb2.SessionParked(digest=layer.digest, size=layer.size))
        self._reply(command, exit=types_pb2.ExecExit(exit_code=0))  # (the call's end)
        held.reason = command.park.reason or "parked by its caller"
        held.closed.set()

    def close_all(self, reason: str, *, unparkable_only: bool = False) -> int:
        """Closes the sessions held here (`unparkable_only`: those whose machine cannot park,
        which a drain cannot move); returns how many."""
        closing = [
            held for held in self._held.values()
            if not held.closed.is_set() and not (unparkable_only and held.park is not None)
        ]  # fmt: skip
        for held in closing:
            held.reason = reason
            held.closed.set()
        return len(closing)
