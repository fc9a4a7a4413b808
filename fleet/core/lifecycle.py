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

FINAL = FINAL_STATES
"""The states a rollout ends in: nothing moves it on from them (the one definition)."""


def is_final(state: str | RolloutState) -> bool:
    """Whether `state` (a RolloutState or its name, as the wire and the client spell it) is
    one a rollout ends in; an unknown name is not."""
    try:
        return RolloutState(state) in FINAL_STATES
    except ValueError:
        return False


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


class WorkItemState(enum.StrEnum):
    """A work item's place in the queue (a rollout has one; its state is the rollout's)."""

    QUEUED = "QUEUED"
    """Waiting for a host: new, retried after a failed attempt, or released by a lost lease."""
    LEASED = "LEASED"
    """A host holds it under a fencing token until the lease expires."""
    DONE = "DONE"
    """Its rollout reached a final state; never leased again."""


ITEM_TRANSITIONS: dict[WorkItemState, frozenset[WorkItemState]] = {
    # Leased by a claim; done when cancelled or past its deadline before it ran.
    WorkItemState.QUEUED: frozenset({WorkItemState.LEASED, WorkItemState.DONE}),
    # Back in the queue for a retry (a failed attempt, an expired or released lease); done.
    WorkItemState.LEASED: frozenset({WorkItemState.QUEUED, WorkItemState.DONE}),
    WorkItemState.DONE: frozenset(),
}


def check_item_transition(current: WorkItemState, target: WorkItemState) -> None:
    """Raises FailedPrecondition unless `current -> target` is an allowed move."""
    if target not in ITEM_TRANSITIONS[current]:
        raise FailedPrecondition(f"work item cannot move from {current} to {target}")


class Outcome(enum.StrEnum):
    """How an attempt ended, as the agent reports it."""

    SUCCEEDED = "SUCCEEDED"
    STEP_FAILED = "STEP_FAILED"
    TRANSIENT_ERROR = "TRANSIENT_ERROR"
    CANCELLED = "CANCELLED"
    MALFORMED_INPUT = "MALFORMED_INPUT"
    INCOMPATIBLE = "INCOMPATIBLE"
    LEASE_EXPIRED = "LEASE_EXPIRED"
