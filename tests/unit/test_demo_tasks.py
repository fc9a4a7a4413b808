"""The LLM-agent suite's tasks, scorers and random agent (fleet.demo.tasks, fleet.demo.agent),
with real files and real shell commands; the whole evaluation runs in
tests/acceptance/test_demo.py."""

from __future__ import annotations

import importlib
import random
import shutil
import sys
from pathlib import Path

import pytest

from fleet.core.errors import InvalidArgument
from fleet.demo import agent
from fleet.demo.tasks import QUICK, TASKS, AgentTask, score, suite
from gateway.llm.chat import SHELL_TOOL
from tests.conftest import REPO

TRAINING_TRANSCRIPTS = 24_000
TRAINING_SEED = 1
"""scripts/train_llm.py's defaults: `--transcripts` and its corpus seed (`--seed` + 1)."""


def test_the_numeric_scorer_takes_the_last_number_of_the_answer() -> None:
    task = AgentTask("t", "What is 47 plus 385?", "432", "numeric")
    assert score(task, "47 + 385 = 432.")
    assert score(task, "The answer is 432.0")
    assert not score(task, "432 is not it, 431 is")
    assert not score(task, "four hundred and thirty-two")
    assert not score(task, None) and not score(task, "")


def test_the_contains_and_exact_scorers() -> None:
    contains = AgentTask("c", "Uppercase this: red", "RED", "contains")
    assert score(contains, "In uppercase: RED") and not score(contains, "In uppercase: red")
    exact = AgentTask("e", "Reverse 'ab'.", "ba", "exact")
    assert score(exact, "Backwards: ba.") and score(exact, " 'ba' ")
    assert not score(exact, "Backwards: bab") and not score(exact, "ba ba")


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"scorer": "fuzzy"}, "task bad: scorer 'fuzzy' is not one of exact, contains, numeric"),
        ({"expected": "many"}, "task bad: a numeric scorer needs a number, not 'many'"),
        ({"files": {"../etc/passwd": "x"}}, "task bad: file '../etc/passwd' must be a relative"),
        ({"files": {"/root/x": "x"}}, "task bad: file '/root/x' must be a relative"),
    ],
)
def test_a_malformed_task_is_refused_naming_it(kwargs: dict[str, object], says: str) -> None:
    fields: dict[str, object] = {"expected": "3", "scorer": "numeric", **kwargs}
    with pytest.raises(InvalidArgument, match=says.replace("(", r"\(").replace(".", r"\.")):
        AgentTask("bad", "How many?", **fields)  # type: ignore[arg-type]


def test_the_suite_is_sized_and_named_as_documented() -> None:
    names = [t.name for t in TASKS]
    assert 16 <= len(TASKS) <= 24 and len(set(names)) == len(names)
    assert [t.name for t in suite(quick=True)] == [n for n in names if n in QUICK]
    assert len(suite(quick=True)) == len(QUICK)
    assert {t.scorer for t in TASKS} <= {"numeric", "contains"}
    assert any(t.files for t in TASKS)  # (files to inspect, not only questions)
    assert all("expected" not in t.to_json() for t in TASKS)  # (the machine never sees it)


def test_no_question_is_one_the_model_was_trained_on() -> None:
    """The shipped model's training transcripts, regenerated as scripts/train-llm makes them,
    ask none of the suite's questions (nor their "please" and lower-case variants, which the
    generator also writes)."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        transcript = importlib.import_module("llm_transcripts").transcript
    finally:
        sys.path.remove(str(REPO / "scripts"))
    rng = random.Random(TRAINING_SEED)
    asked = {
        m["content"]
        for _ in range(TRAINING_TRANSCRIPTS)
        for m in transcript(rng)[0]
        if m["role"] == "user"
    }
    assert len(asked) > 10_000  # (the generator ran as training runs it)
    for task in TASKS:
        q = task.question
        variants = {q, q.lower(), "Please " + q[0].lower() + q[1:]}
        assert not variants & asked, task.name


def test_the_agent_offers_the_tool_the_model_was_trained_on() -> None:
    """fleet.demo.agent runs in a machine without the gateway's code, so it has a copy."""
    assert agent.SHELL_TOOL == SHELL_TOOL


def test_the_random_agent_answers_from_real_command_output(tmp_path: Path) -> None:
    """The random baseline's answers come from commands run where the task's files are, and
    are the same in every run (so is the baseline)."""
    task = next(t for t in TASKS if t.name == "count-files-notes")
    runs = []
    cwd = tmp_path / "task"
    for _ in range(2):
        shutil.rmtree(cwd, ignore_errors=True)
        cwd.mkdir()
        agent.write_files(cwd, task.to_json()["files"])
        assert sorted(p.name for p in (cwd / "notes").iterdir()) == [
            "budget.md", "people.csv", "plan.txt"
        ]  # fmt: skip
        runs.append(agent.random_answers(task.to_json(), cwd, seed=20))
    assert runs[0] == runs[1] and len(runs[0]) == agent.RANDOM_DRAWS
    assert "3" in runs[0]  # (`ls notes | wc -l` was drawn, and its output answered)
    assert 0 < sum(score(task, a) for a in runs[0]) < agent.RANDOM_DRAWS


def test_a_tool_call_runs_in_the_task_directory(tmp_path: Path) -> None:
    agent.write_files(tmp_path, {"logs/a.log": "x\nfire\nfire\n"})
    assert agent.run_tool("grep -c fire logs/a.log", tmp_path) == "2"
    assert "No such file" in agent.run_tool("cat missing.txt", tmp_path)  # (stderr, then)
    assert len(agent.run_tool("yes | head -n 1000", tmp_path)) == agent.TOOL_OUTPUT_CHARS
