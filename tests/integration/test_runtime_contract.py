"""One contract, every runtime: the same test body runs on namespace and on smol (vm marker),
and where it needs no real machine (a shell, a filesystem), on the in-memory fake of
`fleet.testing` too: so the fake the API tests stand on keeps the contract they rely on."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from fleet.core.errors import NotFound
from fleet.core.smolfile import parse_smolfile
from fleet.image.store import ImageStore
from fleet.runtime import smol as smol_runtime
from fleet.runtime.base import Machine, MachineSpec, Runtime
from fleet.runtime.namespace import NamespaceRuntime
from fleet.testing import FakeRuntime


def make_runtime(kind: str, tmp_path: Path, rootfs: Path) -> Runtime:
    if kind == "fake":
        return FakeRuntime()
    if kind == "namespace":
        return NamespaceRuntime(tmp_path / "machines")
    ok, reason = smol_runtime.preflight(tmp_path / "preflight", lambda: rootfs)
    if not ok:
        pytest.skip(f"microVMs cannot boot on this host: {reason}")
    return smol_runtime.SmolRuntime()


RUNTIMES = [
    pytest.param("namespace", marks=pytest.mark.sandbox),
    pytest.param("smol", marks=pytest.mark.vm),
]
EVERY_RUNTIME = ["fake", *RUNTIMES]


def with_machine(
    kind: str, tmp_path: Path, rootfs: Path, body: Callable[[Machine], Awaitable[Any]],
    text: str = 'image = "minimal"\nenv = ["FROM_SMOLFILE=yes"]\n',
) -> Any:  # fmt: skip
    runtime = make_runtime(kind, tmp_path, rootfs)
    label = uuid.uuid4().hex[:8]

    async def go() -> Any:
        spec = MachineSpec(
            name=f"contract-{label}", smolfile=parse_smolfile(text).spec,
            image_digest="sha256:x", rootfs=rootfs,
            labels={"fleet": "1", "host": "contract", "case": label},
        )  # fmt: skip
        machine = await runtime.create(spec)
        try:
            assert await runtime.list_machines({"case": label}) != []
            return await body(machine)
        finally:
            await machine.delete()
            assert await runtime.list_machines({"case": label}) == []

    return asyncio.run(go())


@pytest.mark.parametrize("kind", RUNTIMES)
def test_exec_with_env_workdir_and_exit_code(kind: str, tmp_path: Path, rootfs: Path) -> None:
    """exec passes env (Smolfile and step) and workdir, and returns the exit code as data."""

    async def body(m: Machine) -> Any:
        ok = await m.exec(["sh", "-c", 'echo "$FROM_SMOLFILE $STEP $(pwd)"'], env={"STEP": "s"},
                          workdir="/tmp", timeout_s=60)  # fmt: skip
        bad = await m.exec(["sh", "-c", "exit 9"], timeout_s=60)
        return ok, bad

    ok, bad = with_machine(kind, tmp_path, rootfs, body)
    assert ok.exit_code == 0 and ok.stdout == b"yes s /tmp\n"
    assert bad.exit_code == 9


@pytest.mark.parametrize("kind", RUNTIMES)
def test_files_written_are_read_back_and_seen_by_steps(
    kind: str, tmp_path: Path, rootfs: Path
) -> None:
    """Files round-trip as bytes with their mode, steps see them, a missing one is NOT_FOUND."""

    async def body(m: Machine) -> Any:
        await m.write_file("/root/data.bin", b"\x00\x01hello\n", mode=0o600)
        back = await m.read_file("/root/data.bin")
        seen = await m.exec(
            ["sh", "-c", "stat -c %a /root/data.bin; tail -c 6 /root/data.bin"], timeout_s=60
        )
        with pytest.raises(NotFound):
            await m.read_file("/root/nope")
        return back, seen

    back, seen = with_machine(kind, tmp_path, rootfs, body)
    assert back == b"\x00\x01hello\n"
    assert seen.stdout == b"600\nhello\n"


@pytest.mark.parametrize("kind", EVERY_RUNTIME)
def test_exit_codes_are_data_and_files_round_trip_as_bytes(
    kind: str, tmp_path: Path, rootfs: Path
) -> None:
    """A failing command is an exit code, not an error; a file comes back byte for byte; a
    missing one is NOT_FOUND; the machine is listed by its labels until deleted."""

    async def body(m: Machine) -> Any:
        failed = await m.exec(["sh", "-c", "exit 9"], timeout_s=60)
        await m.write_file("/root/blob", bytes(range(256)) * 3)
        back = await m.read_file("/root/blob")
        with pytest.raises(NotFound):
            await m.read_file("/root/never-written")
        return failed.exit_code, back

    code, back = with_machine(kind, tmp_path, rootfs, body)
    assert code == 9 and back == bytes(range(256)) * 3


@pytest.mark.parametrize("kind", EVERY_RUNTIME)
def test_timeout_is_reported_not_raised(kind: str, tmp_path: Path, rootfs: Path) -> None:
    """A command past its timeout comes back as timed_out, and the machine stays usable."""

    async def body(m: Machine) -> Any:
        slow = await m.exec(["sleep", "30"], timeout_s=0.5)
        after = await m.exec(["echo", "still here"], timeout_s=60)
        return slow, after

    slow, after = with_machine(kind, tmp_path, rootfs, body)
    assert slow.timed_out and after.stdout == b"still here\n"


@pytest.mark.vm
async def test_an_image_packs_into_a_smolmachine_that_boots(
    tmp_path: Path, rootfs: Path, images: ImageStore
) -> None:
    """`fleet image pack`: the pack boots and carries the image's digest as its marker."""
    runtime = make_runtime("smol", tmp_path, rootfs)
    assert isinstance(runtime, smol_runtime.SmolRuntime)
    record = images.record("minimal")
    assert record is not None

    spec = MachineSpec(
        name=f"pack-{uuid.uuid4().hex[:6]}",
        smolfile=parse_smolfile('image = "minimal"\n').spec,
        image_digest=record.digest,
        rootfs=rootfs,
        labels={"fleet": "test"},
    )
    pack = await runtime.pack(spec, tmp_path / "minimal.smolmachine")
    booted = await runtime.create(spec.model_copy(update={"rootfs": pack}))
    try:
        result = await booted.read_file("/etc/fleet-image")
    finally:
        await booted.delete()

    assert result.strip() == record.digest.encode()
