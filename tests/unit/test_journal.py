"""The agent's attempt journal: what a restarted agent needs to go on with an adopted attempt."""

from __future__ import annotations

from pathlib import Path

from fleet.agent.journal import AttemptJournal, prune
from fleet.core.rollout import StepResult


def test_results_survive_a_restart_byte_for_byte(tmp_path: Path) -> None:
    journal = AttemptJournal(tmp_path, "w-1", 5)
    journal.mark_init_done()
    first = StepResult(index=0, name="a", exit_code=0, stdout=b"\xff\x00bin", stderr=b"e")
    second = StepResult(index=2, name="c", exit_code=1, timed_out=True, stdout_truncated=True)
    journal.record(first)
    journal.record(second)

    again = AttemptJournal.resume(tmp_path, "w-1", 5)
    assert again.init_done and again.results == [first, second]
    assert again.finished == {0, 2}
    assert not list(tmp_path.glob("*.tmp"))


def test_another_attempts_journal_is_not_taken_for_this_one(tmp_path: Path) -> None:
    AttemptJournal(tmp_path, "w-1", 5).record(StepResult(index=0, exit_code=0))
    fresh = AttemptJournal.resume(tmp_path, "w-1", 6)
    assert not fresh.init_done and fresh.results == []
    assert AttemptJournal.resume(tmp_path, "w-2", 5).results == []  # none at all


def test_an_unreadable_journal_means_starting_over(tmp_path: Path) -> None:
    (tmp_path / "w-1.json").write_text("{not json")
    assert AttemptJournal.resume(tmp_path, "w-1", 1).results == []


def test_prune_keeps_only_the_adopted(tmp_path: Path) -> None:
    for work in ("w-1", "w-2", "w-3"):
        AttemptJournal(tmp_path, work, 1).mark_init_done()
    (tmp_path / "w-4.tmp").write_text("half")
    assert prune(tmp_path, {"w-2"}) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w-2.json"]
    assert prune(tmp_path / "missing", set()) == 0
