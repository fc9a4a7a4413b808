"""fleet's wire messages to its domain values and back, for the server and the agents alike.

Every decoder checks what it reads and refuses bad input with InvalidArgument naming the field,
so a servicer hands only well-formed values to the ledger and core. Pure apart from protobuf:
it imports fleet.core and the generated messages, never the server or the ledger, so an agent
that encodes its registration and completions here loads neither."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from google.protobuf.timestamp_pb2 import Timestamp

from fleet.api.pb import fleet_pb2, host_pb2, types_pb2
from fleet.core.egress import EffectiveEgress, EgressEvent, EgressMode
from fleet.core.errors import InvalidArgument
from fleet.core.labels import check_labels
from fleet.core.lifecycle import Outcome, RolloutState
from fleet.core.manifest import (
    MAX_FILES,
    InputFile,
    Manifest,
    OutputArtifact,
    SessionSpec,
    Step,
    SubmitRequest,
    Versions,
    is_digest,
)
from fleet.core.placement import HostCapabilities, HostClass, Isolation, Requirements, RuntimeKind
from fleet.core.retry import RetryPolicy
from fleet.core.rollout import Assignment, Completion, Rollout, RolloutEvent, StepResult

HOST_CLASS_TO_PB = {
    HostClass.GPU: types_pb2.HOST_CLASS_GPU,
    HostClass.CPU: types_pb2.HOST_CLASS_CPU,
}
HOST_CLASS_FROM_PB = {v: k for k, v in HOST_CLASS_TO_PB.items()}
ISOLATION_TO_PB = {
    Isolation.ANY: types_pb2.ISOLATION_UNSPECIFIED,
    Isolation.NAMESPACE: types_pb2.ISOLATION_NAMESPACE,
    Isolation.VM: types_pb2.ISOLATION_VM,
}
ISOLATION_FROM_PB = {v: k for k, v in ISOLATION_TO_PB.items()}
RUNTIME_TO_PB = {
    RuntimeKind.SMOL: types_pb2.RUNTIME_KIND_SMOL,
    RuntimeKind.NAMESPACE: types_pb2.RUNTIME_KIND_NAMESPACE,
}
RUNTIME_FROM_PB = {v: k for k, v in RUNTIME_TO_PB.items()}
STATE_TO_PB = {
    RolloutState.QUEUED: types_pb2.ROLLOUT_STATE_QUEUED,
    RolloutState.RUNNING: types_pb2.ROLLOUT_STATE_RUNNING,
    RolloutState.SUCCEEDED: types_pb2.ROLLOUT_STATE_SUCCEEDED,
    RolloutState.FAILED: types_pb2.ROLLOUT_STATE_FAILED,
    RolloutState.CANCELLED: types_pb2.ROLLOUT_STATE_CANCELLED,
    RolloutState.QUARANTINED: types_pb2.ROLLOUT_STATE_QUARANTINED,
}
STATE_FROM_PB = {v: k for k, v in STATE_TO_PB.items()}
OUTCOME_TO_PB = {
    Outcome.SUCCEEDED: types_pb2.OUTCOME_SUCCEEDED,
    Outcome.STEP_FAILED: types_pb2.OUTCOME_STEP_FAILED,
    Outcome.TRANSIENT_ERROR: types_pb2.OUTCOME_TRANSIENT_ERROR,
    Outcome.CANCELLED: types_pb2.OUTCOME_CANCELLED,
    Outcome.MALFORMED_INPUT: types_pb2.OUTCOME_MALFORMED_INPUT,
    Outcome.INCOMPATIBLE: types_pb2.OUTCOME_INCOMPATIBLE,
}
OUTCOME_FROM_PB = {v: k for k, v in OUTCOME_TO_PB.items()}


def ts(value: datetime | None) -> Timestamp | None:
    if value is None:
        return None
    out = Timestamp()
    out.FromDatetime(value.astimezone(UTC))
    return out


def from_ts(value: Timestamp) -> datetime:
    out: datetime = value.ToDatetime(tzinfo=UTC)
    return out


def step_to_pb(step: Step) -> types_pb2.Step:
    return types_pb2.Step(
        argv=list(step.argv),
        env=step.env,
        workdir=step.workdir or "",
        timeout_s=step.timeout_s,
        name=step.name,
    )


def step_from_pb(step: types_pb2.Step, index: int) -> Step:
    kwargs: dict[str, object] = {"argv": tuple(step.argv), "env": dict(step.env)}
    if step.workdir:
        kwargs["workdir"] = step.workdir
    if step.timeout_s:
        kwargs["timeout_s"] = step.timeout_s
    kwargs["name"] = step.name or f"step-{index}"
    try:
        return Step.model_validate(kwargs)
    except ValueError as exc:
        raise InvalidArgument(f"steps[{index}]: {exc}") from None


def deadline_from_pb(value: Timestamp) -> datetime:
    """A request's deadline; one outside what a timestamp can hold is refused."""
    try:
        return from_ts(value)
    except (ValueError, OverflowError, OSError) as exc:
        raise InvalidArgument(
            f"deadline: {value.seconds}s {value.nanos}ns is not a valid time ({exc})"
        ) from None


def retry_from_pb(retry: types_pb2.RetryPolicy) -> RetryPolicy:
    kwargs: dict[str, object] = {}
    if retry.max_attempts:
        kwargs["max_attempts"] = retry.max_attempts
    if retry.initial_backoff_s:
        kwargs["initial_backoff_s"] = retry.initial_backoff_s
    if retry.max_backoff_s:
        kwargs["max_backoff_s"] = retry.max_backoff_s
    try:
        return RetryPolicy.model_validate(kwargs)
    except ValueError as exc:
        raise InvalidArgument(f"retry: {exc}") from None


def requirements_from_pb(r: types_pb2.Requirements) -> Requirements:
    isolation = ISOLATION_FROM_PB.get(r.isolation)
    if isolation is None:
        raise InvalidArgument(f"requirements.isolation: unknown value {r.isolation}")
    return Requirements(
        isolation=isolation, cuda_device=r.cuda_device, inference=r.inference,
        near_gateway=r.near_gateway,
    )  # fmt: skip


def submit_from_pb(req: fleet_pb2.SubmitRolloutRequest) -> SubmitRequest:
    isolation = ISOLATION_FROM_PB.get(req.requirements.isolation)
    if isolation is None:
        raise InvalidArgument(f"requirements.isolation: unknown value {req.requirements.isolation}")
    return SubmitRequest(
        idempotency_key=req.idempotency_key,
        smolfile=req.smolfile,
        smolfile_name=req.smolfile_name or "<smolfile>",
        steps=tuple(step_from_pb(s, i) for i, s in enumerate(req.steps)),
        deadline=deadline_from_pb(req.deadline) if req.HasField("deadline") else None,
        retry=retry_from_pb(req.retry),
        versions=Versions(
            policy=req.versions.policy,
            environment=req.versions.environment,
            evaluator=req.versions.evaluator,
        ),
        labels=dict(req.labels),
        tenant=req.tenant or "default",
        requirements=Requirements(
            isolation=isolation,
            cuda_device=req.requirements.cuda_device,
            inference=req.requirements.inference,
            near_gateway=req.requirements.near_gateway,
        ),
        priority=req.priority,
        inputs=tuple(input_from_pb(i) for i in req.inputs),
        outputs=tuple(req.outputs),
        models=tuple(req.models),
        max_prompt_tokens=req.max_prompt_tokens,
        max_completion_tokens=req.max_completion_tokens,
    )


def input_to_pb(i: InputFile) -> types_pb2.InputFile:
    return types_pb2.InputFile(path=i.path, digest=i.digest, size=i.size, directory=i.directory)


def input_from_pb(i: types_pb2.InputFile) -> InputFile:
    return InputFile(path=i.path, digest=i.digest, size=i.size, directory=i.directory)


def output_to_pb(o: OutputArtifact) -> types_pb2.OutputArtifact:
    return types_pb2.OutputArtifact(
        path=o.path, digest=o.digest, size=o.size, directory=o.directory, error=o.error
    )


def output_from_pb(o: types_pb2.OutputArtifact) -> OutputArtifact:
    if o.digest and not is_digest(o.digest):
        raise InvalidArgument(f"outputs: digest {o.digest[:80]!r} is not sha256:<64 hex>")
    return OutputArtifact(path=o.path[:1024], digest=o.digest, size=o.size,
                          directory=o.directory, error=o.error[:1024])  # fmt: skip


def manifest_to_pb(m: Manifest) -> types_pb2.Manifest:
    return types_pb2.Manifest(
        digest=m.digest,
        smolfile=m.smolfile,
        smolfile_name=m.smolfile_name,
        smolfile_digest=m.smolfile_digest,
        image_ref=m.image_ref,
        image_digest=m.image_digest,
        steps=[step_to_pb(s) for s in m.steps],
        deadline=ts(m.deadline),
        retry=types_pb2.RetryPolicy(
            max_attempts=m.retry.max_attempts,
            initial_backoff_s=m.retry.initial_backoff_s,
            max_backoff_s=m.retry.max_backoff_s,
        ),
        versions=types_pb2.Versions(
            policy=m.versions.policy,
            environment=m.versions.environment,
            evaluator=m.versions.evaluator,
        ),
        requirements=types_pb2.Requirements(
            isolation=ISOLATION_TO_PB[m.requirements.isolation],
            cuda_device=m.requirements.cuda_device,
            inference=m.requirements.inference,
            near_gateway=m.requirements.near_gateway,
        ),
        host_class=HOST_CLASS_TO_PB[m.host_class],
        inputs=[input_to_pb(i) for i in m.inputs],
        outputs=list(m.outputs),
        session=(
            types_pb2.SessionSpec(
                idle_timeout_s=m.session.idle_timeout_s,
                fork_of=m.session.fork_of,
                host=m.session.host,
                layer=m.session.layer,
                layer_size=m.session.layer_size,
                on_idle=m.session.on_idle,
            )
            if m.session is not None
            else None
        ),
        models=list(m.models),
        max_prompt_tokens=m.max_prompt_tokens,
        max_completion_tokens=m.max_completion_tokens,
    )


def session_on_idle(text: str) -> Literal["park", "close"]:
    """What an idle session does, as a caller named it ("": park); INVALID_ARGUMENT naming
    the field otherwise."""
    if text in ("", "park"):
        return "park"
    if text == "close":
        return "close"
    raise InvalidArgument(f"on_idle must be park or close, got {text[:40]!r}")


def manifest_from_pb(m: types_pb2.Manifest) -> Manifest:
    return Manifest(
        smolfile=m.smolfile,
        smolfile_name=m.smolfile_name,
        smolfile_digest=m.smolfile_digest,
        image_ref=m.image_ref,
        image_digest=m.image_digest,
        steps=tuple(step_from_pb(s, i) for i, s in enumerate(m.steps)),
        deadline=from_ts(m.deadline),
        retry=retry_from_pb(m.retry),
        versions=Versions(
            policy=m.versions.policy,
            environment=m.versions.environment,
            evaluator=m.versions.evaluator,
        ),
        requirements=Requirements(
            isolation=ISOLATION_FROM_PB[m.requirements.isolation],
            cuda_device=m.requirements.cuda_device,
            inference=m.requirements.inference,
            near_gateway=m.requirements.near_gateway,
        ),
        host_class=HOST_CLASS_FROM_PB[m.host_class],
        inputs=tuple(input_from_pb(i) for i in m.inputs),
        outputs=tuple(m.outputs),
        session=(
            SessionSpec(
                idle_timeout_s=m.session.idle_timeout_s,
                fork_of=m.session.fork_of,
                host=m.session.host,
                layer=m.session.layer,
                layer_size=m.session.layer_size,
                on_idle=session_on_idle(m.session.on_idle),
            )
            if m.HasField("session")
            else None
        ),
        models=tuple(m.models),
        max_prompt_tokens=m.max_prompt_tokens,
        max_completion_tokens=m.max_completion_tokens,
    )


def result_to_pb(r: StepResult) -> types_pb2.StepResult:
    return types_pb2.StepResult(
        index=r.index,
        name=r.name,
        exit_code=r.exit_code,
        timed_out=r.timed_out,
        duration_s=r.duration_s,
        stdout=r.stdout,
        stderr=r.stderr,
        stdout_truncated=r.stdout_truncated,
        stderr_truncated=r.stderr_truncated,
        stdout_digest=r.stdout_digest,
        stderr_digest=r.stderr_digest,
    )


def result_from_pb(r: types_pb2.StepResult) -> StepResult:
    return StepResult(
        index=r.index,
        name=r.name,
        exit_code=r.exit_code,
        timed_out=r.timed_out,
        duration_s=r.duration_s,
        stdout=r.stdout,
        stderr=r.stderr,
        stdout_truncated=r.stdout_truncated,
        stderr_truncated=r.stderr_truncated,
        stdout_digest=r.stdout_digest,
        stderr_digest=r.stderr_digest,
    )


def rollout_to_pb(r: Rollout) -> types_pb2.Rollout:
    return types_pb2.Rollout(
        id=r.id,
        state=STATE_TO_PB[r.state],
        tenant=r.tenant,
        idempotency_key=r.idempotency_key,
        labels=r.labels,
        manifest=manifest_to_pb(r.manifest),
        host_class=HOST_CLASS_TO_PB[r.host_class],
        attempts=r.attempts,
        results=[result_to_pb(x) for x in r.results],
        error=r.error,
        host_id=r.host_id,
        runtime=RUNTIME_TO_PB[RuntimeKind(r.runtime)]
        if r.runtime
        else types_pb2.RUNTIME_KIND_UNSPECIFIED,
        device=r.device,
        created_at=ts(r.created_at),
        started_at=ts(r.started_at),
        finished_at=ts(r.finished_at),
        priority=r.priority,
        egress=egress_to_pb(r.egress),
        outputs=[output_to_pb(o) for o in r.outputs],
        attempt_history=[
            types_pb2.Attempt(
                attempt=a.attempt,
                host_id=a.host_id,
                started_at=ts(a.started_at),
                ended_at=ts(a.ended_at),
                outcome=a.outcome,
                error=a.error,
            )
            for a in r.attempt_history
        ],
    )


EGRESS_MODE_TO_PB = {
    EgressMode.OFF: types_pb2.EgressPolicy.MODE_OFF,
    EgressMode.ALLOWLIST: types_pb2.EgressPolicy.MODE_ALLOWLIST,
    EgressMode.OPEN: types_pb2.EgressPolicy.MODE_OPEN,
}
EGRESS_MODE_FROM_PB = {v: k for k, v in EGRESS_MODE_TO_PB.items()}


def egress_to_pb(e: EffectiveEgress | None) -> types_pb2.EgressPolicy | None:
    if e is None:
        return None
    return types_pb2.EgressPolicy(
        mode=EGRESS_MODE_TO_PB[e.mode], allow_hosts=list(e.allow_hosts),
        allow_cidrs=list(e.allow_cidrs), enforced_by=e.enforced_by,
    )  # fmt: skip


def egress_from_pb(e: types_pb2.EgressPolicy) -> EffectiveEgress | None:
    mode = EGRESS_MODE_FROM_PB.get(e.mode)
    if mode is None:
        return None
    return EffectiveEgress(
        mode=mode, allow_hosts=tuple(e.allow_hosts), allow_cidrs=tuple(e.allow_cidrs),
        enforced_by=e.enforced_by,
    )  # fmt: skip


def event_to_pb(e: RolloutEvent) -> types_pb2.RolloutEvent:
    return types_pb2.RolloutEvent(
        sequence=e.sequence,
        rollout_id=e.rollout_id,
        kind=e.kind,
        from_state=STATE_TO_PB[e.from_state]
        if e.from_state
        else types_pb2.ROLLOUT_STATE_UNSPECIFIED,
        to_state=STATE_TO_PB[e.to_state] if e.to_state else types_pb2.ROLLOUT_STATE_UNSPECIFIED,
        actor=e.actor,
        at=ts(e.at),
        message=e.message,
        attempt=e.attempt,
    )


def capabilities_from_pb(req: host_pb2.RegisterHostRequest) -> HostCapabilities:
    if not req.host_id:
        raise InvalidArgument("host_id is empty")
    host_class = HOST_CLASS_FROM_PB.get(req.host_class)
    if host_class is None:
        raise InvalidArgument("host_class must be HOST_CLASS_GPU or HOST_CLASS_CPU")
    caps = req.capabilities
    runtime = RUNTIME_FROM_PB.get(caps.runtime)
    if runtime is None:
        raise InvalidArgument("capabilities.runtime must be RUNTIME_KIND_SMOL or _NAMESPACE")
    isolation = ISOLATION_FROM_PB.get(caps.isolation)
    if isolation in (None, Isolation.ANY):
        raise InvalidArgument("capabilities.isolation must be ISOLATION_NAMESPACE or ISOLATION_VM")
    assert isolation is not None
    return HostCapabilities(
        host_id=req.host_id,
        host_class=host_class,
        runtime=runtime,
        isolation=isolation,
        cpus=caps.cpus,
        memory_mib=caps.memory_mib,
        cuda_devices=caps.cuda_devices,
        slots=max(1, caps.slots),
        device=caps.device or "cpu",
        runtime_reason=caps.runtime_reason,
        gateway=caps.gateway,
        labels=check_labels(dict(caps.labels)),
    )


def capabilities_to_pb(c: HostCapabilities) -> host_pb2.Capabilities:
    return host_pb2.Capabilities(
        runtime=RUNTIME_TO_PB[c.runtime],
        isolation=ISOLATION_TO_PB[c.isolation],
        cpus=c.cpus,
        memory_mib=c.memory_mib,
        cuda_devices=c.cuda_devices,
        slots=c.slots,
        runtime_reason=c.runtime_reason,
        device=c.device,
        gateway=c.gateway,
        labels=c.labels,
    )


def assignment_to_pb(a: Assignment) -> host_pb2.WorkAssignment:
    return host_pb2.WorkAssignment(
        work_id=a.work_id,
        rollout_id=a.rollout_id,
        attempt=a.attempt,
        fencing_token=a.fencing_token,
        lease_expires_at=ts(a.lease_expires_at),
        manifest=manifest_to_pb(a.manifest),
        inference_token=a.inference_token,
        checkpoint_sequence=a.checkpoint_sequence,
        checkpoint=a.checkpoint,
        tenant=a.tenant,
    )


def assignment_from_pb(a: host_pb2.WorkAssignment) -> Assignment:
    return Assignment(
        work_id=a.work_id,
        rollout_id=a.rollout_id,
        attempt=a.attempt,
        fencing_token=a.fencing_token,
        lease_expires_at=from_ts(a.lease_expires_at),
        manifest=manifest_from_pb(a.manifest),
        inference_token=a.inference_token,
        checkpoint_sequence=a.checkpoint_sequence,
        checkpoint=a.checkpoint,
        tenant=a.tenant or "default",
    )


MAX_EGRESS_EVENTS = 1000
"""Per completion: a machine hammering refused addresses cannot flood the ledger."""


def completion_from_pb(req: host_pb2.CompleteWorkRequest) -> Completion:
    if len(req.egress_events) > MAX_EGRESS_EVENTS:
        raise InvalidArgument(
            f"egress_events: {len(req.egress_events)} events, over the limit of "
            f"{MAX_EGRESS_EVENTS} per completion"
        )
    outcome = OUTCOME_FROM_PB.get(req.outcome)
    if outcome is None:
        raise InvalidArgument("outcome must be set (OUTCOME_SUCCEEDED, _STEP_FAILED, ...)")
    return Completion(
        work_id=req.work_id,
        fencing_token=req.fencing_token,
        outcome=outcome,
        results=tuple(result_from_pb(r) for r in req.results),
        error=req.error,
        runtime=RUNTIME_FROM_PB[req.runtime].value if req.runtime in RUNTIME_FROM_PB else "",
        device=req.device,
        egress=egress_from_pb(req.egress) if req.HasField("egress") else None,
        egress_events=tuple(egress_event_from_pb(e) for e in req.egress_events),
        cpu_seconds=max(0.0, req.cpu_seconds),
        peak_memory_mib=max(0.0, req.peak_memory_mib),
        artifact_failed=req.artifact_failed,
        outputs=tuple(output_from_pb(o) for o in req.outputs[:MAX_FILES]),
    )


def egress_event_from_pb(e: types_pb2.EgressEvent) -> EgressEvent:
    if e.kind not in ("dns", "connect"):
        raise InvalidArgument(f"egress_events: kind {e.kind!r} is not 'dns' or 'connect'")
    if e.decision not in ("", "refused"):
        raise InvalidArgument(f"egress_events: decision {e.decision!r} is not 'refused'")
    return EgressEvent(
        at=e.at.ToDatetime(tzinfo=UTC).timestamp(), machine=e.machine, kind=e.kind,
        destination=e.destination[:512], reason=e.reason[:1024],
    )  # fmt: skip


def egress_event_to_pb(
    e: EgressEvent, rollout_id: str = "", attempt: int = 0
) -> types_pb2.EgressEvent:
    return types_pb2.EgressEvent(
        rollout_id=rollout_id, attempt=attempt, machine=e.machine,
        at=ts(datetime.fromtimestamp(e.at, UTC)), kind=e.kind, destination=e.destination,
        decision=e.decision, reason=e.reason,
    )  # fmt: skip


def completion_to_pb(host_id: str, c: Completion, request_id: str) -> host_pb2.CompleteWorkRequest:
    return host_pb2.CompleteWorkRequest(
        request_id=request_id,
        host_id=host_id,
        work_id=c.work_id,
        fencing_token=c.fencing_token,
        outcome=OUTCOME_TO_PB[c.outcome],
        results=[result_to_pb(r) for r in c.results],
        error=c.error,
        runtime=RUNTIME_TO_PB[RuntimeKind(c.runtime)]
        if c.runtime
        else types_pb2.RUNTIME_KIND_UNSPECIFIED,
        device=c.device,
        egress=egress_to_pb(c.egress),
        egress_events=[egress_event_to_pb(e) for e in c.egress_events[:MAX_EGRESS_EVENTS]],
        cpu_seconds=c.cpu_seconds,
        peak_memory_mib=c.peak_memory_mib,
        artifact_failed=c.artifact_failed,
        outputs=[output_to_pb(o) for o in c.outputs],
    )
