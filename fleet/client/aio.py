"""`AsyncFleet` and `AsyncSession`: fleet's client on asyncio, over one gRPC channel.

Every call the client makes goes through here; the blocking `Fleet` runs these same coroutines
on an event loop of its own. Refusals raise fleet's own errors (`fleet.core.errors`), never
gRPC's.
"""

from __future__ import annotations

import asyncio
import builtins
import functools
import io
import tarfile
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar, Unpack

import grpc
import structlog

from fleet import safepath
from fleet.api.pb import fleet_pb2
from fleet.client import transfer, wire
from fleet.client.admin import AsyncAdmin
from fleet.client.errors import error_from_rpc, unreachable
from fleet.client.models import (
    EgressEvent,
    Event,
    ExecResult,
    InputFile,
    Page,
    Rollout,
    SessionInfo,
    Smolfile,
    Submission,
)
from fleet.client.wire import CommonOptions, StepLike, SubmitOptions
from fleet.config import Paths
from fleet.connect import ClientAuth, Replicas, default_server, is_gone, never_sent
from fleet.core.errors import DeadlineExceeded, FleetError, InvalidArgument

log = structlog.get_logger(__name__)

T = TypeVar("T")
SUBMIT_BATCH = 1000
"""Submissions per SubmitRollouts call (the server's limit)."""
LIST_PAGE = 500
RESUME_FOR_S = 60.0
"""How long a watch keeps trying to reconnect after its stream dropped, before it gives up."""
RESUME_BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE})
"""What a dropped connection looks like: the watch resumes after it; anything else is raised."""
OLD_CHANNEL_GRACE_S = 30.0
"""How long the channel to a replica left behind stays open for the calls still on it."""


def _smolfile(value: str | Path | Smolfile) -> Smolfile:
    return value if isinstance(value, Smolfile) else Smolfile.load(value)


class AsyncFleet:
    """A connection to a fleet server, for asyncio code.

    `server` defaults to $FLEET_SERVER, else 127.0.0.1:50051; several replicas sharing one
    ledger are given comma-separated or as a list, and the client moves to the next when the
    one it uses is out of reach (see `call`; a watch resumes there). `key` to $FLEET_KEY, else the
    admin key `fleet up` writes ($FLEET_HOME/admin.key); `ca` (a PEM path or bytes) to
    $FLEET_CA, else $FLEET_HOME/ca/ca.crt when it exists (TLS), else no TLS. `auth` stands for
    all three where the caller holds them already (an embedded fleet's). The channel opens on
    the first call, on the event loop that makes it."""

    def __init__(
        self,
        server: str | Sequence[str] | None = None,
        *,
        key: str | None = None,
        ca: str | bytes | None = None,
        plaintext: bool = False,
        auth: ClientAuth | None = None,
    ) -> None:
        self.replicas = Replicas(server or default_server(), "server")
        self.server = str(self.replicas)
        self.auth = auth or ClientAuth.find(
            Paths.from_env().home, ca=ca or "", key=key or "", plaintext=plaintext
        )
        self.key = self.auth.key
        self._channel: Any = None
        self._channel_of = 0
        """The replica (its index in `replicas`) the open channel reaches."""
        self._rollouts: Any = None
        self._sessions: Any = None
        self._left: dict[asyncio.Task[None], Any] = {}
        """Channels to replicas left behind, by their closing task (after a grace, for the
        calls still on them; at once by `close`)."""
        self._log = log.bind(server=self.server)

    def _stubs(self) -> tuple[Any, Any]:
        if self._channel is None:
            self._channel_of = self.replicas.index
            self._channel = self.auth.channel(self.replicas.current)
            self._rollouts, self._sessions = wire.stubs(self._channel)
        return self._rollouts, self._sessions

    def _move_on(self, channel: Any, exc: grpc.RpcError) -> bool:
        """After a call on `channel` failed: when its replica is out of reach and the client
        knows others, the next calls go to the next one (once, however many calls failed on
        the same channel). Returns whether the client moved."""
        if channel is None or channel is not self._channel or not is_gone(exc):
            return False
        if not self.replicas.move_from(self._channel_of, str(exc.details())):
            return False
        self._channel = None
        task = asyncio.create_task(_close_later(channel))
        self._left[task] = channel
        task.add_done_callback(lambda done: self._left.pop(done, None))
        return True

    @property
    def rollouts_stub(self) -> Any:
        return self._stubs()[0]

    @functools.cached_property
    def admin(self) -> AsyncAdmin:
        """The operator's calls (AdminService: hosts, join tokens, API keys, pools); they need
        a key with the admin scope."""
        return AsyncAdmin(self)

    @property
    def sessions_stub(self) -> Any:
        return self._stubs()[1]

    async def call(self, fn: Callable[[], Awaitable[T]], *, idempotent: bool = False) -> T:
        """`fn()` with a gRPC refusal raised as fleet's own error. When the replica it went to
        is out of reach, the client moves to the next, and `fn()` is made again there if it
        cannot have been done twice: an `idempotent` call (a read, a submission under its
        idempotency key), or one that never reached a server. Each replica is tried once."""
        for tries in range(len(self.replicas.servers), 0, -1):
            self._stubs()
            channel = self._channel
            try:
                return await fn()
            except grpc.RpcError as exc:
                moved = self._move_on(channel, exc)
                if not moved or tries == 1 or not (idempotent or never_sent(exc)):
                    raise error_from_rpc(exc, self.server) from None
                self._log.info("call_moved", to=self.replicas.current, error=exc.details())
        raise AssertionError("unreachable")

    async def close(self) -> None:
        """Closes the connection to the server (and any left to replicas moved away from)."""
        channel, self._channel = self._channel, None
        left, self._left = self._left, {}
        for task, old in left.items():
            task.cancel()
            await old.close()
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> AsyncFleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- rollouts ----------------------------------------------------------------------------

    async def upload(self, src: str | Path, path: str) -> InputFile:
        """Uploads a local file, or a directory as one tar, to be placed at `path` in a
        rollout's machine (pass it in `inputs`); the same content is stored once."""
        local = Path(src)
        if not path.startswith("/"):
            raise InvalidArgument(f"input {src}: {path!r} is not an absolute path in the machine")
        if not await asyncio.to_thread(local.exists):
            raise InvalidArgument(f"input {src}: does not exist")
        directory = await asyncio.to_thread(local.is_dir)
        return await self.call(
            lambda: transfer.upload(self.rollouts_stub, local, path, directory), idempotent=True
        )

    async def _inputs(self, inputs: Mapping[str, Any] | None) -> builtins.list[InputFile]:
        out = []
        for path, source in (inputs or {}).items():
            if isinstance(source, InputFile):
                out.append(InputFile(path, source.digest, source.size, source.directory))
            else:
                out.append(await self.upload(source, path))
        return out

    async def submit(
        self,
        smolfile: str | Path | Smolfile,
        steps: Sequence[StepLike] = (),
        **options: Unpack[SubmitOptions],
    ) -> Submission:
        """Submits a plan: each step a Step, an argv list or a shell string (none: the
        Smolfile's entrypoint and cmd). Local `inputs` are uploaded first, and an archive
        `image` in the Smolfile is flattened and uploaded; the same `idempotency_key`
        submitted again returns the same rollout (`created` False)."""
        parsed = _smolfile(smolfile)
        inputs = await self._inputs(options.get("inputs"))
        image = await self.call(
            lambda: transfer.upload_image_archive(self.rollouts_stub, parsed), idempotent=True
        )
        request = wire.submit_request(parsed, steps, options, inputs, image)
        reply = await self.call(
            lambda: self.rollouts_stub.SubmitRollout(request, timeout=30), idempotent=True
        )
        return wire.rollout(reply.rollout, created=reply.created)  # type: ignore[return-value]

    async def submit_many(
        self,
        smolfile: str | Path | Smolfile,
        plans: Sequence[Sequence[StepLike]],
        *,
        idempotency_keys: Sequence[str] | None = None,
        **options: Unpack[CommonOptions],
    ) -> builtins.list[str]:
        """Submits many plans on one Smolfile (SubmitRollouts, up to 1000 a call: each call's
        are all stored, or none) and returns their rollout ids, in order. Inputs are uploaded
        once for all of them. The same keys submitted again return the same ids."""
        if idempotency_keys is not None and len(idempotency_keys) != len(plans):
            raise InvalidArgument(
                f"{len(idempotency_keys)} idempotency keys for {len(plans)} plans"
            )
        parsed = _smolfile(smolfile)
        inputs = await self._inputs(options.get("inputs"))
        image = await self.call(
            lambda: transfer.upload_image_archive(self.rollouts_stub, parsed), idempotent=True
        )
        requests = [
            wire.submit_request(
                parsed, steps,
                {**options, "idempotency_key": idempotency_keys[i] if idempotency_keys else None},
                inputs, image,
            )
            for i, steps in enumerate(plans)
        ]  # fmt: skip
        ids: builtins.list[str] = []
        for start in range(0, len(requests), SUBMIT_BATCH):
            batch = wire.submit_batch(requests[start : start + SUBMIT_BATCH])
            reply = await self.call(
                lambda b=batch: self.rollouts_stub.SubmitRollouts(b, timeout=60),  # type: ignore[misc]
                idempotent=True,
            )
            ids += [r.id for r in reply.rollouts]
        return ids

    async def get(self, rollout_id: str) -> Rollout:
        """The rollout with this id (NotFound for an unknown one or another tenant's)."""
        request = wire.get_request(rollout_id)
        return wire.rollout(
            await self.call(lambda: self.rollouts_stub.GetRollout(request), idempotent=True)
        )

    async def list_page(
        self, labels: Mapping[str, str] | None = None, *, could_reach: str = "",
        page_size: int = 50, page_token: str = "",
    ) -> Page:  # fmt: skip
        """One page of the rollouts the key may see (with these labels; whose machine could
        reach `could_reach`), newest first."""
        request = wire.list_request(labels, could_reach, page_size, page_token)
        return wire.page(
            await self.call(lambda: self.rollouts_stub.ListRollouts(request), idempotent=True)
        )

    async def list(
        self, labels: Mapping[str, str] | None = None, *, could_reach: str = ""
    ) -> builtins.list[Rollout]:
        """Every rollout the key may see (with these labels), newest first, page after page."""
        out: builtins.list[Rollout] = []
        token = ""
        while True:
            page = await self.list_page(
                labels, could_reach=could_reach, page_size=LIST_PAGE, page_token=token
            )
            out += page.rollouts
            token = page.next_page_token
            if not token:
                return out

    async def watch(self, rollout_id: str, after_sequence: int = 0) -> AsyncGenerator[Event, None]:
        """The rollout's events after `after_sequence`, in order, until it is final. A stream
        that drops (the server restarting, a proxy cutting it) is resumed after the last event
        seen, so none is lost or repeated; after RESUME_FOR_S without reaching the server again
        the watch raises Unavailable. With several replicas it resumes on the next one when
        its own is gone.

        A stream that ends before the final event is asked once more from there: a server reads
        a rollout's new events and then its state apart, so a rollout that became final in
        between ends the stream without its last events (a second read has them)."""
        seen = after_sequence
        failures = 0
        give_up = 0.0
        final = False
        again = False
        while True:
            call = self.rollouts_stub.WatchRollout(wire.watch_request(rollout_id, seen))
            channel = self._channel
            try:
                got = 0
                async for pb in call:
                    seen, failures, got = pb.sequence, 0, got + 1
                    event = wire.event(pb)
                    final = final or event.final
                    yield event
                if final or (again and not got):
                    return
                again = True
                self._log.info("watch_ended_early", rollout_id=rollout_id, after_sequence=seen)
                continue
            except grpc.RpcError as exc:
                if exc.code() not in RESUMABLE:
                    raise error_from_rpc(exc, self.server) from None
                # (Its replica gone, the watch resumes on the next: every replica reads the
                # same events from the ledger, so `seen` means the same there.)
                self._move_on(channel, exc)
                now = time.monotonic()
                if failures == 0:
                    give_up = now + RESUME_FOR_S
                elif now > give_up:
                    raise unreachable(
                        self.server, f"watching {rollout_id}: no connection for "
                        f"{RESUME_FOR_S:.0f}s after the stream dropped ({exc.details()})",
                    ) from None  # fmt: skip
                pause = RESUME_BACKOFF_S[min(failures, len(RESUME_BACKOFF_S) - 1)]
                failures += 1
                self._log.info("watch_resuming", rollout_id=rollout_id, after_sequence=seen,
                               attempt=failures, error=exc.details())  # fmt: skip
                await asyncio.sleep(pause)
            finally:
                call.cancel()

    async def wait(self, rollout_id: str, timeout_s: float = 3600.0) -> Rollout:
        """The rollout once it is final: its events are watched (no polling) until one moves
        it to a final state, then it is read once. DeadlineExceeded after `timeout_s`."""
        events = self.watch(rollout_id)
        try:
            async with asyncio.timeout(timeout_s):
                async for event in events:
                    if event.final:
                        break
        except TimeoutError:
            raise DeadlineExceeded(
                f"rollout {rollout_id} is not final after {timeout_s:g}s"
            ) from None
        finally:
            await events.aclose()
        return await self.get(rollout_id)

    async def cancel(self, rollout_id: str, reason: str = "") -> Rollout:
        """Cancels the rollout (its running attempt is stopped); returns it as it is then."""
        request = wire.cancel_request(rollout_id, reason)
        return wire.rollout(
            await self.call(lambda: self.rollouts_stub.CancelRollout(request), idempotent=True)
        )

    async def download(self, rollout_id: str, digest: str) -> bytes:
        """An input or output of the rollout, by digest, in memory."""
        buffer = io.BytesIO()
        await self.call(lambda: transfer.fetch(self.rollouts_stub, rollout_id, digest, buffer))
        return buffer.getvalue()

    async def download_outputs(
        self, rollout: Rollout | str, into: str | Path
    ) -> builtins.list[str]:
        """Writes each stored output of the rollout under `into` (a directory's unpacked into a
        folder of its name, by `fleet.safepath`); returns the paths written. An output that
        cannot be written safely is skipped and named by the UnsafeArchive raised after the
        others are written."""
        if isinstance(rollout, str):
            rollout = await self.get(rollout)
        done = rollout
        return await self.call(
            lambda: transfer.download_outputs(self.rollouts_stub, done.id, done.outputs, Path(into))
        )

    async def egress_events(self, rollout_id: str) -> builtins.list[EgressEvent]:
        """Every DNS query and connection the rollout's machines were refused, oldest first."""
        request = wire.egress_events_request(rollout_id)
        reply = await self.call(
            lambda: self.rollouts_stub.ListEgressEvents(request), idempotent=True
        )
        return [wire.egress_event(e) for e in reply.events]

    # -- sessions ----------------------------------------------------------------------------

    async def session(
        self,
        smolfile: str | Path | Smolfile,
        *,
        idle_timeout_s: float = 600.0,
        max_lifetime_s: float = 3600.0,
        labels: Mapping[str, str] | None = None,
        require_vm: bool = False,
        idempotency_key: str | None = None,
        inference: bool = False,
        models: Sequence[str] = (),
        max_prompt_tokens: int = 0,
        max_completion_tokens: int = 0,
        on_idle: str = "park",
    ) -> AsyncSession:
        """Opens a session (a machine held for your calls) and returns once it is ready; use
        it with `async with` to close it at the end. `inference`: its machine may call the
        inference gateway with a token of its own; `models`: the upstream models
        (`UPSTREAM/MODEL`) it may call there, besides the gateway's own; the budgets: the
        tokens those calls may take in all (0: no budget); `on_idle`: "park" (idle
        `idle_timeout_s`, it parks: `resume()` opens it again) or "close"."""
        request = wire.open_session_request(
            _smolfile(smolfile), idle_timeout_s=idle_timeout_s, max_lifetime_s=max_lifetime_s,
            labels=labels, require_vm=require_vm, idempotency_key=idempotency_key,
            inference=inference, models=models, max_prompt_tokens=max_prompt_tokens,
            max_completion_tokens=max_completion_tokens,
        )  # fmt: skip
        request.on_idle = on_idle
        reply = await self.call(lambda: self.sessions_stub.OpenSession(request))
        return AsyncSession(self, reply.id, reply.host_id)

    def attach(self, session_id: str) -> AsyncSession:
        """A session opened before (by its id), to call."""
        return AsyncSession(self, session_id)

    async def sessions(self) -> builtins.list[SessionInfo]:
        """(id, state, host_id) of the sessions the key may see."""
        request = wire.list_sessions_request()
        reply = await self.call(lambda: self.sessions_stub.ListSessions(request), idempotent=True)
        return [wire.session_info(s) for s in reply.sessions]


class AsyncSession:
    """An open session: run commands and move files in its machine; `close()` ends it."""

    def __init__(self, fleet: AsyncFleet, session_id: str, host_id: str = "") -> None:
        self.fleet = fleet
        self.id = session_id
        self.host_id = host_id

    async def exec(
        self,
        command: Sequence[str] | str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str = "",
        stdin: bytes = b"",
        timeout_s: float = 600.0,
        on_output: Callable[[str, bytes], None] | None = None,
    ) -> ExecResult:
        """Runs a command (an argv list, or a shell string); `on_output(stream, chunk)` sees
        output as it arrives."""
        request = wire.exec_request(self.id, command, env=env, cwd=cwd, stdin=stdin,
                                    timeout_s=timeout_s)  # fmt: skip
        out, err = bytearray(), bytearray()
        done: Any = None

        async def run() -> None:
            nonlocal done
            async for part in self.fleet.sessions_stub.Exec(request):
                kind = part.WhichOneof("kind")
                if kind == "exit":
                    done = part.exit
                    continue
                chunk = getattr(part, kind)
                (out if kind == "stdout" else err).extend(chunk)
                if on_output is not None:
                    on_output(kind, chunk)

        await self.fleet.call(run)
        return wire.exec_result(done, bytes(out), bytes(err))

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> int:
        """Writes `data` at `path` (directories made as needed); returns its size."""
        return await self._write(path, data, mode, tar=False)

    async def _write(self, path: str, data: bytes, mode: int, tar: bool) -> int:
        async def chunks() -> AsyncIterator[Any]:
            yield wire.write_chunk(self.id, path, mode, tar)
            for offset in range(0, len(data), transfer.CHUNK):
                yield wire.write_chunk(data=data[offset : offset + transfer.CHUNK])

        reply = await self.fleet.call(lambda: self.fleet.sessions_stub.WriteFile(chunks()))
        return int(reply.size)

    async def read_file(self, path: str) -> bytes:
        """The file at `path` in the machine."""
        return await self._read(path, tar=False)

    async def _read(self, path: str, tar: bool) -> bytes:
        data = bytearray()

        async def run() -> None:
            async for chunk in self.fleet.sessions_stub.ReadFile(
                wire.read_request(self.id, path, tar)
            ):
                data.extend(chunk.data)

        await self.fleet.call(run)
        return bytes(data)

    async def upload_dir(self, local: str | Path, path: str) -> int:
        """Copies the local directory `local` into `path` in the machine (made as needed), as
        one tar archive; returns the archive's size."""

        def pack() -> bytes:
            buffer = io.BytesIO()
            with tarfile.open(fileobj=buffer, mode="w") as archive:
                archive.add(str(local), arcname=".")
            return buffer.getvalue()

        return await self._write(path, await asyncio.to_thread(pack), 0, tar=True)

    async def download_dir(self, path: str, local: str | Path) -> builtins.list[str]:
        """Copies the directory `path` from the machine into `local` (made as needed); returns
        the names unpacked. The archive is unpacked by `fleet.safepath`, not tarfile's filter:
        nothing is written outside `local` and no link there is followed; no owners, setuid
        bits or device nodes are kept, and no symlink pointing out of `local` is made. An
        archive that tries is refused with `UnsafeArchive`, naming the member."""
        data = await self._read(path, tar=True)

        def unpack() -> builtins.list[str]:
            Path(local).mkdir(parents=True, exist_ok=True)
            return safepath.extract_tar(io.BytesIO(data), Path(local), safepath.ExtractPolicy())

        return await asyncio.to_thread(unpack)

    async def fork(
        self,
        count: int = 1,
        *,
        idle_timeout_s: float = 0.0,
        max_lifetime_s: float = 3600.0,
        labels: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> builtins.list[AsyncSession]:
        """`count` new sessions, each starting as a copy of this one's machine as it is now
        (its files; no process carries over), on the same host. Close each when done."""
        request = wire.fork_request(
            self.id, count, idle_timeout_s=idle_timeout_s, max_lifetime_s=max_lifetime_s,
            labels=labels, idempotency_key=idempotency_key,
        )  # fmt: skip
        reply = await self.fleet.call(lambda: self.fleet.sessions_stub.ForkSession(request))
        return [AsyncSession(self.fleet, s.id, s.host_id) for s in reply.sessions]

    async def park(self) -> SessionInfo:
        """Parks the session: its disk (the machine's writable layer) is stored and its
        machine freed; no process carries over. `resume()` opens it again, on any host of its
        class; `fork()` works on a parked session too. A session on a microVM cannot park."""
        request = fleet_pb2.ParkSessionRequest(session_id=self.id)
        reply = await self.fleet.call(
            lambda: self.fleet.sessions_stub.ParkSession(request), idempotent=True
        )
        self.host_id = ""
        return wire.session_info(reply)

    async def resume(self, *, ready_timeout_s: float = 0.0) -> AsyncSession:
        """Opens the parked session again (same id, its files as parked) and returns once its
        machine is ready; an open session is returned as it is."""
        request = fleet_pb2.ResumeSessionRequest(
            session_id=self.id, ready_timeout_s=ready_timeout_s
        )
        reply = await self.fleet.call(
            lambda: self.fleet.sessions_stub.ResumeSession(request), idempotent=True
        )
        self.host_id = reply.host_id
        return self

    async def close(self) -> str:
        """Closes the session (its machine is deleted); returns its final state."""
        request = wire.close_request(self.id)
        reply = await self.fleet.call(
            lambda: self.fleet.sessions_stub.CloseSession(request), idempotent=True
        )
        return str(reply.state)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self.close()
        except FleetError:
            if kind is None:
                raise


async def _close_later(channel: Any) -> None:
    """Closes the channel to a replica the client moved away from, once the calls still on it
    had their time (a replica that is out of reach fails them sooner)."""
    await asyncio.sleep(OLD_CHANNEL_GRACE_S)
    await channel.close()
