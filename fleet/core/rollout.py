"""Rollouts as the ledger reports them: state, results, events, leased work."""

from __future__ import annotations

import hashlib
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from fleet.core.egress import EffectiveEgress, EgressEvent
from fleet.core.lifecycle import Outcome, RolloutState
from fleet.core.manifest import Manifest, OutputArtifact
from fleet.core.placement import HostClass

MAX_OUTPUT_BYTES = 64 * 1024


class StepResult(BaseModel):
    """What one step did: exit code, bounded output and its stored digests."""

    model_config = ConfigDict(frozen=True)

    index: int
    name: str = ""
    exit_code: int
    timed_out: bool = False
    duration_s: float = 0.0
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    stdout_digest: str = ""
    stderr_digest: str = ""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class AttemptRecord(BaseModel):
    """One attempt: host, start, end, outcome and error."""

    model_config = ConfigDict(frozen=True)

    attempt: int
    host_id: str
    started_at: datetime
    ended_at: datetime | None = None
    outcome: str = ""
    error: str = ""


class Rollout(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    state: RolloutState
    tenant: str
    idempotency_key: str
    labels: dict[str, str] = Field(default_factory=dict)
    manifest: Manifest
    manifest_digest: str
    attempts: int = 0
    results: tuple[StepResult, ...] = ()
    error: str = ""
    host_id: str = ""
    runtime: str = ""
    device: str = ""
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    priority: int = 0
    attempt_history: tuple[AttemptRecord, ...] = ()
    egress: EffectiveEgress | None = None
    outputs: tuple[OutputArtifact, ...] = ()

    @property
    def host_class(self) -> HostClass:
        return self.manifest.host_class


class RolloutEvent(BaseModel):
    model_config = ConfigDict(frozen=True)

    sequence: int
    rollout_id: str
    kind: str
    from_state: RolloutState | None = None
    to_state: RolloutState | None = None
    actor: str = ""
    at: datetime
    message: str = ""
    attempt: int = 0


class Assignment(BaseModel):
    """A leased work item handed to an agent."""

    model_config = ConfigDict(frozen=True)

    work_id: str
    rollout_id: str
    attempt: int
    fencing_token: int
    lease_expires_at: datetime
    manifest: Manifest
    inference_token: str = ""
    checkpoint_sequence: int = 0
    checkpoint: bytes = b""
    tenant: str = "default"


class Completion(BaseModel):
    """An agent's report on one attempt."""

    model_config = ConfigDict(frozen=True)

    work_id: str
    fencing_token: int
    outcome: Outcome
    results: tuple[StepResult, ...] = ()
    error: str = ""
    runtime: str = ""
    device: str = ""
    egress: EffectiveEgress | None = None
    egress_events: tuple[EgressEvent, ...] = ()
    cpu_seconds: float = 0.0
    """CPU time the attempt's machine used (0 where the runtime cannot tell)."""
    peak_memory_mib: float = 0.0
    """The most memory the attempt's machine held at once (0 where the runtime cannot tell)."""
    outputs: tuple[OutputArtifact, ...] = ()
    """What the attempt collected at the manifest's output paths (stored already)."""
    artifact_failed: bool = False
    """It failed to move an artifact: its image fetched, an input placed, an output collected."""

    def fingerprint(self) -> str:
        """Identifies the reported result, so a resent completion is recognised."""
        body = self.model_dump_json(exclude={"work_id", "fencing_token"})
        return "sha256:" + hashlib.sha256(body.encode()).hexdigest()
