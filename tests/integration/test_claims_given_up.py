"""A claim whose caller gave up before the ledger got to it leases nothing: its host, never
answered, claims again (perhaps at another replica), and work leased to it under the first
claim would have waited for its lease to expire and then run a second time."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc

from fleet.api.pb import fleet_pb2_grpc, host_pb2, host_pb2_grpc
from fleet.image.store import ImageStore
from fleet.ledger.raw import LEASED
from fleet.ledger.store import Ledger
from fleet.server.app import FleetServer, ServerConfig
from tests.integration.harness import request
from tests.integration.test_heartbeat_batches import register_host


def leases_of(ledger: Ledger, host_id: str) -> int:
    with ledger._read() as db:
        return int(
            db.value(
                "SELECT count(*) FROM work_items WHERE state = ? AND lease_owner = ?",
                (LEASED, host_id),
            )
        )


async def test_a_claim_given_up_while_it_waited_for_the_ledger_is_not_taken(
    tmp_path: Path, images: ImageStore
) -> None:
    ledger = Ledger.sqlite(tmp_path / "ledger.sqlite3")
    server = FleetServer(ledger, images, "127.0.0.1:0", ServerConfig(lease_ttl_s=30.0))
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    try:
        hosts = host_pb2_grpc.HostServiceStub(channel)
        fleet = fleet_pb2_grpc.FleetServiceStub(channel)
        for host_id in ("patient", "hasty"):
            await register_host(hosts, host_id)
        for _ in range(2):
            await fleet.SubmitRollout(request())
        claims = server.host_servicer.claims.coalescer
        busy = threading.Event()
        blocked = asyncio.ensure_future(server.core.db(busy.wait, 30))
        # The first claim's batch waits for the ledger's thread; the second waits for the
        # next batch, and its caller gives up meanwhile.
        patient = asyncio.ensure_future(
            hosts.ClaimWork(
                host_pb2.ClaimWorkRequest(host_id="patient", max_items=1, wait_s=0), timeout=60
            )
        )
        for _ in range(200):  # (10 s)
            if len(claims.batches) >= 1:
                break
            await asyncio.sleep(0.05)
        assert len(claims.batches) >= 1
        hasty = hosts.ClaimWork(
            host_pb2.ClaimWorkRequest(host_id="hasty", max_items=1, wait_s=0), timeout=1
        )
        try:
            await hasty
            raise AssertionError("the claim was answered while the ledger was busy")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        busy.set()
        await blocked
        assert len((await patient).items) == 1
        for _ in range(100):  # (5 s) until no claim is waiting or running
            if not claims.waiting and (claims._task is None or claims._task.done()):
                break
            await asyncio.sleep(0.05)
        assert leases_of(ledger, "hasty") == 0
        assert leases_of(ledger, "patient") == 1
        # The work the given-up claim would have taken is still there for its retry.
        again = await hosts.ClaimWork(
            host_pb2.ClaimWorkRequest(host_id="hasty", max_items=1, wait_s=0), timeout=30
        )
        assert len(again.items) == 1
    finally:
        await channel.close()
        await server.stop()
