"""The gRPC API in-process: submit, get, list, watch with resume, cancel, bad input, health."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import urllib.request
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from structlog.testing import capture_logs

import fleet
from fleet.api.pb import fleet_pb2, host_pb2, types_pb2
from fleet.core.coalesce import Coalescer
from fleet.core.placement import HostCapabilities, HostClass, Isolation, RuntimeKind
from fleet.image.store import ImageStore
from fleet.ledger.leases import Claim
from fleet.runtime.netns import NetConfig
from fleet.server.app import ServerConfig
from fleet.server.core import Core
from tests.acceptance.procs import FLEET
from tests.integration.harness import harness, namespace_runtime, request
from tests.networld import networld


def go(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


@pytest.mark.sandbox
async def test_submit_runs_and_get_shows_results(tmp_path: Path, images: ImageStore) -> None:
    """A submitted rollout runs on a cpu agent; get returns each step's exit code and output."""

    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        reply = await h.fleet.SubmitRollout(
            request(
                'image = "minimal"\n',
                ["sh", "-c", "echo out; echo err >&2"],
                ["python3", "-c", "print(2+2)"],
            )
        )
        assert reply.created and reply.rollout.state == types_pb2.ROLLOUT_STATE_QUEUED
        r = await h.wait_final(reply.rollout.id)

    assert r.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, r.error
    assert [s.exit_code for s in r.results] == [0, 0]
    assert r.results[0].stdout == b"out\n" and r.results[0].stderr == b"err\n"
    assert r.results[1].stdout == b"4\n"
    assert r.results[0].stdout_digest.startswith("sha256:")
    assert (
        r.host_id == "cpu-a" and r.runtime == types_pb2.RUNTIME_KIND_NAMESPACE and r.device == "cpu"
    )
    assert r.manifest.image_digest.startswith("sha256:") and r.manifest.digest.startswith("sha256:")


async def test_a_failing_step_stops_the_plan(tmp_path: Path, images: ImageStore) -> None:
    """A non-zero step fails the rollout; later steps do not run."""

    async with harness(tmp_path, images) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        reply = await h.fleet.SubmitRollout(
            request('image = "minimal"\n', ["sh", "-c", "exit 4"], ["true"])
        )
        r = await h.wait_final(reply.rollout.id)

    assert r.state == types_pb2.ROLLOUT_STATE_FAILED
    assert [s.exit_code for s in r.results] == [4] and "exited 4" in r.error


@pytest.mark.sandbox
async def test_cuda_rollout_waits_for_and_runs_only_on_a_gpu_agent(
    tmp_path: Path, images: ImageStore
) -> None:
    """With the gpu agent away, CUDA work stays queued while a cpu agent polls; it runs on gpu."""

    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await h.start_agent("gpu-a", HostClass.GPU)
        await h.stop_agent("gpu-a")
        await h.start_agent("cpu-a", HostClass.CPU)
        # The cpu agent's claims, counted as the ledger answers them: three that came after
        # the submission and found nothing it may take (not a sleep that hopes for as many).
        ledger = h.server.core.ledger
        claim, looked, seen = ledger._claim, threading.Event(), []

        def counting(db: Any, asked: Claim, now: float) -> Any:
            after = submitted.is_set()  # (a claim begun before the submission does not count)
            taken = claim(db, asked, now)
            if asked.host_id == "cpu-a" and after:
                seen.append(len(taken.assignments()))
                if len(seen) >= 3:
                    looked.set()
            return taken

        submitted = threading.Event()
        ledger._claim = counting  # type: ignore[method-assign]
        reply = await h.fleet.SubmitRollout(
            request('image = "minimal"\ncuda = true\n', ["sh", "-c", "echo $FLEET_DEVICE"])
        )
        submitted.set()
        assert await asyncio.to_thread(looked.wait, 30), "the cpu agent stopped claiming"
        assert seen[:3] == [0, 0, 0]
        waiting = (await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=reply.rollout.id))).state
        await h.start_agent("gpu-b", HostClass.GPU)
        r = await h.wait_final(reply.rollout.id)

    assert waiting == types_pb2.ROLLOUT_STATE_QUEUED
    assert r.state == types_pb2.ROLLOUT_STATE_SUCCEEDED and r.host_id == "gpu-b"
    assert r.host_class == types_pb2.HOST_CLASS_GPU
    assert (
        r.device == "cpu (no CUDA device here)"
        and r.results[0].stdout == b"cpu (no CUDA device here)\n"
    )


async def test_unservable_rollout_is_refused_at_submit(tmp_path: Path, images: ImageStore) -> None:
    """CUDA work with no gpu host registered is FAILED_PRECONDITION with a reason, not queued."""

    async with harness(tmp_path, images) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.fleet.SubmitRollout(request('image = "minimal"\ncuda = true\n'))
        vm = request(requirements=types_pb2.Requirements(isolation=types_pb2.ISOLATION_VM))
        with pytest.raises(grpc.aio.AioRpcError) as info_vm:
            await h.fleet.SubmitRollout(vm)
        assert "vm isolation" in (info_vm.value.details() or "")
        err, count = info.value, await h.count()

    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "needs a gpu-class host" in (err.details() or "") and count == 0


async def test_a_refusal_at_submit_sees_a_host_registered_a_moment_before(
    tmp_path: Path, images: ImageStore
) -> None:
    """Submissions check hosts they may have read a moment ago, but a refusal is decided on
    what the ledger holds now: a gpu host registered straight into the ledger (as through
    another server sharing it) is seen by the very next submission."""
    gpu = 'image = "minimal"\ncuda = true\n'

    async with harness(tmp_path, images) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        await h.fleet.SubmitRollout(request())  # the hosts read, and kept a moment
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await h.fleet.SubmitRollout(request(gpu))
        caps = HostCapabilities(
            host_id="gpu-elsewhere",
            host_class=HostClass.GPU,
            runtime=RuntimeKind.NAMESPACE,
            isolation=Isolation.NAMESPACE,
            cpus=2,
            memory_mib=4096,
            cuda_devices=1,
        )
        core = h.server.core
        await core.db(core.ledger.register_host, caps, time.time())
        reply = await h.fleet.SubmitRollout(request(gpu))
        code, created = refused.value.code(), reply.created

    assert code == grpc.StatusCode.FAILED_PRECONDITION and created


BAD_INPUTS = [
    (
        "malformed TOML",
        request('image = "minimal"\ncpus = [\n'),
        grpc.StatusCode.INVALID_ARGUMENT,
        "malformed TOML",
    ),
    (
        "unknown key",
        request('image = "minimal"\ncpu = 2\n'),
        grpc.StatusCode.INVALID_ARGUMENT,
        "test.smolfile:2: unknown key 'cpu'",
    ),
    (
        "wrong type",
        request('image = "minimal"\nmemory = "lots"\n'),
        grpc.StatusCode.INVALID_ARGUMENT,
        "key 'memory'",
    ),
    (
        "missing image",
        request('image = "no-such-image"\n'),
        grpc.StatusCode.FAILED_PRECONDITION,
        "image 'no-such-image' is not in the image store",
    ),
    (
        "empty argv",
        request('image = "minimal"\n', []),
        grpc.StatusCode.INVALID_ARGUMENT,
        "argv is empty",
    ),
    ("no key", request(key=" "), grpc.StatusCode.INVALID_ARGUMENT, "idempotency_key is empty"),
]


@pytest.mark.parametrize(
    ("what", "req", "code", "text"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS]
)
async def test_bad_input_is_refused_and_changes_nothing(
    tmp_path: Path,
    images: ImageStore,
    what: str,
    req: fleet_pb2.SubmitRolloutRequest,
    code: grpc.StatusCode,
    text: str,
) -> None:
    """Each bad submission gets its status and a message naming the problem; nothing is stored."""

    async with harness(tmp_path, images) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.fleet.SubmitRollout(req)
        err, count = info.value, await h.count()

    assert err.code() == code, err.details()
    assert text in (err.details() or "")
    assert count == 0


async def test_deadline_in_the_past_is_refused(tmp_path: Path, images: ImageStore) -> None:
    """A deadline already passed is INVALID_ARGUMENT and nothing is stored."""

    async with harness(tmp_path, images) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        req = request()
        req.deadline.FromDatetime(datetime.now(UTC) - timedelta(minutes=1))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.fleet.SubmitRollout(req)
        err, count = info.value, await h.count()

    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "in the past" in (err.details() or "")
    assert count == 0


async def test_oversized_request_is_refused(tmp_path: Path, images: ImageStore) -> None:
    """A request over the size limit gets RESOURCE_EXHAUSTED and stores nothing."""

    async with harness(tmp_path, images) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        errors = []
        for req in (
            request(
                'image = "minimal"\n', ["echo", "x" * (5 * 1024 * 1024)]
            ),  # over the wire limit
            request('image = "minimal"\n', ["echo", "x" * (300 * 1024)]),  # over the plan limit
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.fleet.SubmitRollout(req)
            errors.append(info.value)
        count = await h.count()

    assert [e.code() for e in errors] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    assert "larger than max" in (errors[0].details() or "")
    assert "over the" in (errors[1].details() or "")
    assert count == 0


async def test_idempotency_over_grpc(tmp_path: Path, images: ImageStore) -> None:
    """Same key and body returns the original; same key, other body is ALREADY_EXISTS."""

    async with harness(tmp_path, images) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        first = await h.fleet.SubmitRollout(request(key="same"))
        second = await h.fleet.SubmitRollout(request(key="same"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.fleet.SubmitRollout(request('image = "minimal"\n', ["false"], key="same"))
        a, b, created, err, count = (
            first.rollout.id,
            second.rollout.id,
            second.created,
            info.value,
            await h.count(),
        )

    assert a == b and not created and count == 1
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS and "body differs" in (err.details() or "")


async def test_watch_streams_events_in_order_and_resumes(
    tmp_path: Path, images: ImageStore
) -> None:
    """Watch ends at the final state; resuming after a sequence replays only what came after."""

    async with harness(tmp_path, images) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        reply = await h.fleet.SubmitRollout(request())
        events = [
            e
            async for e in h.fleet.WatchRollout(fleet_pb2.WatchRolloutRequest(id=reply.rollout.id))
        ]
        resumed = [
            e
            async for e in h.fleet.WatchRollout(
                fleet_pb2.WatchRolloutRequest(
                    id=reply.rollout.id, after_sequence=events[0].sequence
                )
            )
        ]

    assert [e.kind for e in events] == ["submitted", "leased", "succeeded"]
    assert [e.sequence for e in events] == sorted(e.sequence for e in events)
    assert events[-1].to_state == types_pb2.ROLLOUT_STATE_SUCCEEDED
    assert [e.sequence for e in resumed] == [e.sequence for e in events[1:]]


async def test_cancel_reaches_the_running_machine(tmp_path: Path, images: ImageStore) -> None:
    """Cancelling a running rollout stops its machine; it ends CANCELLED with partial results."""

    async with harness(tmp_path, images) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        reply = await h.fleet.SubmitRollout(
            request('image = "minimal"\n', ["echo", "first"], ["sleep", "600"])
        )
        for _ in range(200):
            r = await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=reply.rollout.id))
            if r.state == types_pb2.ROLLOUT_STATE_RUNNING:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        await h.fleet.CancelRollout(
            fleet_pb2.CancelRolloutRequest(request_id="c1", id=reply.rollout.id, reason="enough")
        )
        r = await h.wait_final(reply.rollout.id, timeout_s=20)

    assert r.state == types_pb2.ROLLOUT_STATE_CANCELLED
    assert r.results[0].stdout == b"first\n" and r.error == "enough"


async def test_step_timeout_fails_the_rollout(tmp_path: Path, images: ImageStore) -> None:
    """A step past its timeout is killed and the rollout fails saying so."""

    async with harness(tmp_path, images) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        req = request()
        req.steps[0].CopyFrom(types_pb2.Step(argv=["sleep", "100"], timeout_s=0.5))
        reply = await h.fleet.SubmitRollout(req)
        r = await h.wait_final(reply.rollout.id)

    assert r.state == types_pb2.ROLLOUT_STATE_FAILED and r.results[0].timed_out
    assert "timeout" in r.error


async def test_host_api_refuses_stale_tokens_with_aborted(
    tmp_path: Path, images: ImageStore
) -> None:
    """CompleteWork with a token that is not the lease's is ABORTED."""

    async with harness(tmp_path, images) as h:
        await h.register_host("h1")
        await h.fleet.SubmitRollout(request())
        claim = await h.hosts.ClaimWork(
            host_pb2.ClaimWorkRequest(request_id="c", host_id="h1", max_items=3, wait_s=1)
        )
        item = claim.items[0]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.hosts.CompleteWork(
                host_pb2.CompleteWorkRequest(
                    request_id="x",
                    host_id="h1",
                    work_id=item.work_id,
                    fencing_token=item.fencing_token + 1,
                    outcome=types_pb2.OUTCOME_SUCCEEDED,
                )
            )
        err = info.value

    assert err.code() == grpc.StatusCode.ABORTED and "stale fencing token" in (err.details() or "")


async def test_bad_host_registration_is_refused(tmp_path: Path, images: ImageStore) -> None:
    """RegisterHost without a class is INVALID_ARGUMENT naming the field."""

    async with harness(tmp_path, images) as h:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.hosts.RegisterHost(
                host_pb2.RegisterHostRequest(
                    request_id="r", host_id="h1", agent_version=fleet.__version__
                )
            )
        err = info.value

    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "host_class" in (err.details() or "")


async def test_bad_reclaim_requests_are_refused(tmp_path: Path, images: ImageStore) -> None:
    """ReclaimWork from an unregistered host, or naming a lease without a work id."""

    errors = []
    async with harness(tmp_path, images) as h:
        for request in (
            host_pb2.ReclaimWorkRequest(request_id="r1", host_id="nobody"),
            host_pb2.ReclaimWorkRequest(
                request_id="r2", host_id="nobody", leases=[host_pb2.LeaseRef(fencing_token=3)]
            ),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.hosts.ReclaimWork(request)
            errors.append(info.value)
    unregistered, empty = errors

    assert unregistered.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not registered" in (unregistered.details() or "")
    assert empty.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "work_id" in (empty.details() or "")


async def test_health_and_reflection(tmp_path: Path, images: ImageStore) -> None:
    """Standard health checking answers SERVING; reflection lists fleet's services."""

    async with harness(tmp_path, images) as h:
        health = await health_pb2_grpc.HealthStub(h.channel).Check(
            health_pb2.HealthCheckRequest(service="fleet.v1.FleetService")
        )
        stub = reflection_pb2_grpc.ServerReflectionStub(h.channel)
        replies = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = [s.name async for r in replies for s in r.list_services_response.service]
        status = health.status

    assert status == health_pb2.HealthCheckResponse.SERVING
    assert {"fleet.v1.FleetService", "fleet.v1.HostService"} <= set(names)


async def test_tenant_limit_refusal_carries_a_retry_hint(
    tmp_path: Path, images: ImageStore
) -> None:
    """Over the tenant's limit: RESOURCE_EXHAUSTED with retry-after-s in trailing metadata."""

    config = ServerConfig(max_active_per_tenant=1, lease_ttl_s=5, heartbeat_interval_s=0.5)
    async with harness(tmp_path, images, config) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        await h.fleet.SubmitRollout(request('image = "minimal"\n', ["sleep", "5"], tenant="t"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.fleet.SubmitRollout(request(tenant="t"))
        err = info.value

    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit" in (err.details() or "")
    assert float(dict(err.trailing_metadata() or ())["retry-after-s"]) > 0


async def test_stale_heartbeat_is_aborted_naming_the_work(
    tmp_path: Path, images: ImageStore
) -> None:
    """A heartbeat with a lease that is not current is ABORTED and names the stale work."""

    async with harness(tmp_path, images) as h:
        await h.register_host("h1")
        reply = await h.fleet.SubmitRollout(request(tenant="team-x"))
        claim = await h.hosts.ClaimWork(
            host_pb2.ClaimWorkRequest(request_id="c", host_id="h1", max_items=1, wait_s=1)
        )
        again = await h.hosts.ClaimWork(
            host_pb2.ClaimWorkRequest(request_id="c", host_id="h1", max_items=1, wait_s=1)
        )
        assert [i.fencing_token for i in again.items] == [i.fencing_token for i in claim.items]
        # The assignment names its tenant, first time and replayed (warm parents key by it).
        assert [i.tenant for i in [*claim.items, *again.items]] == ["team-x", "team-x"]
        item = claim.items[0]
        stale = host_pb2.LeaseRef(work_id=item.work_id, fencing_token=item.fencing_token + 5)
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await h.hosts.Heartbeat(
                host_pb2.HeartbeatRequest(
                    request_id="i",
                    host_id="h1",
                    images_cached=["not-a-digest"],
                    images_changed=True,
                )
            )
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "images_cached: at most 256 digests" in (bad.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.hosts.Heartbeat(
                host_pb2.HeartbeatRequest(request_id="b", host_id="h1", leases=[stale])
            )
        err, rollout = (
            info.value,
            await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=reply.rollout.id)),
        )

    assert err.code() == grpc.StatusCode.ABORTED
    assert dict(err.trailing_metadata() or ())["fleet-stale-work-ids"] in (err.details() or "")
    assert rollout.attempts == 1 and len(rollout.attempt_history) == 1


async def test_a_paused_server_keeps_the_leases_of_hosts_that_could_not_reach_it(
    tmp_path: Path, images: ImageStore
) -> None:
    """The server stops for longer than a lease (its event loop blocked: a VM paused, a stopped
    process) and its sweeper runs first on resuming, before any host could beat: the lease is
    kept, the host's next beat renews it, and a host that then stays silent still loses it."""
    config = ServerConfig(lease_ttl_s=3.0, heartbeat_interval_s=0.5, sweep_interval_s=0.1)
    async with harness(tmp_path, images, config) as h:
        await h.register_host("h1")
        reply = await h.fleet.SubmitRollout(request())
        claim = await h.hosts.ClaimWork(
            host_pb2.ClaimWorkRequest(request_id="c", host_id="h1", max_items=1, wait_s=1)
        )
        [item] = claim.items
        lease = host_pb2.LeaseRef(work_id=item.work_id, fencing_token=item.fencing_token)
        with capture_logs() as logs:
            # Blocks the loop on purpose: the server, its sweeper and this client all stop.
            time.sleep(6.0)  # noqa: ASYNC251
            await asyncio.sleep(0.5)  # the sweeper runs first, five times
        beat = await h.hosts.Heartbeat(
            host_pb2.HeartbeatRequest(request_id="b1", host_id="h1", leases=[lease])
        )
        assert [(r.work_id, r.fencing_token) for r in beat.renewed] == [
            (item.work_id, item.fencing_token)
        ]
        assert any(e["event"] == "sweeper_resumed_late" and e["late_s"] > 5 for e in logs)
        for _ in range(200):  # silent from now on: the lease expires (bounded: 10 s)
            rollout = await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=reply.rollout.id))
            if rollout.attempt_history and rollout.attempt_history[0].outcome == "LEASE_EXPIRED":
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"the silent host's lease never expired: {rollout}")


async def test_malformed_input_is_quarantined_not_retried(
    tmp_path: Path, images: ImageStore
) -> None:
    """A secret the agent cannot resolve is malformed input: quarantined after one attempt."""

    async with harness(tmp_path, images) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        smolfile = 'image = "minimal"\n[secrets]\nTOKEN = { from_env = "FLEET_TEST_UNSET_VAR" }\n'
        reply = await h.fleet.SubmitRollout(request(smolfile))
        r = await h.wait_final(reply.rollout.id)

    assert r.state == types_pb2.ROLLOUT_STATE_QUARANTINED and r.attempts == 1
    assert "FLEET_TEST_UNSET_VAR" in r.error
    assert [a.outcome for a in r.attempt_history] == ["MALFORMED_INPUT"]


@pytest.mark.sandbox
async def test_out_of_memory_is_reported_as_such(tmp_path: Path, images: ImageStore) -> None:
    """A step over its memory limit fails the rollout with an out-of-memory reason, not a crash."""

    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        hog = ["python3", "-c", "b = bytearray(400 * 1024 * 1024)"]
        reply = await h.fleet.SubmitRollout(request('image = "minimal"\nmemory = 96\n', hog))
        r = await h.wait_final(reply.rollout.id)

    assert r.state == types_pb2.ROLLOUT_STATE_FAILED
    assert "out of memory" in r.error and "96 MiB" in r.error
    assert [a.outcome for a in r.attempt_history] == ["STEP_FAILED"]


async def test_concurrent_completions_are_group_committed_each_judged_alone(
    tmp_path: Path, images: ImageStore
) -> None:
    """Completions arriving together are recorded together; a stale one among them is refused."""

    async with harness(tmp_path, images) as h:
        await h.register_host("h1")
        ids = [(await h.fleet.SubmitRollout(request())).rollout.id for _ in range(12)]
        claim = await h.hosts.ClaimWork(
            host_pb2.ClaimWorkRequest(request_id="c", host_id="h1", max_items=12, wait_s=1)
        )
        calls = [
            h.hosts.CompleteWork(
                host_pb2.CompleteWorkRequest(
                    request_id=f"x{i}",
                    host_id="h1",
                    work_id=item.work_id,
                    fencing_token=item.fencing_token + (1 if i == 3 else 0),
                    outcome=types_pb2.OUTCOME_SUCCEEDED,
                )
            )
            for i, item in enumerate(claim.items)
        ]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        states = [(await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=i))).state for i in ids]
        answers = list(answers)

    errors = [a for a in answers if isinstance(a, grpc.aio.AioRpcError)]
    assert len(errors) == 1 and errors[0].code() == grpc.StatusCode.ABORTED
    assert states.count(types_pb2.ROLLOUT_STATE_SUCCEEDED) == 11
    assert states.count(types_pb2.ROLLOUT_STATE_RUNNING) == 1


@contextlib.asynccontextmanager
async def writer_held(core: Core) -> AsyncIterator[asyncio.Future[None]]:
    """The ledger's one writing thread kept busy until the block ends: what needs it meanwhile
    waits (yields the holding call, done once released)."""
    busy, release = threading.Event(), threading.Event()

    def hold() -> None:
        busy.set()
        release.wait(30)

    held = asyncio.ensure_future(core.db(hold))
    assert await asyncio.to_thread(busy.wait, 30)
    try:
        yield held
    finally:
        release.set()
        await held


async def arrived(coalescer: Coalescer[Any, Any], n: int) -> None:
    """Until `n` items have reached the coalescer, in batches or waiting for one (bounded:
    10 s)."""
    for _ in range(500):
        if sum(coalescer.batches) + coalescer.waiting >= n:
            return
        await asyncio.sleep(0.02)


async def test_a_report_claims_the_next_work_for_the_slot_it_frees(
    tmp_path: Path, images: ImageStore
) -> None:
    """CompleteWork with claim_max_items stores the report, then leases the host more work in
    the same call; the same request again (a retry) answers the same lease, not a second one;
    with nothing queued it claims nothing, and without claim_max_items nothing is claimed."""

    async with harness(tmp_path, images) as h:
        await h.register_host("h1")
        for key in ("a", "b", "c"):
            await h.fleet.SubmitRollout(request(key=key))
        first = await h.hosts.ClaimWork(
            host_pb2.ClaimWorkRequest(request_id="c1", host_id="h1", max_items=1)
        )

        def report(item: host_pb2.WorkAssignment, rid: str, claim: int) -> Any:
            return h.hosts.CompleteWork(
                host_pb2.CompleteWorkRequest(
                    request_id=rid, host_id="h1", work_id=item.work_id,
                    fencing_token=item.fencing_token, outcome=types_pb2.OUTCOME_SUCCEEDED,
                    claim_max_items=claim,
                )
            )  # fmt: skip

        done = await report(first.items[0], "r1", 1)
        again = await report(first.items[0], "r1", 1)  # the reply was lost: sent again
        [second] = done.items
        plain = await report(second, "r2", 0)
        third = await h.hosts.ClaimWork(
            host_pb2.ClaimWorkRequest(request_id="c2", host_id="h1", max_items=5)
        )
        last = await report(third.items[0], "r3", 1)
        states = {
            r.idempotency_key: r.state
            for r in (await h.fleet.ListRollouts(fleet_pb2.ListRolloutsRequest())).rollouts
        }

    assert done.state == types_pb2.ROLLOUT_STATE_SUCCEEDED
    assert second.work_id != first.items[0].work_id
    assert [(i.work_id, i.fencing_token) for i in again.items] == [
        (second.work_id, second.fencing_token)
    ]
    assert list(plain.items) == [] and len(third.items) == 1  # the one left, claimed once
    assert list(last.items) == []
    assert states == dict.fromkeys(("a", "b", "c"), types_pb2.ROLLOUT_STATE_SUCCEEDED)


async def test_an_agent_takes_its_next_work_in_the_report_of_the_last(
    tmp_path: Path, images: ImageStore
) -> None:
    """An agent with one slot and three rollouts queued: each report brings the next rollout
    back with it (no claim of its own in between); the last report, with nothing queued,
    brings none, and the agent's claim loop takes the slot back."""

    async with harness(tmp_path, images) as h:
        await h.start_agent("cpu-a", HostClass.CPU, slots=1)
        with capture_logs() as logs:
            reply = await h.fleet.SubmitRollouts(
                fleet_pb2.SubmitRolloutsRequest(
                    rollouts=[request('image = "minimal"\n', ["sleep", "0.2"]) for _ in range(3)]
                )
            )
            done = [await h.wait_final(r.id) for r in reply.rollouts]
            for _ in range(100):  # (the last report's log line follows its rollout's end)
                if sum(e["event"] == "work_reported" for e in logs) == 3:
                    break
                await asyncio.sleep(0.05)
        reported = [e["claimed"] for e in logs if e["event"] == "work_reported"]
        # Then a fourth rollout is taken by the claim loop, the slot being free again.
        fourth = await h.fleet.SubmitRollout(request())
        last = await h.wait_final(fourth.rollout.id)

    assert [r.state for r in done] == [types_pb2.ROLLOUT_STATE_SUCCEEDED] * 3
    assert reported == [1, 1, 0]
    assert last.state == types_pb2.ROLLOUT_STATE_SUCCEEDED


async def test_claims_arriving_together_are_taken_in_one_transaction(
    tmp_path: Path, images: ImageStore
) -> None:
    """Six hosts claim while the ledger is busy: their claims wait together and are taken in
    one or two transactions, not six; each gets its own items, none twice, and an unknown
    host among them is refused alone."""

    async with harness(tmp_path, images) as h:
        hosts = [f"h{i}" for i in range(6)]
        for host in hosts:
            await h.register_host(host)
        for _ in range(12):
            await h.fleet.SubmitRollout(request())
        claims = h.server.host_servicer.claims.coalescer
        async with writer_held(h.server.core):  # until every claim has arrived
            calls = [
                asyncio.ensure_future(
                    h.hosts.ClaimWork(
                        host_pb2.ClaimWorkRequest(request_id=f"c-{host}", host_id=host, max_items=2)
                    )
                )
                for host in [*hosts, "ghost"]
            ]
            await arrived(claims, len(calls))
        answers = await asyncio.gather(*calls, return_exceptions=True)
        batches = list(claims.batches)

    *taken, ghost = answers
    assert isinstance(ghost, grpc.aio.AioRpcError)
    assert ghost.code() == grpc.StatusCode.FAILED_PRECONDITION and "ghost" in (
        ghost.details() or ""
    )
    work = [item.work_id for reply in taken for item in reply.items]  # type: ignore[union-attr]
    assert all(len(reply.items) == 2 for reply in taken)  # type: ignore[union-attr]
    assert len(work) == len(set(work)) == 12
    assert sum(batches) == len(calls) and len(batches) <= 2


async def test_submissions_arriving_together_are_stored_in_one_transaction(
    tmp_path: Path, images: ImageStore
) -> None:
    """Eight submissions arrive while the ledger is busy: they wait together and are stored
    in one or two transactions, not eight; each gets its own rollout, and one that reuses a
    key with another body is refused alone."""

    async with harness(tmp_path, images) as h:
        await h.register_host("h1")
        first = await h.fleet.SubmitRollout(request(key="taken"))
        submits = h.server.fleet_servicer.submits.coalescer
        before = list(submits.batches)  # (the first submission's)
        async with writer_held(h.server.core):  # until every submission has arrived
            requests = [request(key=f"k{i}") for i in range(7)]
            requests.insert(3, request('image = "minimal"\n', ["false"], key="taken"))
            calls = [asyncio.ensure_future(h.fleet.SubmitRollout(r)) for r in requests]
            await arrived(submits, sum(before) + len(calls))
        answers = await asyncio.gather(*calls, return_exceptions=True)
        batches = list(submits.batches)[len(before) :]
        listed = await h.fleet.ListRollouts(fleet_pb2.ListRolloutsRequest(page_size=50))

    refused = answers.pop(3)
    assert isinstance(refused, grpc.aio.AioRpcError)
    assert refused.code() == grpc.StatusCode.ALREADY_EXISTS
    assert first.rollout.id in (refused.details() or "")
    assert all(a.created for a in answers)  # type: ignore[union-attr]
    ids = {a.rollout.id for a in answers}  # type: ignore[union-attr]
    assert len(ids) == 7 and first.rollout.id not in ids
    assert {r.id for r in listed.rollouts} == ids | {first.rollout.id}
    assert sum(batches) == len(calls) and len(batches) <= 2


async def test_reads_are_answered_while_the_ledger_is_writing(
    tmp_path: Path, images: ImageStore
) -> None:
    """GetRollout, ListRollouts, WatchRollout and a /metrics scrape are answered while the
    ledger's writing thread is busy: reads run on their own threads, never queued behind (or
    holding up) writes."""

    def scrape(url: str) -> str:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return str(reply.read().decode())

    async with harness(tmp_path, images, ServerConfig(metrics_listen="127.0.0.1:0")) as h:
        await h.register_host("h1")
        submitted = (await h.fleet.SubmitRollout(request())).rollout
        async with writer_held(h.server.core) as held:  # until the reads are answered
            got = await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=submitted.id), timeout=10)
            listed = await h.fleet.ListRollouts(fleet_pb2.ListRolloutsRequest(), timeout=10)
            watch = h.fleet.WatchRollout(fleet_pb2.WatchRolloutRequest(id=submitted.id), timeout=10)
            first = await watch.read()
            watch.cancel()
            text = await asyncio.to_thread(
                scrape, f"http://127.0.0.1:{h.server.metrics_port}/metrics"
            )
            still_busy = not held.done()

    assert still_busy
    assert got.id == submitted.id and [r.id for r in listed.rollouts] == [submitted.id]
    assert first.kind == "submitted"
    assert "fleet_rollouts" in text


@pytest.mark.sandbox
async def test_refused_egress_reaches_the_ledger_api_and_cli(
    tmp_path: Path, images: ImageStore
) -> None:
    """A rollout's machine is refused a name and the metadata address: both are listed."""
    probe = (
        "import socket\n"
        "for name in ('other.test', 'svc.fleet.test'):\n"
        "    try: socket.getaddrinfo(name, 80, socket.AF_INET)\n"
        "    except OSError: pass\n"
        "s = socket.socket(); s.settimeout(3)\n"
        "try: s.connect(('169.254.169.254', 80))\n"
        "except OSError: pass\n"
    )

    with networld() as world:
        async with harness(tmp_path, images, runtime=namespace_runtime) as h:
            net = NetConfig(uplink_netns=world.uplink, dns_upstream=world.dns)
            await h.start_agent("cpu-a", HostClass.CPU, net=net)
            smolfile = 'image = "minimal"\n[network]\nallow_hosts = ["svc.fleet.test"]\n'
            reply = await h.fleet.SubmitRollout(request(smolfile, ["python3", "-c", probe]))
            r = await h.wait_final(reply.rollout.id)
            events = await h.fleet.ListEgressEvents(
                fleet_pb2.ListEgressEventsRequest(rollout_id=r.id)
            )
            reach = await h.fleet.ListRollouts(
                fleet_pb2.ListRolloutsRequest(could_reach="api.svc.fleet.test")
            )
            cli = await asyncio.create_subprocess_exec(
                *FLEET,
                "egress-events",
                "--plaintext",
                "--server",
                h.server.address,
                r.id,
                stdout=asyncio.subprocess.PIPE,
            )
            out, _ = await cli.communicate()
            events, reaching, table = list(events.events), len(reach.rollouts), out.decode()

    assert r.state == types_pb2.ROLLOUT_STATE_SUCCEEDED
    assert r.egress.mode == types_pb2.EgressPolicy.MODE_ALLOWLIST
    assert "nftables" in r.egress.enforced_by
    assert reaching == 1
    assert [(e.kind, e.destination) for e in events] == [
        ("dns", "other.test"),
        ("connect", "tcp://169.254.169.254:80"),
    ]
    assert all(e.rollout_id == r.id and e.attempt == 1 for e in events)
    assert "other.test" in table and "169.254.169.254" in table and "metadata" in table


@pytest.mark.sandbox
async def test_a_warm_rollout_that_reaches_out_gets_its_own_machine_and_namespace(
    tmp_path: Path, images: ImageStore
) -> None:
    """A warm parent's children have no network beyond their loopback: a `[branch]` rollout
    with an allowlist runs in its own machine instead, each step starting from the warm-up's state,
    and its refusals are its own."""
    smolfile = (
        'image = "minimal"\n[branch]\nenabled = true\n[network]\nallow_cidrs = ["10.9.9.0/24"]\n'
    )
    step = (
        "import socket\n"
        "page = socket.create_connection(('10.9.9.9', 8080), timeout=5).recv(100).decode()\n"
        "print(STATE + 1, page.strip())\n"
        "s = socket.socket(); s.settimeout(3)\n"
        "try: s.connect(('198.51.100.99', 8080))\n"
        "except OSError: pass\n"
    )

    with networld() as world:
        async with harness(tmp_path, images, runtime=namespace_runtime) as h:
            net = NetConfig(uplink_netns=world.uplink, dns_upstream=world.dns)
            await h.start_agent("cpu-a", HostClass.CPU, net=net)
            submit = request(smolfile)
            del submit.steps[:]
            submit.steps.extend(
                [
                    types_pb2.Step(name="warm-up", argv=["python3", "-c", "STATE = 41"]),
                    types_pb2.Step(name="work", argv=["python3", "-c", step], timeout_s=30),
                ]
            )
            reply = await h.fleet.SubmitRollout(submit)
            r = await h.wait_final(reply.rollout.id)
            events = await h.fleet.ListEgressEvents(
                fleet_pb2.ListEgressEventsRequest(rollout_id=r.id)
            )
            parents = [p.name for p in (tmp_path / "machines").glob("*/fleet-parent-*")]
            events = list(events.events)

    assert r.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, r.results[-1].stderr.decode()
    assert [res.name for res in r.results] == ["work"]  # the warm-up ran as part of it
    assert r.results[0].stdout.decode().strip() == "42 hello from 10.9.9.9"
    assert "not a warm parent's child" in r.egress.enforced_by
    assert parents == []
    assert [(e.kind, e.destination) for e in events] == [("connect", "tcp://198.51.100.99:8080")]


async def test_list_egress_events_refuses_bad_requests(tmp_path: Path, images: ImageStore) -> None:
    codes = []
    async with harness(tmp_path, images) as h:
        for rid in ("", "r-none"):
            try:
                await h.fleet.ListEgressEvents(fleet_pb2.ListEgressEventsRequest(rollout_id=rid))
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
        await h.register_host("h1")
        await h.fleet.SubmitRollout(request())
        claim = await h.hosts.ClaimWork(
            host_pb2.ClaimWorkRequest(request_id="c", host_id="h1", max_items=1, wait_s=1)
        )
        try:
            await h.hosts.CompleteWork(
                host_pb2.CompleteWorkRequest(
                    request_id="x",
                    host_id="h1",
                    work_id=claim.items[0].work_id,
                    fencing_token=claim.items[0].fencing_token,
                    outcome=types_pb2.OUTCOME_SUCCEEDED,
                    egress_events=[types_pb2.EgressEvent(kind="teleport", destination="x")],
                )
            )
        except grpc.aio.AioRpcError as exc:
            codes.append(exc.code())
            assert "teleport" in (exc.details() or "")
    result = codes

    assert result == [
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.INVALID_ARGUMENT,
    ]


async def test_put_checkpoints_stores_each_or_refuses_it_alone(
    tmp_path: Path, images: ImageStore
) -> None:
    """One PutCheckpoints call: the good checkpoints are stored (a resend is harmless), a stale
    token and another rollout's conflicting data are refused alone, with PutCheckpoint's code;
    the agent's sender coalesces concurrent puts into fewer calls and reports the same."""
    from fleet.agent.checkpoints import CheckpointSender
    from fleet.core.errors import Aborted

    async with harness(tmp_path, images) as h:
        await h.register_host("h1")
        reply = await h.fleet.SubmitRollout(request())
        claim = await h.hosts.ClaimWork(
            host_pb2.ClaimWorkRequest(request_id="c", host_id="h1", max_items=1, wait_s=1)
        )
        item = claim.items[0]

        def cp(
            seq: int, data: bytes, token: int = item.fencing_token
        ) -> host_pb2.PutCheckpointRequest:
            return host_pb2.PutCheckpointRequest(
                host_id="h1", work_id=item.work_id, fencing_token=token, sequence=seq, data=data
            )

        answer = await h.hosts.PutCheckpoints(
            host_pb2.PutCheckpointsRequest(
                checkpoints=[
                    cp(1, b"one"),
                    cp(2, b"two", token=item.fencing_token + 1),
                    cp(1, b"one"),
                    cp(2, b"two"),
                    cp(1, b"other"),
                ]
            )
        )
        sender = CheckpointSender(h.hosts)
        puts = [sender.put(cp(seq, b"s%d" % seq)) for seq in range(3, 11)]
        puts.append(sender.put(cp(11, b"x", token=item.fencing_token + 1)))
        results = await asyncio.gather(*puts, return_exceptions=True)
        saved = h.server.core.ledger.checkpoints(reply.rollout.id)
        outcomes, calls = [(o.code, o.message) for o in answer.outcomes], sender.calls

    assert [code for code, _ in outcomes] == ["", "ABORTED", "", "", "ABORTED"]
    assert "stale lease" in outcomes[1][1] and "other data" in outcomes[4][1]
    assert [(seq, data) for seq, _, data in saved] == [
        (1, b"one"),
        (2, b"two"),
        *((seq, b"s%d" % seq) for seq in range(3, 11)),
    ]
    assert results[:8] == [None] * 8 and isinstance(results[8], Aborted)
    assert 0 < calls < 9  # the nine puts went in fewer calls than one each


async def test_a_list_page_ends_before_its_bytes_pass_the_limit(
    tmp_path: Path, images: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page whose rollouts would pass MAX_LIST_BYTES ends early with a token that goes on
    from there: every rollout once, newest first, whatever the page size asked for."""
    from fleet.server import fleet_service

    async with harness(tmp_path, images) as h:
        await h.register_host("h1")  # (rollouts only queue: nothing claims them)
        ids = []
        for i in range(5):
            big = request('image = "minimal"\n', ["echo", "x" * 2000, str(i)])
            reply = await h.fleet.SubmitRollout(big)
            ids.append(reply.rollout.id)
        one = (await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=ids[0]))).ByteSize()
        monkeypatch.setattr(fleet_service, "MAX_LIST_BYTES", 2 * one + one // 2)
        pages, token = [], ""
        while True:
            reply = await h.fleet.ListRollouts(
                fleet_pb2.ListRolloutsRequest(page_size=500, page_token=token)
            )
            pages.append([r.id for r in reply.rollouts])
            token = reply.next_page_token
            if not token:
                break
    assert one > 2000
    assert pages == [[ids[4], ids[3]], [ids[2], ids[1]], [ids[0]]]


async def test_submit_rollouts_stores_every_one_in_one_call_or_none(
    tmp_path: Path, images: ImageStore
) -> None:
    """SubmitRollouts: each submission checked as SubmitRollout checks it, all stored in one
    transaction; repeated, the same rollouts; one bad submission refuses the call, naming it
    by index, and stores nothing."""

    async with harness(tmp_path, images) as h:
        await h.register_host("h1")
        batch = [request(key=f"batch-{i}") for i in range(3)]
        first = await h.fleet.SubmitRollouts(
            fleet_pb2.SubmitRolloutsRequest(request_id="b1", rollouts=batch)
        )
        again = await h.fleet.SubmitRollouts(
            fleet_pb2.SubmitRolloutsRequest(request_id="b2", rollouts=batch)
        )
        stored = await h.count()
        bad = [
            request(key="batch-new"),
            request('image = "minimal"\ncpus = "many"\n', key="batch-bad"),
        ]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.fleet.SubmitRollouts(
                fleet_pb2.SubmitRolloutsRequest(request_id="b3", rollouts=bad)
            )
        with pytest.raises(grpc.aio.AioRpcError) as empty:
            await h.fleet.SubmitRollouts(fleet_pb2.SubmitRolloutsRequest(request_id="b4"))
        assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        first = [(r.id, r.created) for r in first.rollouts]
        again = [(r.id, r.created) for r in again.rollouts]
        refused, after = info.value, await h.count()

    assert [created for _, created in first] == [True] * 3
    assert again == [(rid, False) for rid, _ in first]
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rollouts[1] (idempotency key 'batch-bad')" in (refused.details() or "")
    assert "nothing was submitted" in (refused.details() or "")
    assert stored == after == 3  # the good one of the refused call was not stored either
