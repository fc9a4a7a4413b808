"""Rollout lifecycle: the states and the only moves allowed between them."""

from __future__ import annotations

import enum

from fleet.core.errors import FailedPrecondition


class RolloutState(enum.StrEnum):
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    QUARANTINED = "QUARANTINED"

    @property
    def final(self) -> bool:
        return self in FINAL_STATES


FINAL_STATES = frozenset(
    {
        RolloutState.SUCCEEDED,
        RolloutState.FAILED,
        RolloutState.CANCELLED,
        RolloutState.QUARANTINED,
    }
)

TRANSITIONS: dict[RolloutState, frozenset[RolloutState]] = {
    RolloutState.QUEUED: frozenset(
        {RolloutState.RUNNING, RolloutState.FAILED, RolloutState.CANCELLED}
    ),
    # RUNNING -> QUEUED is a retry after a lost lease or a transient error.
    RolloutState.RUNNING: frozenset(
        {
            RolloutState.QUEUED,
            RolloutState.SUCCEEDED,
            RolloutState.FAILED,
            RolloutState.CANCELLED,
            RolloutState.QUARANTINED,
        }
    ),
    RolloutState.SUCCEEDED: frozenset(),
    RolloutState.QUARANTINED: frozenset(),
    RolloutState.FAILED: frozenset(),
    RolloutState.CANCELLED: frozenset(),
}


def check_transition(current: RolloutState, target: RolloutState) -> None:
    """Raises FailedPrecondition unless `current -> target` is an allowed move."""
    if target not in TRANSITIONS[current]:
        raise FailedPrecondition(f"rollout cannot move from {current} to {target}")


class Outcome(enum.StrEnum):
    """How an attempt ended, as the agent reports it."""

    SUCCEEDED = "SUCCEEDED"
    STEP_FAILED = "STEP_FAILED"
    TRANSIENT_ERROR = "TRANSIENT_ERROR"
    CANCELLED = "CANCELLED"
    MALFORMED_INPUT = "MALFORMED_INPUT"
    INCOMPATIBLE = "INCOMPATIBLE"
    LEASE_EXPIRED = "LEASE_EXPIRED"
