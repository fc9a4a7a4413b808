"""Cordoning a host: it takes no new work (checked in the claim's own transaction), others
do; uncordoned it takes work again; the CLI says so and refuses an unknown host."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
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
        ledger.register_host(caps, time.time())

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
    silent = cli("list", "--unresponsive-after-s", "0")
    assert any(line.split()[:3] == ["cpu-1", "cpu", "unresponsive"]
               for line in silent.stdout.splitlines()), silent.stdout  # fmt: skip


def test_agents_of_another_version_are_refused_saying_which_to_upgrade(
    tmp_path: Path, images: ImageStore
) -> None:
    """A server serves agents of its own minor version and the one before: a newer agent, or
    one that reports no version, is refused with FAILED_PRECONDITION; a real agent registers,
    and `fleet host list` shows its version and the slots its leases hold."""
    import grpc

    import fleet
    from fleet._proto.fleet.v1 import types_pb2
    from fleet.core.placement import HostClass

    async def body() -> tuple[list[tuple[grpc.StatusCode, str]], list[str]]:
        async with harness(tmp_path, images) as h:
            refused = []
            for version in ("99.0.0", ""):
                try:
                    await h.hosts.RegisterHost(host_pb2.RegisterHostRequest(
                        request_id="r", host_id="odd", host_class=types_pb2.HOST_CLASS_CPU,
                        agent_version=version,
                    ))  # fmt: skip
                except grpc.aio.AioRpcError as exc:
                    refused.append((exc.code(), exc.details() or ""))
            await h.start_agent("cpu-a", HostClass.CPU, slots=3)
            views = await asyncio.to_thread(h.server.core.ledger.host_table, time.time(), 60.0)
            return refused, [f"{v.capabilities.host_id} {v.state} {v.capabilities.agent_version} "
                             f"{v.slots_used}/{v.capabilities.slots}" for v in views]  # fmt: skip

    refused, listed = asyncio.run(body())
    assert refused[0][0] == grpc.StatusCode.FAILED_PRECONDITION
    assert "upgrade the server" in refused[0][1] and "99.0.0" in refused[0][1]
    assert refused[1][0] == grpc.StatusCode.FAILED_PRECONDITION
    assert "upgrade the agent" in refused[1][1]
    assert listed == [f"cpu-a ready {fleet.__version__} 0/3"]
