"""The client's side of the wire: requests built from the client's values, and replies read
back into them. The one module of `fleet.client` that touches the generated protobuf code, so
the sync and the async client build every request the same way."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TypedDict

from google.protobuf.timestamp_pb2 import Timestamp

from fleet.api.pb import as_dict, fleet_pb2, fleet_pb2_grpc, types_pb2
from fleet.client.models import (
    AttemptRecord,
    Egress,
    EgressEvent,
    Event,
    ExecResult,
    InputFile,
    Output,
    Page,
    Rollout,
    SessionInfo,
    Smolfile,
    Step,
    StepResult,
    Submission,
)
from fleet.core.errors import InvalidArgument

StepLike = Step | Sequence[str] | str
"""A step: a Step, an argv list, or a shell string (run with /bin/sh -c)."""


class CommonOptions(TypedDict, total=False):
    """What a submission may say besides its Smolfile and steps (every key optional)."""

    inputs: Mapping[str, Any]
    """Path in the machine -> a local file or directory (uploaded first; a directory as one
    tar), or an InputFile uploaded before (`upload`)."""
    outputs: Sequence[str]
    """Absolute paths collected after the last step (`download_outputs` fetches them)."""
    labels: Mapping[str, str]
    deadline_s: float | None
    """Seconds from now after which the rollout is stopped and failed."""
    timeout_s: float
    """Each argv or shell step's timeout (0: the server's default)."""
    max_attempts: int
    """Attempts in all (0: the server's default)."""
    require_vm: bool
    """Never run on namespace isolation."""
    require_cuda_device: bool
    inference: bool
    """Its steps call the inference gateway (the machine may reach it, with a token)."""
    models: Sequence[str]
    """The upstream models (`UPSTREAM/MODEL`, or `UPSTREAM/*`) its machine may call through
    the gateway, besides the gateway's own model; needs `inference`."""
    max_prompt_tokens: int
    """Prompt tokens its model calls through the gateway may take in all (0: no budget);
    needs `inference`. A call past it is refused (429, code budget_exceeded)."""
    max_completion_tokens: int
    """Completion tokens its model calls through the gateway may take in all (0: no budget);
    needs `inference`."""
    near_gateway: bool
    versions: Mapping[str, str]
    """policy, environment and evaluator: a retry reuses them."""
    tenant: str
    priority: int


class SubmitOptions(CommonOptions, total=False):
    idempotency_key: str | None
    """The same key submitted again returns the same rollout (default: a new key)."""


def stubs(channel: Any) -> tuple[Any, Any]:
    """The FleetService and SessionService stubs on `channel`."""
    return fleet_pb2_grpc.FleetServiceStub(channel), fleet_pb2_grpc.SessionServiceStub(channel)


# -- values out of replies ---------------------------------------------------------------------


def _name(enum: Any, value: int, prefix: str) -> str:
    """An enum value's name without its prefix ("" for UNSPECIFIED or a value not known)."""
    try:
        name = str(enum.Name(value)).removeprefix(prefix)
    except ValueError:
        return ""
    return "" if name == "UNSPECIFIED" else name


def state(value: int) -> str:
    """A RolloutState as its name ("SUCCEEDED"; "" for none)."""
    return _name(types_pb2.RolloutState, value, "ROLLOUT_STATE_")


def _when(message: Any, name: str) -> datetime | None:
    if not message.HasField(name):
        return None
    stamp: Timestamp = getattr(message, name)
    when: datetime = stamp.ToDatetime(tzinfo=UTC)
    return when


def rollout(pb: types_pb2.Rollout, created: bool | None = None) -> Rollout:
    """The client's Rollout of a reply's (a Submission when `created` is given)."""
    egress = None
    if pb.HasField("egress"):
        e = pb.egress
        egress = Egress(
            mode=_name(types_pb2.EgressPolicy.Mode, e.mode, "MODE_").lower(),
            allow_hosts=list(e.allow_hosts), allow_cidrs=list(e.allow_cidrs),
            enforced_by=e.enforced_by,
        )  # fmt: skip
    fields: dict[str, Any] = dict(
        id=pb.id, state=state(pb.state), tenant=pb.tenant, attempts=pb.attempts, error=pb.error,
        labels=dict(pb.labels),
        results=[
            StepResult(r.index, r.name, r.exit_code, r.stdout, r.stderr, r.timed_out,
                       r.duration_s, r.stdout_truncated, r.stderr_truncated)
            for r in pb.results
        ],
        host_class=_name(types_pb2.HostClass, pb.host_class, "HOST_CLASS_").lower(),
        host_id=pb.host_id,
        runtime=_name(types_pb2.RuntimeKind, pb.runtime, "RUNTIME_KIND_").lower(),
        device=pb.device, created_at=_when(pb, "created_at"), started_at=_when(pb, "started_at"),
        finished_at=_when(pb, "finished_at"),
        attempt_history=[
            AttemptRecord(a.attempt, a.host_id, _when(a, "started_at"), _when(a, "ended_at"),
                          a.outcome, a.error)
            for a in pb.attempt_history
        ],
        outputs=[Output(o.path, o.digest, o.size, o.directory, o.error) for o in pb.outputs],
        egress=egress, idempotency_key=pb.idempotency_key, _wire=_json_of(pb),
    )  # fmt: skip
    if created is None:
        return Rollout(**fields)
    return Submission(**fields, created=created)


def _json_of(pb: types_pb2.Rollout) -> Callable[[], dict[str, Any]]:
    return lambda: as_dict(pb)


def page(reply: fleet_pb2.ListRolloutsResponse) -> Page:
    return Page([rollout(r) for r in reply.rollouts], reply.next_page_token)


def event(pb: types_pb2.RolloutEvent) -> Event:
    return Event(
        sequence=pb.sequence, kind=pb.kind, state=state(pb.to_state), message=pb.message,
        from_state=state(pb.from_state), actor=pb.actor, at=_when(pb, "at"),
        attempt=pb.attempt, rollout_id=pb.rollout_id,
    )  # fmt: skip


def egress_event(pb: types_pb2.EgressEvent) -> EgressEvent:
    return EgressEvent(pb.rollout_id, pb.attempt, pb.machine, _when(pb, "at"), pb.kind,
                       pb.destination, pb.decision, pb.reason)  # fmt: skip


def input_file(pb: types_pb2.InputFile) -> InputFile:
    return InputFile(pb.path, pb.digest, pb.size, pb.directory)


def input_file_pb(value: InputFile) -> types_pb2.InputFile:
    return types_pb2.InputFile(path=value.path, digest=value.digest, size=value.size,
                               directory=value.directory)  # fmt: skip


def exec_result(done: types_pb2.ExecExit | None, stdout: bytes, stderr: bytes) -> ExecResult:
    """How a command ended (`done` None: the stream ended without saying, read as exit 0)."""
    if done is None:
        done = types_pb2.ExecExit()
    return ExecResult(done.exit_code, stdout, stderr, done.timed_out, done.oom_killed,
                      done.duration_s)  # fmt: skip


def session_info(pb: fleet_pb2.Session) -> SessionInfo:
    return SessionInfo(pb.id, pb.state, pb.host_id)


# -- requests ----------------------------------------------------------------------------------


def step(value: StepLike, index: int, timeout_s: float = 0.0) -> types_pb2.Step:
    """A plan's step on the wire; a string no protobuf string can hold is refused naming the
    step."""
    if isinstance(value, str):
        value = Step(argv=["/bin/sh", "-c", value], timeout_s=timeout_s)
    elif not isinstance(value, Step):
        value = Step(argv=list(value), timeout_s=timeout_s)
    try:
        return types_pb2.Step(
            argv=value.argv, env=dict(value.env), workdir=value.workdir,
            timeout_s=value.timeout_s, name=value.name,
        )  # fmt: skip
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"steps[{index}]: {exc}") from None


def submit_request(
    smolfile: Smolfile,
    steps: Sequence[StepLike],
    options: SubmitOptions,
    inputs: Sequence[InputFile] = (),
    image_upload: str = "",
) -> fleet_pb2.SubmitRolloutRequest:
    """The one place a SubmitRolloutRequest is built: no steps means the Smolfile's own
    entrypoint and cmd, as one step named `main`."""
    timeout_s = float(options.get("timeout_s", 0.0))
    pb_steps = [step(s, i, timeout_s) for i, s in enumerate(steps)]
    spec = smolfile.parsed.spec
    if not pb_steps and (spec.entrypoint or spec.cmd):
        pb_steps = [types_pb2.Step(argv=[*spec.entrypoint, *spec.cmd], name="main",
                                   timeout_s=timeout_s)]  # fmt: skip
    require_vm = options.get("require_vm", False)
    try:
        request = fleet_pb2.SubmitRolloutRequest(
            request_id=uuid.uuid4().hex,
            idempotency_key=options.get("idempotency_key") or uuid.uuid4().hex,
            smolfile=smolfile.text, smolfile_name=smolfile.name, steps=pb_steps,
            labels=dict(options.get("labels") or {}), tenant=options.get("tenant", ""),
            priority=options.get("priority", 0),
            retry=types_pb2.RetryPolicy(max_attempts=options.get("max_attempts", 0)),
            requirements=types_pb2.Requirements(
                isolation=types_pb2.ISOLATION_VM if require_vm else types_pb2.ISOLATION_UNSPECIFIED,
                cuda_device=options.get("require_cuda_device", False),
                inference=options.get("inference", False),
                near_gateway=options.get("near_gateway", False),
            ),
            versions=types_pb2.Versions(**dict(options.get("versions") or {})),
            inputs=[input_file_pb(f) for f in inputs],
            outputs=list(options.get("outputs") or ()),
            image_upload=image_upload,
            models=list(options.get("models") or ()),
            max_prompt_tokens=options.get("max_prompt_tokens", 0),
            max_completion_tokens=options.get("max_completion_tokens", 0),
        )  # fmt: skip
    except (TypeError, ValueError) as exc:  # (a label or version no protobuf string can hold)
        raise InvalidArgument(f"{smolfile.name}: submission: {exc}") from None
    deadline_s = options.get("deadline_s")
    if deadline_s is not None:
        request.deadline.FromDatetime(datetime.now(UTC) + timedelta(seconds=deadline_s))
    return request


def submit_batch(
    requests: Sequence[fleet_pb2.SubmitRolloutRequest],
) -> fleet_pb2.SubmitRolloutsRequest:
    return fleet_pb2.SubmitRolloutsRequest(request_id=uuid.uuid4().hex, rollouts=requests)


def get_request(rollout_id: str) -> fleet_pb2.GetRolloutRequest:
    return fleet_pb2.GetRolloutRequest(id=rollout_id)


def list_request(
    labels: Mapping[str, str] | None, could_reach: str, page_size: int, page_token: str
) -> fleet_pb2.ListRolloutsRequest:
    return fleet_pb2.ListRolloutsRequest(
        page_size=page_size, page_token=page_token, labels=dict(labels or {}),
        could_reach=could_reach,
    )  # fmt: skip


def watch_request(rollout_id: str, after_sequence: int) -> fleet_pb2.WatchRolloutRequest:
    return fleet_pb2.WatchRolloutRequest(id=rollout_id, after_sequence=after_sequence)


def cancel_request(rollout_id: str, reason: str) -> fleet_pb2.CancelRolloutRequest:
    return fleet_pb2.CancelRolloutRequest(id=rollout_id, reason=reason,
                                          request_id=uuid.uuid4().hex)  # fmt: skip


def artifact_request(rollout_id: str, digest: str) -> fleet_pb2.GetArtifactRequest:
    return fleet_pb2.GetArtifactRequest(rollout_id=rollout_id, digest=digest)


def egress_events_request(rollout_id: str) -> fleet_pb2.ListEgressEventsRequest:
    return fleet_pb2.ListEgressEventsRequest(rollout_id=rollout_id)


def blob_part(data: bytes) -> fleet_pb2.BlobPart:
    return fleet_pb2.BlobPart(data=data)


def open_session_request(
    smolfile: Smolfile, *, idle_timeout_s: float, max_lifetime_s: float,
    labels: Mapping[str, str] | None, require_vm: bool, idempotency_key: str | None,
    inference: bool = False, models: Sequence[str] = (), max_prompt_tokens: int = 0,
    max_completion_tokens: int = 0,
) -> fleet_pb2.OpenSessionRequest:  # fmt: skip
    return fleet_pb2.OpenSessionRequest(
        request_id=uuid.uuid4().hex, idempotency_key=idempotency_key or uuid.uuid4().hex,
        smolfile=smolfile.text, smolfile_name=smolfile.name, labels=dict(labels or {}),
        idle_timeout_s=idle_timeout_s, max_lifetime_s=max_lifetime_s,
        requirements=types_pb2.Requirements(
            isolation=types_pb2.ISOLATION_VM if require_vm else types_pb2.ISOLATION_UNSPECIFIED,
            inference=inference,
        ),
        models=list(models), max_prompt_tokens=max_prompt_tokens,
        max_completion_tokens=max_completion_tokens,
    )  # fmt: skip


def fork_request(
    session_id: str, count: int, *, idle_timeout_s: float, max_lifetime_s: float,
    labels: Mapping[str, str] | None, idempotency_key: str | None,
) -> fleet_pb2.ForkSessionRequest:  # fmt: skip
    return fleet_pb2.ForkSessionRequest(
        request_id=uuid.uuid4().hex, session_id=session_id, count=count,
        idempotency_key=idempotency_key or uuid.uuid4().hex, labels=dict(labels or {}),
        idle_timeout_s=idle_timeout_s, max_lifetime_s=max_lifetime_s,
    )  # fmt: skip


def exec_request(
    session_id: str, command: Sequence[str] | str, *, env: Mapping[str, str] | None, cwd: str,
    stdin: bytes, timeout_s: float,
) -> fleet_pb2.ExecRequest:  # fmt: skip
    request = fleet_pb2.ExecRequest(
        session_id=session_id, env=dict(env or {}), cwd=cwd, stdin=stdin, timeout_s=timeout_s
    )
    if isinstance(command, str):
        request.shell = command
    else:
        request.argv.extend(command)
    return request


def write_chunk(
    session_id: str = "", path: str = "", mode: int = 0, tar: bool = False, data: bytes = b""
) -> fleet_pb2.WriteFileChunk:
    return fleet_pb2.WriteFileChunk(session_id=session_id, path=path, mode=mode, tar=tar,
                                    data=data)  # fmt: skip


def read_request(session_id: str, path: str, tar: bool) -> fleet_pb2.ReadFileRequest:
    return fleet_pb2.ReadFileRequest(session_id=session_id, path=path, tar=tar)


def close_request(session_id: str) -> fleet_pb2.CloseSessionRequest:
    return fleet_pb2.CloseSessionRequest(session_id=session_id)


def list_sessions_request() -> fleet_pb2.ListSessionsRequest:
    return fleet_pb2.ListSessionsRequest()
