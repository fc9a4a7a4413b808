"""An agent killed with kill -9 and restarted under the same host id reconciles its machines:
work still leased to it goes on in the machine it left (finished steps are not run again);
a machine whose lease it lost meanwhile is deleted. Nothing is left once it stops."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from sqlmodel import Session, select

from fleet.api.pb import fleet_pb2, fleet_pb2_grpc, types_pb2
from fleet.ledger.store import Ledger
from fleet.ledger.tables import EventRow
from fleet.runtime.cgroups import MachineCgroup
from fleet.runtime.namespace import NamespaceRuntime
from tests.acceptance.procs import Procs, free_port

HOST = "cpu-restart"


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.stop_all()


def sh(script: str) -> types_pb2.Step:
    return types_pb2.Step(argv=["/bin/sh", "-c", script], timeout_s=120)


# Step 1 waits until its marker is there, then blocks: the agent is killed while it runs.
# Run again in the same machine, it finds the marker and goes on.
ADOPTED_STEPS = [
    sh("echo ran >> /root/count; echo first"),
    sh("if [ -f /root/marker ]; then echo resumed; else touch /root/marker; sleep 300; fi"),
    sh("wc -l < /root/count"),
]


async def submit(address: str, key: str, steps: list[types_pb2.Step]) -> str:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = fleet_pb2_grpc.FleetServiceStub(channel)
        reply = await stub.SubmitRollout(
            fleet_pb2.SubmitRolloutRequest(
                request_id=uuid.uuid4().hex,
                idempotency_key=key,
                smolfile='image = "minimal"\n',
                smolfile_name="restart.smolfile",
                steps=steps,
                retry=types_pb2.RetryPolicy(max_attempts=3, initial_backoff_s=0.05),
            ),
            timeout=30,
        )
        return str(reply.rollout.id)


async def get(address: str, rollout_id: str) -> types_pb2.Rollout:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = fleet_pb2_grpc.FleetServiceStub(channel)
        return await stub.GetRollout(fleet_pb2.GetRolloutRequest(id=rollout_id), timeout=30)


async def cancel(address: str, rollout_id: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = fleet_pb2_grpc.FleetServiceStub(channel)
        await stub.CancelRollout(
            fleet_pb2.CancelRolloutRequest(
                request_id=uuid.uuid4().hex, id=rollout_id, reason="test"
            ),
            timeout=30,
        )


def wait_for(what: str, check: object, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def machine_dir(machines: Path, rollout_id: str) -> Path | None:
    found = sorted((machines / HOST).glob(f"fleet-{rollout_id}-a1-*"))
    return found[0] if found else None


def final(address: str, rollout_id: str) -> types_pb2.Rollout | None:
    rollout = asyncio.run(get(address, rollout_id))
    done = {
        types_pb2.ROLLOUT_STATE_SUCCEEDED,
        types_pb2.ROLLOUT_STATE_FAILED,
        types_pb2.ROLLOUT_STATE_CANCELLED,
        types_pb2.ROLLOUT_STATE_QUARANTINED,
    }
    return rollout if rollout.state in done else None


@pytest.mark.sandbox
def test_restarted_agent_adopts_leased_work_and_deletes_the_rest(
    tmp_path: Path, procs: Procs, images: object
) -> None:
    db = str(tmp_path / "ledger.sqlite3")
    port = free_port()
    address = f"127.0.0.1:{port}"
    # Leases outlive the agent's restart by far (120 s), so the work is still this host's,
    # and the cancelled rollout can only end early if the restarted agent releases it.
    procs.server("server", db, port, "--lease-ttl-s", "120", "--heartbeat-s", "0.3")
    machines = tmp_path / "machines"
    agent = procs.agent(HOST, address, machines, 2)
    ledger = Ledger.open(db)
    wait_for("the agent to register", lambda: len(ledger.hosts()) == 1, 60)
    kept = asyncio.run(submit(address, "adopt-me", ADOPTED_STEPS))
    dropped = asyncio.run(submit(address, "cancel-me", [sh("sleep 300")]))

    def marker() -> bool:
        d = machine_dir(machines, kept)
        return d is not None and (d / "disk" / "upper" / "root" / "marker").exists()

    wait_for("step 1 of the adopted rollout to start", marker)
    wait_for("the other rollout's machine", lambda: machine_dir(machines, dropped) is not None)
    kept_dir, dropped_dir = machine_dir(machines, kept), machine_dir(machines, dropped)
    assert kept_dir is not None and dropped_dir is not None
    agent.kill9()
    # While the agent is down, the second rollout is cancelled: its lease is no longer
    # something to go on with, and its machine must not be adopted.
    asyncio.run(cancel(address, dropped))
    runtime = NamespaceRuntime(machines)
    assert MachineCgroup(kept_dir.name, runtime.cgroup_version).exists()

    agent = procs.agent(HOST, address, machines, 2)
    wait_for("the adopted rollout to finish", lambda: final(address, kept) is not None)
    done = final(address, kept)
    assert done is not None
    assert done.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, done.error
    assert done.attempts == 1  # the same attempt went on: no retry
    assert [r.index for r in done.results] == [0, 1, 2]
    assert done.results[0].stdout == b"first\n"
    assert done.results[1].stdout == b"resumed\n"  # ran again, in the same machine
    assert done.results[2].stdout.strip() == b"1"  # step 0 ran exactly once
    assert not kept_dir.exists()  # deleted once the attempt finished

    # The cancelled rollout's machine went at once, when the restarted agent reconciled.
    assert not dropped_dir.exists()
    assert not MachineCgroup(dropped_dir.name, runtime.cgroup_version).exists()
    wait_for("the cancelled rollout to end", lambda: final(address, dropped) is not None, 60)
    # ...without waiting out its lease: the restarted agent said it holds it no more.
    ended = final(address, dropped)
    assert ended is not None and ended.state == types_pb2.ROLLOUT_STATE_CANCELLED

    with Session(ledger.engine) as s:
        adopted = [e for e in s.exec(select(EventRow)) if e.kind == "adopted"]
    ledger.engine.dispose()
    assert [e.rollout_id for e in adopted] == [kept]
    assert "adopted by cpu-restart" in adopted[0].message

    agent.stop()
    assert [d for d in machines.glob("*/*") if d.is_dir()] == []
    assert not MachineCgroup(kept_dir.name, runtime.cgroup_version).exists()
    assert list((tmp_path / "journal" / HOST).glob("*.json")) == []
