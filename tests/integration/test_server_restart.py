"""A server started again on the same ledger and address, after being down for longer than a
lease: it judges no lease for its first lease, so hosts that reconnect keep their work and
nothing runs twice; a host that stays away still loses its lease. A replica that starts
holds only its own sweeps: the others go on expiring dead hosts' leases."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from structlog.testing import capture_logs

from fleet.api.pb import fleet_pb2, fleet_pb2_grpc, host_pb2, host_pb2_grpc, types_pb2
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from fleet.ledger.store import Ledger
from fleet.server.app import FleetServer, ServerConfig
from tests.integration.harness import FINAL, SECRET, Harness, harness, request


def config(lease_ttl_s: float) -> ServerConfig:
    return ServerConfig(
        lease_ttl_s=lease_ttl_s, heartbeat_interval_s=0.3, sweep_interval_s=0.1, token_secret=SECRET
    )


@contextlib.asynccontextmanager
async def restarted(
    h: Harness, settings: ServerConfig, down_s: float
) -> AsyncIterator[FleetServer]:
    """Stops the harness's server, waits `down_s`, and serves again on the same ledger and
    address (a new process would be the same: a new sweeper, a ledger opened afresh)."""
    port = h.server.port
    await h.server.stop(grace_s=0)
    await asyncio.sleep(down_s)
    ledger = Ledger.sqlite(h.tmp / "ledger.sqlite3")
    server = FleetServer(ledger, h.images, f"127.0.0.1:{port}", settings)
    await server.start()
    try:
        yield server
    finally:
        for host_id in list(h.agents):  # (they drain against this server)
            await h.stop_agent(host_id)
        await server.stop()


async def claim(h: Harness, host_id: str) -> host_pb2.LeaseRef:
    reply = await h.hosts.ClaimWork(
        host_pb2.ClaimWorkRequest(request_id=f"c-{host_id}", host_id=host_id, max_items=1, wait_s=1)
    )
    [item] = reply.items
    return host_pb2.LeaseRef(work_id=item.work_id, fencing_token=item.fencing_token)


async def outcomes(fleet: fleet_pb2_grpc.FleetServiceStub, rollout_id: str) -> list[str]:
    rollout = await fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=rollout_id))
    return [a.outcome for a in rollout.attempt_history]


async def test_a_restarted_server_keeps_a_returning_hosts_lease_and_expires_a_silent_ones(
    tmp_path: Path, images: ImageStore
) -> None:
    """Two hosts hold a lease each; the server is down for longer than a lease, so both leases'
    expiry passes meanwhile. The new server sweeps five times before either beats: neither
    lease is judged. The host that comes back beats and keeps its lease; the one that stays
    away loses its lease, by the new server's hold's end (a lease after the start)."""
    settings = config(2.0)
    async with harness(tmp_path, images, settings) as h:
        await h.register_host("back")
        await h.register_host("gone")
        kept = (await h.fleet.SubmitRollout(request())).rollout.id
        lost = (await h.fleet.SubmitRollout(request())).rollout.id
        leases = {"back": await claim(h, "back"), "gone": await claim(h, "gone")}
        with capture_logs() as logs:
            async with restarted(h, settings, down_s=2.5) as server:
                await asyncio.sleep(0.5)  # the new server sweeps first, five times
                async with h.connect(address=server.address) as channel:
                    hosts = host_pb2_grpc.HostServiceStub(channel)
                    fleet = fleet_pb2_grpc.FleetServiceStub(channel)
                    beat = await hosts.Heartbeat(
                        host_pb2.HeartbeatRequest(
                            request_id="b0", host_id="back", leases=[leases["back"]]
                        )
                    )
                    assert [r.work_id for r in beat.renewed] == [leases["back"].work_id]
                    for i in range(100):  # "back" beats on; "gone" is silent (bounded: 10 s)
                        if await outcomes(fleet, lost) == ["LEASE_EXPIRED"]:
                            break
                        await hosts.Heartbeat(
                            host_pb2.HeartbeatRequest(
                                request_id=f"b{i + 1}", host_id="back", leases=[leases["back"]]
                            )
                        )
                        await asyncio.sleep(0.1)
                    else:
                        raise AssertionError("the silent host's lease never expired")
                    still = await fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=kept))
    assert still.state == types_pb2.ROLLOUT_STATE_RUNNING
    assert [a.outcome for a in still.attempt_history] == [""], still.attempt_history
    held = [e for e in logs if e["event"] == "sweeper_holding_after_start"]
    assert [e["hold_s"] for e in held] == [2.0]


async def test_a_step_running_through_a_server_restart_runs_once(
    tmp_path: Path, images: ImageStore
) -> None:
    """A real agent runs a long step; the server stops while it runs and serves again on the
    same ledger and address after longer than a lease. The agent reconnects, its next beat
    renews the lease, the step finishes: one attempt, not a second run."""
    # The agent's channel retries the lost server on gRPC's default backoff (1 s, x1.6, +-20 %):
    # 7.4 to 11.1 s after it went, then 5.2 to 7.9 s later. Back after 10.5 s, the server is
    # reached within 7.9 s: a 10 s lease covers that wait.
    settings = config(10.0)
    async with harness(tmp_path, images, settings) as h:
        await h.start_agent("cpu-a", HostClass.CPU, slots=1)
        retry = types_pb2.RetryPolicy(max_attempts=3, initial_backoff_s=0.05)
        reply = await h.fleet.SubmitRollout(
            request('image = "minimal"\n', ["sleep", "14"], retry=retry)
        )
        rollout_id = reply.rollout.id
        for _ in range(200):  # until the agent has it (bounded: 10 s)
            rollout = await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=rollout_id))
            if rollout.state == types_pb2.ROLLOUT_STATE_RUNNING:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"the rollout never started: {rollout}")
        with capture_logs() as logs:
            async with (
                restarted(h, settings, down_s=10.5) as server,
                h.connect(address=server.address) as channel,
            ):
                fleet = fleet_pb2_grpc.FleetServiceStub(channel)
                for _ in range(600):  # (bounded: 60 s)
                    # (In-process, this channel shares the agent's connection and its backoff.)
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        got = fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=rollout_id))
                        if (rollout := await got).state in FINAL:
                            break
                    await asyncio.sleep(0.1)
    assert rollout.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, rollout.error
    assert [a.outcome for a in rollout.attempt_history] == ["SUCCEEDED"]
    assert rollout.attempts == 1 and [r.exit_code for r in rollout.results] == [0]
    assert any(e["event"] == "sweeper_holding_after_start" for e in logs)


async def test_a_replica_holding_after_its_start_leaves_expiry_to_the_others(
    tmp_path: Path, images: ImageStore
) -> None:
    """Two servers on one ledger: the first has run for longer than its lease, the second has
    just started and holds its own sweeps (for a lease far longer than this test). A dead
    host's lease still expires: the first one's sweeps judge it."""
    async with harness(tmp_path, images, config(1.0)) as h:
        await h.register_host("dead")
        rollout_id = (await h.fleet.SubmitRollout(request())).rollout.id
        await claim(h, "dead")
        second = FleetServer(
            Ledger.sqlite(tmp_path / "ledger.sqlite3"), images, "127.0.0.1:0", config(600.0)
        )
        with capture_logs() as logs:
            await second.start()
            try:
                for _ in range(200):  # (bounded: 10 s)
                    if await outcomes(h.fleet, rollout_id) == ["LEASE_EXPIRED"]:
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("the dead host's lease never expired")
            finally:
                await second.stop()
    held = [e for e in logs if e["event"] == "sweeper_holding_after_start"]
    assert [e["hold_s"] for e in held] == [600.0]
