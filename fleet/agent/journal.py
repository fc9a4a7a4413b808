"""The agent's journal of each attempt it runs: which steps finished, with their results.

Written to the agent's own disk after `init` and after every step (atomically, fsynced), and
read back when a restarted agent adopts the attempt's machine: finished steps are not run
again and their results are reported as they were; the step that was running when the agent
died runs again from its start. A journal belongs to one lease (work id and fencing token), so
one left by an earlier attempt is never mistaken for the current one's.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
from pathlib import Path
from typing import Any

import structlog

from fleet.core.rollout import StepResult

log = structlog.get_logger(__name__)

_BYTES = ("stdout", "stderr")


def _encode(result: StepResult) -> dict[str, Any]:
    row = result.model_dump(exclude=set(_BYTES))
    for key in _BYTES:
        row[key] = base64.b64encode(getattr(result, key)).decode()
    return row


def _decode(row: dict[str, Any]) -> StepResult:
    data = dict(row)
    for key in _BYTES:
        data[key] = base64.b64decode(data.get(key, ""))
    return StepResult.model_validate(data)


class AttemptJournal:
    """What one attempt (work id + fencing token) has done so far."""

    def __init__(self, directory: Path, work_id: str, fencing_token: int) -> None:
        self.path = directory / f"{work_id}.json"
        self.work_id = work_id
        self.fencing_token = fencing_token
        self.init_done = False
        self.results: list[StepResult] = []

    @classmethod
    def resume(cls, directory: Path, work_id: str, fencing_token: int) -> AttemptJournal:
        """The journal of this lease as the last agent left it (empty if it left none)."""
        journal = cls(directory, work_id, fencing_token)
        try:
            doc = json.loads(journal.path.read_text())
        except FileNotFoundError:
            return journal
        except (OSError, ValueError) as exc:
            log.warning("journal_unreadable", path=str(journal.path), error=str(exc))
            return journal
        if doc.get("fencing_token") != fencing_token:
            return journal  # another attempt's: this one starts from the beginning
        journal.init_done = bool(doc.get("init_done"))
        journal.results = [_decode(row) for row in doc.get("results", [])]
        return journal

    @property
    def finished(self) -> set[int]:
        return {r.index for r in self.results}

    def mark_init_done(self) -> None:
        self.init_done = True
        self._write()

    def record(self, result: StepResult) -> None:
        self.results.append(result)
        self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "work_id": self.work_id,
            "fencing_token": self.fencing_token,
            "init_done": self.init_done,
            "results": [_encode(r) for r in self.results],
        }
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def prune(directory: Path, keep: set[str]) -> int:
    """Removes the journals of every work id not in `keep`; returns how many."""
    removed = 0
    for path in directory.glob("*.json") if directory.exists() else []:
        if path.stem not in keep:
            path.unlink(missing_ok=True)
            removed += 1
    for tmp in directory.glob("*.tmp") if directory.exists() else []:
        tmp.unlink(missing_ok=True)
    return removed
