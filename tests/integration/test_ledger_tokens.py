"""Language-model tokens in the ledger, on every backend: each gateway poll's tokens are
charged to the rollout's latest attempt, in all and by model, in one transaction with the
device seconds; `fleet report` reads them back per attempt; retention deletes them with it."""

from __future__ import annotations

from sqlalchemy import text

from fleet.core.lifecycle import Outcome
from fleet.core.retry import RetryPolicy
from fleet.ledger.retention import purge_finished
from fleet.ledger.store import Ledger
from tests.integration.test_ledger import T0, done, submit
from tests.integration.test_pool_control import LONG, host


def test_tokens_are_charged_to_the_latest_attempt_by_model(ledger: Ledger) -> None:
    host(ledger, "c1", "cloud")
    retry = RetryPolicy(max_attempts=3, initial_backoff_s=1, max_backoff_s=1)
    rollout, _ = submit(ledger, retry=retry)
    [a] = ledger.claim("c1", 1, T0, LONG)
    charged = ledger.add_usage(
        {rollout.id: 0.5}, {rollout.id: {"m": (10, 2)}, "r-unknown": {"m": (1, 1)}}
    )
    assert charged == 1  # (a rollout this ledger does not hold is passed over)
    ledger.complete("c1", done(a.work_id, a.fencing_token, Outcome.TRANSIENT_ERROR), T0 + 1)
    [b] = ledger.claim("c1", 1, T0 + 3, LONG)
    ledger.add_usage({}, {rollout.id: {"m": (5, 5), "up/x": (7, 0)}})
    ledger.add_usage({rollout.id: 0.25}, {rollout.id: {"m": (1, 1)}})
    ledger.complete("c1", done(b.work_id, b.fencing_token), T0 + 4)
    first, last = ledger.cost_attempts(T0)

    assert (first.final, dict(first.tokens), first.device_s) == (False, {"m": (10, 2)}, 0.5)
    assert (last.final, dict(last.tokens)) == (True, {"m": (6, 6), "up/x": (7, 0)})
    assert (last.prompt_tokens, last.completion_tokens, last.device_s) == (13, 6, 0.25)
    with ledger.engine.begin() as conn:
        totals = conn.execute(
            text("SELECT prompt_tokens, completion_tokens FROM attempts ORDER BY id")
        ).all()
    assert [tuple(t) for t in totals] == [(10, 2), (13, 6)]


def test_retention_deletes_an_attempts_tokens_with_it(ledger: Ledger) -> None:
    host(ledger, "c1", "cloud")
    rollout, _ = submit(ledger)
    [a] = ledger.claim("c1", 1, T0, LONG)
    ledger.add_usage({}, {rollout.id: {"m": (3, 4)}})
    ledger.complete("c1", done(a.work_id, a.fencing_token), T0 + 1)

    assert purge_finished(ledger, T0 + 10**9) == 1
    with ledger.engine.begin() as conn:
        left = conn.execute(text("SELECT count(*) FROM attempt_tokens")).scalar_one()
    assert left == 0
