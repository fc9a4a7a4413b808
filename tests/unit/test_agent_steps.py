"""How the agent rewrites a warm rollout's steps when it cannot use a warm parent."""

from __future__ import annotations

from fleet.agent.attempt import with_warm_up
from fleet.core.manifest import Step


def test_python_steps_start_from_the_warm_up_state() -> None:
    step = Step(argv=("python3", "-c", "print(X)", "arg"), env={"A": "1"}, name="work")
    done = with_warm_up(step, "X = 1")
    assert done.argv == ("python3", "-c", "X = 1\nprint(X)", "arg")
    assert (done.env, done.name, done.timeout_s) == (step.env, step.name, step.timeout_s)


def test_other_commands_are_left_alone() -> None:
    for argv in (("/bin/sh", "-c", "true"), ("python3", "script.py"), ("python3",)):
        assert with_warm_up(Step(argv=argv), "X = 1").argv == argv
