"""Interactive sessions on the server: `SessionService` for callers, and the hub that routes
each call to the host holding the session's machine over that host's session stream.

A session is a rollout whose manifest has a `session` and no steps: placed, leased, recorded,
audited and limited like any rollout (label `fleet.session=1`). Its attempt is held by one
host; calls go to that host and nowhere else. A host whose stream is gone fails the calls
waiting on it, and later ones, with UNAVAILABLE naming it: a session is never re-created
elsewhere behind its caller's back (its retry policy allows one attempt). It moves only by
parking (its disk kept, its machine freed) and resuming (`fleet.server.session_moves`): asked
by its caller, when idle, or when its host drains.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import BinaryIO, cast

import grpc
import structlog

from fleet import safepath
from fleet.api import convert
from fleet.api.convert import session_on_idle
from fleet.api.pb import fleet_pb2, fleet_pb2_grpc, host_pb2, types_pb2
from fleet.core.errors import (
    FailedPrecondition,
    FleetError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from fleet.core.lifecycle import RolloutState
from fleet.core.manifest import (
    DEFAULT_SESSION_LIFETIME,
    SessionSpec,
    SubmitRequest,
    check_machine_path,
    validate_request,
)
from fleet.core.retry import RetryPolicy
from fleet.core.rollout import Rollout
from fleet.core.smolfile import is_env_name
from fleet.ledger.parks import parked_layer
from fleet.server.core import Core
from fleet.server.fleet_service import FleetServicer
from fleet.server.hub import SessionHub
from fleet.server.session_moves import SessionMoves, layer_requirements
from fleet.server.session_moves import session_pb as moved_pb

log = structlog.get_logger(__name__)

SESSION_LABEL = "fleet.session"
FORK_LABEL = "fleet.fork_of"
MAX_FORKS = 64
DEFAULT_IDLE_S = 600.0
DEFAULT_READY_S = 300.0
MAX_FILE_BYTES = 256 << 20
"""A file written or read through a session, at most."""
CHUNK = 1 << 20
FILE_CALLS_PER_SESSION = 4
FILE_CALLS_PER_TENANT = 8
FILE_CALLS_PER_SERVER = 16
"""File calls (WriteFile, ReadFile) in flight at once: each holds up to MAX_FILE_BYTES on its
way through the server and the session's host, so these bound what they hold together."""
SPOOL_BYTES = 1 << 20
"""What of a file call's data the server keeps in memory; the rest waits in a temporary file."""
TAR_LIMITS = safepath.Limits(max_members=200_000, max_bytes=MAX_FILE_BYTES)
"""A directory read from a session: the bounds of the archive fleet makes of it."""


class FileCalls:
    """The session file calls in flight on this server, by session and by tenant, each count
    under its bound (RESOURCE_EXHAUSTED names the one reached)."""

    def __init__(self) -> None:
        self.by_session: collections.Counter[str] = collections.Counter()
        self.by_tenant: collections.Counter[str] = collections.Counter()
        self.total = 0

    @contextlib.contextmanager
    def hold(self, session_id: str, tenant: str) -> Iterator[None]:
        if self.by_session[session_id] >= FILE_CALLS_PER_SESSION:
            raise ResourceExhausted(
                f"session {session_id} has {FILE_CALLS_PER_SESSION} file calls in flight, "
                "the bound per session: retry when one ends"
            )
        if self.by_tenant[tenant] >= FILE_CALLS_PER_TENANT:
            raise ResourceExhausted(
                f"tenant {tenant} has {FILE_CALLS_PER_TENANT} session file calls in flight, "
                "the bound per tenant: retry when one ends"
            )
        if self.total >= FILE_CALLS_PER_SERVER:
            raise ResourceExhausted(
                f"this server has {FILE_CALLS_PER_SERVER} session file calls in flight, its "
                "bound: retry when one ends"
            )
        self.by_session[session_id] += 1
        self.by_tenant[tenant] += 1
        self.total += 1
        try:
            yield
        finally:
            self.total -= 1
            for counter, key in ((self.by_session, session_id), (self.by_tenant, tenant)):
                counter[key] -= 1
                if counter[key] <= 0:
                    del counter[key]


def exec_commands(
    work_id: str, ex: host_pb2.SessionExec, stdin: bytes
) -> tuple[host_pb2.SessionCommand, list[host_pb2.SessionCommand]]:
    """An exec for the host, with its stdin in 1 MiB pieces: the first in the command, the rest
    in stdin commands after it (one gRPC message holds 4 MiB at most)."""
    ex.stdin = stdin[:CHUNK]
    ex.stdin_follows = len(stdin) > CHUNK
    more = [
        host_pb2.SessionCommand(
            stdin=host_pb2.SessionStdin(
                data=stdin[offset : offset + CHUNK], eof=offset + CHUNK >= len(stdin)
            )
        )
        for offset in range(CHUNK, len(stdin), CHUNK)
    ]
    return host_pb2.SessionCommand(work_id=work_id, exec=ex), more


def _check_read(path: str, done: types_pb2.ExecExit, err: bytearray) -> None:
    """A read whose command failed: NOT_FOUND with what the machine said."""
    if done.exit_code != 0:
        raise NotFound(f"{path}: {err.decode(errors='replace').strip()[-500:]}")


def session_state(rollout: Rollout) -> str:
    if rollout.state in (RolloutState.QUEUED, RolloutState.RUNNING):
        return "OPEN"
    return (
        "CLOSED"
        if rollout.state in (RolloutState.SUCCEEDED, RolloutState.CANCELLED)
        else ("FAILED")
    )


def session_pb(rollout: Rollout, host_id: str = "") -> fleet_pb2.Session:
    out = fleet_pb2.Session(
        id=rollout.id, state=session_state(rollout), host_id=host_id, tenant=rollout.tenant,
        error=rollout.error,
    )  # fmt: skip
    out.opened_at.FromDatetime(rollout.created_at.astimezone(UTC))
    return out


class SessionServicer(fleet_pb2_grpc.SessionServiceServicer):  # type: ignore[misc]
    def __init__(self, core: Core, hub: SessionHub) -> None:
        self.core = core
        self.hub = hub
        self.fleet = FleetServicer(core)
        self._known: dict[str, tuple[str, str, str]] = {}
        """Open sessions: id -> (tenant, work id, host id)."""
        self.files = FileCalls()
        self.moves = SessionMoves(self)

    def _lifetime(self, asked: float) -> float:
        """A session's lifetime in seconds (0: the default), within the server's deadline cap."""
        lifetime = asked or DEFAULT_SESSION_LIFETIME.total_seconds()
        if not 0 < lifetime <= self.core.config.max_deadline_s:
            raise InvalidArgument(
                f"max_lifetime_s must be in (0, {self.core.config.max_deadline_s:g}], "
                f"got {lifetime}"
            )
        return lifetime

    async def _session(self, session_id: str) -> Rollout:
        """The caller's session (NOT_FOUND for another tenant's, as for an unknown id)."""
        rollout = await self.core.db(self.core.ledger.get, session_id)
        self.core.caller().check_owner(session_id, rollout.tenant)
        if rollout.manifest.session is None:
            raise NotFound(f"{session_id} is a rollout, not a session")
        return rollout

    async def _holder(self, session_id: str) -> tuple[str, str]:
        """(work id, host id) of an open session's machine. Remembered while the host says the
        machine is ready, so that a call costs no ledger read (ownership checked each time)."""
        known = self._known.get(session_id)
        if known is not None:
            tenant, work_id, host_id = known
            self.core.caller().check_owner(session_id, tenant)
            if self.hub.is_ready(host_id, work_id):
                return work_id, host_id
            del self._known[session_id]  # closed, or its host went away: the ledger says which
        _, rollout, park = await self.moves.current(session_id)
        if parked_layer(rollout, park) is not None:
            raise FailedPrecondition(f"session {session_id} is parked: resume it first")
        if rollout.state.final:
            raise FailedPrecondition(
                f"session {session_id} is {session_state(rollout).lower()}"
                + (f": {rollout.error}" if rollout.error else "")
            )
        lease = await self.core.db(self.core.ledger.rollout_lease, rollout.id)
        if lease is not None and lease[1] not in self.hub.links:
            raise Unavailable(
                f"session {session_id}: host {lease[1]}, which holds its machine, is not "
                "connected (lost or restarting); the session is not moved elsewhere"
            )
        if lease is None or not self.hub.is_ready(lease[1], lease[0]):
            raise Unavailable(
                f"session {session_id} is not ready (its machine is starting or closing)"
            )
        if len(self._known) > 100_000:
            self._known.clear()
        self._known[session_id] = (rollout.tenant, *lease)
        return lease

    async def OpenSession(
        self, request: fleet_pb2.OpenSessionRequest, context: grpc.aio.ServicerContext
    ) -> fleet_pb2.Session:
        now = datetime.now(UTC)
        lifetime = self._lifetime(request.max_lifetime_s)
        tenant = self.core.caller().tenant_for(request.tenant)
        submit = SubmitRequest(
            idempotency_key=request.idempotency_key or uuid.uuid4().hex,
            smolfile=request.smolfile, smolfile_name=request.smolfile_name or "<smolfile>",
            steps=(), deadline=now + timedelta(seconds=lifetime),
            retry=RetryPolicy(max_attempts=1),
            labels={**request.labels, SESSION_LABEL: "1"}, tenant=tenant,
            requirements=convert.requirements_from_pb(request.requirements),
            session=SessionSpec(
                idle_timeout_s=request.idle_timeout_s or DEFAULT_IDLE_S,
                on_idle=session_on_idle(request.on_idle),
            ),
            models=tuple(request.models), max_prompt_tokens=request.max_prompt_tokens,
            max_completion_tokens=request.max_completion_tokens,
        )  # fmt: skip
        parsed = await asyncio.to_thread(
            validate_request, submit, now, timedelta(seconds=self.core.config.max_deadline_s)
        )
        rollout, _ = await self.fleet.admit(submit, parsed, now, request_id=request.request_id)
        return await self._until_ready(
            rollout.id, request.ready_timeout_s or DEFAULT_READY_S, "OpenSession"
        )

    async def _until_ready(self, session_id: str, wait: float, call: str) -> fleet_pb2.Session:
        """The session once its host says its machine is ready; FAILED_PRECONDITION if its
        attempt ended first, UNAVAILABLE after `wait` seconds (it stays open)."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + wait
        while True:
            changed = self.hub.changed
            rollout = await self.core.db(self.core.ledger.get, session_id)
            if rollout.state.final:
                raise FailedPrecondition(f"session {rollout.id} did not open: {rollout.error}")
            lease = await self.core.db(self.core.ledger.rollout_lease, rollout.id)
            if lease is not None and self.hub.is_ready(lease[1], lease[0]):
                log.info("session_opened", session_id=rollout.id, host_id=lease[1])
                return session_pb(rollout, lease[1])
            left = give_up - loop.time()
            if left <= 0:
                raise Unavailable(
                    f"session {rollout.id} is not ready after {wait:g} s (still "
                    f"{rollout.state.value.lower()}); it stays open: call {call} again "
                    "with the same idempotency_key to wait more"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(left, 0.5))

    async def ForkSession(
        self, request: fleet_pb2.ForkSessionRequest, context: grpc.aio.ServicerContext
    ) -> fleet_pb2.ForkSessionResponse:
        count = request.count or 1
        if not 1 <= count <= MAX_FORKS:
            raise InvalidArgument(f"count must be in [1, {MAX_FORKS}], got {request.count}")
        now = datetime.now(UTC)
        lifetime = self._lifetime(request.max_lifetime_s)
        first, source, park = await self.moves.current(request.session_id)
        assert source.manifest.session is not None
        idle = request.idle_timeout_s or source.manifest.session.idle_timeout_s
        layer = parked_layer(source, park)
        needs = source.manifest.requirements
        if layer is not None:  # a parked session's copies start from its layer, on any host
            host_id = ""  # (of the namespace runtime, which alone can start from a layer)
            spec = SessionSpec(idle_timeout_s=idle, layer=layer.digest, layer_size=layer.size)
            needs = layer_requirements(needs)
        else:
            _, host_id = await self._holder(request.session_id)  # open, its host connected
            # (The rollout holding the session now: the one whose machine its host holds.)
            spec = SessionSpec(idle_timeout_s=idle, fork_of=source.id, host=host_id)
        labels = {**request.labels, SESSION_LABEL: "1", FORK_LABEL: first.id}
        key = request.idempotency_key or uuid.uuid4().hex
        deadline = now + timedelta(seconds=lifetime)
        manifest = source.manifest.model_copy(
            update={"session": spec, "deadline": deadline, "requirements": needs}
        )
        forks = [
            SubmitRequest(
                idempotency_key=f"{key}/fork-{i}", smolfile=manifest.smolfile,
                smolfile_name=manifest.smolfile_name, steps=(), deadline=deadline,
                retry=manifest.retry, labels=labels, tenant=source.tenant,
                requirements=manifest.requirements, session=spec, models=manifest.models,
                max_prompt_tokens=manifest.max_prompt_tokens,
                max_completion_tokens=manifest.max_completion_tokens,
            )
            for i in range(count)
        ]  # fmt: skip
        # (The forks differ only by their keys: one check is every fork's.)
        await asyncio.to_thread(
            validate_request, forks[0], now, timedelta(seconds=self.core.config.max_deadline_s)
        )
        if layer is not None:
            await self.moves.check_layer_placeable(first.id, manifest.host_class, needs)
        # All forks in one transaction: a crash stores all of them or none, and a retry with
        # the same key finds every one it stored.
        stored = await self.core.db(
            functools.partial(
                self.core.ledger.submit_many,
                max_active_per_tenant=self.core.config.max_active_per_tenant,
            ),
            [(fork, manifest) for fork in forks], now.timestamp(),
        )  # fmt: skip
        if any(created for _, created in stored):
            self.core.changed()
        ids = [rollout_id for rollout_id, _ in stored]
        log.info("session_fork_submitted", session_id=first.id, forks=ids, host_id=host_id,
                 parked=layer is not None, request_id=request.request_id)  # fmt: skip
        wait = request.ready_timeout_s or DEFAULT_READY_S
        ready = await asyncio.gather(*(self._until_ready(i, wait, "ForkSession") for i in ids))
        return fleet_pb2.ForkSessionResponse(sessions=ready)

    async def Exec(
        self, request: fleet_pb2.ExecRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[fleet_pb2.ExecOutput]:
        argv = list(request.argv) or (["/bin/sh", "-c", request.shell] if request.shell else [])
        if not argv or not argv[0]:
            raise InvalidArgument("exec: give argv or shell")
        if any("\0" in a for a in argv) or any("\0" in v for v in request.env.values()):
            raise InvalidArgument("exec: a NUL in argv or in an env value")
        for k in request.env:
            if not is_env_name(k):
                raise InvalidArgument(f"exec: env name {k[:100]!r} is not [A-Za-z_][A-Za-z0-9_]*")
        work_id, host_id = await self._holder(request.session_id)
        command, more = exec_commands(
            work_id,
            host_pb2.SessionExec(
                argv=argv, env=dict(request.env), cwd=request.cwd, timeout_s=request.timeout_s,
            ),
            request.stdin,
        )  # fmt: skip
        async for reply in self.hub.call(host_id, request.session_id, command, more):
            kind = reply.WhichOneof("kind")
            if kind == "stdout":
                yield fleet_pb2.ExecOutput(stdout=reply.stdout)
            elif kind == "stderr":
                yield fleet_pb2.ExecOutput(stderr=reply.stderr)
            elif kind == "exit":
                yield fleet_pb2.ExecOutput(exit=reply.exit)

    async def _file_call(self, session_id: str) -> tuple[str, str, str]:
        """(work id, host id, tenant) of the open session a file call goes to."""
        work_id, host_id = await self._holder(session_id)
        known = self._known.get(session_id)
        tenant = known[0] if known is not None else (await self._session(session_id)).tenant
        return work_id, host_id, tenant

    async def _output(
        self, session_id: str, holder: tuple[str, str, str], argv: list[str], err: bytearray,
        stdin: bytes = b"",
    ) -> AsyncIterator[bytes | types_pb2.ExecExit]:  # fmt: skip
        """A command's stdout as it arrives, then its exit; the tail of its stderr is kept in
        `err` for the error a failed command gives. More stdout than MAX_FILE_BYTES is
        RESOURCE_EXHAUSTED."""
        work_id, host_id, _ = holder
        command, more = exec_commands(
            work_id,
            host_pb2.SessionExec(argv=argv, timeout_s=600, max_output_bytes=MAX_FILE_BYTES + 1),
            stdin,
        )
        seen = 0
        try:
            async for reply in self.hub.call(host_id, session_id, command, more):
                kind = reply.WhichOneof("kind")
                if kind == "stdout":
                    seen += len(reply.stdout)
                    if seen > MAX_FILE_BYTES:
                        raise ResourceExhausted(f"over {MAX_FILE_BYTES >> 20} MiB")
                    yield reply.stdout
                elif kind == "stderr":
                    err += reply.stderr
                    del err[:-4096]
                elif kind == "exit":
                    yield reply.exit
        except FailedPrecondition as exc:  # (the host refused it: one of its bounds, say)
            if ": resource exhausted: " in exc.message:
                raise ResourceExhausted(exc.message) from None
            raise

    async def WriteFile(
        self, requests: AsyncIterator[fleet_pb2.WriteFileChunk], context: grpc.aio.ServicerContext
    ) -> fleet_pb2.WriteFileResponse:
        session_id = path = ""
        mode = 0o644
        tar = False
        size = 0
        with contextlib.ExitStack() as stack:
            spool = stack.enter_context(tempfile.SpooledTemporaryFile(SPOOL_BYTES))
            holder = ("", "", "")
            async for chunk in requests:
                if not session_id:
                    session_id, path, mode = chunk.session_id, chunk.path, chunk.mode or 0o644
                    tar = chunk.tar
                    check_machine_path(path, "path")
                    holder = await self._file_call(session_id)  # before any data is taken
                    stack.enter_context(self.files.hold(session_id, holder[2]))
                size += len(chunk.data)
                if size > MAX_FILE_BYTES:
                    raise ResourceExhausted(f"{path}: over {MAX_FILE_BYTES >> 20} MiB")
                spool.write(chunk.data)
            if not session_id:
                raise InvalidArgument("WriteFile: no chunk named a session and a path")
            if tar:
                script = 'mkdir -p -- "$1" && exec tar -x -f - -C "$1"'
                argv = ["/bin/sh", "-c", script, "unpack", path]
            else:
                script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1" && chmod "$2" "$1"'
                argv = ["/bin/sh", "-c", script, "write", path, f"{mode & 0o7777:o}"]
            spool.seek(0)
            done, err = types_pb2.ExecExit(), bytearray()
            async for part in self._output(session_id, holder, argv, err, spool.read()):
                if isinstance(part, types_pb2.ExecExit):
                    done = part
        if done.exit_code != 0:
            why = err.decode(errors="replace")[-500:]
            if tar and done.exit_code == 127:
                why = f"the machine's image has no tar ({why.strip()})"
            raise FailedPrecondition(f"{path}: cannot {'unpack' if tar else 'write'}: {why}")
        return fleet_pb2.WriteFileResponse(size=size)

    async def ReadFile(
        self, request: fleet_pb2.ReadFileRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[fleet_pb2.FileChunk]:
        """The file streamed as the machine sends it (never held whole here), or a directory
        as a tar archive fleet makes anew from what the machine's `tar` sent (a program the
        workload may have replaced): only fleet's archive reaches the caller."""
        check_machine_path(request.path, "path")
        holder = await self._file_call(request.session_id)
        with self.files.hold(request.session_id, holder[2]):
            if request.tar:
                async for data in self._read_tree(request.session_id, holder, request.path):
                    yield fleet_pb2.FileChunk(data=data)
                return
            argv = ["head", "-c", str(MAX_FILE_BYTES + 1), "--", request.path]
            sent, err = False, bytearray()
            async for part in self._output(request.session_id, holder, argv, err):
                if isinstance(part, types_pb2.ExecExit):
                    _check_read(request.path, part, err)
                elif part:
                    sent = True
                    yield fleet_pb2.FileChunk(data=part)
            if not sent:
                yield fleet_pb2.FileChunk()

    async def _read_tree(
        self, session_id: str, holder: tuple[str, str, str], path: str
    ) -> AsyncIterator[bytes]:
        argv = ["tar", "-c", "-f", "-", "-C", path, "."]
        with (
            tempfile.SpooledTemporaryFile(SPOOL_BYTES) as sent,
            tempfile.SpooledTemporaryFile(SPOOL_BYTES) as made,
        ):
            err = bytearray()
            async for part in self._output(session_id, holder, argv, err):
                if isinstance(part, types_pb2.ExecExit):
                    _check_read(path, part, err)
                else:
                    sent.write(part)
            sent.seek(0)
            try:
                await asyncio.to_thread(
                    safepath.repack_tar, cast(BinaryIO, sent), cast(BinaryIO, made), TAR_LIMITS,
                    devices="skip",
                )  # fmt: skip
            except safepath.UnsafeArchive as exc:
                raise FailedPrecondition(
                    f"{path}: the archive the machine sent is refused: {exc.message}"
                ) from None
            made.seek(0)
            while data := made.read(CHUNK):
                yield data

    async def CloseSession(
        self, request: fleet_pb2.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> fleet_pb2.Session:
        caller = self.core.caller()
        first, rollout, park = await self.moves.current(request.session_id)
        self._known.pop(request.session_id, None)
        if parked_layer(rollout, park) is not None:
            await self.moves.close_parked(request.session_id, first, park)
            park = await self.core.db(self.core.ledger.session_park, request.session_id)
        elif not rollout.state.final:
            lease = await self.core.db(self.core.ledger.rollout_lease, rollout.id)
            link = self.hub.links.get(lease[1]) if lease is not None else None
            if lease is not None and link is not None:
                command = host_pb2.SessionCommand(
                    work_id=lease[0], close=host_pb2.SessionClose(reason="closed by its caller")
                )
                with contextlib.suppress(FleetError):
                    async for _ in self.hub.call(lease[1], request.session_id, command):
                        pass
                rollout = await self._until_final(rollout.id)
            if not rollout.state.final:  # not reachable on a host: ended in the ledger
                actor = "client" + (f" key:{caller.key_id}" if caller.key_id else "")
                rollout = await self.core.db(
                    self.core.ledger.cancel, rollout.id, "closed by its caller",
                    actor, datetime.now(UTC).timestamp(),
                )  # fmt: skip
                self.core.changed()
        log.info("session_closed", session_id=request.session_id, state=rollout.state.value)
        return moved_pb(request.session_id, first, rollout, park)

    async def _until_final(self, session_id: str, wait_s: float = 10.0) -> Rollout:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + wait_s
        while True:
            rollout = await self.core.db(self.core.ledger.get, session_id)
            if rollout.state.final or loop.time() >= give_up:
                return rollout
            await self.core.event_pulse.wait(0.2)

    async def ListSessions(
        self, request: fleet_pb2.ListSessionsRequest, context: grpc.aio.ServicerContext
    ) -> fleet_pb2.ListSessionsResponse:
        caller = self.core.caller()
        rollouts, _ = await self.core.db(
            functools.partial(
                self.core.ledger.list_rollouts,
                tenant=None if caller.all_tenants else caller.tenant,
            ),
            500, "", {SESSION_LABEL: "1"}, "",
        )  # fmt: skip
        out = []
        for first in rollouts:
            current, park = await self.moves._current(first)
            lease = None
            if not current.state.final:
                lease = await self.core.db(self.core.ledger.rollout_lease, current.id)
            out.append(moved_pb(first.id, first, current, park, lease[1] if lease else ""))
        return fleet_pb2.ListSessionsResponse(sessions=out)

    async def ParkSession(
        self, request: fleet_pb2.ParkSessionRequest, context: grpc.aio.ServicerContext
    ) -> fleet_pb2.Session:
        return await self.moves.park(request.session_id)

    async def ResumeSession(
        self, request: fleet_pb2.ResumeSessionRequest, context: grpc.aio.ServicerContext
    ) -> fleet_pb2.Session:
        return await self.moves.resume(
            request.session_id, request.ready_timeout_s or DEFAULT_READY_S
        )
