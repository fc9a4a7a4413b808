"""`fleet run` on this host: a real namespace machine on the real default image."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

from fleet.cli.local import cmd_run

pytestmark = pytest.mark.sandbox


def fleet_run(smolfile: Path, *command: str) -> int:
    args = argparse.Namespace(
        smolfile=str(smolfile), runtime="namespace", timeout_s=120.0, command=list(command)
    )
    return asyncio.run(cmd_run(args))


def test_fleet_run_says_when_a_command_is_killed_for_memory(
    rootfs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The kernel's OOM killer leaves the command no word to say: `fleet run` says it, naming
    the Smolfile's memory limit, and exits non-zero; a command within the limit says nothing
    of the sort."""
    smolfile = tmp_path / "small.smolfile"
    smolfile.write_text('image = "minimal"\nmemory = 128\n')
    hog = "b = bytearray(400 * 1024 * 1024); print('survived')"

    fine = fleet_run(smolfile, "python3", "-c", "print('ok')")
    quiet = capsys.readouterr()
    killed = fleet_run(smolfile, "python3", "-c", hog)
    said = capsys.readouterr()

    assert fine == 0 and "ok" in quiet.out.splitlines() and "out of memory" not in quiet.err
    assert killed != 0 and "survived" not in said.out
    assert "fleet run: killed: out of memory" in said.err
    assert "the Smolfile's memory limit is 128 MiB" in said.err
