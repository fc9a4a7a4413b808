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
from fleet.api.pb import fleet_pb2, fleet_pb2_grpc, host_pb2, types_pb2
from fleet.core.errors import NotFound
from fleet.core.lifecycle import Outcome
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
from fleet.ledger.parks import RESUMES_LABEL
from fleet.ledger.retention import purge_finished, referenced_blobs
from fleet.ledger.store import Ledger
from tests.integration.harness import Harness, harness, namespace_runtime
from tests.integration.test_session_parking import (
    SMOLFILE,
    WRITE,
    _listed,
    _shell,
    _shell_when_ready,
    _until_listed,
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


def _open(idle_timeout_s: float = 0) -> fleet_pb2.OpenSessionRequest:
    return fleet_pb2.OpenSessionRequest(
        smolfile=SMOLFILE, smolfile_name="s.smolfile", idle_timeout_s=idle_timeout_s
    )


@pytest.mark.sandbox
async def test_parked_sessions_outlive_retention_until_they_are_closed(
    tmp_path: Path, images: ImageStore
) -> None:
    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU, slots=4)
        ledger, blobs = h.server.core.ledger, h.server.core.blobs
        stub = fleet_pb2_grpc.SessionServiceStub(h.channel)
        called = await stub.OpenSession(_open())
        idle = await stub.OpenSession(_open(idle_timeout_s=3))
        closed = await stub.OpenSession(_open())
        called_wrote = await _shell(stub, called.id, WRITE)
        idle_wrote = await _shell(stub, idle.id, WRITE)
        await _shell(stub, closed.id, WRITE)
        await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=closed.id))
        parked = await stub.ParkSession(fleet_pb2.ParkSessionRequest(session_id=called.id))
        idled = await _until_listed(stub, idle.id, "PARKED")  # (parked by its host: no row)
        assert await h.server.core.db(ledger.session_park, idle.id) is None

        # Only the closed session goes; both parked ones keep their rollout and their layer.
        assert await _retain(h) == 1
        assert await _gone(h, closed.id)
        for session, layer in ((called, parked.layer_digest), (idle, idled.layer_digest)):
            assert layer.startswith("sha256:") and blobs.exists(layer)
            seen = await _listed(stub, session.id)
            assert (seen.state, seen.layer_digest) == ("PARKED", layer)

        # Both resume with their files. The idle one parks again from its resume.
        await stub.ResumeSession(
            fleet_pb2.ResumeSessionRequest(session_id=idle.id, ready_timeout_s=120)
        )
        assert await _shell(stub, idle.id, "cat /work/data.txt") == idle_wrote
        idled = await _until_listed(stub, idle.id, "PARKED")
        await stub.ResumeSession(
            fleet_pb2.ResumeSessionRequest(session_id=called.id, ready_timeout_s=120)
        )
        assert await _shell(stub, called.id, "cat /work/data.txt") == called_wrote
        park = await h.server.core.db(ledger.session_park, called.id)
        assert park is not None and park.rollout_id != called.id
        resume = await h.server.core.db(ledger.get, park.rollout_id)
        assert resume.manifest.requirements.isolation == Isolation.NAMESPACE

        # Their first rollouts ended long ago; one is open on a resume, the other parked from
        # one: retention keeps both sessions whole.
        assert await _retain(h) == 0
        assert await _shell(stub, called.id, "cat /work/data.txt") == called_wrote
        seen = await _listed(stub, idle.id)
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
        assert await _shell(stub, fork.id, "cat /work/data.txt") == idle_wrote

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
    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU, slots=4)
        await h.start_agent("cpu-b", HostClass.CPU, slots=4)
        stub = fleet_pb2_grpc.SessionServiceStub(h.channel)
        opened = await stub.OpenSession(_open())
        wrote = await _shell(stub, opened.id, WRITE)
        other = ({"cpu-a", "cpu-b"} - {opened.host_id}).pop()
        await h.server.core.db(
            h.server.core.ledger.set_host_state, opened.host_id, DRAINING, time.time() + 300
        )
        await _until_listed(stub, opened.id, "OPEN", other)
        assert await _shell_when_ready(stub, opened.id, "cat /work/data.txt") == wrote

        # The rollout the drain parked is the session's first: kept while its resume holds it.
        assert await _retain(h) == 0
        assert await _shell(stub, opened.id, "cat /work/data.txt") == wrote
        await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=opened.id))
        assert await _retain(h) == 2
        assert await _gone(h, opened.id)


@pytest.mark.sandbox
async def test_a_parked_session_stays_parked_where_no_host_can_use_its_layer(
    tmp_path: Path, images: ImageStore
) -> None:
    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU, slots=4)
        stub = fleet_pb2_grpc.SessionServiceStub(h.channel)
        opened = await stub.OpenSession(_open())
        await _shell(stub, opened.id, WRITE)
        parked = await stub.ParkSession(fleet_pb2.ParkSessionRequest(session_id=opened.id))

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
        seen = await _listed(stub, opened.id)
        assert (seen.state, seen.layer_digest) == ("PARKED", parked.layer_digest)


T0 = datetime(2030, 1, 1, tzinfo=UTC).timestamp()
TTL = 10.0


def _layer(n: int) -> str:
    return f"sha256:{n:064x}"


class _Sessions:
    """Sessions written to a ledger as the server writes them: each rollout submitted,
    claimed by cpu-1 and ended (with a stored layer, as a park ends it, or without)."""

    def __init__(self, ledger: Ledger) -> None:
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

    def end(self, rollout_id: str, layer: str = "") -> None:
        work_id, token = self.work[rollout_id]
        outputs = (OutputArtifact(path=SESSION_LAYER_OUTPUT, digest=layer, size=1),)
        report = Completion(
            work_id=work_id, fencing_token=token, outcome=Outcome.SUCCEEDED,
            runtime="namespace", device="cpu", outputs=outputs if layer else (),
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
    host = HostCapabilities(
        host_id="cpu-1", host_class=HostClass.CPU, runtime=RuntimeKind.NAMESPACE,
        isolation=Isolation.NAMESPACE, cpus=2, memory_mib=1024, cuda_devices=0,
    )  # fmt: skip
    ledger.register_host(host, T0)
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
