"""What a submission may ask for: a bounded priority, and environment variables with portable
names, in the request's steps and in the Smolfile alike."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from fleet.core.errors import InvalidArgument
from fleet.core.manifest import (
    MAX_PRIORITY,
    MIN_PRIORITY,
    Step,
    SubmitRequest,
    check_steps,
    validate_request,
)
from fleet.core.smolfile import load_smolfile, parse_smolfile

NOW = datetime(2026, 1, 1, tzinfo=UTC)
SMOL = 'image = "minimal"\n'
SMOLFILES = Path(__file__).resolve().parents[2] / "smolfiles"


def submit(**kw: object) -> SubmitRequest:
    fields: dict[str, object] = {
        "idempotency_key": "k", "smolfile": SMOL, "steps": (Step(argv=("true",)),),
    }  # fmt: skip
    fields.update(kw)
    return SubmitRequest.model_validate(fields)


@pytest.mark.parametrize("priority", [MIN_PRIORITY, -1, 0, 1, MAX_PRIORITY])
def test_a_priority_in_range_is_accepted(priority: int) -> None:
    validate_request(submit(priority=priority), NOW)


@pytest.mark.parametrize("priority", [MAX_PRIORITY + 1, MIN_PRIORITY - 1, 2**31 - 1, -(2**31)])
def test_a_priority_out_of_range_is_refused_naming_the_field(priority: int) -> None:
    """Work is leased highest priority first across the whole queue: an unbounded priority
    would put one submitter ahead of every other."""
    with pytest.raises(InvalidArgument) as caught:
        validate_request(submit(priority=priority), NOW)
    assert caught.value.message == (
        f"priority {priority} is out of range: it must be from -100 to 100 "
        "(higher is leased first; 0 by default)"
    )


@pytest.mark.parametrize("name", ["1BAD-KEY", "BAD-KEY", "A B", "A\n", "Ä", "a.b", "-x"])
def test_a_step_env_name_that_is_not_a_variable_name_is_refused_naming_it(name: str) -> None:
    steps = (Step(argv=("true",)), Step(argv=("true",), env={"OK": "1", name: "v"}, name="run"))
    with pytest.raises(InvalidArgument) as caught:
        validate_request(submit(steps=steps), NOW)
    assert caught.value.message == (
        f"step 1 (run): env name {name!r} is not a variable name (a letter or _, then "
        "letters, digits and _ (POSIX))"
    )


def test_portable_step_env_names_are_accepted_and_agents_still_run_older_plans() -> None:
    """Names of letters, digits and _ pass; a plan accepted before the rule (its steps are
    checked again on the agent) is not refused there."""
    good = (Step(argv=("true",), env={"_A": "1", "a9": "2", "PATH": "/bin"}),)
    validate_request(submit(steps=good), NOW)
    check_steps((Step(argv=("true",), env={"1BAD-KEY": "v"}),))


@pytest.mark.parametrize(
    ("entry", "name"),
    [("1BAD-KEY=x", "1BAD-KEY"), ("BAD-KEY=x", "BAD-KEY"), ("A\\n=x", "A\n"), ("Ä=x", "Ä")],
)
def test_a_smolfile_env_name_that_is_not_a_variable_name_is_refused_naming_it(
    entry: str, name: str
) -> None:
    """`entry` as written in the TOML file; `name` the variable name it holds."""
    for text, key in (
        (f'env = ["OK=1", "{entry}"]\n', "env"),
        (f'[dev]\nenv = ["{entry}"]\n', "dev.env"),
    ):
        with pytest.raises(InvalidArgument) as caught:
            parse_smolfile(text, "x.smolfile")
        message = caught.value.message
        assert message.startswith(f"x.smolfile:{text.count(chr(10))}: key {key!r}"), message
        assert f"{name!r} is not a variable name" in message, message


def test_the_shipped_smolfiles_still_parse() -> None:
    shipped = sorted(SMOLFILES.glob("*.smolfile"))
    assert shipped
    for path in shipped:
        load_smolfile(str(path))
