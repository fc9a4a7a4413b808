"""Sessions that park: which rollout holds each parked or resumed session, and its layer.

A session's id is the id of the rollout that opened it, and stays the id callers use. Parking
ends that rollout (its machine's writable layer stored as an artifact); a resume is a rollout
of its own, and `session_parks` maps the session's id to the newest. A session never parked
has no row: its own rollout holds it (one parked by idleness, too: its host parks it).

Retention keeps what a session that is not over needs (`fleet.ledger.retention`): the rollout
that stores a parked session's layer, and the first rollout of a session a resume holds.

A resume that fails before its machine starts (its layer not fetched or not unpacked, the host
unable to make the machine: the agent reports it as the layer's failure, `artifact_failed`)
lost nothing: the session's disk is still the stored layer. Its park row goes back to the
rollout that stores that layer (`repark_failed_resumes`, in the transaction that records the
report), so the session is PARKED again and may be resumed again; the failure stays on the
resume's rollout (its error and its events). A resume that fails once its machine started
ends the session FAILED, as any session's failure does: what it did since is gone.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import NamedTuple

import structlog

from fleet.core.lifecycle import RolloutState
from fleet.core.manifest import SESSION_LAYER_OUTPUT, OutputArtifact
from fleet.core.rollout import Rollout
from fleet.ledger.base import DRAINING, LedgerBase
from fleet.ledger.raw import LEASED, Raw

log = structlog.get_logger(__name__)

PARKED, RESUMED, CLOSED = "PARKED", "RESUMED", "CLOSED"
RESUMES_LABEL = "fleet.resumes"
"""The label of a resume's rollout: the id of the session it holds."""

PARK_COLS = "session_id, rollout_id, layer_digest, layer_size, parked_from, state, updated_at"
PARK = f"SELECT {PARK_COLS} FROM session_parks WHERE session_id = ?"
PARK_OF_ROLLOUT = f"SELECT {PARK_COLS} FROM session_parks WHERE rollout_id = ?"
UPSERT_PARK = (
    f"INSERT INTO session_parks ({PARK_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (session_id) DO UPDATE SET rollout_id = excluded.rollout_id, "
    "layer_digest = excluded.layer_digest, layer_size = excluded.layer_size, "
    "parked_from = excluded.parked_from, state = excluded.state, "
    "updated_at = excluded.updated_at"
)
CLOSE_PARK = "UPDATE session_parks SET state = ?, updated_at = ? WHERE session_id = ?"
LEASED_ON_HOSTS_IN_STATE = (
    "SELECT w.rollout_id, w.lease_owner, r.manifest_digest FROM work_items w "
    "JOIN hosts h ON h.id = w.lease_owner JOIN rollouts r ON r.id = w.rollout_id "
    "WHERE h.state = ? AND w.state = ?"
)
PARKED_LAYERS = "SELECT layer_digest FROM session_parks WHERE state = ? AND layer_digest <> ''"
LAYER_HOLDERS = (
    "SELECT id, outputs_json FROM rollouts WHERE state = ? AND outputs_json LIKE ? AND (id = ? "
    "OR id IN (SELECT rollout_id FROM rollout_labels WHERE key = ? AND value = ?)) "
    "ORDER BY finished_at DESC"
)
"""The rollouts of a session (its first, its resumes) that ended storing a layer, newest first."""


class Park(NamedTuple):
    """A `session_parks` row."""

    session_id: str
    rollout_id: str
    layer_digest: str
    layer_size: int
    parked_from: str
    state: str
    updated_at: float


def _park(row: tuple[object, ...] | None) -> Park | None:
    if row is None:
        return None
    sid, rid, digest, size, host, state, at = row
    return Park(
        str(sid), str(rid), str(digest), int(str(size)), str(host), str(state), float(str(at))
    )


def parked_layer(rollout: Rollout, park: Park | None) -> OutputArtifact | None:
    """The layer a session rests in: its rollout ended by parking (and it was not closed
    since); None for a session that is open, closed or failed."""
    if park is not None and park.state == CLOSED:
        return None
    if rollout.state != RolloutState.SUCCEEDED:
        return None
    return next((o for o in rollout.outputs if o.path == SESSION_LAYER_OUTPUT and o.digest), None)


def session_state(rollout: Rollout, park: Park | None) -> str:
    """OPEN, PARKED, CLOSED or FAILED, as SessionService reports a session whose rollout
    holding it now is `rollout` (with its park record, if it was ever parked)."""
    if parked_layer(rollout, park) is not None:
        return "PARKED"
    if park is not None and park.state == CLOSED:
        return "CLOSED"
    if rollout.state in (RolloutState.QUEUED, RolloutState.RUNNING):
        return "OPEN"
    closed = rollout.state in (RolloutState.SUCCEEDED, RolloutState.CANCELLED)
    return "CLOSED" if closed else "FAILED"


def repark_failed_resumes(db: Raw, rollout_ids: Iterable[str], now: float) -> list[Park]:
    """Sessions whose resume (each of `rollout_ids`, ended just now before its machine
    started) parked again, in the writer's transaction `db`: each park row back on the
    rollout that stores the layer the resume started from. A rollout that holds no resumed
    session (a fork's, a session closed meanwhile) or whose layer no rollout of its session
    stores any more is left as it is."""
    reparked = []
    for rollout_id in rollout_ids:
        park = _park(db.one(PARK_OF_ROLLOUT, (rollout_id,)))
        if park is None or park.state != RESUMED or not park.layer_digest:
            continue
        holder = _layer_holder(db, park.session_id, park.layer_digest)
        bound = log.bind(session_id=park.session_id, rollout_id=rollout_id,
                         layer=park.layer_digest)  # fmt: skip
        if holder is None:
            bound.warning("session_not_reparked", reason="no rollout of it stores the layer")
            continue
        row = (park.session_id, holder, park.layer_digest, park.layer_size, park.parked_from,
               PARKED, now)  # fmt: skip
        db.run(UPSERT_PARK, row)
        reparked.append(Park(*row))
        bound.warning("session_reparked", holder=holder,
                      reason="its resume failed before its machine started")  # fmt: skip
    return reparked


def _layer_holder(db: Raw, session_id: str, digest: str) -> str | None:
    """The newest rollout of the session that ended storing the layer `digest`; None if none."""
    params = (RolloutState.SUCCEEDED.value, f"%{digest}%", session_id, RESUMES_LABEL, session_id)
    for rollout_id, outputs_json in db.all(LAYER_HOLDERS, params):
        outputs = json.loads(str(outputs_json or "[]"))
        if any(o.get("path") == SESSION_LAYER_OUTPUT and o.get("digest") == digest
               for o in outputs):  # fmt: skip
            return str(rollout_id)
    return None


class Parks(LedgerBase):
    def session_park(self, session_id: str) -> Park | None:
        """The session's park row; None for a session never parked."""
        with self._read() as db:
            return _park(db.one(PARK, (session_id,)))

    def park_of_rollout(self, rollout_id: str) -> Park | None:
        """The park row whose session the rollout holds now (a resume's rollout); None when
        the rollout is a session's first (or no session's)."""
        with self._read() as db:
            return _park(db.one(PARK_OF_ROLLOUT, (rollout_id,)))

    def record_park(
        self, session_id: str, rollout_id: str, digest: str, size: int, host_id: str, now: float
    ) -> Park:
        """The session parked from `rollout_id` with the layer `digest`. A park of a rollout
        that no longer holds the session (a resume came first) changes nothing; the row is
        returned as it stands."""
        with self._tx() as db:
            old = _park(db.one(PARK, (session_id,)))
            if old is not None and old.rollout_id != rollout_id:
                return old
            row = (session_id, rollout_id, digest, size, host_id, PARKED, now)
            db.run(UPSERT_PARK, row)
            return Park(*row)

    def record_resume(
        self, session_id: str, rollout_id: str, digest: str, size: int, parked_from: str,
        now: float,
    ) -> Park:  # fmt: skip
        """`rollout_id` holds the session from now on, started from the layer `digest`."""
        row = (session_id, rollout_id, digest, size, parked_from, RESUMED, now)
        with self._tx() as db:
            db.run(UPSERT_PARK, row)
        return Park(*row)

    def record_park_closed(self, session_id: str, now: float) -> None:
        """A parked session closed by its caller: it is not resumed again."""
        with self._tx() as db:
            db.run(CLOSE_PARK, (CLOSED, now, session_id))

    def sessions_on_draining_hosts(self) -> list[tuple[str, str]]:
        """(rollout id, host) of every session leased to a draining host: what moves."""
        with self._read() as db:
            rows = db.all(LEASED_ON_HOSTS_IN_STATE, (DRAINING, LEASED))
            manifests = self._manifests_raw(db, {str(digest) for _, _, digest in rows})
        return [
            (str(rollout_id), str(host_id))
            for rollout_id, host_id, digest in rows
            if manifests[str(digest)].session is not None
        ]

    def parked_layers(self) -> set[str]:
        """The layers of parked sessions: blobs kept while they may be resumed."""
        with self._read() as db:
            return {str(digest) for (digest,) in db.all(PARKED_LAYERS, (PARKED,))}
