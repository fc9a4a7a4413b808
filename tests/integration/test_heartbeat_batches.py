"""Heartbeats in group commit: many hosts' beats in one ledger transaction, each answered as it
would be alone (a stale lease or an unknown host refused, writing nothing), on SQLite and
PostgreSQL; and through a server, beats that arrive together share one transaction."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest

from fleet.api.pb import host_pb2, host_pb2_grpc
from fleet.core.errors import Aborted, FailedPrecondition
from fleet.core.manifest import SubmitRequest, build_manifest, validate_request
from fleet.core.placement import HostCapabilities, HostClass, Isolation, RuntimeKind
from fleet.core.rollout import Rollout
from fleet.image.store import ImageStore
from fleet.ledger.leases import Beat
from fleet.ledger.store import Ledger
from fleet.server.app import FleetServer, ServerConfig
from tests.integration.harness import register_cpu_host

HOSTS = 6
BEATS = 48
T0 = datetime(2030, 1, 1, tzinfo=UTC).timestamp()
TTL = 10.0
QUIET = {"sweep_interval_s": 3600.0, "late_sweep_interval_s": 3600.0, "govern_interval_s": 3600.0}
"""A server whose own periodic writes (sweeps, pools' gates) wait past the test's end, once
they have run at its start: every write transaction it runs then is a heartbeat's."""


def register(ledger: Ledger, host_id: str) -> None:
    caps = HostCapabilities(
        host_id=host_id, host_class=HostClass.CPU, runtime=RuntimeKind.NAMESPACE,
        isolation=Isolation.NAMESPACE, cpus=2, memory_mib=1024, cuda_devices=0,
    )  # fmt: skip
    ledger.register_host(caps, T0)


def submit(ledger: Ledger, key: str) -> Rollout:
    req = SubmitRequest.model_validate(
        {"idempotency_key": key, "smolfile": 'image = "minimal"\n', "steps": [{"argv": ["true"]}]}
    )
    now = datetime.fromtimestamp(T0, UTC)
    manifest = build_manifest(req, validate_request(req, now), "sha256:img", now)
    return ledger.submit(req, manifest, T0)[0]


def count_transactions(ledger: Ledger) -> list[int]:
    """A counter (one element) of the write transactions `ledger` runs from now on."""
    count = [0]
    real = ledger._tx

    @contextlib.contextmanager
    def counted() -> Iterator[Any]:
        count[0] += 1
        with real() as db:
            yield db

    ledger._tx = counted  # type: ignore[method-assign]
    return count


def lease_expiry(ledger: Ledger, work_id: str) -> float:
    with ledger._read() as db:
        return float(db.value("SELECT lease_expires_at FROM work_items WHERE id = ?", (work_id,)))


def last_beat(ledger: Ledger, host_id: str) -> float:
    with ledger._read() as db:
        return float(db.value("SELECT last_heartbeat_at FROM hosts WHERE id = ?", (host_id,)))


def test_many_hosts_beats_are_one_transaction_each_answered_alone(ledger: Ledger) -> None:
    leases = {}
    for n in range(HOSTS):
        host = f"cpu-{n}"
        register(ledger, host)
        submit(ledger, f"k{n}")
        [a] = ledger.claim(host, 1, T0, TTL)
        leases[host] = (a.work_id, a.fencing_token)
    stale_host, (stale_work, stale_token) = "cpu-1", leases["cpu-1"]
    beats = [Beat(h, [leases[h]], T0 + 5, TTL) for h in leases if h != stale_host]
    beats.append(Beat(stale_host, [(stale_work, stale_token - 1)], T0 + 5, TTL))
    beats.append(Beat("nobody", [], T0 + 5, TTL))
    beats.append(Beat("cpu-2", [leases["cpu-2"]], T0 + 6, TTL, images=["sha256:" + "a" * 64]))

    transactions = count_transactions(ledger)
    answers = ledger.heartbeat_batch(beats)

    assert transactions == [1]
    assert len(answers) == len(beats)
    for beat, answer in zip(beats[: HOSTS - 1], answers, strict=False):
        assert answer == ([leases[beat.host_id]], [])
        assert lease_expiry(ledger, leases[beat.host_id][0]) >= T0 + 5 + TTL
    stale, unknown, later = answers[HOSTS - 1 :]
    assert isinstance(stale, Aborted) and stale.details == {"stale-work-ids": stale_work}
    assert isinstance(unknown, FailedPrecondition) and "'nobody'" in unknown.message
    assert later == ([leases["cpu-2"]], [])
    # The refused beat wrote nothing: its host's lease and last beat are as the claim left them.
    assert lease_expiry(ledger, stale_work) == T0 + TTL
    assert last_beat(ledger, stale_host) < T0 + 5
    # A host's later beat in the same batch wins, and its images are kept.
    assert last_beat(ledger, "cpu-2") == T0 + 6
    assert lease_expiry(ledger, leases["cpu-2"][0]) == T0 + 6 + TTL
    [view] = [h for h in ledger.host_table(T0 + 6, 60) if h.capabilities.host_id == "cpu-2"]
    assert view.images == ["sha256:" + "a" * 64]
    # The renewed leases outlive their first expiry; the refused one does not.
    ledger.sweep(T0 + TTL + 1)
    renewed, _ = ledger.heartbeat("cpu-0", [leases["cpu-0"]], T0 + TTL + 2, TTL)
    assert renewed == [leases["cpu-0"]]
    with pytest.raises(Aborted, match="stale lease"):
        ledger.heartbeat(stale_host, [(stale_work, stale_token)], T0 + TTL + 2, TTL)


def test_a_beat_says_which_work_to_stop(ledger: Ledger) -> None:
    register(ledger, "cpu-1")
    rollout = submit(ledger, "k1")
    [a] = ledger.claim("cpu-1", 1, T0, TTL)
    ledger.cancel(rollout.id, "no longer wanted", "tenant", T0 + 1)
    [answer] = ledger.heartbeat_batch([Beat("cpu-1", [(a.work_id, a.fencing_token)], T0 + 2, TTL)])
    assert answer == ([(a.work_id, a.fencing_token)], [a.work_id])


async def test_beats_arriving_together_share_a_commit(tmp_path: Path, images: ImageStore) -> None:
    """BEATS hosts beat at once through gRPC while the ledger's thread is busy: they are
    written in one transaction when it frees, not one each, and each gets its own answer."""
    ledger = Ledger.sqlite(tmp_path / "ledger.sqlite3")
    config = ServerConfig(lease_ttl_s=TTL, heartbeat_interval_s=1.0, **QUIET)
    server = FleetServer(ledger, images, "127.0.0.1:0", config)
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    hosts = host_pb2_grpc.HostServiceStub(channel)
    try:
        for n in range(BEATS):
            await register_host(hosts, f"cpu-{n}")
        await asyncio.sleep(0.5)  # (the server's first sweep, at its start, is over)
        busy = threading.Event()
        blocked = asyncio.ensure_future(server.core.db(busy.wait, 30))
        transactions = count_transactions(ledger)
        beats = [
            asyncio.ensure_future(
                hosts.Heartbeat(host_pb2.HeartbeatRequest(host_id=f"cpu-{n}"), timeout=60)
            )
            for n in range(BEATS)
        ]
        beats.append(
            asyncio.ensure_future(
                hosts.Heartbeat(host_pb2.HeartbeatRequest(host_id="nobody"), timeout=30)
            )
        )
        servicer = server.host_servicer
        for _ in range(200):  # (10 s) until every beat waits for the ledger's thread
            if servicer.beats.coalescer.waiting >= BEATS:
                break
            await asyncio.sleep(0.05)
        busy.set()
        await blocked
        answers = await asyncio.gather(*beats, return_exceptions=True)
        assert all(isinstance(a, host_pb2.HeartbeatResponse) for a in answers[:BEATS])
        refused = answers[BEATS]
        assert isinstance(refused, grpc.aio.AioRpcError)
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
        # The first beats may have gone ahead (a batch begun before the rest arrived, held by
        # the busy thread); the rest are one.
        assert transactions[0] <= 2, f"{transactions[0]} transactions for {BEATS + 1} beats"
        batches = list(servicer.beats.coalescer.batches)
        assert sum(batches) == BEATS + 1 and len(batches) <= 2, batches
    finally:
        await channel.close()
        await server.stop()


async def register_host(hosts: host_pb2_grpc.HostServiceStub, host_id: str) -> None:
    await register_cpu_host(_Named(hosts, host_id))


class _Named:
    """A host stub whose RegisterHost names `host_id` (the server has no TLS: the request's
    name is the host's)."""

    def __init__(self, stub: host_pb2_grpc.HostServiceStub, host_id: str) -> None:
        self._stub = stub
        self._host_id = host_id

    async def RegisterHost(self, request: host_pb2.RegisterHostRequest) -> Any:
        request.host_id = self._host_id
        return await self._stub.RegisterHost(request)
