"""Claims waiting at one replica are woken by work submitted through another (PostgreSQL's
LISTEN/NOTIFY): two servers on one PostgreSQL ledger, a host's claim waiting at the second
with its fallback poll longer than the call's own deadline, work submitted at the first."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from fleet.api.pb import fleet_pb2_grpc, host_pb2, host_pb2_grpc
from fleet.image.store import ImageStore
from fleet.ledger.store import Ledger
from fleet.server import core as server_core
from fleet.server.app import FleetServer, ServerConfig
from tests.integration.harness import request
from tests.integration.test_heartbeat_batches import register_host
from tests.pgserver import create_database, drop_database

CLAIM_WAIT_S = 30.0
CALL_DEADLINE_S = 15.0
"""Shorter than the claim's wait and than the fallback poll: only a wake-up answers in time."""


@pytest.fixture
def database(postgres: str) -> Iterator[str]:
    url = create_database(postgres)
    yield url
    drop_database(postgres, url)


@pytest.fixture
async def replicas(database: str, images: ImageStore) -> AsyncIterator[list[FleetServer]]:
    servers = []
    try:
        for _ in range(2):
            config = ServerConfig(lease_ttl_s=10.0, heartbeat_interval_s=1.0)
            server = FleetServer(Ledger.open(database), images, "127.0.0.1:0", config)
            await server.start()
            servers.append(server)
        yield servers
    finally:
        for server in servers:
            await server.stop()


async def test_work_submitted_at_one_replica_wakes_claims_waiting_at_another(
    replicas: list[FleetServer], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(server_core, "SIGNALLED_CLAIM_POLL_S", 1000.0)
    submitting, claiming = replicas
    to_submit = grpc.aio.insecure_channel(submitting.address)
    to_claim = grpc.aio.insecure_channel(claiming.address)
    try:
        hosts = host_pb2_grpc.HostServiceStub(to_claim)
        await register_host(hosts, "cpu-1")
        claim = asyncio.ensure_future(
            hosts.ClaimWork(
                host_pb2.ClaimWorkRequest(host_id="cpu-1", max_items=1, wait_s=CLAIM_WAIT_S),
                timeout=CALL_DEADLINE_S,
            )
        )
        for _ in range(200):  # (10 s) until the claiming replica listens
            signal = claiming.core.signal
            if signal is not None and signal.listening:
                break
            await asyncio.sleep(0.05)
        assert claiming.core.signal is not None and claiming.core.signal.listening
        # (a wait begun before it listened polls again soon; every one after that does not)
        await asyncio.sleep(2 * server_core.CLAIM_POLL_S)
        assert not claim.done()
        fleet = fleet_pb2_grpc.FleetServiceStub(to_submit)
        submitted = await fleet.SubmitRollout(request())
        reply = await claim
        assert [i.rollout_id for i in reply.items] == [submitted.rollout.id]
        assert claiming.core.signal.received >= 1
    finally:
        await to_submit.close()
        await to_claim.close()


async def test_a_sqlite_server_keeps_its_short_poll(tmp_path: Path, images: ImageStore) -> None:
    """With no other replica to hear from, a waiting claim polls as before."""
    server = FleetServer(Ledger.sqlite(tmp_path / "ledger.sqlite3"), images, "127.0.0.1:0",
                         ServerConfig())  # fmt: skip
    await server.start()
    try:
        assert server.core.claim_poll_s() == server_core.CLAIM_POLL_S
        assert server.core.signal is None
    finally:
        await server.stop()
