"""Parked sessions and retention, end to end: a real server, agents on the namespace runtime,
the real ledger and blob store, retention run with every rollout so far older than its cutoff.

A session that is not over (parked by its caller, by idleness or by a drain, or open on a
resume) keeps what it needs: the rollout that stores its layer, its first rollout, and the
layer's blob; a closed session's rollouts and layer go as any others. A resume (or a fork of a
parked session) requires a host of the namespace runtime, which alone can use the layer, and
where none is registered it is refused before anything is submitted: the session stays
parked."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest

import fleet
from fleet.api.pb import fleet_pb2, host_pb2, types_pb2
from fleet.core.errors import NotFound
from fleet.core.lifecycle import Outcome, RolloutState
from fleet.core.manifest import (
    SESSION_LAYER_OUTPUT,
    OutputArtifact,
    SessionSpec,
    SubmitRequest,
    build_manifest,
    validate_request,
)
from fleet.core.placement import HostCapabilities, HostClass, Isolation, RuntimeKind
from fleet.core.retry import RetryPolicy
from fleet.core.rollout import Completion
from fleet.image.store import ImageStore
from fleet.ledger.base import DRAINING
from fleet.ledger.parks import RESUMES_LABEL, session_state
from fleet.ledger.retention import purge_finished, referenced_blobs
from fleet.ledger.store import Ledger
from tests.integration.harness import Harness
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


async def _retain(h: Harness) -> int:
    """Retention as the server runs it, with every rollout ended so far past its cutoff: the
    ledger purged, then the blobs no remaining rollout (or park) names collected. Returns how
    many rollouts it removed."""
    core = h.server.core
    cutoff = time.time() + 1
    removed = await core.db(purge_finished, core.ledger, cutoff)
    await core.db(lambda: core.blobs.collect_garbage(referenced_blobs(core.ledger), cutoff))
    return removed


async def _gone(h: Harness, rollout_id: str) -> bool:
    try:
        await h.server.core.db(h.server.core.ledger.get, rollout_id)
    except NotFound:
        return True
    return False


@pytest.mark.sandbox
async def test_parked_sessions_outlive_retention_until_they_are_closed(
    tmp_path: Path, images: ImageStore
) -> None:
    async with session_fleet(tmp_path, images, "cpu-a") as (h, stub):
        ledger, blobs = h.server.core.ledger, h.server.core.blobs
        called = await stub.OpenSession(open_request())
        idle = await stub.OpenSession(open_request(idle_timeout_s=3))
        closed = await stub.OpenSession(open_request())
        called_wrote = await shell(stub, called.id, WRITE)
        idle_wrote = await shell(stub, idle.id, WRITE)
        await shell(stub, closed.id, WRITE)
        await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=closed.id))
        parked = await stub.ParkSession(fleet_pb2.ParkSessionRequest(session_id=called.id))
        idled = await until_listed(stub, idle.id, "PARKED")  # (parked by its host: no row)
        assert await h.server.core.db(ledger.session_park, idle.id) is None

        # Only the closed session goes; both parked ones keep their rollout and their layer.
        assert await _retain(h) == 1
        assert await _gone(h, closed.id)
        for session, layer in ((called, parked.layer_digest), (idle, idled.layer_digest)):
            assert layer.startswith("sha256:") and blobs.exists(layer)
            seen = await listed(stub, session.id)
            assert (seen.state, seen.layer_digest) == ("PARKED", layer)

        # Both resume with their files. The idle one parks again from its resume.
        await stub.ResumeSession(
            fleet_pb2.ResumeSessionRequest(session_id=idle.id, ready_timeout_s=120)
        )
        assert await shell(stub, idle.id, "cat /work/data.txt") == idle_wrote
        idled = await until_listed(stub, idle.id, "PARKED")
        await stub.ResumeSession(
            fleet_pb2.ResumeSessionRequest(session_id=called.id, ready_timeout_s=120)
        )
        assert await shell(stub, called.id, "cat /work/data.txt") == called_wrote
        park = await h.server.core.db(ledger.session_park, called.id)
        assert park is not None and park.rollout_id != called.id
        resume = await h.server.core.db(ledger.get, park.rollout_id)
        assert resume.manifest.requirements.isolation == Isolation.NAMESPACE

        # Their first rollouts ended long ago; one is open on a resume, the other parked from
        # one: retention keeps both sessions whole.
        assert await _retain(h) == 0
        assert await shell(stub, called.id, "cat /work/data.txt") == called_wrote
        seen = await listed(stub, idle.id)
        assert (seen.state, seen.layer_digest) == ("PARKED", idled.layer_digest)
        assert blobs.exists(idled.layer_digest)

        # A fork of the parked one starts from its layer, on a namespace host too.
        [fork] = (
            await stub.ForkSession(
                fleet_pb2.ForkSessionRequest(session_id=idle.id, count=1, ready_timeout_s=120)
            )
        ).sessions
        copy = await h.server.core.db(ledger.get, fork.id)
        assert copy.manifest.requirements.isolation == Isolation.NAMESPACE
        assert await shell(stub, fork.id, "cat /work/data.txt") == idle_wrote

        # Closed, they go as any rollouts do: each its first and its resume (and the fork),
        # with their layers.
        for session in (called, idle, fork):
            await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=session.id))
        assert await _retain(h) == 5
        for session in (called, idle):
            assert await _gone(h, session.id)
            assert await h.server.core.db(ledger.session_park, session.id) is None
        assert not blobs.exists(parked.layer_digest) and not blobs.exists(idled.layer_digest)


@pytest.mark.sandbox
async def test_a_session_a_drain_moved_outlives_retention(
    tmp_path: Path, images: ImageStore
) -> None:
    async with session_fleet(tmp_path, images, "cpu-a", "cpu-b") as (h, stub):
        opened = await stub.OpenSession(open_request())
        wrote = await shell(stub, opened.id, WRITE)
        other = ({"cpu-a", "cpu-b"} - {opened.host_id}).pop()
        await h.server.core.db(
            h.server.core.ledger.set_host_state, opened.host_id, DRAINING, time.time() + 300
        )
        await until_listed(stub, opened.id, "OPEN", other)
        assert await shell_when_ready(stub, opened.id, "cat /work/data.txt") == wrote

        # The rollout the drain parked is the session's first: kept while its resume holds it.
        assert await _retain(h) == 0
        assert await shell(stub, opened.id, "cat /work/data.txt") == wrote
        await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=opened.id))
        assert await _retain(h) == 2
        assert await _gone(h, opened.id)


@pytest.mark.sandbox
async def test_a_parked_session_stays_parked_where_no_host_can_use_its_layer(
    tmp_path: Path, images: ImageStore
) -> None:
    async with session_fleet(tmp_path, images, "cpu-a") as (h, stub):
        opened, _, parked = await parked_session(stub)

        # The class's one host comes back running microVMs: none can unpack the layer.
        await h.stop_agent("cpu-a")
        caps = host_pb2.Capabilities(
            runtime=types_pb2.RUNTIME_KIND_SMOL, isolation=types_pb2.ISOLATION_VM, cpus=1
        )
        await h.hosts.RegisterHost(
            host_pb2.RegisterHostRequest(
                request_id=uuid.uuid4().hex, host_id="cpu-a", host_class=types_pb2.HOST_CLASS_CPU,
                capabilities=caps, agent_version=fleet.__version__,
            )
        )  # fmt: skip
        before = await h.count()
        with pytest.raises(grpc.aio.AioRpcError) as resume:
            await stub.ResumeSession(
                fleet_pb2.ResumeSessionRequest(session_id=opened.id, ready_timeout_s=3)
            )
        with pytest.raises(grpc.aio.AioRpcError) as fork:
            await stub.ForkSession(
                fleet_pb2.ForkSessionRequest(session_id=opened.id, count=1, ready_timeout_s=3)
            )
        for refused in (resume.value, fork.value):
            assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "namespace runtime" in (refused.details() or "")
            assert opened.id in (refused.details() or "")
        assert await h.count() == before  # nothing was submitted
        seen = await listed(stub, opened.id)
        assert (seen.state, seen.layer_digest) == ("PARKED", parked.layer_digest)


T0 = datetime(2030, 1, 1, tzinfo=UTC).timestamp()
TTL = 10.0


def _layer(n: int) -> str:
    return f"sha256:{n:064x}"


class _Sessions:
    """Sessions written to a ledger as the server writes them: each rollout submitted,
    claimed by cpu-1 (a namespace host, registered here) and ended (with a stored layer, as a
    park ends it, or without)."""

    def __init__(self, ledger: Ledger) -> None:
        host = HostCapabilities(
            host_id="cpu-1", host_class=HostClass.CPU, runtime=RuntimeKind.NAMESPACE,
            isolation=Isolation.NAMESPACE, cpus=2, memory_mib=1024, cuda_devices=0,
        )  # fmt: skip
        ledger.register_host(host, T0)
        self.ledger = ledger
        self.at = T0
        self.work: dict[str, tuple[str, int]] = {}
        """Each rollout's lease: (work id, fencing token)."""

    def start(self, key: str, resumes: str = "", layer: str = "") -> str:
        labels = {RESUMES_LABEL: resumes} if resumes else {"fleet.session": "1"}
        session = SessionSpec(layer=layer, layer_size=1 if layer else 0)
        request = SubmitRequest(
            idempotency_key=key, smolfile=SMOLFILE, steps=(), session=session,
            labels=labels, retry=RetryPolicy(max_attempts=1),
        )  # fmt: skip
        now = datetime.fromtimestamp(T0, UTC)
        manifest = build_manifest(request, validate_request(request, now), "sha256:img", now)
        rollout, _ = self.ledger.submit(request, manifest, T0)
        self.at += 1
        [a] = self.ledger.claim("cpu-1", 1, self.at, TTL)
        assert a.rollout_id == rollout.id
        self.work[rollout.id] = (a.work_id, a.fencing_token)
        return str(rollout.id)

    def end(
        self, rollout_id: str, layer: str = "", outcome: Outcome = Outcome.SUCCEEDED,
        *, artifact_failed: bool = False,
    ) -> None:  # fmt: skip
        work_id, token = self.work[rollout_id]
        outputs = (OutputArtifact(path=SESSION_LAYER_OUTPUT, digest=layer, size=1),)
        report = Completion(
            work_id=work_id, fencing_token=token, outcome=outcome, runtime="namespace",
            device="cpu", outputs=outputs if layer else (), artifact_failed=artifact_failed,
            error="" if outcome == Outcome.SUCCEEDED else f"{outcome.value.lower()} here",
        )  # fmt: skip
        self.at += 1
        self.ledger.complete("cpu-1", report, self.at)

    def parked(self, key: str, layer: str, *, by_call: bool = True) -> str:
        session = self.start(key)
        self.end(session, layer)
        if by_call:  # (one its host parked when idle has no row)
            self.ledger.record_park(session, session, layer, 1, "cpu-1", self.at)
        return session

    def resumed(self, session: str, key: str, layer: str) -> str:
        rollout = self.start(key, resumes=session, layer=layer)
        self.ledger.record_resume(session, rollout, layer, 1, "cpu-1", self.at)
        return rollout


def test_retention_keeps_every_session_not_over_on_every_backend(ledger: Ledger) -> None:
    """Each way a session parks, resumes and closes, in the ledger alone: retention with every
    rollout past its cutoff removes exactly the rollouts of sessions that are over, and the
    rollouts a session has moved on from."""
    s = _Sessions(ledger)
    idle = s.parked("idle", _layer(1), by_call=False)
    called = s.parked("called", _layer(2))
    closed_parked = s.parked("closed-parked", _layer(3))
    ledger.record_park_closed(closed_parked, s.at)
    closed = s.start("closed")
    s.end(closed)
    open_on_resume = s.parked("open-on-resume", _layer(4))
    running = s.resumed(open_on_resume, "open-on-resume/1", _layer(4))
    parked_again = s.parked("parked-again", _layer(5))
    parked_resume = s.resumed(parked_again, "parked-again/1", _layer(5))
    s.end(parked_resume, _layer(6))  # (idle on its resume: its host parked it)
    closed_resumed = s.parked("closed-resumed", _layer(7))
    closed_resume = s.resumed(closed_resumed, "closed-resumed/1", _layer(7))
    s.end(closed_resume)
    moved_on = s.parked("moved-on", _layer(8))
    left_behind = s.resumed(moved_on, "moved-on/1", _layer(8))
    s.end(left_behind, _layer(9))
    newest = s.resumed(moved_on, "moved-on/2", _layer(9))

    assert purge_finished(ledger, s.at + 1000) == 5
    for gone in (closed_parked, closed, closed_resumed, closed_resume, left_behind):
        with pytest.raises(NotFound):
            ledger.get(gone)
    for kept in (idle, called, open_on_resume, running, parked_again, parked_resume, moved_on,
                 newest):  # fmt: skip
        ledger.get(kept)
    for session in (closed_parked, closed_resumed):
        assert ledger.session_park(session) is None
    assert ledger.session_park(moved_on) is not None
    assert {_layer(n) for n in (1, 2, 6, 9)} <= referenced_blobs(ledger)
    assert not {_layer(n) for n in (3, 7)} & referenced_blobs(ledger)


def test_a_resume_that_failed_before_its_machine_started_parks_again(ledger: Ledger) -> None:
    """A resume whose agent reports the layer's failure (fetched, unpacked or made into a
    machine) parks its session again on the rollout that stores the layer, which retention
    then keeps with the layer; one that failed otherwise (its machine ran) ends it FAILED. A
    fork of a parked layer that fails so has no session to park again: it fails."""
    s = _Sessions(ledger)
    called = s.parked("called", _layer(1))
    idle = s.parked("idle", _layer(2), by_call=False)
    ran = s.parked("ran", _layer(3))
    for session, layer, outcome, before_start in (
        (called, 1, Outcome.TRANSIENT_ERROR, True),
        (idle, 2, Outcome.INCOMPATIBLE, True),
        (ran, 3, Outcome.TRANSIENT_ERROR, False),
    ):
        resume = s.resumed(session, f"{session}/1", _layer(layer))
        s.end(resume, outcome=outcome, artifact_failed=before_start)
        assert ledger.get(resume).state == RolloutState.FAILED
        assert f"{outcome.value.lower()} here" in ledger.get(resume).error
    fork = s.start("fork", layer=_layer(1))
    s.end(fork, outcome=Outcome.TRANSIENT_ERROR, artifact_failed=True)

    for session, layer in ((called, 1), (idle, 2)):
        park = ledger.session_park(session)
        assert park is not None
        assert (park.rollout_id, park.state) == (session, "PARKED")
        assert park.layer_digest == _layer(layer)
        assert session_state(ledger.get(park.rollout_id), park) == "PARKED"
    park = ledger.session_park(ran)
    assert park is not None and park.state == "RESUMED" and park.rollout_id != ran
    assert session_state(ledger.get(park.rollout_id), park) == "FAILED"
    assert ledger.get(fork).state == RolloutState.FAILED and ledger.session_park(fork) is None

    # The failed resumes, the failed session and the fork go; the parked sessions stay whole.
    assert purge_finished(ledger, s.at + 1000) == 5
    for session in (called, idle):
        ledger.get(session)
    assert {_layer(1), _layer(2)} <= referenced_blobs(ledger)
    assert _layer(3) not in referenced_blobs(ledger)
