"""The inference gateway: real torch, the shipped weights, a real in-process gRPC server."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import torch

from fleet.api.pb import inference_pb2, inference_pb2_grpc
from fleet.core.errors import FailedPrecondition, InvalidArgument
from fleet.core.tokens import issue
from fleet.envs.gridworld import GridWorld
from gateway.batcher import BatchConfig
from gateway.engine import EngineRunner
from gateway.http import connection_limit, serve_http
from gateway.model import DeviceFault, TorchRunner, load_network, memory_model, model_specs
from gateway.service import Gateway, GatewayConfig, failing, serve
from tests import faulty_device

SECRET = b"s" * 32
MODEL = "gridworld-policy"
T = TypeVar("T")


def go(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


class Client:
    def __init__(
        self, stub: inference_pb2_grpc.InferenceServiceStub, gateway: Gateway, address: str = ""
    ) -> None:
        self.stub = stub
        self.gateway = gateway
        self.address = address

    def request(
        self, rollout: str, key: str, sample: list[float], token: str | None = None
    ) -> inference_pb2.InferRequest:
        return inference_pb2.InferRequest(
            token=issue(SECRET, rollout, time.time() + 60) if token is None else token,
            rollout_id=rollout, request_id=key, idempotency_key=key, model=MODEL,
            input=inference_pb2.Tensor(shape=[len(sample)], values=sample),
        )  # fmt: skip

    async def infer(self, rollout: str, key: str, sample: list[float]) -> Any:
        return await self.stub.Infer(self.request(rollout, key, sample))


@asynccontextmanager
async def gateway(fault: Any = None, **overrides: Any) -> AsyncIterator[Client]:
    """A bare gateway (no fleet server polls it: it serves tokens on their own)."""
    config = GatewayConfig(secret=SECRET, device="cpu", tokens_without_server=True)
    config = config.model_copy(update=overrides)
    gw = Gateway.build(config, fault_primary=fault)
    server, port = await serve(gw, "127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Client(inference_pb2_grpc.InferenceServiceStub(channel), gw, f"127.0.0.1:{port}")
    finally:
        await channel.close()
        await gw.batcher.stop()
        await server.stop(None)


def observations(n: int) -> list[list[float]]:
    return [GridWorld(seed).observation() for seed in range(n)]


def reference(samples: list[list[float]]) -> list[list[float]]:
    net = load_network(model_specs()[MODEL])
    with torch.inference_mode():
        out: list[list[float]] = net(torch.tensor(samples)).tolist()
        return out


async def test_concurrent_requests_are_batched_and_answered_exactly() -> None:
    """64 concurrent callers share batches; each gets the same output as an unbatched model."""
    samples = observations(64)

    async with gateway(batch=BatchConfig(max_batch=32, max_wait_ms=20)) as c:
        replies = await asyncio.gather(
            *(c.infer(f"r-{i % 4}", f"k{i}", s) for i, s in enumerate(samples))
        )

    expected = reference(samples)
    assert max(r.batch_size for r in replies) > 1
    assert all(r.batch_size <= 32 and r.device == "cpu" and not r.degraded for r in replies)
    for reply, want in zip(replies, expected, strict=True):
        assert list(reply.output.shape) == [4]
        # To float32 rounding: batches of other sizes sum in other orders (seen: 4e-7 relative).
        assert reply.output.values == pytest.approx(want, rel=2e-6, abs=1e-5)


async def test_a_full_queue_refuses_at_once_with_a_retry_hint() -> None:
    """Over max_queue: RESOURCE_EXHAUSTED immediately; everything accepted is still answered."""
    release = threading.Event()

    def slow() -> None:  # the device, held until every call was admitted or refused
        assert release.wait(30), "the test never released the device"

    config = BatchConfig(max_batch=2, max_wait_ms=1, max_queue=4)
    finished: list[str] = []  # "refused" or "answered", in the order the calls ended

    async def call(i: int, sample: list[float]) -> Any:
        try:
            reply = await c.infer(f"r-{i}", "k", sample)
        except grpc.aio.AioRpcError as exc:
            finished.append("refused")
            return exc
        finished.append("answered")
        return reply

    # A slow device, simulated by a hook that blocks: it must run off the event loop, as
    # the inline runner runs it (an engine's hook runs on the loop, before sending).
    async with gateway(fault=slow, batch=config, engine="inline") as c:
        calls = asyncio.gather(*(call(i, s) for i, s in enumerate(observations(12))))
        deadline = time.monotonic() + 30
        while finished.count("refused") + c.gateway.batcher.outstanding < 12:  # (none answered)
            assert time.monotonic() < deadline, "the calls were neither admitted nor refused"
            await asyncio.sleep(0.01)
        release.set()
        replies = await calls

    refused = [r for r in replies if isinstance(r, grpc.aio.AioRpcError)]
    answered = [r for r in replies if not isinstance(r, Exception)]
    assert refused and answered and len(refused) + len(answered) == 12
    # At once: every refusal came back before the slow device answered anything.
    assert finished == ["refused"] * len(refused) + ["answered"] * len(answered)
    for error in refused:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in (error.details() or "")
        hints = dict(error.trailing_metadata() or ())
        assert float(hints["retry-after-s"]) > 0


async def test_one_rollout_cannot_hold_more_than_its_in_flight_cap() -> None:
    release = threading.Event()

    def slow() -> None:  # the device, held until every call was admitted or refused
        assert release.wait(30), "the test never released the device"

    config = BatchConfig(max_batch=1, max_wait_ms=1, max_inflight_per_rollout=2)
    async with gateway(fault=slow, batch=config, engine="inline") as c:  # (a blocking hook)
        calls = [
            asyncio.ensure_future(c.infer("r-greedy", f"k{i}", s))
            for i, s in enumerate(observations(5))
        ]
        deadline = time.monotonic() + 30
        while sum(f.done() for f in calls) + c.gateway.batcher.outstanding < 5:
            assert time.monotonic() < deadline, "the calls were neither admitted nor refused"
            await asyncio.sleep(0.01)
        release.set()
        replies = await asyncio.gather(*calls, return_exceptions=True)

    refused = [r for r in replies if isinstance(r, grpc.aio.AioRpcError)]
    assert len(refused) == 3
    assert all("in flight" in (e.details() or "") for e in refused)


async def test_admission_shrinks_batches_to_the_memory_budget_without_oom() -> None:
    """A budget for ~5 samples: batches never exceed it and no batch faults for memory."""
    spec = model_specs()[MODEL]
    from gateway.model import memory_model

    mem = memory_model(spec)
    budget = mem.weights_bytes + 5 * mem.activation_bytes_per_sample

    async with gateway(
        capacity_mib=budget / 2**20, batch=BatchConfig(max_batch=64, max_wait_ms=20)
    ) as c:
        replies = await asyncio.gather(
            *(c.infer(f"r-{i}", "k", s) for i, s in enumerate(observations(40)))
        )
        replies, gw = list(replies), c.gateway

    assert max(r.batch_size for r in replies) == 5
    assert all(not r.degraded for r in replies)
    assert gw.batcher.metrics.failovers == 0 and gw.batcher.metrics.shrunk > 0


async def test_faults_open_the_breaker_and_fail_over_without_losing_requests() -> None:
    """A failing primary: every request is answered by the CPU replica; probes close it again."""
    fault = failing("device_error")

    async with gateway(
        fault=fault,
        breaker_failures=2,
        breaker_open_s=0.2,
        batch=BatchConfig(max_batch=8, max_wait_ms=5),
    ) as c:
        fault.on = True  # type: ignore[attr-defined]
        during = await asyncio.gather(
            *(c.infer(f"r-{i}", "a", s) for i, s in enumerate(observations(30)))
        )
        assert str(c.gateway.batcher.breaker.state) == "open"
        fault.on = False  # type: ignore[attr-defined]
        await asyncio.sleep(0.3)
        after = [await c.infer("r", f"b{i}", s) for i, s in enumerate(observations(3))]
        during, batcher = list(during), c.gateway.batcher

    assert len(during) == 30
    assert all(r.degraded and r.device == "cpu (failover)" for r in during)
    assert batcher.metrics.failovers >= 1
    assert all(not r.degraded and r.device == "cpu" for r in after)
    assert str(batcher.breaker.state) == "closed"
    expected = reference(observations(30))
    for reply, want in zip(during, expected, strict=True):
        assert reply.output.values == pytest.approx(want, abs=1e-5)


async def test_a_retried_request_gets_the_stored_answer() -> None:
    """Same rollout and idempotency key: the first answer again, marked replayed."""

    async with gateway() as c:
        sample = observations(1)[0]
        first = await c.infer("r-1", "step-7", sample)
        again = await c.infer("r-1", "step-7", sample)
        other = await c.infer("r-2", "step-7", sample)  # keys are per rollout

    assert again.output.values == first.output.values and again.replayed
    assert not first.replayed and not other.replayed


@pytest.mark.parametrize(
    ("token", "code", "text"),
    [
        (lambda: issue(SECRET, "r-other", time.time() + 60), "PERMISSION_DENIED", "scoped"),
        (lambda: issue(SECRET, "r-1", time.time() - 1), "PERMISSION_DENIED", "expired"),
        (lambda: issue(b"x" * 32, "r-1", time.time() + 60), "UNAUTHENTICATED", "signature"),
        (lambda: "", "UNAUTHENTICATED", "no inference token"),
    ],
)
async def test_tokens_are_scoped_to_one_rollout_and_its_deadline(
    token: Callable[[], str], code: str, text: str
) -> None:
    async with gateway() as c:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.stub.Infer(c.request("r-1", "k", observations(1)[0], token=token()))
        error = info.value

    assert error.code().name == code and text in (error.details() or "")


async def test_malformed_requests_are_refused_saying_what() -> None:
    out = []
    async with gateway() as c:
        good = c.request("r-1", "k", observations(1)[0])
        bad = [
            inference_pb2.InferRequest(**{**_fields(good), "model": "gpt-17"}),
            inference_pb2.InferRequest(**{**_fields(good), "revision": "v9"}),
            inference_pb2.InferRequest(
                **{**_fields(good), "input": inference_pb2.Tensor(shape=[3], values=[1, 2, 3])}
            ),
            inference_pb2.InferRequest(**{**_fields(good), "idempotency_key": ""}),
        ]
        for request in bad:
            try:
                await c.stub.Infer(request)
            except grpc.aio.AioRpcError as exc:
                out.append((exc.code().name, exc.details() or ""))
    errors = out

    assert [code for code, _ in errors] == [
        "NOT_FOUND", "FAILED_PRECONDITION", "INVALID_ARGUMENT", "INVALID_ARGUMENT"
    ]  # fmt: skip
    assert "gpt-17" in errors[0][1] and "v9" in errors[1][1]
    assert "shape [147]" in errors[2][1] and "idempotency_key" in errors[3][1]


async def test_non_finite_inputs_are_refused_saying_where() -> None:
    """NaN or infinity in an input, over gRPC and over HTTP: refused before the batcher."""
    sample = observations(1)[0]

    grpc_errors, http_replies = [], []
    async with gateway() as c:
        for bad in (float("nan"), float("inf")):
            values = [*sample[:5], bad, *sample[6:]]
            try:
                await c.infer("r-1", f"k{bad}", values)
            except grpc.aio.AioRpcError as exc:
                grpc_errors.append(f"{exc.code().name} {exc.details()}")
        http, port = await serve_http(c.gateway, "127.0.0.1", 0)
        try:
            for text in ("NaN", "-Infinity"):
                raw = (
                    f'{{"token": "{issue(SECRET, "r-1", time.time() + 60)}", '
                    f'"rollout_id": "r-1", "idempotency_key": "h{text}", "model": "{MODEL}", '
                    f'"input": [{", ".join(map(str, sample[:146]))}, {text}]}}'
                )
                http_replies.append(await _post(port, "/v1/infer", raw.encode()))
        finally:
            http.close()

    assert grpc_errors == [
        "INVALID_ARGUMENT input[5] is nan: inputs must be finite numbers",
        "INVALID_ARGUMENT input[5] is inf: inputs must be finite numbers",
    ]
    assert [status for status, _ in http_replies] == [400, 400]
    assert http_replies[0][1]["message"] == "input[146] is nan: inputs must be finite numbers"
    assert http_replies[1][1]["message"] == "input[146] is -inf: inputs must be finite numbers"


async def test_the_http_endpoint_holds_a_bounded_number_of_connections() -> None:
    """Past its limit (by default what the process may open, less room for the rest of the
    gateway) a connection gets a 503 to retry, and those already open are still served."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert connection_limit() == max(16, soft - 256)

    async with gateway() as c:
        http, port = await serve_http(c.gateway, "127.0.0.1", 0, max_connections=3)
        try:
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            refused = await asyncio.wait_for(reader.read(), 10)  # (not held open)
            writer.close()
            _, first = held[0]
            first.write(b"GET /healthz HTTP/1.1\r\nHost: g\r\n\r\n")
            answer = await held[0][0].readuntil(b"ok")
            for _, w in held:
                w.close()
            status = int(answer.split()[1])
        finally:
            http.close()

    assert refused.startswith(b"HTTP/1.1 503") and b"Retry-After: 0.5" in refused
    assert b"3 connections are open here, the limit" in refused
    assert status == 200


async def _post(port: int, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: g\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n".encode()
        + body
    )
    raw = await reader.read()
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def _fields(request: inference_pb2.InferRequest) -> dict[str, Any]:
    return {f.name: v for f, v in request.ListFields()}


def test_corrupt_weights_are_refused_before_loading(tmp_path: Path) -> None:
    spec = model_specs()[MODEL]
    bad = tmp_path / spec.file
    shutil.copy(spec.path, bad)
    with bad.open("r+b") as handle:
        handle.seek(100)
        handle.write(b"\x00\x01\x02")
    with pytest.raises(FailedPrecondition, match="sha256"):
        load_network(spec, bad)


@pytest.mark.parametrize("engine", ["process", "inline"])
def test_runner_faults_instead_of_allocating_past_its_budget(engine: str) -> None:
    """The CPU runner holds batches to its budget the way a device would: an OOM fault, from
    the engine process as from a runner in the gateway's own."""
    gw = Gateway.build(GatewayConfig(secret=SECRET, device="cpu", capacity_mib=0.2, engine=engine))
    try:
        with pytest.raises(DeviceFault) as info:
            go(gw.batcher.primary.infer(observations(1) * 2000))
        fits = go(gw.batcher.primary.infer(observations(2)))
    finally:
        go(gw.batcher.stop())
    assert info.value.kind == "oom" and "out of memory: batch of 2000" in str(info.value)
    for got, want in zip(fits, reference(observations(2)), strict=True):
        assert got == pytest.approx(want, abs=1e-5)


def test_the_reservation_stops_at_the_budget_and_at_the_first_size_that_does_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a CUDA runner does at load, run here on the CPU: batches of 1, 2, 4 ... rows up to
    the largest, which the budget may cut; on a device without the memory for one of them, the
    sizes before it are what is reserved."""
    spec = model_specs()[MODEL]
    memory = memory_model(spec)
    budget = memory.weights_bytes + 100 * memory.activation_bytes_per_sample
    runner = TorchRunner(spec, load_network(spec), "cpu", budget)
    run_flat, sizes = runner.run_flat, []

    def spy(flat: Any, samples: int, width: int) -> Any:
        sizes.append(samples)
        if samples >= 32 and short:
            raise DeviceFault("oom", "cuda:0: out of memory")
        return run_flat(flat, samples, width)

    monkeypatch.setattr(runner, "run_flat", spy)
    short = False
    assert runner._reserve(256) == 100
    assert sizes == [1, 2, 4, 8, 16, 32, 64, 100]
    sizes.clear()
    short = True
    assert runner._reserve(64) == 16
    assert sizes == [1, 2, 4, 8, 16, 32]
    assert runner._reserve(0) == 0


def test_on_cuda_the_allocators_figures_are_read_at_most_every_half_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Admission's free memory on CUDA: the driver's free bytes at every call, plus what the
    caching allocator holds unused, whose statistics (slow to build) are read again only every
    CACHED_READ_S. The CUDA calls are stood in for here (tests/gpu has the real ones)."""
    from gateway import model

    spec = model_specs()[MODEL]
    runner = TorchRunner(spec, load_network(spec), "cpu", 1 << 30)
    runner.device = "cuda:0"
    clock, reads, driver_free = [100.0], [], [1000]
    stats = {"reserved_bytes.all.current": 700, "allocated_bytes.all.current": 200}
    monkeypatch.setattr(model.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (driver_free[0], 1 << 40))

    def memory_stats(device: Any) -> dict[str, int]:
        reads.append(clock[0])
        return dict(stats)

    monkeypatch.setattr(torch.cuda, "memory_stats", memory_stats)
    assert runner.observed_free_bytes() == 1000 + 500
    driver_free[0], stats["reserved_bytes.all.current"] = 400, 1300  # the allocator grew
    clock[0] += model.CACHED_READ_S / 2
    assert runner.observed_free_bytes() == 400 + 500  # the driver's figure is always fresh
    clock[0] += model.CACHED_READ_S / 2
    assert runner.observed_free_bytes() == 400 + 1100
    assert reads == [100.0, 100.0 + model.CACHED_READ_S]


def _engine_pid(gw: Gateway) -> int:
    pid = getattr(gw.batcher.primary, "pid", None)
    assert isinstance(pid, int), "the primary runs in an engine process"
    return pid


async def _until(check: Callable[[], bool], what: str, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        await asyncio.sleep(0.05)


def test_an_engine_whose_device_raised_an_error_is_replaced_by_a_fresh_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a device error the engine ends itself (a CUDA context may be unusable for good,
    tests/gpu has that one), and the runner starts another at once, which serves again."""
    hook = faulty_device.install(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (hook, os.getenv("PYTHONPATH")))))
    seen = go(faulty_device.device_error_then_fresh_engine("cpu"))
    assert seen["fault"] is not None and seen["fault"].kind == "device_error"
    assert "injected device error" in str(seen["fault"])
    assert "restarting the model engine" in str(seen["fault"])
    assert seen["restarts"] == 1 and seen["pid"] != seen["first_pid"]
    # (The same values within rounding: the fresh engine times its packing anew at load and may
    # pick the other kernel for this batch size under load.)
    for got, before in zip(seen["after"], seen["before"], strict=True):
        assert got == pytest.approx(before, abs=1e-5)
    for got, want in zip(seen["after"], reference([[0.25 * (i % 4)] * 147 for i in range(4)]),
                         strict=True):  # fmt: skip
        assert got == pytest.approx(want, abs=1e-5)


async def test_an_engine_that_cannot_start_again_is_retried_with_growing_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine lost and its model unloadable (its weights gone): one failed restart, then
    batches fault at once saying when the next try comes, and no new try is made before then;
    once the weights are back, the next try after the wait serves again."""
    shipped = model_specs()[MODEL]
    shutil.copy(shipped.directory / "models.toml", tmp_path / "models.toml")
    weights = tmp_path / shipped.file
    shutil.copy(shipped.path, weights)
    spec = model_specs(tmp_path / "models.toml")[MODEL]
    runner = EngineRunner(spec, tmp_path / "models.toml", "cpu", restart_backoff_s=(1.0, 60.0))
    start, tries = runner.start, []

    def counted() -> None:
        tries.append(time.monotonic())
        start()

    batch = observations(3)

    try:
        await asyncio.to_thread(runner.start)
        first = await runner.infer(batch)
        monkeypatch.setattr(runner, "start", counted)
        weights.rename(tmp_path / "elsewhere.pt")
        os.kill(_pid(runner), signal.SIGKILL)
        with pytest.raises(DeviceFault):
            await runner.infer(batch)
        await _until(lambda: runner.failed_starts == 1, "a failed restart")
        failed_at, downs = time.monotonic(), []
        while time.monotonic() - failed_at < 0.6:  # inside the 1 s wait
            with pytest.raises(DeviceFault) as info:
                await runner.infer(batch)
            downs.append(str(info.value))
            await asyncio.sleep(0.05)
        assert len(tries) == 1, "a new try before the wait was over"
        (tmp_path / "elsewhere.pt").rename(weights)
        deadline = time.monotonic() + 60
        while True:
            try:
                again = await runner.infer(batch)
                break
            except DeviceFault:
                assert time.monotonic() < deadline, "the engine did not start again"
                await asyncio.sleep(0.1)
    finally:
        runner.close()
    assert downs and all("restart failed (1 in a row; next try in 1 s)" in d for d in downs)
    assert "cannot read weights" in downs[0]
    assert len(tries) == 2 and tries[1] - tries[0] >= 1.0
    assert runner.failed_starts == 0 and runner.restarts == 1
    assert again == first


def _pid(runner: EngineRunner) -> int:
    assert runner.pid is not None, "the engine runs"
    return runner.pid


@pytest.mark.parametrize("how", ["killed", "hung"])
async def test_a_lost_engine_fails_over_without_losing_requests_and_is_started_again(
    how: str,
) -> None:
    """The engine process killed (SIGKILL), or hung (SIGSTOP: no answer within the answer
    timeout): every request is still answered, by the CPU replica; the engine is ended and
    started again, and once the breaker's probe passes the primary serves again."""
    samples = observations(24)

    async with gateway(
        breaker_failures=1,
        breaker_open_s=0.3,
        engine_answer_timeout_s=1.0,
        batch=BatchConfig(max_batch=8, max_wait_ms=5),
    ) as c:
        gw = c.gateway
        await c.infer("warm", "k", samples[0])  # the engine answers
        first = _engine_pid(gw)
        os.kill(first, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        during = await asyncio.gather(*(c.infer(f"r-{i}", "a", s) for i, s in enumerate(samples)))
        await _until(lambda: gw.batcher.primary.restarts == 1, "the engine restarted")
        second = _engine_pid(gw)
        await asyncio.sleep(0.4)  # the breaker's open time: the next batch is its probe
        after = [await c.infer("r", f"b{i}", s) for i, s in enumerate(samples[:3])]
        during = list(during)

    assert len(during) == len(samples) and all(r.degraded for r in during)
    assert {r.device for r in during} == {"cpu (failover)"}
    for reply, want in zip(during, reference(samples), strict=True):
        assert reply.output.values == pytest.approx(want, abs=1e-5)
    assert second != first
    with pytest.raises(ProcessLookupError):  # the lost one was ended, and reaped
        os.kill(first, 0)
    assert all(not r.degraded and r.device == "cpu" for r in after)
    assert str(gw.batcher.breaker.state) == "closed"
    assert "fleet_gateway_engine_restarts_total 1.0" in gw.batcher.metrics_text()
    with pytest.raises(ProcessLookupError):  # stopping the gateway ended its engine
        os.kill(second, 0)


async def test_health_probes_of_an_idle_primary_open_the_breaker_and_close_it_again() -> None:
    """No requests at all: the engine killed while idle is found by a probe, which opens the
    breaker (a request then goes straight to the CPU replica, with no failed batch first); the
    engine is started again and the next probe closes the breaker."""
    probes = BatchConfig(max_batch=8, max_wait_ms=1, probe_interval_s=0.2)

    async with gateway(breaker_failures=1, breaker_open_s=60.0, batch=probes) as c:
        gw = c.gateway
        breaker = gw.batcher.breaker
        await _until(lambda: gw.batcher.metrics.probes >= 2, "idle probes passed")
        assert str(breaker.state) == "closed" and gw.batcher.metrics.probes_failed == 0
        os.kill(_engine_pid(gw), signal.SIGKILL)
        await _until(lambda: str(breaker.state) == "open", "a probe opened the breaker")
        while_open = await c.infer("r-1", "a", observations(1)[0])
        await _until(lambda: gw.batcher.primary.restarts == 1, "the engine restarted")
        breaker.open_s = 0.1  # let the next probe be the half-open one
        await _until(lambda: str(breaker.state) == "closed", "a probe closed the breaker")
        after = await c.infer("r-2", "b", observations(1)[0])
        reasons = [t.reason for t in breaker.history]

    assert reasons[0].startswith("a fault: health probe: device_error")
    assert reasons[-1] == "probe succeeded"
    assert while_open.degraded and while_open.device == "cpu (failover)"
    assert gw.batcher.metrics.failovers == 0  # no batch of a request failed on the primary
    assert not after.degraded and after.device == "cpu"
    text = gw.batcher.metrics_text()
    assert "fleet_gateway_health_probes_failed_total 1.0" in text


def test_the_engine_ends_when_its_gateway_is_killed() -> None:
    """A gateway killed with SIGKILL cleans nothing up: its engine ends by itself (its end of
    the socket closes), rather than holding the device."""
    script = (
        "import sys\n"
        "from gateway.service import Gateway, GatewayConfig\n"
        f"gw = Gateway.build(GatewayConfig(secret={SECRET!r}, device='cpu'))\n"
        "print('engine-pid', gw.batcher.primary.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    root = Path(__file__).resolve().parents[2]
    with subprocess.Popen(
        [sys.executable, "-c", script], cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as proc:  # (its pipes closed at the end)
        assert proc.stdout is not None
        line = b""
        while not line.startswith(b"engine-pid "):  # (the gateway's log lines come first)
            line = proc.stdout.readline()
            assert line, "the gateway exited before it was built"
        engine = int(line.split()[1])
        assert not _ended(engine)
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 30
        while not _ended(engine):
            assert time.monotonic() < deadline, f"engine {engine} outlived its gateway"
            time.sleep(0.05)


def _ended(pid: int) -> bool:
    """Gone, or a zombie waiting for whoever inherited it to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_an_engine_that_cannot_load_its_model_says_why(tmp_path: Path) -> None:
    """Corrupt weights: the engine refuses them and the gateway's start fails with its reason."""
    spec = model_specs()[MODEL]
    shutil.copy(spec.directory / "models.toml", tmp_path / "models.toml")
    (tmp_path / spec.file).write_bytes(spec.path.read_bytes()[:-10] + b"0123456789")
    runner = EngineRunner(replace(spec, directory=tmp_path), tmp_path / "models.toml", "cpu")
    with pytest.raises(FailedPrecondition, match=r"could not load gridworld-policy.*sha256"):
        runner.start()
    assert runner.pid is None


def test_an_unknown_engine_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="gateway engine 'gpu' is not one of process"):
        Gateway.build(GatewayConfig(secret=SECRET, device="cpu", engine="gpu"))


@pytest.mark.parametrize(
    ("overrides", "text"),
    [
        ({"batch": BatchConfig(max_batch=0)}, "gateway max_batch is 0: it must be at least 1"),
        ({"batch": BatchConfig(max_wait_ms=-1)}, "gateway max_wait_ms is -1"),
        ({"batch": BatchConfig(max_wait_ms=float("nan"))}, "gateway max_wait_ms is nan"),
        ({"secret": b""}, "the gateway needs the token secret"),
        ({"stream_outstanding": 0}, "gateway stream_outstanding is 0: it must be at least 1"),
        ({"breaker_failures": 0}, "gateway breaker_failures is 0"),
    ],
)
def test_limits_that_cannot_work_are_refused_saying_which(
    overrides: dict[str, Any], text: str
) -> None:
    with pytest.raises(InvalidArgument, match=text):
        Gateway.build(GatewayConfig(secret=SECRET, device="cpu").model_copy(update=overrides))


async def test_a_model_served_in_bfloat16_answers_like_float32_and_fails_over_in_float32() -> None:
    """The primary in bfloat16 (half the bytes per weight, admission counts them so); the
    actions agree with float32; the CPU replica serves the stored float32 weights."""
    samples = observations(16)
    expected = reference(samples)

    async with gateway(dtype="bfloat16") as client:
        replies = await asyncio.gather(
            *(client.infer(f"r{i}", f"k{i}", s) for i, s in enumerate(samples))
        )
        status = await client.stub.Status(inference_pb2.GatewayStatusRequest())
        engine = client.gateway.batcher.primary._engine  # type: ignore[attr-defined]
        outputs = [list(r.output.values) for r in replies]
        gw, ready = client.gateway, engine.ready

    assert [(m.name, m.dtype) for m in status.models] == [(MODEL, "bfloat16")]
    assert gw.batcher.primary.spec.dtype == "bfloat16"
    assert gw.batcher.fallback is not None and gw.batcher.fallback.spec.dtype == "float32"
    half, full = memory_model(gw.spec), memory_model(replace(gw.spec, dtype="float32"))
    assert half.weights_bytes * 2 == full.weights_bytes
    copies = 1 if ready["packed_from_rows"] is None else 2  # a packed copy counts too
    assert gw.batcher.primary.memory.weights_bytes == copies * half.weights_bytes
    assert [max(range(4), key=o.__getitem__) for o in outputs] == [
        max(range(4), key=e.__getitem__) for e in expected
    ]
    pairs = zip(outputs, expected, strict=True)  # bfloat16 keeps about 3 significant digits
    assert all(
        abs(a - b) <= 0.05 * max(1.0, abs(b)) for o, e in pairs for a, b in zip(o, e, strict=True)
    )


def test_an_unknown_dtype_is_refused_saying_where(tmp_path: Path) -> None:
    spec = model_specs()[MODEL]
    shutil.copy(spec.path, tmp_path / spec.file)
    manifest = (spec.directory / "models.toml").read_text()
    (tmp_path / "models.toml").write_text(
        manifest.replace("output_dim", 'dtype = "int4"\noutput_dim')
    )
    with pytest.raises(InvalidArgument, match=r"model\.gridworld-policy: dtype 'int4'"):
        model_specs(tmp_path / "models.toml")
    with pytest.raises(InvalidArgument, match="gateway dtype: dtype 'fp8'"):
        Gateway.build(GatewayConfig(secret=SECRET, device="cpu", dtype="fp8"))


async def test_one_rollout_cannot_hold_every_connection_and_metrics_stay_on_loopback() -> None:
    """Past MAX_PER_ROLLOUT connections of one rollout (by its token) a new one of that
    rollout gets a 503, while another rollout's is served; a connection that fails to
    authenticate is answered and closed; /metrics answers loopback only."""
    from gateway.http import MAX_PER_ROLLOUT

    sample = observations(1)[0]

    def infer_request(rollout: str, key: str, token: str | None = None) -> bytes:
        body = (
            f'{{"token": "{token or issue(SECRET, rollout, time.time() + 60)}", '
            f'"rollout_id": "{rollout}", "idempotency_key": "{key}", "model": "{MODEL}", '
            f'"input": [{", ".join(map(str, sample))}]}}'
        ).encode()
        head = f"POST /v1/infer HTTP/1.1\r\nHost: g\r\nContent-Length: {len(body)}\r\n\r\n"
        return head.encode() + body

    async def status_of(reader: asyncio.StreamReader) -> int:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        return int(head.split()[1])

    async with gateway() as c:
        http, port = await serve_http(c.gateway, "127.0.0.1", 0)
        held = []
        try:
            statuses = []
            for i in range(MAX_PER_ROLLOUT + 1):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                held.append(writer)
                writer.write(infer_request("r-greedy", f"k{i}"))
                statuses.append(await status_of(reader))
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            held.append(writer)
            writer.write(infer_request("r-other", "k"))
            other = await status_of(reader)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(infer_request("r-x", "k", token="v1.forged.token"))
            forged = await status_of(reader)
            closed = await asyncio.wait_for(reader.read(), 10)  # EOF: not held open
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n")
            metrics = await asyncio.wait_for(reader.read(), 10)
            writer.close()
        finally:
            for w in held:
                w.close()
            http.close()

    assert statuses == [200] * MAX_PER_ROLLOUT + [503]
    assert other == 200 and forged == 401 and closed == b""
    assert metrics.startswith(b"HTTP/1.1 200") and b"fleet_gateway" in metrics


async def test_a_token_is_good_only_while_its_rollout_runs() -> None:
    """The server's signed list of running rollouts: a token of a rollout not on it is
    refused (unless issued after the list was read: an attempt it could not hold yet), one on
    it is served; a list signed with another key is refused; while the list is stale every
    token is refused."""
    from fleet.core.tokens import sign_running
    from gateway import service

    sample = observations(1)[0]

    def request(rollout: str, issued_at: float) -> inference_pb2.InferRequest:
        return inference_pb2.InferRequest(
            token=issue(SECRET, rollout, time.time() + 600, issued_at), rollout_id=rollout,
            idempotency_key=f"{rollout}-{issued_at}", model=MODEL,
            input=inference_pb2.Tensor(shape=[len(sample)], values=sample),
        )  # fmt: skip

    async with gateway() as c:
        before = time.time() - 30
        as_of = time.time()
        running = inference_pb2.RunningRollouts(
            rollout_ids=["r-live"],
            as_of=as_of,
            signature=sign_running(SECRET, ["r-live"], as_of),
        )
        await c.stub.Status(inference_pb2.GatewayStatusRequest(running=running))
        outcomes = []
        for rollout, issued in (("r-live", before), ("r-ended", before), ("r-new", as_of + 0.5)):
            try:
                await c.stub.Infer(request(rollout, issued))
                outcomes.append("served")
            except grpc.aio.AioRpcError as exc:
                outcomes.append(f"{exc.code().name}: {exc.details()}")
        forged = inference_pb2.RunningRollouts(
            rollout_ids=[], as_of=as_of + 1, signature=sign_running(b"k" * 32, [], as_of + 1)
        )
        try:
            await c.stub.Status(inference_pb2.GatewayStatusRequest(running=forged))
            refused = "accepted"
        except grpc.aio.AioRpcError as exc:
            refused = exc.code().name
        c.gateway.running_received -= service.RUNNING_STALE_S + 1  # the server went quiet
        try:
            await c.stub.Infer(request("r-ended", before))
            stale = "served"
        except grpc.aio.AioRpcError as exc:
            stale = exc.code().name

    assert outcomes[0] == "served" and outcomes[2] == "served"
    assert outcomes[1] == (
        "PERMISSION_DENIED: rollout r-ended is not running: its inference token ended with it"
    )
    assert refused == "UNAUTHENTICATED"
    assert stale == "UNAVAILABLE"
