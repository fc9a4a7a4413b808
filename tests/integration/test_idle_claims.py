"""Claims while nothing is due: a batch of them reads no pools, caps or queue, only its claims'
hosts and their repeats, in one statement each; a repeat still gets back what it leased, an
unknown host is still refused, and work that becomes due is claimed as before. On SQLite and
PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest

from fleet.core.errors import FailedPrecondition
from fleet.ledger.leases import Claim
from fleet.ledger.raw import Raw
from fleet.ledger.store import Ledger
from tests.integration.test_heartbeat_batches import T0, TTL, register, submit

IDLE = 24


def count_statements(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    count = [0]
    real = Raw._execute

    def counted(self: Raw, sql: str, params: Any, n: int) -> None:
        count[0] += 1
        real(self, sql, params, n)

    monkeypatch.setattr(Raw, "_execute", counted)
    return count


def test_claims_while_nothing_is_due_are_cheap_and_answered_alike(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    for n in range(IDLE):
        register(ledger, f"cpu-{n}")
    submit(ledger, "k1")
    [first] = ledger.claim("cpu-0", 1, T0, TTL, request_id="claim-0")
    claims = [Claim(f"cpu-{n}", 2, TTL, request_id=f"claim-{n}") for n in range(IDLE)]
    claims.append(Claim("nobody", 1, TTL))

    statements = count_statements(monkeypatch)
    answers = ledger.claim_batch(claims, T0 + 1)

    again, *idle, unknown = answers
    assert isinstance(again, list) and [a.work_id for a in again] == [first.work_id]
    assert again[0].fencing_token == first.fencing_token
    assert idle == [[]] * (IDLE - 1)
    assert isinstance(unknown, FailedPrecondition)
    # One look at the queue, one at the claims' hosts and one at their repeats for the whole
    # batch (and the repeat's assignment): not a statement per claim, nor the pools, caps and
    # queue of each.
    assert statements[0] <= 1 + 2 + 2, statements[0]
    # Work that becomes due is claimed by the next batch as usual.
    rollout = submit(ledger, "k2")
    first_due, *rest = ledger.claim_batch(claims[1:-1], T0 + 2)
    assert isinstance(first_due, list) and [a.rollout_id for a in first_due] == [rollout.id]
    assert rest == [[]] * (IDLE - 2)
