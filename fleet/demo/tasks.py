"""The shipped task suite of the LLM-agent evaluation (`fleet demo`, suite `llm-agent`).

Each task is one episode: files written into the episode's machine, a question for the agent,
and the answer a scorer accepts. The tasks are of the families the shipped model,
fleet-tiny-chat-v1, was trained on (scripts/llm_transcripts.py: compute, count characters and
words, read a file's first line, grep, count files), in the words and small numbers of its
training vocabulary: a one-million-parameter model copies only what it has seen, and questions
in new words score little above random (the demo's page gives the figures). They are held out
all the same: no question here is one its training transcripts ask (a test regenerates them
with the training seed and checks), and the files, and so the tool outputs and answers, are
real ones in the machine where training only showed invented outputs. The tasks were chosen by
rule, not by result: arithmetic and string lengths drawn from those not in the training set,
file contents drawn from the vocabulary.

Scoring is deliberately literal, so that a score is easy to audit:

- `numeric`: the last number in the answer equals the expected one (an answer that restates
  the question's operands first, "47 + 385 = 432", still counts);
- `contains`: the expected text occurs in the answer, case and spacing as given;
- `exact`: the answer, or what follows its last ": ", is the expected text once surrounding
  quotes, spaces and a final period are removed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from fleet.core.errors import InvalidArgument

Scorer = Literal["exact", "contains", "numeric"]
SCORERS: tuple[Scorer, ...] = ("exact", "contains", "numeric")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class AgentTask:
    """One episode's task: what the machine holds, what is asked, what is accepted."""

    name: str
    question: str
    expected: str
    scorer: Scorer
    files: dict[str, str] = field(default_factory=dict)
    """Relative path -> content, written into the episode's working directory first."""

    def __post_init__(self) -> None:
        if self.scorer not in SCORERS:
            raise InvalidArgument(
                f"task {self.name}: scorer {self.scorer!r} is not one of {', '.join(SCORERS)}"
            )
        if self.scorer == "numeric" and not NUMBER.fullmatch(self.expected):
            raise InvalidArgument(
                f"task {self.name}: a numeric scorer needs a number, not {self.expected!r}"
            )
        for path in self.files:
            if path.startswith("/") or ".." in path.split("/") or not path:
                raise InvalidArgument(
                    f"task {self.name}: file {path!r} must be a relative path inside the "
                    "episode's working directory"
                )

    def to_json(self) -> dict[str, Any]:
        """What the episode's program is given (the expected answer is not: the machine runs
        the agent, the host scores it)."""
        return {"name": self.name, "question": self.question, "files": dict(self.files)}


def score(task: AgentTask, answer: str | None) -> bool:
    """Whether `answer` is right for `task`, by the task's scorer."""
    if not answer:
        return False
    if task.scorer == "numeric":
        numbers = NUMBER.findall(answer)
        return bool(numbers) and float(numbers[-1]) == float(task.expected)
    if task.scorer == "contains":
        return task.expected in answer

    def clean(text: str) -> str:
        return " ".join(text.split()).strip("'\"` ").removesuffix(".").strip("'\"` ")

    return task.expected in (clean(answer), clean(answer.rpartition(": ")[2]))


TASKS: tuple[AgentTask, ...] = (
    AgentTask("multiply-9-4", "What is 9 times 4?", "36", "numeric"),
    AgentTask("add-1-6", "What is 1 plus 6?", "7", "numeric"),
    AgentTask("multiply-5-6", "What is 5 times 6?", "30", "numeric"),
    AgentTask("add-6-3", "What is 6 plus 3?", "9", "numeric"),
    AgentTask("multiply-5-1", "What is 5 times 1?", "5", "numeric"),
    AgentTask("add-3-4", "What is 3 plus 4?", "7", "numeric"),
    AgentTask("length-cherry", "What is the length of 'cherry'?", "6", "numeric"),
    AgentTask("length-boat", "How many characters are in 'boat'?", "4", "numeric"),
    AgentTask("length-brave", "How long is the string 'brave'?", "5", "numeric"),
    AgentTask("length-brown", "How long is the string 'brown'?", "5", "numeric"),
    AgentTask("length-socket", "How many characters are in 'socket'?", "6", "numeric"),
    AgentTask("length-music", "How many characters are in 'music'?", "5", "numeric"),
    AgentTask("words-dark-letter", "How many words are in 'dark letter'?", "2", "numeric"),
    AgentTask("words-model-house", "How many words are in 'model house'?", "2", "numeric"),
    AgentTask("words-bridge-large", "How many words are in 'bridge large'?", "2", "numeric"),
    AgentTask("first-line-winter", "What is the first line of winter.txt?", "butter brave sun",
              "contains", files={"winter.txt": "butter brave sun\nrobot rocket window\n"}),
    AgentTask("first-line-alpha", "What is the first line of alpha.txt?", "tree large soft",
              "contains", files={"alpha.txt": "tree large soft\norange mountain small\n"}),
    AgentTask("grep-shell-log", "How many lines of shell.log contain 'buffer'?", "4", "numeric",
              files={"shell.log": "engine water buffer\nnumber stone buffer\nsilver summer "
                     "buffer\ngrape batch buffer\nhost bright\ntoken milk\n"}),
    AgentTask("grep-bread-log", "How many lines of bread.log contain 'fire'?", "3", "numeric",
              files={"bread.log": "dog ocean\ncar cache fire\ngamma boat\ndelta rollout\n"
                     "grape page fire\nplane city fire\n"}),
    AgentTask("grep-butter-log", "How many lines of butter.log contain 'chair'?", "4",
              "numeric",
              files={"butter.log": "village loud chair\nbread light chair\nlight data chair\n"
                     "delta buffer\nsmall robot chair\nfirst cat\n"}),
    AgentTask("count-files-notes", "Please count the files in notes.", "3", "numeric",
              files={"notes/plan.txt": "x\n", "notes/budget.md": "x\n",
                     "notes/people.csv": "x\n"}),
)  # fmt: skip
"""The suite, in the order episodes are submitted."""

QUICK = (
    "multiply-9-4",
    "length-cherry",
    "words-model-house",
    "first-line-winter",
    "grep-bread-log",
    "count-files-notes",
)
"""The tasks `--quick` runs: one of each family the suite has."""


def suite(quick: bool = False) -> list[AgentTask]:
    """The tasks a run evaluates: all of them, or one per family with `quick`."""
    if not quick:
        return list(TASKS)
    return [t for t in TASKS if t.name in QUICK]
