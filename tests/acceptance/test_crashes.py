"""Crash tests with real processes and kill -9: exactly one final result per rollout."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from sqlmodel import Session, col, select

from fleet.api.pb import fleet_pb2, fleet_pb2_grpc, types_pb2
from fleet.core.lifecycle import Outcome
from fleet.ledger.store import Ledger
from fleet.ledger.tables import AttemptRow, EventRow, ManifestRow, RolloutRow, WorkItemRow
from fleet.runtime.cgroups import MachineCgroup
from fleet.runtime.namespace import NamespaceRuntime
from tests.acceptance.procs import Procs, free_port
from tests.pgserver import create_database, drop_database

FINAL_KINDS = {"succeeded", "failed", "cancelled", "deadline_exceeded"}


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.stop_all()


def make_request(key: str, argv: list[str] | None = None) -> fleet_pb2.SubmitRolloutRequest:
    return fleet_pb2.SubmitRolloutRequest(
        request_id=uuid.uuid4().hex,
        idempotency_key=key,
        smolfile='image = "minimal"\n',
        smolfile_name="crash.smolfile",
        steps=[types_pb2.Step(argv=argv or ["true"], timeout_s=60)],
        retry=types_pb2.RetryPolicy(max_attempts=50, initial_backoff_s=0.05, max_backoff_s=0.2),
        labels={"suite": "crash"},
    )


async def submit_all(address: str, keys: list[str], argv: list[str] | None = None) -> list[str]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = fleet_pb2_grpc.FleetServiceStub(channel)
        ids = []
        for key in keys:
            reply = await stub.SubmitRollout(make_request(key, argv), timeout=30)
            ids.append(reply.rollout.id)
        return ids


def wait_registered(ledger: Ledger, count: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while len(ledger.hosts()) < count:
        assert time.monotonic() < deadline, "agents did not register"
        time.sleep(0.1)


def states(ledger: Ledger) -> Counter[str]:
    with Session(ledger.engine) as s:
        return Counter(r.state for r in s.exec(select(RolloutRow)))


def held_leases(ledger: Ledger, host_id: str) -> int:
    with Session(ledger.engine) as s:
        return len(
            s.exec(
                select(WorkItemRow).where(
                    WorkItemRow.lease_owner == host_id, WorkItemRow.state == "LEASED"
                )
            ).all()
        )


def check_exactly_once(ledger: Ledger, expected: int) -> tuple[list[AttemptRow], dict[str, int]]:
    """Every rollout is SUCCEEDED with one final event, its manifest, item and results."""
    with Session(ledger.engine) as s:
        rollouts = s.exec(select(RolloutRow)).all()
        assert len(rollouts) == expected
        assert {r.state for r in rollouts} == {"SUCCEEDED"}
        finals = Counter(e.rollout_id for e in s.exec(select(EventRow)) if e.kind in FINAL_KINDS)
        assert all(finals[r.id] == 1 for r in rollouts)
        items = s.exec(select(WorkItemRow)).all()
        assert len(items) == expected and {i.state for i in items} == {"DONE"}
        digests = {r.manifest_digest for r in rollouts}
        assert all(s.get(ManifestRow, d) is not None for d in digests)
        assert all(r.results_json != "[]" for r in rollouts)
        attempts = list(s.exec(select(AttemptRow).order_by(col(AttemptRow.id))))
        per_item = Counter(a.work_id for a in attempts if a.outcome == Outcome.SUCCEEDED.value)
        assert all(per_item[i.id] == 1 for i in items)
        return attempts, {r.id: r.attempts for r in rollouts}


@pytest.mark.sandbox
def test_kill_agents_mid_lease_repeatedly(tmp_path: Path, procs: Procs, images: object) -> None:
    """1,000 short rollouts, 20+ agent kill -9s mid-lease: one result each, retries match kills."""
    db = str(tmp_path / "ledger.sqlite3")
    port = free_port()
    address = f"127.0.0.1:{port}"
    procs.server("server", db, port, "--lease-ttl-s", "3", "--heartbeat-s", "0.3")
    ledger = Ledger.open(db)
    machines = tmp_path / "machines"
    # Register a cpu host, then queue everything before the agents that will be killed start,
    # so that the kills land while work runs.
    first = procs.agent("cpu-registrar", address, machines)
    wait_registered(ledger, 1)
    first.stop()
    total = 1000
    asyncio.run(submit_all(address, [f"crash-{i}" for i in range(total)], ["sleep", "0.3"]))
    agents = {slot: procs.agent(f"cpu-{slot}-0", address, machines) for slot in ("a", "b")}
    incarnation = {"a": 0, "b": 0}
    killed: dict[str, int] = {}
    rng = random.Random(1)
    deadline = time.monotonic() + 600
    while states(ledger)["SUCCEEDED"] < total:
        assert time.monotonic() < deadline, f"not done: {states(ledger)}"
        if len(killed) < 24:
            slot = rng.choice(["a", "b"])
            host = f"cpu-{slot}-{incarnation[slot]}"
            if held_leases(ledger, host) > 0:
                agents[slot].kill9()
                incarnation[slot] += 1
                agents[slot] = procs.agent(f"cpu-{slot}-{incarnation[slot]}", address, machines)
                # Let requests the dead agent had in flight land (a claim may still lease to
                # it, a completion may still record), then count what it holds: well before
                # its lease can expire (3 s after its last beat).
                time.sleep(0.8)
                killed[host] = held_leases(ledger, host)
            time.sleep(rng.uniform(0.1, 0.3))
        else:
            time.sleep(0.2)
    attempts, per_rollout = check_exactly_once(ledger, total)
    assert len(killed) >= 20 and sum(killed.values()) >= 20
    expired = [a for a in attempts if a.outcome == Outcome.LEASE_EXPIRED.value]
    # Every lost attempt belonged to a killed agent, and each killed agent lost exactly the
    # leases it held when it died; nothing else was ever retried.
    assert {a.host_id for a in expired} <= set(killed)
    lost = Counter(a.host_id for a in expired)
    assert all(lost[host] == count for host, count in killed.items()), (lost, killed)
    assert sum(per_rollout.values()) == total + len(expired)
    assert all(
        a.outcome in (Outcome.SUCCEEDED.value, Outcome.LEASE_EXPIRED.value) for a in attempts
    )
    ledger.engine.dispose()
    # A killed agent leaves its machines' directories and cgroups behind; its reaper (run by
    # the next agent with its host id) removes them. Nothing else may be left once the
    # survivors stop.
    for slot in agents:
        agents[slot].stop()
    runtime = NamespaceRuntime(machines)
    orphans = [d.name for d in machines.glob("*/*") if d.is_dir()]
    assert orphans and any(MachineCgroup(n, runtime.cgroup_version).exists() for n in orphans)
    reaped = sum(asyncio.run(runtime.reap(host)) for host in killed)
    assert reaped == len(orphans), (reaped, len(orphans), killed)
    assert reaped <= sum(killed.values()), (reaped, killed)
    assert [d for d in machines.glob("*/*") if d.is_dir()] == []
    assert not any(MachineCgroup(n, runtime.cgroup_version).exists() for n in orphans)


@pytest.mark.sandbox
def test_kill_the_server_mid_submissions_and_completions(
    tmp_path: Path, procs: Procs, images: object
) -> None:
    """Acknowledged submissions survive a kill -9 of the server; nothing is half-present."""
    db = str(tmp_path / "ledger.sqlite3")
    port = free_port()
    address = f"127.0.0.1:{port}"
    server = procs.server("server-0", db, port, "--lease-ttl-s", "3", "--heartbeat-s", "0.3")
    ledger = Ledger.open(db)
    procs.agent("cpu-a", address, tmp_path / "machines")
    wait_registered(ledger, 1)
    acked: list[str] = []
    sent: list[str] = []

    async def submitter() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = fleet_pb2_grpc.FleetServiceStub(channel)
            for i in range(100_000):
                key = f"srv-{i}"
                sent.append(key)
                try:
                    await stub.SubmitRollout(make_request(key), timeout=5)
                except grpc.aio.AioRpcError:
                    return
                acked.append(key)

    async def kill_after(delay: float) -> None:
        await asyncio.sleep(delay)
        server.kill9()

    async def run() -> None:
        await asyncio.gather(submitter(), kill_after(3.0))

    asyncio.run(run())
    assert len(acked) > 20
    procs.server("server-1", db, port, "--lease-ttl-s", "3", "--heartbeat-s", "0.3")
    with Session(ledger.engine) as s:
        present = {r.idempotency_key for r in s.exec(select(RolloutRow))}
    assert set(acked) <= present
    assert present <= set(sent)  # at most the one in flight besides the acknowledged
    # Resubmitting the unacknowledged one is safe: it either was stored whole or not at all.
    asyncio.run(submit_all(address, [k for k in sent if k not in acked]))
    deadline = time.monotonic() + 300
    while states(ledger)["SUCCEEDED"] < len(set(sent)):
        assert time.monotonic() < deadline, f"not done: {states(ledger)}"
        time.sleep(0.2)
    check_exactly_once(ledger, len(set(sent)))
    ledger.engine.dispose()


@pytest.mark.sandbox
def test_two_servers_share_one_postgresql_ledger(
    tmp_path: Path, procs: Procs, postgres: str, images: object
) -> None:
    """Two `fleet serve` replicas on one PostgreSQL database, agents spread across them."""
    url = create_database(postgres)
    try:
        ports = [free_port(), free_port()]
        for n, port in enumerate(ports):
            procs.server(f"server-{n}", url, port, "--lease-ttl-s", "5", "--heartbeat-s", "0.5")
        ledger = Ledger.open(url)
        addresses = [f"127.0.0.1:{p}" for p in ports]
        for n in range(4):
            procs.agent(f"cpu-{n}", addresses[n % 2], tmp_path / "machines", slots=2)
        wait_registered(ledger, 4)
        total = 200

        async def both() -> None:
            await asyncio.gather(
                submit_all(addresses[0], [f"pg-{i}" for i in range(0, total, 2)]),
                submit_all(addresses[1], [f"pg-{i}" for i in range(1, total, 2)]),
                submit_all(addresses[1], [f"pg-{i}" for i in range(0, 20, 2)]),  # duplicates
            )

        asyncio.run(both())
        deadline = time.monotonic() + 300
        while states(ledger)["SUCCEEDED"] < total:
            assert time.monotonic() < deadline, f"not done: {states(ledger)}"
            time.sleep(0.2)
        attempts, per_rollout = check_exactly_once(ledger, total)
        retried = [a for a in attempts if a.outcome != Outcome.SUCCEEDED.value]
        assert retried == [], [(a.host_id, a.outcome, a.error) for a in retried]
        assert set(per_rollout.values()) == {1}
        assert len({a.host_id for a in attempts}) == 4  # every agent took work
        ledger.engine.dispose()
    finally:
        procs.stop_all()
        drop_database(postgres, url)
