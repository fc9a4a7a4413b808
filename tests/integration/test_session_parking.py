"""Sessions that park and move, end to end: a real server, agents on the namespace runtime,
real files in the sessions' machines. A parked session resumed on another host has its files;
a fork of a parked session has them; a session on a draining host is resumed elsewhere; an
idle session parks (or closes, where it asked to)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from fleet.api.pb import fleet_pb2
from fleet.core.lifecycle import RolloutState
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from fleet.ledger.base import DRAINING
from fleet.ledger.parks import RESUMES_LABEL
from fleet.runtime.base import Machine, MachineSpec
from tests.integration.session_support import (
    SMOLFILE,
    WRITE,
    listed,
    open_request,
    parked_session,
    session_fleet,
    shell,
    shell_when_ready,
    until_listed,
)


@pytest.mark.sandbox
async def test_parked_session_resumes_elsewhere_forks_and_moves_off_a_draining_host(
    tmp_path: Path, images: ImageStore
) -> None:
    async with session_fleet(tmp_path, images, "cpu-a", "cpu-b") as (h, stub):
        opened, written, parked = await parked_session(stub)
        assert (parked.id, parked.state) == (opened.id, "PARKED")
        assert parked.layer_digest.startswith("sha256:") and parked.layer_size > 0
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await shell(stub, opened.id, "true")
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "parked" in (refused.value.details() or "")
        # Parking again is answered as it stands.
        again = await stub.ParkSession(fleet_pb2.ParkSessionRequest(session_id=opened.id))
        assert (again.state, again.layer_digest) == ("PARKED", parked.layer_digest)

        # Its first host goes away: the resume can only land on the other.
        await h.stop_agent(opened.host_id)
        other = ({"cpu-a", "cpu-b"} - {opened.host_id}).pop()
        resumed = await stub.ResumeSession(
            fleet_pb2.ResumeSessionRequest(session_id=opened.id, ready_timeout_s=120)
        )
        assert (resumed.id, resumed.state, resumed.host_id) == (opened.id, "OPEN", other)
        assert await shell(stub, opened.id, "cat /work/data.txt") == written

        # A fork of the session once parked again has its files, on a machine of its own.
        await shell(stub, opened.id, "echo more > /work/more.txt")
        await stub.ParkSession(fleet_pb2.ParkSessionRequest(session_id=opened.id))
        forks = await stub.ForkSession(
            fleet_pb2.ForkSessionRequest(session_id=opened.id, count=1, ready_timeout_s=120)
        )
        [fork] = forks.sessions
        assert fork.id != opened.id and fork.state == "OPEN"
        seen = await shell(stub, fork.id, "cat /work/data.txt /work/more.txt")
        assert seen == written + b"more\n"
        await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=fork.id))
        assert (await listed(stub, opened.id)).state == "PARKED"  # the fork took nothing

        # Resumed on the one host left, which then drains: the session moves to a new host.
        resumed = await stub.ResumeSession(
            fleet_pb2.ResumeSessionRequest(session_id=opened.id, ready_timeout_s=120)
        )
        assert resumed.host_id == other
        await h.start_agent("cpu-c", HostClass.CPU, slots=4)
        await h.server.core.db(
            h.server.core.ledger.set_host_state, other, DRAINING, time.time() + 300
        )
        moved = await until_listed(stub, opened.id, "OPEN", "cpu-c")
        assert moved.id == opened.id
        assert await shell_when_ready(stub, opened.id, "cat /work/data.txt /work/more.txt") == seen

        closed = await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=opened.id))
        assert closed.state == "CLOSED"
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await stub.ResumeSession(fleet_pb2.ResumeSessionRequest(session_id=opened.id))
        assert gone.value.code() == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.sandbox
async def test_an_idle_session_parks_unless_it_asked_to_close(
    tmp_path: Path, images: ImageStore
) -> None:
    async with session_fleet(tmp_path, images, "cpu-a") as (_, stub):
        parks, closes = [
            await stub.OpenSession(open_request(idle_timeout_s=3, on_idle=on_idle))
            for on_idle in ("", "close")
        ]
        written = await shell(stub, parks.id, WRITE)
        await shell(stub, closes.id, WRITE)
        parked = await until_listed(stub, parks.id, "PARKED")
        assert parked.layer_digest.startswith("sha256:")
        assert (await until_listed(stub, closes.id, "CLOSED")).layer_digest == ""
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ResumeSession(fleet_pb2.ResumeSessionRequest(session_id=closes.id))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        resumed = await stub.ResumeSession(
            fleet_pb2.ResumeSessionRequest(session_id=parks.id, ready_timeout_s=120)
        )
        assert resumed.state == "OPEN"
        assert await shell(stub, parks.id, "cat /work/data.txt") == written
        await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=parks.id))

        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.OpenSession(fleet_pb2.OpenSessionRequest(smolfile=SMOLFILE, on_idle="sleep"))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "on_idle" in (bad.value.details() or "")


@pytest.mark.sandbox
async def test_a_resume_that_fails_before_its_machine_starts_leaves_the_session_parked(
    tmp_path: Path, images: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each resume fails before a machine is made: its layer gone from the blob store, then
    refused as it arrives (other bytes under its digest), then the host failing to make the
    machine from it. The session stays parked with its layer each time, and the failure is on
    the resume's rollout. With the layer back, the session resumes with its files."""
    async with session_fleet(tmp_path, images) as (h, stub):
        agent = await h.start_agent("cpu-a", HostClass.CPU, slots=4)
        core = h.server.core
        opened, written, parked = await parked_session(stub)
        blob = core.blobs.path(parked.layer_digest)
        kept = tmp_path / "layer-kept"
        blob.rename(kept)
        make = agent.runtime.create

        async def cannot_make(spec: MachineSpec, copy_of: Path | None = None) -> Machine:
            if copy_of is not None:
                raise RuntimeError("the host could not make the machine")
            return await make(spec)

        failed: list[str] = []
        for fault, why in (
            ("missing", "could not be fetched"),
            ("corrupt", "does not verify"),
            ("host", "the host could not make the machine"),
        ):
            if fault == "corrupt":
                blob.write_bytes(b"not the layer")
            if fault == "host":
                blob.unlink()
                kept.rename(blob)
                monkeypatch.setattr(agent.runtime, "create", cannot_make)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ResumeSession(
                    fleet_pb2.ResumeSessionRequest(session_id=opened.id, ready_timeout_s=120)
                )
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            said = refused.value.details() or ""
            assert why in said and "the session is parked: resume it again" in said, said
            seen = await listed(stub, opened.id)
            assert (seen.state, seen.layer_digest) == ("PARKED", parked.layer_digest)
            assert seen.layer_size == parked.layer_size
            resumes, _ = await core.db(
                core.ledger.list_rollouts, 50, "", {RESUMES_LABEL: opened.id}
            )
            [resume] = [r for r in resumes if r.id not in failed]
            assert resume.state == RolloutState.FAILED and why in resume.error
            failed.append(resume.id)
        park = await core.db(core.ledger.session_park, opened.id)
        assert park is not None and park.rollout_id == opened.id and park.state == "PARKED"

        monkeypatch.setattr(agent.runtime, "create", make)
        resumed = await stub.ResumeSession(
            fleet_pb2.ResumeSessionRequest(session_id=opened.id, ready_timeout_s=120)
        )
        assert (resumed.id, resumed.state) == (opened.id, "OPEN")
        assert await shell(stub, opened.id, "cat /work/data.txt") == written
