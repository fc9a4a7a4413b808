"""Which rollouts run as a warm parent's children, of which parent, and what the others run
instead."""

from __future__ import annotations

import pytest

from fleet.agent.attempt import parent_key, warm_plan
from fleet.core.errors import InvalidArgument
from fleet.core.manifest import Step
from fleet.core.smolfile import parse_smolfile
from fleet.runtime.warm_child import fitted_limit

BRANCH = 'image = "minimal"\n[branch]\nenabled = true\n'
WARM = "STATE = 41"


def steps(*argvs: tuple[str, ...], first: str = "warm-up") -> list[tuple[int, Step]]:
    return [
        (i, Step(name=first if i == 0 else f"s{i}", argv=argv, timeout_s=10))
        for i, argv in enumerate(argvs)
    ]


PLAN = steps(("python3", "-c", WARM), ("python3", "-c", "print(STATE + 1)"), ("true",))


def test_a_branching_rollout_on_a_forking_runtime_keeps_its_steps_and_names_its_warm_up() -> None:
    planned, warm, why = warm_plan(parse_smolfile(BRANCH).spec, PLAN, True, "namespace")
    assert (planned, warm, why) == (PLAN, WARM, "")


@pytest.mark.parametrize(
    ("smolfile", "forks", "reason"),
    [
        (BRANCH + '[network]\nallow_hosts = ["a.example"]\n', True, "no network beyond"),
        (BRANCH, False, "this host's smol runtime forks no warm children"),
    ],
)
def test_where_it_cannot_fork_each_python_step_runs_the_warm_up_first(
    smolfile: str, forks: bool, reason: str
) -> None:
    planned, warm, why = warm_plan(parse_smolfile(smolfile).spec, PLAN, forks, "smol")
    assert warm is None and reason in why
    assert [i for i, _ in planned] == [1, 2]  # the warm-up step itself is not run alone
    assert planned[0][1].argv == ("python3", "-c", f"{WARM}\nprint(STATE + 1)")
    assert planned[1][1].argv == ("true",)  # not python: as it was


def test_no_branch_table_or_no_warm_up_step_means_plain_steps() -> None:
    plain = parse_smolfile('image = "minimal"\n').spec
    assert warm_plan(plain, PLAN, True, "namespace") == (PLAN, None, "")
    unnamed = steps(("python3", "-c", WARM), first="setup")
    assert warm_plan(parse_smolfile(BRANCH).spec, unnamed, True, "namespace") == (unnamed, None, "")


def test_a_warm_up_that_is_not_python_c_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="python3 -c CODE"):
        warm_plan(parse_smolfile(BRANCH).spec, steps(("sh", "-c", "true")), False, "smol")


def test_warm_parents_are_one_per_tenant_image_smolfile_and_warm_up() -> None:
    key = parent_key("team-a", "sha256:img", "sha256:sf", WARM)
    assert key == parent_key("team-a", "sha256:img", "sha256:sf", WARM)  # shared within a tenant
    others = {
        parent_key("team-b", "sha256:img", "sha256:sf", WARM),  # never across tenants
        parent_key("team-a", "sha256:img2", "sha256:sf", WARM),
        parent_key("team-a", "sha256:img", "sha256:sf2", WARM),
        parent_key("team-a", "sha256:img", "sha256:sf", WARM + " "),
        parent_key("team-a\0sha256:img", "", "sha256:sf", WARM),  # parts cannot run together
    }
    assert key not in others and len(others) == 5


MIB = 1 << 20


@pytest.mark.parametrize(
    ("due", "held", "now", "want", "why"),
    [
        (96, 40, 128, 96, "holds far less: what is due"),
        (160, 40, 128, 160, "a child more: raised to what is due"),
        (64, 70, 96, 74, "lowered: it stops one allowance above what the parent holds"),
        (64, 70, 72, 72, "never above the limit it has, whatever it holds"),
        (64, 100, 90, 90, "holds more than its limit (charged before it was lowered): kept"),
        (64, None, 96, 64, "usage unreadable: what is due"),
        (64, 70, None, 64, "no limit to keep: what is due"),
    ],
)
def test_a_warm_parents_limit_never_falls_to_what_it_holds_nor_grows_with_it(
    due: int, held: int | None, now: int | None, want: int, why: str
) -> None:
    mib = [None if v is None else v * MIB for v in (due, held, now)]
    assert fitted_limit(mib[0] or 0, mib[1], mib[2], 4 * MIB) == want * MIB, why
