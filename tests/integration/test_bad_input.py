"""Malformed submissions over the real gRPC API: each refused at submit with INVALID_ARGUMENT
(or RESOURCE_EXHAUSTED for sizes) naming the field, nothing stored; a malformed plan that reaches
an agent anyway is quarantined, not retried as a host failure."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings

from fleet.api import convert
from fleet.api.pb import fleet_pb2, fleet_pb2_grpc, types_pb2
from fleet.core.manifest import SubmitRequest, build_manifest
from fleet.core.placement import HostClass
from fleet.core.smolfile import parse_smolfile
from fleet.image.store import ImageStore
from tests.integration.harness import Harness, harness, request, threaded_harness
from tests.unit.test_properties import submit_requests

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _step(**kw: object) -> types_pb2.Step:
    return types_pb2.Step(**{"argv": ["true"], "timeout_s": 30, **kw})  # type: ignore[arg-type]


def _with(req: fleet_pb2.SubmitRolloutRequest, **fields: object) -> fleet_pb2.SubmitRolloutRequest:
    for name, value in fields.items():
        if isinstance(value, dict):
            getattr(req, name).update(value)
        elif hasattr(value, "CopyFrom"):
            getattr(req, name).CopyFrom(value)
        else:
            setattr(req, name, value)
    return req


def _deadline(seconds: int) -> fleet_pb2.SubmitRolloutRequest:
    req = request()
    req.deadline.seconds = seconds
    return req


def _steps(*steps: types_pb2.Step) -> fleet_pb2.SubmitRolloutRequest:
    req = request()
    del req.steps[:]
    req.steps.extend(steps)
    return req


CASES: list[tuple[str, fleet_pb2.SubmitRolloutRequest, str]] = [
    ("nul in argv", request('image = "minimal"\n', ["echo", "a\0b"]), "argv[1] holds a NUL"),
    ("nul in env value", _steps(_step(env={"A": "x\0y"})), "env A's value holds a NUL"),
    ("nul in workdir", _steps(_step(workdir="/tmp\0x")), "workdir holds a NUL"),
    ("nan timeout", _steps(_step(timeout_s=float("nan"))), "timeout_s must be positive"),
    ("infinite timeout", _steps(_step(timeout_s=float("inf"))), "timeout_s must be positive"),
    ("timeout of years", _steps(_step(timeout_s=1e9)), "over the limit"),
    ("absurd overlay", request('image = "minimal"\noverlay = 1000000000\n'), "key 'overlay'"),
    ("absurd storage", request('image = "minimal"\nstorage = 99999\n'), "key 'storage'"),
    ("deep toml", request("x = " + "[" * 3000 + "]" * 3000 + "\n"), "nested too deeply"),
    ("nul in image", request('image = "mini\\u0000mal"\n'), "key 'image': a NUL"),
    ("nul in smolfile env", request('env = ["A=\\u0000"]\n'), "key 'env.0': a NUL"),
    ("image not a name", request('image = "mini mal"\n'), "is not an image name"),
    ("image escaping the store", request('image = "minimal/../../x"\n'), "not an image name"),
    ("malformed image digest", request('image = "sha256:../../x"\n'), "is not a digest"),
    ("image name with a newline", request('image = "minimal\\n"\n'), "is not an image name"),
    ("year 9999 deadline", _deadline(253402300000 - 100), "more than 7 days"),
    ("deadline out of range", _deadline(2**62), "deadline:"),
    ("label value too long", _with(request(), labels={"k": "v" * 5000}), "over the limit of 256"),
    ("label key too long", _with(request(), labels={"k" * 500: "v"}), "over the limit of 128"),
    ("tenant too long", _with(request(), tenant="t" * 1000), "tenant is 1000 characters"),
    ("version too long", _with(request(), versions=types_pb2.Versions(policy="p" * 1000)),
     "versions.policy"),
    ("nul in label", _with(request(), labels={"k": "a\0b"}), "holds a NUL"),
    ("nul in idempotency key", request(key="k\0ey"), "idempotency_key holds a NUL"),
]  # fmt: skip


async def test_each_malformed_submission_is_refused_naming_its_field(
    tmp_path: Path, images: ImageStore
) -> None:
    async with harness(tmp_path, images) as h:
        await h.register_host("cpu-a")
        seen = []
        for what, req, _ in CASES:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.fleet.SubmitRollout(req)
            seen.append((what, info.value.code(), info.value.details() or ""))
        # A page token no server issued, however long: refused, not INTERNAL.
        codes = set()
        for token in ("9" * 40, "9" * 5000, "-1", "x\0"):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.fleet.ListRollouts(fleet_pb2.ListRolloutsRequest(page_token=token))
            codes.add(info.value.code())
        assert codes == {INVALID}, codes
        ok = await h.fleet.SubmitRollout(request())  # the server took no harm
        count, ok = await h.count(), len(ok.rollout.id)

    for (what, code, details), (_, _, text) in zip(seen, CASES, strict=True):
        assert code == INVALID, (what, code, details)
        assert text in details, (what, details)
    assert count == 1 and ok > 0  # only the good one was stored


async def test_a_huge_plan_is_refused_by_its_count_and_the_server_stays_responsive(
    tmp_path: Path, images: ImageStore
) -> None:
    """400,000 steps (about 2 MB): refused for its count before any per-step work; health
    checks sent meanwhile are all answered SERVING."""

    async with harness(tmp_path, images) as h:
        req = request()
        del req.steps[:]
        req.steps.extend(types_pb2.Step(argv=["x"]) for _ in range(400_000))
        health = health_pb2_grpc.HealthStub(h.channel)
        submit = asyncio.ensure_future(h.fleet.SubmitRollout(req))
        answers = []
        for _ in range(20):
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=30)
            answers.append(reply.status)
            if submit.done():
                break
            await asyncio.sleep(0.01)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await submit
        err = info.value

    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "400000 steps" in (err.details() or "")
    assert answers and set(answers) == {health_pb2.HealthCheckResponse.SERVING}


async def test_a_malformed_plan_that_reaches_an_agent_is_quarantined_not_retried(
    tmp_path: Path, images: ImageStore
) -> None:
    """A plan stored without the server's checks (an older server, a bug): the agent refuses
    it as malformed on the first attempt, and nothing is retried."""

    async with harness(tmp_path, images) as h:
        now = datetime.now(UTC)
        submit = SubmitRequest(
            idempotency_key="slipped",
            smolfile='image = "minimal"\n',
            steps=(convert.step_from_pb(_step(argv=["echo", "a\0b"]), 0),),
            deadline=now + timedelta(minutes=5),
        )
        parsed = parse_smolfile(submit.smolfile)
        manifest = build_manifest(submit, parsed, images.resolve("minimal"), now)
        rollout, _ = h.server.core.ledger.submit(submit, manifest, time.time())
        h.server.core.changed()
        await h.start_agent("cpu-a", HostClass.CPU)
        r = await h.wait_final(rollout.id)

    assert r.state == types_pb2.ROLLOUT_STATE_QUARANTINED and r.attempts == 1, r.error
    assert "NUL" in r.error
    assert [a.outcome for a in r.attempt_history] == ["MALFORMED_INPUT"]


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory, images: ImageStore) -> Iterator[str]:
    """A real server with a cpu host registered (no agent), on a thread of its own."""

    async def prepare(h: Harness) -> None:
        await h.register_host("cpu-a")

    with threaded_harness(tmp_path_factory.mktemp("live"), images, prepare) as address:
        yield address


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(req=submit_requests())
def test_a_server_fed_arbitrary_submissions_answers_each_with_a_status_and_stays_healthy(
    live_server: str, req: fleet_pb2.SubmitRolloutRequest
) -> None:
    """Whatever the request, the answer is a rollout or a refusal of fleet's own (never
    INTERNAL or UNKNOWN), and the server still answers health checks SERVING after it."""
    with grpc.insecure_channel(live_server) as channel:
        stub = fleet_pb2_grpc.FleetServiceStub(channel)
        try:
            stub.SubmitRollout(req, timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (
                exc.code(),
                exc.details(),
            )
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(), timeout=30).status
        assert status == health_pb2.HealthCheckResponse.SERVING
