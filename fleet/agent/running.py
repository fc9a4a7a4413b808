"""What the agent tracks of an attempt it runs (`Running`) and how an attempt ends before its
last step (`Finished`).

Both the making of an attempt's machine (`fleet.agent.machine_making`) and the running of its
steps up to the report (`fleet.agent.attempt`) read and write these, so they sit below both.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fleet.agent.checkpoints import CheckpointRelay
from fleet.agent.passage import GatewaySplice
from fleet.core.manifest import OutputArtifact
from fleet.core.rollout import Assignment, Completion, StepResult
from fleet.runtime.base import Leftover, Machine


@dataclass
class Running:
    """A leased work item this agent runs, as the agent tracks it."""

    assignment: Assignment
    task: asyncio.Task[None] | None = None
    stop_reason: str = ""
    results: list[StepResult] = field(default_factory=list)
    machine: Machine | None = None
    relay: CheckpointRelay | None = None
    splice: GatewaySplice | None = None
    """A warm child's way to the gateway (other machines reach it over their own link)."""
    adopt: Leftover | None = None
    """The machine an earlier run of this agent left running this attempt (after a restart)."""
    image: str = ""
    """The image digest this attempt holds in the image cache ("": none yet)."""
    logs: list[OutputArtifact] = field(default_factory=list)
    """Steps' whole stdout/stderr where it passed the inline limit (stored already)."""
    journalled: bool = False
    """Whether the attempt may have a journal on disk (to remove once it is reported)."""


class Finished(Exception):
    """The attempt ended before its last step (a failed init, a step that failed, a session
    closed); carries its report."""

    def __init__(self, completion: Completion) -> None:
        super().__init__(completion.error)
        self.completion = completion
