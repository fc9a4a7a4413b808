"""The rollouts listing's filters in SQL (state, creation time, tenant) and a rollout's tokens
by model, on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from fleet.core.errors import NotFound
from fleet.core.lifecycle import RolloutState
from fleet.ledger.store import Ledger
from tests.integration.test_ledger import T0, TTL, done, register, submit


def test_the_listing_filters_by_state_time_and_tenant_in_pages(ledger: Ledger) -> None:
    """A state filter pages through that state's rollouts only, newest first, however many
    of other states lie between them; creation time and tenant narrow it further."""
    register(ledger)
    ids = [submit(ledger, key=f"k{i}", tenant="a" if i < 6 else "b")[0].id for i in range(8)]
    claimed = ledger.claim("cpu-1", 2, T0, TTL)
    running = {a.rollout_id for a in claimed}
    assert len(running) == 2
    first, token = ledger.list_rollouts(1, "", {}, state=RolloutState.RUNNING)
    rest, end = ledger.list_rollouts(1, token, {}, state=RolloutState.RUNNING)
    assert token and not end
    assert {r.id for r in first + rest} == running
    assert all(r.state == RolloutState.RUNNING for r in first + rest)
    queued, _ = ledger.list_rollouts(50, "", {}, state=RolloutState.QUEUED)
    assert [r.id for r in queued] == [i for i in reversed(ids) if i not in running]
    assert ledger.list_rollouts(50, "", {}, state=RolloutState.SUCCEEDED) == ([], "")
    only_b, _ = ledger.list_rollouts(50, "", {}, tenant="b", state=RolloutState.QUEUED)
    assert {r.id for r in only_b} == set(ids[6:]) - running
    assert ledger.list_rollouts(50, "", {}, created_since=T0 + 1)[0] == []
    assert ledger.list_rollouts(50, "", {}, created_before=T0)[0] == []
    window, _ = ledger.list_rollouts(50, "", {}, created_since=T0, created_before=T0 + 1)
    assert len(window) == 8


def test_a_rollouts_tokens_are_summed_by_model_over_its_attempts(ledger: Ledger) -> None:
    register(ledger)
    rollout, _ = submit(ledger)
    assert ledger.rollout_tokens(rollout.id) == {}
    [a] = ledger.claim("cpu-1", 1, T0, TTL)
    ledger.add_usage({}, {rollout.id: {"tiny": (10, 3), "big": (1, 1)}})
    ledger.add_usage({}, {rollout.id: {"tiny": (5, 2)}})
    ledger.complete("cpu-1", done(a.work_id, a.fencing_token), T0 + 1)
    assert ledger.rollout_tokens(rollout.id) == {"big": (1, 1), "tiny": (15, 5)}
    with pytest.raises(NotFound):
        ledger.rollout_tokens("r-missing")
