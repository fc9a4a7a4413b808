"""Retention: rollouts that finished long enough ago are deleted with everything of theirs
(events, attempts, labels, egress events, checkpoints, step output, unreferenced manifests);
`referenced_blobs` says which inputs and outputs the remaining rollouts still name."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from sqlalchemy import bindparam, text

if TYPE_CHECKING:
    from fleet.ledger.store import Ledger

BATCH = 500
_BY_ROLLOUT = ("events", "rollout_labels", "egress_events", "checkpoints", "checkpoint_usage")


def purge_finished(ledger: Ledger, before: float) -> int:
    """Deletes rollouts that finished before `before` (epoch seconds), in batches; returns
    how many."""
    removed = 0
    while True:
        with ledger._begin() as conn:
            ids = [
                row[0]
                for row in conn.execute(
                    text(
                        "SELECT id FROM rollouts WHERE finished_at IS NOT NULL "
                        "AND finished_at < :before ORDER BY finished_at LIMIT :n"
                    ),
                    {"before": before, "n": BATCH},
                )
            ]
            if not ids:
                return removed

            statements = [
                "DELETE FROM attempts WHERE work_id IN "
                "(SELECT id FROM work_items WHERE rollout_id IN :ids)",
                "DELETE FROM work_items WHERE rollout_id IN :ids",
                *(f"DELETE FROM {table} WHERE rollout_id IN :ids" for table in _BY_ROLLOUT),
                "DELETE FROM rollouts WHERE id IN :ids",
            ]
            for sql in statements:
                statement = text(sql).bindparams(bindparam("ids", expanding=True))
                conn.execute(statement, {"ids": ids})
            conn.execute(
                text(
                    "DELETE FROM manifests WHERE digest NOT IN "
                    "(SELECT manifest_digest FROM rollouts)"
                )
            )
            # Step output kept as artifacts, once no remaining rollout's results name it.
            conn.execute(
                text(
                    "DELETE FROM artifacts WHERE created_at < :before AND NOT EXISTS "
                    "(SELECT 1 FROM rollouts r WHERE r.results_json LIKE "
                    "'%' || artifacts.digest || '%')"
                ),
                {"before": before},
            )
            removed += len(ids)


def referenced_blobs(ledger: Ledger) -> set[str]:
    """Digests of the inputs and outputs that remaining rollouts name."""
    found: set[str] = set()
    with ledger.engine.connect() as conn:
        for (body,) in conn.execute(
            text("SELECT body FROM manifests WHERE body LIKE '%\"inputs\":[{%'")
        ):
            found.update(i["digest"] for i in json.loads(body).get("inputs", []))
        for (outputs,) in conn.execute(
            text("SELECT outputs_json FROM rollouts WHERE outputs_json <> '[]'")
        ):
            found.update(o["digest"] for o in json.loads(outputs) if o.get("digest"))
    return found
