"""The runtime's C helpers are built once, by `fleet host prepare`, into the directory the
runtime reads them from; only what is missing or stale is built again."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from fleet.config import Paths
from fleet.core.errors import FailedPrecondition
from fleet.runtime import capabilities, helpers, resident, users


def test_prepare_builds_each_helper_once_where_the_runtime_looks(tmp_path: Path) -> None:
    tools = tmp_path / "tools"
    assert helpers.missing(tools) == list(helpers.HELPERS)
    built = helpers.prepare(tools)
    assert sorted(built) == sorted(helpers.program(tools, h) for h in helpers.HELPERS)
    assert {p.name.split("-")[0] for p in built} == {"stepexec", "sessiond", "capbound"}
    # The programs the runtime asks for are these, and asking builds nothing more.
    assert users.helper(tools) in built
    assert capabilities.bounder(tools) in built
    assert users.tool(tools, resident.SOURCE, "", "") in built
    for program in built:
        assert program.stat().st_mode & 0o111
        with open(program, "rb") as f:
            assert f.read(4) == b"\x7fELF"
    assert sorted(tools.iterdir()) == sorted(built)
    assert helpers.missing(tools) == []
    assert helpers.prepare(tools) == []


def test_a_program_built_from_another_source_is_stale_and_rebuilt(tmp_path: Path) -> None:
    tools = tmp_path / "tools"
    tools.mkdir()
    old = tools / "stepexec-0000000000000000"  # (from a source since changed)
    old.write_bytes(b"\x7fELF old")
    [stepexec] = [h for h in helpers.HELPERS if h.source == users.SOURCE]
    assert stepexec in helpers.missing(tools)
    built = helpers.prepare(tools)
    assert helpers.program(tools, stepexec) in built
    assert helpers.missing(tools) == []


def test_ensure_says_when_it_had_to_build_and_is_silent_after(tmp_path: Path) -> None:
    tools = tmp_path / "tools"
    with capture_logs() as first:
        helpers.ensure(tools)
    [event] = [e for e in first if e["event"] == "runtime_helpers_built"]
    assert event["tools"] == str(tools)
    assert len(event["built"]) == len(helpers.HELPERS)
    with capture_logs() as second:
        helpers.ensure(tools)
    assert [e for e in second if e["event"] == "runtime_helpers_built"] == []


def test_without_a_compiler_the_error_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)  # (what users.tool asks)
    with pytest.raises(FailedPrecondition, match=r"needs a C compiler.*apt-get install gcc"):
        helpers.prepare(tmp_path / "tools")


def test_the_tools_directory_is_one_per_fleet_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_HOME", str(tmp_path))
    assert Paths.from_env().tools == tmp_path / "tools"


def test_the_prepare_command_builds_then_reports_them_up_to_date(tmp_path: Path) -> None:
    tools = tmp_path / "tools"
    argv = [sys.executable, "-m", "fleet.cli.prepare", "--tools", str(tools)]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert first.returncode == 0, first.stderr
    assert "3 runtime helpers" in first.stdout and "3 built now" in first.stdout
    assert helpers.missing(tools) == []
    again = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 0, again.stderr
    assert "all up to date" in again.stdout
    (tmp_path / "file").write_text("")
    refused = subprocess.run(
        [*argv[:-1], str(tmp_path / "file" / "tools")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert refused.returncode == 2
    assert f"UNAVAILABLE: cannot build the namespace runtime's helpers in {tmp_path}" in (
        refused.stderr
    )
