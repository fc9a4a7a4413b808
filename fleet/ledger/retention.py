"""Retention: rollouts that finished long enough ago are deleted with everything of theirs
(events, attempts, labels, egress events, checkpoints, step output, unreferenced manifests);
`referenced_blobs` says which inputs and outputs the remaining rollouts still name (and
which layers parked sessions keep, or resumes and forks not ended yet start from).

A session that is not over is never purged from under its caller, however long ago its
rollouts ended: a parked session keeps the rollout that stores its layer (parked by a call, by
idleness or by a drain alike; the layer stays named by its outputs), and a session held by a
resume keeps its first rollout (its id, owner and opening time). Once it is closed (or its
last rollout failed), its rollouts go as any others, and its park record with the first.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from fleet.core.lifecycle import RolloutState
from fleet.core.manifest import SESSION_LAYER_OUTPUT
from fleet.ledger import queries as Q
from fleet.ledger.parks import CLOSED, RESUMES_LABEL

if TYPE_CHECKING:
    from fleet.ledger.store import Ledger

BATCH = 500
HOLDS_LAYER = f"%{json.dumps(SESSION_LAYER_OUTPUT)}%"
"""An `outputs_json` that names a parked session's layer (`LIKE`)."""
IS_RESUME = f"%{json.dumps(RESUMES_LABEL)}: %"
"""A `labels_json` (sorted JSON, as stored) of a session's resume (`LIKE`)."""


def purge_finished(ledger: Ledger, before: float) -> int:
    """Deletes rollouts that finished before `before` (epoch seconds), in batches, but for
    those a session that is not over needs; returns how many."""
    removed = 0
    succeeded = RolloutState.SUCCEEDED.value
    params = (before, succeeded, HOLDS_LAYER, CLOSED, IS_RESUME, CLOSED, succeeded, HOLDS_LAYER,
              BATCH)  # fmt: skip
    while True:
        with ledger._tx() as db:
            ids = [row[0] for row in db.all(Q.FINISHED_BEFORE, params)]
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
    """Digests of the inputs and outputs that remaining rollouts name (a parked session's
    layer among them: its rollout remains), and the layers that resumes and forks not started
    yet will fetch."""
    found: set[str] = set()
    with ledger._read() as db:
        for (body,) in db.all(Q.MANIFESTS_WITH_INPUTS):
            found.update(i["digest"] for i in json.loads(body).get("inputs", []))
        for (body,) in db.all(Q.MANIFESTS_STARTING_FROM_LAYERS):
            found.add((json.loads(body).get("session") or {}).get("layer", ""))
        for (outputs,) in db.all(Q.ROLLOUT_OUTPUTS):
            found.update(o["digest"] for o in json.loads(outputs) if o.get("digest"))
    found.discard("")
    return found | ledger.parked_layers()
