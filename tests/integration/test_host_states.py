"""Cordoning a host: it takes no new work (checked in the claim's own transaction), others
do; uncordoned it takes work again; the CLI says so and refuses an unknown host."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from fleet._proto.fleet.v1 import host_pb2
from fleet.image.store import ImageStore
from tests.integration.harness import harness, request


def test_a_cordoned_host_takes_no_new_work_and_others_do(
    tmp_path: Path, images: ImageStore
) -> None:
    async def body() -> tuple[list[str], list[str], list[str], str]:
        async with harness(tmp_path, images) as h:
            await h.register_host("h1")
            await h.register_host("h2")
            ledger = h.server.core.ledger

            async def claim(host: str) -> list[str]:
                reply = await h.hosts.ClaimWork(
                    host_pb2.ClaimWorkRequest(
                        request_id=f"{host}-{id(object())}", host_id=host, max_items=5, wait_s=0
                    )
                )
                return [i.rollout_id for i in reply.items]

            await asyncio.to_thread(ledger.set_host_state, "h1", "cordoned")
            first = await h.fleet.SubmitRollout(request())
            cordoned = await claim("h1")
            other = await claim("h2")
            await asyncio.to_thread(ledger.set_host_state, "h1", "ready")
            await h.fleet.SubmitRollout(request())
            again = await claim("h1")
            assert other == [first.rollout.id]
            return cordoned, other, again, (await asyncio.to_thread(ledger.host_states))["h1"]

    cordoned, other, again, state = asyncio.run(body())
    assert cordoned == [] and len(other) == 1 and len(again) == 1 and state == "ready"


def test_fleet_host_cordon_and_list(tmp_path: Path, images: ImageStore) -> None:
    db = tmp_path / "ledger.sqlite3"

    async def register() -> None:
        from fleet.core.placement import HostCapabilities, HostClass, Isolation, RuntimeKind
        from fleet.ledger.store import Ledger

        ledger = Ledger.open(str(db))
        caps = HostCapabilities(
            host_id="cpu-1", host_class=HostClass.CPU, runtime=RuntimeKind.NAMESPACE,
            isolation=Isolation.NAMESPACE, cpus=2, memory_mib=1024, slots=2, cuda_devices=0,
        )  # fmt: skip
        ledger.register_host(caps, 0.0)

    asyncio.run(register())

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fleet.cli.main", "host", *argv, "--db", str(db)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    cordoned = cli("cordon", "cpu-1")
    assert cordoned.returncode == 0 and "takes no new work" in cordoned.stdout, cordoned.stderr
    listed = cli("list")
    assert any(
        line.split()[:3] == ["cpu-1", "cpu", "cordoned"] for line in listed.stdout.splitlines()
    )
    assert cli("uncordon", "cpu-1").returncode == 0
    assert any(
        line.split()[:3] == ["cpu-1", "cpu", "ready"] for line in cli("list").stdout.splitlines()
    )
    unknown = cli("cordon", "nope")
    assert unknown.returncode == 2 and "no registered host 'nope'" in unknown.stderr
