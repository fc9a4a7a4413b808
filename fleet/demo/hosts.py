"""The host the demo loses on purpose: one more cpu-class agent in a process of its own, killed
(-9) while it holds work, so that every suite shows its rollouts surviving a lost host."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from fleet.agent.agent import default_host_id
from fleet.agent.capabilities import make_runtime
from fleet.config import Paths
from fleet.core.placement import HostClass
from fleet.embedded import Fleet
from fleet.server.core import Core

DOOMED = f"{default_host_id(HostClass.CPU, 9)}-doomed"


async def wait_hosts(fleet_core: Core, want: int, timeout_s: float) -> None:
    give_up = time.monotonic() + timeout_s
    while len(await fleet_core.db(fleet_core.ledger.hosts)) < want:
        if time.monotonic() > give_up:
            raise TimeoutError(f"agents did not register within {timeout_s:.0f}s")
        await asyncio.sleep(0.05)


async def start_doomed_agent(
    fleet: Fleet, paths: Paths, machines: Path, gateway_port: int | None = None
) -> asyncio.subprocess.Process:
    """One more cpu agent, as its own process: the host the demo will lose. It joins the
    fleet as a cloud host would, with a one-use join token; with `gateway_port`, its machines
    reach the gateway (over TLS from the fleet's CA), so it takes inference rollouts too."""
    gateway = ["--gateway", f"https://host:{gateway_port}"] if gateway_port else []
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleet.cli.main", "--log-level", "error", "agent",
        "--class", "cpu", "--runtime", fleet.runtime.kind.value, "--server", fleet.address,
        "--host-id", DOOMED, "--slots", "2", "--machines-dir", str(machines),
        "--join", fleet.join_token(HostClass.CPU), "--ca", str(paths.ca / "ca.crt"),
        "--identity-dir", str(machines.parent / "doomed-identity"), *gateway,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip


async def lose_a_host(fleet: Fleet, proc: asyncio.subprocess.Process, machines: Path) -> str:
    """Kills (-9) the extra agent while it holds work.

    Its leases expire and the work runs again elsewhere: what a lost cloud host looks like.
    """
    host_id = DOOMED
    ledger = fleet.server.core.ledger
    try:
        for _ in range(600):
            held = await fleet.server.core.db(ledger.leased_to, host_id)
            if held:
                proc.kill()  # SIGKILL: no goodbye, no completion
                await proc.wait()
                return f"killed agent {host_id} (kill -9) while it held {held} rollouts"
            await asyncio.sleep(0.02)
        return f"agent {host_id} took no work before the suite ended; nothing was killed"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        runtime = make_runtime(fleet.runtime, machines)
        await runtime.reap(host_id)
