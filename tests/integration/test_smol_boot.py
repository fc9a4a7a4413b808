"""smol microVMs for real: they boot only where hardware virtualization works (`vm` marker);
elsewhere each test skips, saying why (see SMOLVM.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.core.smolfile import parse_smolfile
from fleet.runtime import smol as smol_runtime
from fleet.runtime.base import MachineSpec


@pytest.mark.vm
async def test_smol_machine_boots_and_runs_a_step(rootfs: Path) -> None:
    """A real microVM runs a command (needs hardware virtualization)."""
    ok, reason = smol_runtime.preflight(Path("/tmp/fleet-preflight"), lambda: rootfs)
    if not ok:
        pytest.skip(f"microVMs cannot boot on this host: {reason}")

    runtime = smol_runtime.SmolRuntime()
    machine = await runtime.create(
        MachineSpec(
            name="fleet-vm-test",
            smolfile=parse_smolfile('image = "x"\n').spec,
            image_digest="sha256:x",
            rootfs=rootfs,
            labels={"fleet": "test"},
        )
    )
    try:
        result = await machine.exec(["python3", "-c", "print(6*7)"], timeout_s=60)
        assert result.stdout.strip() == b"42"
        result = result.exit_code
    finally:
        await machine.delete()

    assert result == 0


@pytest.mark.vm
async def test_a_restarted_agent_adopts_a_leased_microvm_and_reaps_the_rest(rootfs: Path) -> None:
    """Machines outlive the runtime object that made them; a new one finds them by label,
    adopts the leased one (its disk state intact) and reaps the other."""
    ok, reason = smol_runtime.preflight(Path("/tmp/fleet-preflight"), lambda: rootfs)
    if not ok:
        pytest.skip(f"microVMs cannot boot on this host: {reason}")

    def make(name: str, **labels: str) -> MachineSpec:
        return MachineSpec(
            name=name, smolfile=parse_smolfile('image = "x"\n').spec, image_digest="sha256:x",
            rootfs=rootfs, labels={"fleet": "1", "host": "vm-adopt", **labels},
        )  # fmt: skip

    before = smol_runtime.SmolRuntime()
    leased = make("fleet-vm-adopt-a", work="w-1", fence="2")
    first = await before.create(leased)
    await first.exec(["/bin/sh", "-c", "echo kept > /root/state"], timeout_s=60)
    await before.create(make("fleet-vm-adopt-b"))
    after = smol_runtime.SmolRuntime()
    found = {m.name: m for m in await after.leftovers("vm-adopt")}
    assert found["fleet-vm-adopt-a"].adoptable and not found["fleet-vm-adopt-b"].adoptable
    adopted = await after.adopt(found["fleet-vm-adopt-a"], leased)
    try:
        result = await adopted.exec(["cat", "/root/state"], timeout_s=60)
        assert result.stdout == b"kept\n"
        assert await after.reap("vm-adopt", keep={"fleet-vm-adopt-a"}) == 1
    finally:
        await adopted.delete()
    assert await after.leftovers("vm-adopt") == []
