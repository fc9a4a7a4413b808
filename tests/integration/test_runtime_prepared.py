"""An agent's namespace runtime has its C helpers ready before it takes any work: those `fleet
host prepare` did not build are built when the runtime is made, and machines (a Smolfile
`user`, a session's resident server) use them without building anything."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from fleet.core.smolfile import parse_smolfile
from fleet.runtime import helpers
from fleet.runtime.base import MachineSpec
from fleet.runtime.namespace import NamespaceRuntime

pytestmark = pytest.mark.sandbox


def spec(rootfs: Path, text: str) -> MachineSpec:
    return MachineSpec(
        name=f"t-{uuid.uuid4().hex[:8]}", smolfile=parse_smolfile(text).spec,
        image_digest="sha256:x", rootfs=rootfs, labels={"fleet": "test"},
    )  # fmt: skip


def test_the_runtime_builds_missing_helpers_when_made_and_machines_use_them(
    rootfs: Path, tmp_path: Path
) -> None:
    tools = tmp_path / "tools"
    with capture_logs() as logs:
        runtime = NamespaceRuntime(tmp_path / "machines", tools=tools)
    assert helpers.missing(tools) == []  # before any machine was asked for
    [built] = [e for e in logs if e["event"] == "runtime_helpers_built"]
    assert len(built["built"]) == len(helpers.HELPERS)
    ready = sorted(tools.iterdir())

    async def go() -> tuple[str, str]:
        machine = await runtime.create(spec(rootfs, 'image = "minimal"\nuser = "nobody"\n'))
        try:
            await machine.stay_resident()
            done = await machine.exec(["id", "-un"], timeout_s=60)
            assert done.exit_code == 0, done.stderr
            first = done.stdout.decode().strip()
        finally:
            await machine.delete()
        again = NamespaceRuntime(tmp_path / "machines", tools=tools)  # an agent's restart
        machine = await again.create(spec(rootfs, 'image = "minimal"\n'))
        try:
            done = await machine.exec(["id", "-un"], timeout_s=60)
            return first, done.stdout.decode().strip()
        finally:
            await machine.delete()

    with capture_logs() as later:
        assert asyncio.run(go()) == ("nobody", "root")
    assert [e for e in later if e["event"] == "runtime_helpers_built"] == []
    assert sorted(tools.iterdir()) == ready
    assert not (tmp_path / "machines" / ".tools").exists()


def test_by_default_the_runtime_reads_the_helpers_of_its_fleet_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_HOME", str(tmp_path / "home"))
    runtime = NamespaceRuntime(tmp_path / "machines")
    assert runtime.tools == tmp_path / "home" / "tools"
    assert helpers.missing(runtime.tools) == []
