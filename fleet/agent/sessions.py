"""An agent's interactive sessions: machines held for a caller's calls instead of a plan.

A session's attempt creates its machine as any rollout's does, then, instead of running steps,
holds it (`SessionHost.hold`) until the caller closes or parks it, it has been idle for its
`idle_timeout_s` (then it parks, or closes where its `on_idle` says so or its machine cannot
park), or its lease ends (deadline, cancel, lost lease). Parking stores the machine's writable
layer as an artifact of the attempt (`SESSION_LAYER_OUTPUT`) and ends the attempt; a resume
starts a new machine from it on any host. No process carries over.

The server's calls come down a stream the agent keeps open (`HostService.SessionCommands`):
each command names the session's lease (work id) and a call id; output chunks and the exit go
back up that same stream, tagged with it. An agent given several server replicas keeps one
stream open to each (`serve` once per replica, each over a channel of its own), so a session
call reaches the host through whichever replica the caller uses, not only the one its
heartbeats and claims go to. Each stream has its own replies and its own calls (call ids are
the replica's: two replicas may hand out the same one); whether a session is ready is told on
every stream, and a stream that (re)connects first says who this host is and which sessions it
holds. One address (one `dns:` name too) means one stream, which follows the link to whichever
replica it reaches.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
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
RECONNECT_S = 0.5
"""The first wait before a session stream that ended is opened again; it doubles while its
replica stays out of reach, up to RECONNECT_MAX_S, and starts again once it is back."""
RECONNECT_MAX_S = 4.0

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


@dataclass(eq=False)
class _Stream:
    """One session stream (to one replica) while it is open: the replies that go up it, and
    its calls whose stdin is still arriving, by call id (the replica's own ids)."""

    server: str
    replies: asyncio.Queue[host_pb2.SessionReply] = field(default_factory=asyncio.Queue)
    stdin: dict[str, tuple[host_pb2.SessionCommand, bytearray]] = field(default_factory=dict)

    def reply(self, command: host_pb2.SessionCommand, **kind: Any) -> None:
        self.replies.put_nowait(
            host_pb2.SessionReply(call_id=command.call_id, work_id=command.work_id, **kind)
        )


class SessionHost:
    """This host's end of the session streams (one per server replica), and the sessions it
    holds."""

    def __init__(self, host_id: str) -> None:
        self.host_id = host_id
        self._held: dict[str, _Held] = {}
        self._streams: set[_Stream] = set()
        """The streams open now (or opening), each with its own replies and calls."""
        self._calls: set[asyncio.Task[None]] = set()
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
        self._announce(a.work_id, ready=True)
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
            self._announce(a.work_id, ready=False)

    def _announce(self, work_id: str, *, ready: bool) -> None:
        """A session's machine ready (or gone), told to every replica: any may route its calls."""
        for stream in self._streams:
            stream.replies.put_nowait(host_pb2.SessionReply(work_id=work_id, ready=ready))

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

    async def serve(self, stub: Any, stop: asyncio.Event, server: str = "") -> None:
        """Keeps one session stream open through `stub` (reconnecting, with backoff while its
        server is out of reach) until `stop`. `server`: the replica it reaches, for the log;
        several replicas get one `serve` each."""
        log_ = self.log.bind(server=server) if server else self.log
        delay = RECONNECT_S
        lost = False  # (this outage logged: once, not at every try)
        while not stop.is_set():
            # Each stream its own queue: a stream that ended may still have its reader
            # waiting on the old one, which would take (and lose) the next reply, such as
            # the ready of the first session opened after the server restarted. Calls of a
            # stream that ended go with it (their server gave up on them).
            stream = _Stream(server)
            self._streams.add(stream)
            call = None
            try:
                call = stub.SessionCommands(self._outgoing(stream))
                await call.wait_for_connection()
                if lost:
                    log_.info("session_stream_restored")
                lost, delay = False, RECONNECT_S
                async for command in call:
                    self._start(stream, command)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    if not lost:
                        log_.warning("session_stream_lost", code=exc.code().name,
                                     error=exc.details(), retry_s=delay)  # fmt: skip
                    lost = True
            finally:
                self._streams.discard(stream)
                # Ended or cancelled (the agent stopping): the call's task that feeds it our
                # replies ends too, instead of waiting on the queue until the process exits.
                if call is not None:
                    call.cancel()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(delay * 2, RECONNECT_MAX_S)

    async def _outgoing(self, stream: _Stream) -> AsyncIterator[host_pb2.SessionReply]:
        """One stream's replies: who this is, the sessions held now (again, after a
        reconnect), then what its queue gets. A session held from here on says it is ready
        on this stream too (at worst twice, which is harmless)."""
        yield host_pb2.SessionReply(host_id=self.host_id)
        for work_id in list(self._held):
            yield host_pb2.SessionReply(work_id=work_id, ready=True)
        while True:
            yield await stream.replies.get()

    def _start(self, stream: _Stream, command: host_pb2.SessionCommand) -> None:
        """A command that came down `stream`: its replies go back up the same stream."""
        op = command.WhichOneof("op")
        if op == "exec" and command.exec.stdin_follows:
            stream.stdin[command.call_id] = (command, bytearray(command.exec.stdin))
            return
        if op == "stdin":
            pending = stream.stdin.get(command.call_id)
            if pending is None:
                stream.reply(command, error="stdin for a call that is not waiting for it")
                return
            # (The bound is the host's: what every stream's calls hold together.)
            held = sum(len(data) for s in self._streams for _, data in s.stdin.values())
            if held + len(command.stdin.data) > MAX_PENDING_STDIN_BYTES:
                del stream.stdin[command.call_id]
                self.log.warning("session_stdin_refused", work_id=command.work_id,
                                 held_bytes=held, bound=MAX_PENDING_STDIN_BYTES)  # fmt: skip
                stream.reply(
                    command,
                    error=f"resource exhausted: this host holds {held >> 20} MiB of stdin for "
                    "calls still arriving, and this call's next piece would take it over its "
                    f"bound of {MAX_PENDING_STDIN_BYTES >> 20} MiB: retry when fewer calls "
                    "write at once",
                )
                return
            pending[1].extend(command.stdin.data)
            if len(pending[1]) > MAX_SESSION_OUTPUT_BYTES:
                del stream.stdin[command.call_id]
                stream.reply(
                    command,
                    error=f"resource exhausted: stdin over {MAX_SESSION_OUTPUT_BYTES >> 20} MiB, "
                    "the bound per call",
                )
                return
            if not command.stdin.eof:
                return
            del stream.stdin[command.call_id]
            command = pending[0]
            command.exec.stdin = bytes(pending[1])
        task = asyncio.create_task(self._run(stream, command))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _run(self, stream: _Stream, command: host_pb2.SessionCommand) -> None:
        reply = functools.partial(stream.reply, command)
        held = self._held.get(command.work_id)
        if held is None or held.closed.is_set():
            reply(error=f"no open session under lease {command.work_id} here")
            return
        if command.WhichOneof("op") == "close":
            held.reason = command.close.reason or "closed by its caller"
            held.closed.set()
            reply(exit=types_pb2.ExecExit(exit_code=0))
            return
        if command.WhichOneof("op") == "park":
            await self._park_call(reply, command, held)
            return
        if held.parking.locked():
            reply(error="the session is parking: resume it to run commands")
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
                on_output=lambda kind, chunk: reply(**{kind: chunk}),
                stdin=ex.stdin if ex.stdin else None,
            )  # fmt: skip
        except Exception as exc:  # the machine is gone, or the call was malformed
            reply(error=f"{type(exc).__name__}: {exc}")
            return
        finally:
            held.busy -= 1
            held.last_used = time.monotonic()
        reply(
            exit=types_pb2.ExecExit(
                exit_code=result.exit_code, timed_out=result.timed_out,
                oom_killed=result.oom_killed, duration_s=result.duration_s,
                stdout_truncated=result.stdout_truncated,
                stderr_truncated=result.stderr_truncated,
            ),
        )  # fmt: skip

    async def _park_call(
        self, reply: Callable[..., None], command: host_pb2.SessionCommand, held: _Held
    ) -> None:
        """A park: the layer stored, the answer sent, then the session ends (its attempt
        reports the layer among its outputs)."""
        held.busy += 1  # (not idle meanwhile: the layer is stored once)
        try:
            layer = await self._park(held)
        except FleetError as exc:
            reply(error=f"cannot park: {exc.message}")
            return
        except Exception as exc:
            self.log.exception("session_park_failed", work_id=command.work_id)
            reply(error=f"cannot park: {type(exc).__name__}: {exc}")
            return
        finally:
            held.busy -= 1
        self.log.info("session_parked", work_id=command.work_id, digest=layer.digest,
                      bytes=layer.size)  # fmt: skip
        reply(parked=host_pb2.SessionParked(digest=layer.digest, size=layer.size))
        reply(exit=types_pb2.ExecExit(exit_code=0))  # (the call's end)
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
