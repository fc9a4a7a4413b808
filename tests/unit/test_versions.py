"""Version skew between an agent and its server: same or one minor older is served."""

from __future__ import annotations

import pytest

from fleet.core.errors import FailedPrecondition
from fleet.core.versions import check_agent, parse


@pytest.mark.parametrize("agent", ["1.4.0", "1.4.7", "1.3.0", "1.3.9", "1.4.2rc1"])
def test_the_same_and_the_previous_minor_are_served(agent: str) -> None:
    check_agent(agent, "1.4.2")


@pytest.mark.parametrize(
    ("agent", "says"),
    [
        ("1.5.0", "upgrade the server"),
        ("2.0.0", "upgrade the server"),
        ("1.2.9", "upgrade the agent"),
        ("0.9.0", "upgrade the agent"),
        ("", "upgrade the agent"),
    ],
)
def test_skew_is_refused_saying_which_side_to_upgrade(agent: str, says: str) -> None:
    with pytest.raises(FailedPrecondition, match=says):
        check_agent(agent, "1.4.2", "cpu-1")


def test_a_malformed_version_is_refused() -> None:
    with pytest.raises(FailedPrecondition, match=r"not MAJOR\.MINOR"):
        parse("latest")
    assert parse("0.1") == (0, 1, 0)
