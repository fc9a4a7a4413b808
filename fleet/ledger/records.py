"""Rows as the ledger's statements read them: named tuples over a table's columns, in order
(`fleet.ledger.queries` selects exactly these columns); and the metrics' settled figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class Item(NamedTuple):
    """A `work_items` row."""

    id: str
    rollout_id: str
    tenant: str
    state: str
    host_class: str
    needs_vm: bool
    needs_cuda_device: bool
    needs_inference: bool
    priority: int
    attempt: int
    max_attempts: int
    not_before: float
    deadline: float
    lease_owner: str
    fencing_token: int
    lease_expires_at: float | None
    cancel_requested: bool
    result_fingerprint: str
    claim_request_id: str
    needs_namespace: bool


class RolloutRec(NamedTuple):
    """A `rollouts` row."""

    seq: int
    id: str
    idempotency_key: str
    manifest_digest: str
    tenant: str
    labels_json: str
    state: str
    priority: int
    attempts: int
    error: str
    host_id: str
    runtime: str
    device: str
    results_json: str
    egress_json: str
    outputs_json: str
    created_at: float
    updated_at: float
    started_at: float | None
    finished_at: float | None


class AttemptRec(NamedTuple):
    """An `attempts` row."""

    id: int
    work_id: str
    attempt: int
    host_id: str
    fencing_token: int
    started_at: float
    ended_at: float | None
    outcome: str
    error: str
    cpu_s: float
    peak_memory_mib: float
    device_s: float
    artifact_failed: bool


def columns(record: type[tuple[object, ...]], alias: str = "") -> str:
    """A record's columns as a select list (`alias.` before each, with an alias)."""
    prefix = f"{alias}." if alias else ""
    return ", ".join(prefix + name for name in record._fields)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Settled:
    """The figures of the rollouts that finished before `until`."""

    until: float = 0.0
    by_state: dict[str, int] = field(default_factory=dict)
    retries: int = 0
    cpu_s: float = 0.0
    inference: int = 0

    def plus(self, more: Settled) -> Settled:
        """These figures and `more`'s, which follow them (until `more.until`)."""
        states = {s: self.by_state.get(s, 0) + more.by_state.get(s, 0)
                  for s in {*self.by_state, *more.by_state}}  # fmt: skip
        return Settled(more.until, states, self.retries + more.retries, self.cpu_s + more.cpu_s,
                       self.inference + more.inference)  # fmt: skip
