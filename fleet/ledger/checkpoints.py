"""Checkpoints: hybrid episodes' state between model calls, within a budget per rollout."""

from __future__ import annotations

import structlog

from fleet.core.errors import (
    Aborted,
    FleetError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from fleet.ledger import queries as Q
from fleet.ledger.base import MAX_CHECKPOINT_BYTES, LedgerBase
from fleet.ledger.raw import LEASED, Raw
from fleet.ledger.records import Item
from fleet.ledger.tables import (
    CHECKPOINT_ROW_BYTES,
)

log = structlog.get_logger(__name__)


class Checkpoints(LedgerBase):
    def put_checkpoint(
        self, host_id: str, work_id: str, fencing_token: int, seq: int, data: bytes, now: float
    ) -> None:
        """Stores a hybrid rollout's checkpoint under the attempt's lease (see PutCheckpoint)."""
        [result] = self.put_checkpoints([(host_id, work_id, fencing_token, seq, data)], now)
        if result is not None:
            raise result

    def put_checkpoints(
        self, items: list[tuple[str, str, int, int, bytes]], now: float
    ) -> list[FleetError | None]:
        """Stores many checkpoints (host, work id, fencing token, sequence, data) in one
        transaction, one durable commit; each gets None (stored, or already stored) or the error
        that refused it alone."""
        results: list[FleetError | None] = []
        with self._tx() as db:
            for host_id, work_id, fencing_token, seq, data in items:
                try:
                    self._put_checkpoint(db, host_id, work_id, fencing_token, seq, data, now)
                    results.append(None)
                except FleetError as exc:
                    results.append(exc)
        return results

    def _put_checkpoint(
        self, db: Raw, host_id: str, work_id: str, fencing_token: int, seq: int, data: bytes,
        now: float,
    ) -> None:  # fmt: skip
        if seq < 1:
            raise InvalidArgument("checkpoint sequence numbers start at 1")
        if len(data) > MAX_CHECKPOINT_BYTES:
            raise ResourceExhausted(
                f"checkpoint of {len(data)} bytes is over the limit of {MAX_CHECKPOINT_BYTES}"
            )
        row = db.one(Q.ITEM_FOR_UPDATE, (work_id,))
        if row is None:
            raise NotFound(f"no work item {work_id!r}")
        item = Item(*row)
        if (
            item.fencing_token != fencing_token
            or item.state != LEASED
            or item.lease_owner != host_id
        ):
            raise Aborted(
                f"stale lease for {work_id} (token {fencing_token}): this attempt may not "
                "write checkpoints"
            )
        stored = db.run(Q.INSERT_CHECKPOINT, (item.rollout_id, seq, item.attempt, data, now))
        if stored:
            charge = len(data) + CHECKPOINT_ROW_BYTES
            held = db.value(Q.CHARGE_CHECKPOINT, (item.rollout_id, charge))
            if held <= self.checkpoint_budget_bytes:
                return
            # Over the budget: this one is not kept (the rest of the batch goes on).
            db.run(Q.DELETE_CHECKPOINT, (item.rollout_id, seq))
            db.run(Q.REFUND_CHECKPOINT, (charge, item.rollout_id))
            raise ResourceExhausted(
                f"rollout {item.rollout_id}: checkpoint {seq} ({len(data)} bytes) would bring "
                f"its checkpoints past their limit of {self.checkpoint_budget_bytes} bytes "
                f"({held - charge} held, each charged its size plus {CHECKPOINT_ROW_BYTES})"
            )
        have = db.value(Q.CHECKPOINT_DATA, (item.rollout_id, seq))
        if bytes(have) != data:
            raise Aborted(f"rollout {item.rollout_id} already has checkpoint {seq} with other data")
        # else a resend: already stored

    def checkpoints(self, rollout_id: str) -> list[tuple[int, int, bytes]]:
        """(sequence, attempt, data) of every checkpoint a rollout stored, in order."""
        with self._read() as db:
            rows = db.all(Q.CHECKPOINTS, (rollout_id,))
        return [(int(s), int(a), bytes(d)) for s, a, d in rows]

    def checkpoint_index(self, rollout_id: str) -> list[tuple[int, int, int, float]]:
        """(sequence, attempt, size in bytes, created at) of every checkpoint a rollout stored,
        in order: what a listing shows, without reading their data."""
        with self._read() as db:
            rows = db.all(Q.CHECKPOINT_INDEX, (rollout_id,))
        return [(int(s), int(a), int(n), float(t)) for s, a, n, t in rows]
