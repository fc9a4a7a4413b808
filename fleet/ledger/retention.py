"""Retention: rollouts that finished long enough ago are deleted with everything of theirs
(events, attempts, labels, egress events, checkpoints, step output, unreferenced manifests);
`referenced_blobs` says which inputs and outputs the remaining rollouts still name (and
which layers parked sessions keep)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from fleet.ledger import queries as Q

if TYPE_CHECKING:
    from fleet.ledger.store import Ledger

BATCH = 500


def purge_finished(ledger: Ledger, before: float) -> int:
    """Deletes rollouts that finished before `before` (epoch seconds), in batches; returns
    how many."""
    removed = 0
    while True:
        with ledger._tx() as db:
            ids = [row[0] for row in db.all(Q.FINISHED_BEFORE, (before, BATCH))]
            if not ids:
                if removed:
                    ledger.forget_settled_figures()
                return removed
            for sql in Q.PURGE_ROLLOUTS:
                db.run(sql, ids, n=len(ids))
            db.run(Q.PURGE_MANIFESTS)
            # Step output kept as artifacts, once no remaining rollout's results name it.
            db.run(Q.PURGE_ARTIFACTS, (before,))
            removed += len(ids)


def referenced_blobs(ledger: Ledger) -> set[str]:
    """Digests of the inputs and outputs that remaining rollouts name."""
    found: set[str] = set()
    with ledger._read() as db:
        for (body,) in db.all(Q.MANIFESTS_WITH_INPUTS):
            found.update(i["digest"] for i in json.loads(body).get("inputs", []))
        for (outputs,) in db.all(Q.ROLLOUT_OUTPUTS):
            found.update(o["digest"] for o in json.loads(outputs) if o.get("digest"))
    return found | ledger.parked_layers()
