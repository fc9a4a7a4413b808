"""fleet's Python client: rollouts and interactive sessions over gRPC, as typed values.

    from fleet.client import Fleet

    fleet = Fleet()                      # $FLEET_SERVER / $FLEET_KEY, or `fleet up`'s files
    with fleet.session("smolfiles/minimal.smolfile") as box:
        box.write_file("/root/task.py", b"print(6 * 7)")
        result = box.exec(["python3", "/root/task.py"])
        print(result.stdout)             # b"42\\n"
    rollout = fleet.submit("smolfiles/minimal.smolfile", [["echo", "hi"]])
    print(fleet.wait(rollout.id).state)  # "SUCCEEDED"

Refusals raise fleet's own errors (`fleet.core.errors`: InvalidArgument, NotFound,
ResourceExhausted with `retry_after_s` ...), never raw gRPC ones. The same calls, awaitable:
`fleet.client_async` (`AsyncFleet`, `AsyncSession`).
"""

from __future__ import annotations

import builtins
import io
import os
import tarfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import grpc

from fleet import safepath
from fleet._proto.fleet.v1 import fleet_pb2, fleet_pb2_grpc, types_pb2
from fleet.config import Paths
from fleet.connect import ClientAuth
from fleet.core.errors import FleetError, InvalidArgument, Unavailable, error_for
from fleet.core.smolfile import load_smolfile

DEFAULT_SERVER = "127.0.0.1:50051"


def default_server() -> str:
    """$FLEET_SERVER, else DEFAULT_SERVER: where clients and agents find the server."""
    return os.environ.get("FLEET_SERVER") or DEFAULT_SERVER


CHUNK = 1 << 20
SUBMIT_BATCH = 1000
"""Submissions per SubmitRollouts call (the server's limit)."""
T = TypeVar("T")
FINAL = {"SUCCEEDED", "FAILED", "CANCELLED", "QUARANTINED"}


@dataclass(frozen=True)
class StepResult:
    """One step of a rollout, as it ended."""

    index: int
    name: str
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    duration_s: float


@dataclass(frozen=True)
class Rollout:
    """A rollout as the server last described it."""

    id: str
    state: str
    """QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED or QUARANTINED."""
    tenant: str
    attempts: int
    error: str
    labels: dict[str, str]
    results: list[StepResult] = field(default_factory=list)

    @property
    def final(self) -> bool:
        """Whether the rollout has ended (succeeded, failed or cancelled)."""
        return self.state in FINAL


@dataclass(frozen=True)
class Event:
    """One entry of a rollout's history (`Fleet.watch`)."""

    sequence: int
    kind: str
    state: str
    """The state it moved the rollout to."""
    message: str


@dataclass(frozen=True)
class ExecResult:
    """How one command in a session ended, with its whole output."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    oom_killed: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the command exited 0 and did not time out."""
        return self.exit_code == 0 and not self.timed_out


def _state(value: int) -> str:
    return str(types_pb2.RolloutState.Name(value)).removeprefix("ROLLOUT_STATE_")


def _rollout(pb: types_pb2.Rollout) -> Rollout:
    return Rollout(
        id=pb.id, state=_state(pb.state), tenant=pb.tenant, attempts=pb.attempts, error=pb.error,
        labels=dict(pb.labels),
        results=[
            StepResult(r.index, r.name, r.exit_code, r.stdout, r.stderr, r.timed_out, r.duration_s)
            for r in pb.results
        ],
    )  # fmt: skip


def _refusal(exc: grpc.RpcError) -> FleetError:
    """fleet's error for a gRPC status (its retry hint kept)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    hint = None
    for key, value in (exc.trailing_metadata() or ()) if hasattr(exc, "trailing_metadata") else ():
        if key == "retry-after-s":
            hint = float(value)
    name = code.name if code is not None else "UNKNOWN"
    return error_for(name, exc.details() or name, hint)


def _call(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except grpc.RpcError as exc:
        raise _refusal(exc) from None


class Fleet:
    """A connection to a fleet server.

    `server` defaults to $FLEET_SERVER, else 127.0.0.1:50051; `key` to $FLEET_KEY, else the
    admin key `fleet up` writes ($FLEET_HOME/admin.key); `ca` (a PEM path or bytes) to
    $FLEET_CA, else $FLEET_HOME/ca/ca.crt when it exists (TLS), else no TLS."""

    def __init__(
        self,
        server: str | None = None,
        *,
        key: str | None = None,
        ca: str | bytes | None = None,
        plaintext: bool = False,
    ) -> None:
        self.server = server or default_server()
        auth = ClientAuth.find(
            Paths.from_env().home, ca=ca or "", key=key or "", plaintext=plaintext
        )
        self.key = auth.key
        self._channel = auth.blocking_channel(self.server)
        self._md = auth.metadata
        self._rollouts = fleet_pb2_grpc.FleetServiceStub(self._channel)
        self._sessions = fleet_pb2_grpc.SessionServiceStub(self._channel)

    def close(self) -> None:
        """Closes the connection to the server."""
        self._channel.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- rollouts ----------------------------------------------------------------------------

    def submit(
        self,
        smolfile: str | Path,
        steps: Sequence[Sequence[str] | str],
        *,
        idempotency_key: str | None = None,
        labels: Mapping[str, str] | None = None,
        deadline_s: float | None = None,
        timeout_s: float = 0.0,
        inference: bool = False,
        require_vm: bool = False,
    ) -> Rollout:
        """Submits a plan: each step an argv list, or a shell string. The same
        `idempotency_key` submitted again returns the same rollout."""
        request = self._request(
            smolfile, steps, idempotency_key, labels, deadline_s, timeout_s, inference, require_vm
        )
        reply = _call(lambda: self._rollouts.SubmitRollout(request, metadata=self._md))
        return _rollout(reply.rollout)

    def submit_many(
        self,
        smolfile: str | Path,
        plans: Sequence[Sequence[Sequence[str] | str]],
        *,
        idempotency_keys: Sequence[str] | None = None,
        labels: Mapping[str, str] | None = None,
        deadline_s: float | None = None,
        timeout_s: float = 0.0,
        inference: bool = False,
        require_vm: bool = False,
    ) -> builtins.list[str]:
        """Submits many plans on one Smolfile (SubmitRollouts, up to 1000 a call: each call's
        are all stored, or none) and returns their rollout ids, in order. The same keys
        submitted again return the same ids."""
        if idempotency_keys is not None and len(idempotency_keys) != len(plans):
            raise InvalidArgument(
                f"{len(idempotency_keys)} idempotency keys for {len(plans)} plans"
            )
        requests = [
            self._request(smolfile, steps, idempotency_keys[i] if idempotency_keys else None,
                          labels, deadline_s, timeout_s, inference, require_vm)
            for i, steps in enumerate(plans)
        ]  # fmt: skip
        ids: builtins.list[str] = []
        for start in range(0, len(requests), SUBMIT_BATCH):
            batch = fleet_pb2.SubmitRolloutsRequest(
                request_id=uuid.uuid4().hex, rollouts=requests[start : start + SUBMIT_BATCH]
            )
            reply = _call(
                lambda b=batch: self._rollouts.SubmitRollouts(b, metadata=self._md)  # type: ignore[misc]
            )
            ids += [r.id for r in reply.rollouts]
        return ids

    def _request(
        self, smolfile: str | Path, steps: Sequence[Sequence[str] | str],
        idempotency_key: str | None, labels: Mapping[str, str] | None, deadline_s: float | None,
        timeout_s: float, inference: bool, require_vm: bool,
    ) -> fleet_pb2.SubmitRolloutRequest:  # fmt: skip
        parsed = load_smolfile(str(smolfile))
        pb_steps = [
            types_pb2.Step(
                argv=["/bin/sh", "-c", s] if isinstance(s, str) else list(s), timeout_s=timeout_s
            )
            for s in steps
        ]
        request = fleet_pb2.SubmitRolloutRequest(
            request_id=uuid.uuid4().hex, idempotency_key=idempotency_key or uuid.uuid4().hex,
            smolfile=parsed.text, smolfile_name=str(smolfile), steps=pb_steps,
            labels=dict(labels or {}),
            requirements=types_pb2.Requirements(
                isolation=types_pb2.ISOLATION_VM if require_vm else types_pb2.ISOLATION_UNSPECIFIED,
                inference=inference,
            ),
        )  # fmt: skip
        if deadline_s is not None:
            request.deadline.FromDatetime(datetime.now(UTC) + timedelta(seconds=deadline_s))
        return request

    def get(self, rollout_id: str) -> Rollout:
        """The rollout with this id (NotFound for an unknown one or another tenant's)."""
        request = fleet_pb2.GetRolloutRequest(id=rollout_id)
        return _rollout(_call(lambda: self._rollouts.GetRollout(request, metadata=self._md)))

    def list(self, labels: Mapping[str, str] | None = None) -> list[Rollout]:
        """Every rollout the key may see (with these labels), newest first."""
        out: list[Rollout] = []
        token = ""
        while True:
            request = fleet_pb2.ListRolloutsRequest(
                page_size=500, page_token=token, labels=dict(labels or {})
            )
            reply = _call(
                lambda r=request: self._rollouts.ListRollouts(r, metadata=self._md)  # type: ignore[misc]
            )
            out += [_rollout(r) for r in reply.rollouts]
            token = reply.next_page_token
            if not token:
                return out

    def watch(self, rollout_id: str, after_sequence: int = 0) -> Iterator[Event]:
        """The rollout's events in order until it is final; a dropped connection is resumed
        from the last event seen."""
        seen = after_sequence
        while True:
            request = fleet_pb2.WatchRolloutRequest(id=rollout_id, after_sequence=seen)
            try:
                for pb in self._rollouts.WatchRollout(request, metadata=self._md):
                    seen = pb.sequence
                    yield Event(pb.sequence, pb.kind, _state(pb.to_state), pb.message)
                return
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise _refusal(exc) from None
                time.sleep(0.5)

    def wait(self, rollout_id: str, timeout_s: float = 3600.0) -> Rollout:
        """The rollout once it is final."""
        give_up = time.monotonic() + timeout_s
        while True:
            rollout = self.get(rollout_id)
            if rollout.final:
                return rollout
            if time.monotonic() > give_up:
                raise Unavailable(
                    f"rollout {rollout_id} is still {rollout.state} after {timeout_s} s"
                )
            time.sleep(0.2)

    def cancel(self, rollout_id: str, reason: str = "") -> Rollout:
        """Cancels the rollout (its running attempt is stopped); returns it as it is then."""
        request = fleet_pb2.CancelRolloutRequest(
            id=rollout_id, reason=reason, request_id=uuid.uuid4().hex
        )
        return _rollout(_call(lambda: self._rollouts.CancelRollout(request, metadata=self._md)))

    def download(self, rollout_id: str, digest: str) -> bytes:
        """An input or output of the rollout, by digest."""
        request = fleet_pb2.GetArtifactRequest(rollout_id=rollout_id, digest=digest)
        data = bytearray()
        try:
            for chunk in self._rollouts.GetArtifact(request, metadata=self._md):
                data += chunk.data
        except grpc.RpcError as exc:
            raise _refusal(exc) from None
        return bytes(data)

    # -- sessions ----------------------------------------------------------------------------

    def session(
        self,
        smolfile: str | Path,
        *,
        idle_timeout_s: float = 600.0,
        max_lifetime_s: float = 3600.0,
        labels: Mapping[str, str] | None = None,
        require_vm: bool = False,
        idempotency_key: str | None = None,
    ) -> Session:
        """Opens a session (a machine held for your calls) and returns once it is ready; use it
        as a context manager to close it at the end."""
        parsed = load_smolfile(str(smolfile))
        request = fleet_pb2.OpenSessionRequest(
            request_id=uuid.uuid4().hex, idempotency_key=idempotency_key or uuid.uuid4().hex,
            smolfile=parsed.text, smolfile_name=str(smolfile), labels=dict(labels or {}),
            idle_timeout_s=idle_timeout_s, max_lifetime_s=max_lifetime_s,
            requirements=types_pb2.Requirements(
                isolation=types_pb2.ISOLATION_VM if require_vm else types_pb2.ISOLATION_UNSPECIFIED
            ),
        )  # fmt: skip
        reply = _call(lambda: self._sessions.OpenSession(request, metadata=self._md))
        return Session(self, reply.id, reply.host_id)

    def sessions(self) -> builtins.list[tuple[str, str, str]]:
        """(id, state, host) of the sessions the key may see."""
        request = fleet_pb2.ListSessionsRequest()
        reply = _call(lambda: self._sessions.ListSessions(request, metadata=self._md))
        return [(s.id, s.state, s.host_id) for s in reply.sessions]


class Session:
    """An open session: run commands and move files in its machine; `close()` ends it."""

    def __init__(self, fleet: Fleet, session_id: str, host_id: str = "") -> None:
        self.fleet = fleet
        self.id = session_id
        self.host_id = host_id

    def exec(
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
        request = fleet_pb2.ExecRequest(
            session_id=self.id, env=dict(env or {}), cwd=cwd, stdin=stdin, timeout_s=timeout_s
        )
        if isinstance(command, str):
            request.shell = command
        else:
            request.argv.extend(command)
        out, err = bytearray(), bytearray()
        done = types_pb2.ExecExit()
        try:
            for part in self.fleet._sessions.Exec(request, metadata=self.fleet._md):
                kind = part.WhichOneof("kind")
                if kind == "exit":
                    done = part.exit
                    continue
                chunk = getattr(part, kind)
                (out if kind == "stdout" else err).extend(chunk)
                if on_output is not None:
                    on_output(kind, chunk)
        except grpc.RpcError as exc:
            raise _refusal(exc) from None
        return ExecResult(done.exit_code, bytes(out), bytes(err), done.timed_out,
                          done.oom_killed, done.duration_s)  # fmt: skip

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> int:
        """Writes `data` at `path` (directories made as needed); returns its size."""
        return self._write(path, data, mode, tar=False)

    def _write(self, path: str, data: bytes, mode: int, tar: bool) -> int:
        def chunks() -> Iterator[fleet_pb2.WriteFileChunk]:
            yield fleet_pb2.WriteFileChunk(session_id=self.id, path=path, mode=mode, tar=tar)
            for offset in range(0, len(data), CHUNK):
                yield fleet_pb2.WriteFileChunk(data=data[offset : offset + CHUNK])

        reply = _call(lambda: self.fleet._sessions.WriteFile(chunks(), metadata=self.fleet._md))
        return int(reply.size)

    def read_file(self, path: str) -> bytes:
        """The file at `path` in the machine."""
        return self._read(path, tar=False)

    def _read(self, path: str, tar: bool) -> bytes:
        request = fleet_pb2.ReadFileRequest(session_id=self.id, path=path, tar=tar)
        data = bytearray()
        try:
            for chunk in self.fleet._sessions.ReadFile(request, metadata=self.fleet._md):
                data += chunk.data
        except grpc.RpcError as exc:
            raise _refusal(exc) from None
        return bytes(data)

    def upload_dir(self, local: str | Path, path: str) -> int:
        """Copies the local directory `local` into `path` in the machine (made as needed), as
        one tar archive; returns the archive's size."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:
            archive.add(str(local), arcname=".")
        return self._write(path, buffer.getvalue(), 0, tar=True)

    def download_dir(self, path: str, local: str | Path) -> list[str]:
        """Copies the directory `path` from the machine into `local` (made as needed); returns
        the names unpacked. The archive is unpacked by `fleet.safepath`, not tarfile's filter:
        nothing is written outside `local` and no link there is followed; no owners, setuid
        bits or device nodes are kept, and no symlink pointing out of `local` is made. An
        archive that tries is refused with `UnsafeArchive`, naming the member."""
        data = self._read(path, tar=True)
        Path(local).mkdir(parents=True, exist_ok=True)
        return safepath.extract_tar(io.BytesIO(data), Path(local), safepath.ExtractPolicy())

    def fork(
        self,
        count: int = 1,
        *,
        idle_timeout_s: float = 0.0,
        max_lifetime_s: float = 3600.0,
        labels: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> builtins.list[Session]:
        """`count` new sessions, each starting as a copy of this one's machine as it is now
        (its files; no process carries over), on the same host. Close each when done."""
        request = fleet_pb2.ForkSessionRequest(
            request_id=uuid.uuid4().hex, session_id=self.id, count=count,
            idempotency_key=idempotency_key or uuid.uuid4().hex, labels=dict(labels or {}),
            idle_timeout_s=idle_timeout_s, max_lifetime_s=max_lifetime_s,
        )  # fmt: skip
        reply = _call(lambda: self.fleet._sessions.ForkSession(request, metadata=self.fleet._md))
        return [Session(self.fleet, s.id, s.host_id) for s in reply.sessions]

    def close(self) -> str:
        """Closes the session (its machine is deleted); returns its final state."""
        request = fleet_pb2.CloseSessionRequest(session_id=self.id)
        reply = _call(lambda: self.fleet._sessions.CloseSession(request, metadata=self.fleet._md))
        return str(reply.state)

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.close()
        except FleetError:
            if kind is None:
                raise


__all__ = [
    "Event", "ExecResult", "Fleet", "Rollout", "Session", "StepResult",
]  # fmt: skip
