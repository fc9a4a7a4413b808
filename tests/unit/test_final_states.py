"""The final rollout states are defined once: the states no move leaves, by name or value."""

from __future__ import annotations

from fleet.core.lifecycle import FINAL, TRANSITIONS, RolloutState, is_final


def test_the_final_states_are_those_no_move_leaves() -> None:
    assert {state for state, moves in TRANSITIONS.items() if not moves} == FINAL
    assert all(is_final(state) and is_final(state.value) for state in FINAL)


def test_a_state_still_moving_or_unknown_is_not_final() -> None:
    assert not any(is_final(name) for name in ("QUEUED", "RUNNING", "", "succeeded", "DONE"))
    assert not is_final(RolloutState.RUNNING)
