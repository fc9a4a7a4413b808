"""InferStream: many model calls on one gRPC stream, each checked and served as Infer serves it.

Real torch, the shipped weights, a real in-process gRPC server (the fixtures of test_gateway).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import grpc
import pytest

from fleet.api.pb import inference_pb2, inference_pb2_grpc
from fleet.core.errors import (
    FleetError,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from fleet.core.tokens import issue
from gateway.batcher import BatchConfig
from gateway.client import InferStreamClient
from tests.integration.test_gateway import SECRET, Client, gateway, observations, reference


class Device:
    """A device the test holds: a batch waits in the hook (run off the event loop, as the
    inline runner runs it) while the gate is shut; `until` waits, on the loop, for a state."""

    def __init__(self, *, shut: bool = True) -> None:
        self.gate = threading.Event()
        if not shut:
            self.gate.set()

    def hook(self) -> None:
        assert self.gate.wait(30), "the test never opened the device's gate"

    @staticmethod
    async def until(what: str, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 30
        while not done():
            assert time.monotonic() < deadline, f"never: {what}"
            await asyncio.sleep(0.01)


async def exchange(
    c: Client, requests: list[inference_pb2.InferRequest], *, all_at_once: bool = True
) -> list[inference_pb2.InferStreamResponse]:
    """Sends `requests` on one stream (all before reading, or one at a time) and returns every
    response in the order it came; the stream must end with OK."""
    call = c.stub.InferStream()
    responses: list[inference_pb2.InferStreamResponse] = []
    if all_at_once:
        for request in requests:
            await call.write(request)
        await call.done_writing()
        async for response in call:
            responses.append(response)
    else:
        for request in requests:
            await call.write(request)
            responses.append(await call.read())
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    return responses


async def test_a_stream_answers_each_request_by_its_id_in_shared_batches() -> None:
    """Sixty-four requests outstanding on one stream are batched together, and each answer
    (matched by request_id, whatever order it came in) is the unbatched model's."""
    samples = observations(64)

    async with gateway(batch=BatchConfig(max_batch=32, max_wait_ms=20)) as c:
        responses = await exchange(
            c, [c.request(f"r-{i % 4}", f"k{i}", s) for i, s in enumerate(samples)]
        )

    assert sorted(r.request_id for r in responses) == sorted(f"k{i}" for i in range(64))
    by_id = {r.request_id: r for r in responses}
    assert all(r.WhichOneof("result") == "answer" for r in responses)
    assert max(r.answer.batch_size for r in responses) > 1
    for i, want in enumerate(reference(samples)):
        answer = by_id[f"k{i}"].answer
        assert answer.device == "cpu" and not answer.degraded and answer.model == "gridworld-policy"
        assert answer.output.values == pytest.approx(want, rel=2e-6, abs=1e-5)


async def test_refusals_are_answered_in_band_and_the_stream_goes_on() -> None:
    """A bad token, another rollout's token, a malformed input, a missing or duplicated
    request_id: each gets an error naming what is wrong, and later requests are still served."""
    sample = observations(1)[0]

    async with gateway() as c:
        other = issue(SECRET, "r-other", time.time() + 60)
        bad = c.request("r-1", "k-bad", sample)
        bad.input.values.append(1.0)
        nameless = c.request("r-1", "k-nameless", sample)
        nameless.request_id = ""
        responses = await exchange(
            c,
            [
                c.request("r-1", "k-forged", sample, token=issue(b"x" * 32, "r-1", 1e10)),
                c.request("r-1", "k-other", sample, token=other),
                bad,
                nameless,
                c.request("r-1", "k-good", sample),
            ],
            all_at_once=False,
        )

    codes = [(r.request_id, r.WhichOneof("result")) for r in responses]
    assert codes == [
        ("k-forged", "error"), ("k-other", "error"), ("k-bad", "error"), ("", "error"),
        ("k-good", "answer"),
    ]  # fmt: skip
    errors = [r.error for r in responses[:4]]
    assert [e.code for e in errors] == [
        "UNAUTHENTICATED", "PERMISSION_DENIED", "INVALID_ARGUMENT", "INVALID_ARGUMENT",
    ]  # fmt: skip
    assert "signature" in errors[0].message and "scoped" in errors[1].message
    assert "with 148 values" in errors[2].message
    assert "request_id is empty" in errors[3].message
    assert not errors[0].HasField("retry_after_s")
    assert responses[4].answer.output.values == pytest.approx(reference([sample])[0], abs=1e-5)


async def test_a_request_id_already_outstanding_is_refused() -> None:
    device = Device()
    sample = observations(1)[0]

    async with gateway(fault=device.hook, engine="inline") as c:
        first = c.request("r-1", "k-1", sample)
        second = c.request("r-1", "k-2", sample)
        second.request_id = "k-1"
        call = c.stub.InferStream()
        await call.write(first)
        await Device.until("the first admitted", lambda: c.gateway.batcher.outstanding > 0)
        await call.write(second)
        await call.done_writing()
        responses = [await call.read()]  # the refusal, while the first is on the device
        device.gate.set()
        while (response := await call.read()) != grpc.aio.EOF:
            responses.append(response)

    assert [(r.request_id, r.WhichOneof("result")) for r in responses] == [
        ("k-1", "error"), ("k-1", "answer"),
    ]  # fmt: skip
    assert "'k-1' is already outstanding on this stream" in responses[0].error.message


async def test_a_full_queue_refuses_on_the_stream_with_a_retry_hint_and_loses_nothing() -> None:
    device = Device()  # held until every request was admitted or refused
    config = BatchConfig(max_batch=2, max_wait_ms=1, max_queue=4)
    async with gateway(fault=device.hook, batch=config, engine="inline") as c:
        requests = [c.request(f"r-{i}", "k", s) for i, s in enumerate(observations(12))]
        for i, request in enumerate(requests):
            request.request_id = f"call-{i}"
        exchanged = asyncio.ensure_future(exchange(c, requests))
        batcher = c.gateway.batcher
        await Device.until(
            "every request admitted or refused",
            lambda: batcher.outstanding + batcher.metrics.refused_full == 12,
        )
        device.gate.set()
        responses = await exchanged

    refused = [r for r in responses if r.WhichOneof("result") == "error"]
    answered = [r for r in responses if r.WhichOneof("result") == "answer"]
    assert refused and answered and len(refused) + len(answered) == 12
    for r in refused:
        assert r.error.code == "RESOURCE_EXHAUSTED" and "queue is full" in r.error.message
        assert r.error.retry_after_s > 0


async def test_a_stream_is_held_back_at_its_outstanding_limit() -> None:
    """With at most two outstanding, the gateway reads no further: no batch holds more than
    two of the stream's requests, though the device would take eight, and all are answered."""

    def slow() -> None:
        time.sleep(0.05)

    config = BatchConfig(max_batch=8, max_wait_ms=20)
    async with gateway(
        fault=slow, batch=config, engine="inline", stream_outstanding=2
    ) as c:  # fmt: skip
        responses = await exchange(
            c, [c.request("r-1", f"k{i}", s) for i, s in enumerate(observations(10))]
        )
        metrics = c.gateway.batcher.metrics

    assert sorted(r.request_id for r in responses) == sorted(f"k{i}" for i in range(10))
    assert all(r.WhichOneof("result") == "answer" for r in responses)
    assert max(metrics.batch_sizes) == 2


async def test_a_repeated_idempotency_key_on_a_stream_gets_the_stored_answer() -> None:
    sample = observations(1)[0]

    async with gateway() as c:
        again = c.request("r-1", "step-3", sample)
        again.request_id = "retry-of-step-3"
        first, again = await exchange(
            c, [c.request("r-1", "step-3", sample), again], all_at_once=False
        )

    assert not first.answer.replayed and again.answer.replayed
    assert again.request_id == "retry-of-step-3"
    assert again.answer.output.values == first.answer.output.values


async def test_a_caller_that_goes_away_leaves_the_gateway_serving_others() -> None:
    """A stream cancelled with requests outstanding: the gateway drops them quietly (their
    answers are kept for a retry) and goes on answering other callers."""

    device = Device()
    samples = observations(4)

    async with gateway(fault=device.hook, engine="inline") as c:
        call = c.stub.InferStream()
        for i, s in enumerate(samples):
            await call.write(c.request("r-gone", f"k{i}", s))
        await Device.until("all four admitted", lambda: c.gateway.batcher.outstanding == 4)
        during = c.gateway.metrics_text()
        call.cancel()
        device.gate.set()
        after = await c.infer("r-2", "k", samples[0])
        retried = await c.infer("r-gone", "k3", samples[3])
        later = c.gateway.metrics_text()

    assert "fleet_gateway_streams_open 1.0\n" in during
    assert 'fleet_gateway_requests_total{via="grpc_stream"} 4.0\n' in later
    assert 'fleet_gateway_requests_total{via="grpc"} 2.0\n' in later
    assert "fleet_gateway_streams_open 0.0\n" in later
    assert after.output.values == pytest.approx(reference(samples[:1])[0], abs=1e-5)
    assert retried.output.values == pytest.approx(reference(samples[3:])[0], abs=1e-5)


# -- InferStreamClient: the caller's side ----------------------------------------------------


async def test_the_client_shares_one_stream_among_many_concurrent_calls() -> None:
    samples = observations(48)

    async with (
        gateway(batch=BatchConfig(max_batch=16, max_wait_ms=20)) as c,
        InferStreamClient(c.stub) as client,
    ):
        answers = list(
            await asyncio.gather(
                *(client.infer(c.request(f"r-{i % 3}", f"k{i}", s)) for i, s in enumerate(samples))
            )
        )

    assert max(a.batch_size for a in answers) > 1
    for answer, want in zip(answers, reference(samples), strict=True):
        assert answer.output.values == pytest.approx(want, rel=2e-6, abs=1e-5)


async def test_the_client_raises_what_the_gateway_refused_with_and_goes_on() -> None:
    device = Device(shut=False)
    sample = observations(1)[0]

    config = BatchConfig(max_batch=1, max_wait_ms=1, max_queue=1)
    async with (
        gateway(fault=device.hook, batch=config, engine="inline") as c,
        InferStreamClient(c.stub) as client,
    ):
        other = issue(SECRET, "r-other", time.time() + 60)
        nameless = c.request("r-1", "k-x", sample)
        nameless.request_id = ""
        local = []
        for request in (nameless, c.request("r-1", "k-1", sample)):
            try:
                await client.infer(request)
            except FleetError as exc:
                local.append(exc)
        device.gate.clear()  # held until all seven calls were refused or admitted
        calls = [
            asyncio.ensure_future(client.infer(c.request("r-1", "k-denied", sample, token=other))),
            *(asyncio.ensure_future(client.infer(c.request(f"r-{i}", f"k-{i}", sample)))
              for i in range(2, 8)),
        ]  # fmt: skip
        await Device.until(
            "every call refused or admitted",
            lambda: sum(f.done() for f in calls) + c.gateway.batcher.outstanding == 7,
        )
        device.gate.set()
        results = list(await asyncio.gather(*calls, return_exceptions=True))

    assert isinstance(local[0], InvalidArgument) and "request_id is empty" in local[0].message
    assert len(local) == 1  # the second call was answered
    assert isinstance(results[0], PermissionDenied) and "scoped" in results[0].message
    full = [r for r in results[1:] if isinstance(r, ResourceExhausted)]
    answered = [r for r in results[1:] if isinstance(r, inference_pb2.InferResponse)]
    assert full and answered and len(full) + len(answered) == 6
    assert all(e.retry_after_s and e.retry_after_s > 0 for e in full)


async def test_calls_waiting_on_a_broken_stream_raise_unavailable_and_resume_on_a_new_one() -> None:
    """The channel closes under two waiting calls: both raise Unavailable; the same requests
    on a new stream get the answers the gateway stored meanwhile (replayed), not new ones."""

    device = Device()
    samples = observations(2)

    async with gateway(fault=device.hook, engine="inline") as c:
        requests = [c.request("r-1", f"k{i}", s) for i, s in enumerate(samples)]
        channel = grpc.aio.insecure_channel(c.address)
        client = InferStreamClient(inference_pb2_grpc.InferenceServiceStub(channel))
        await client.__aenter__()
        calls = [asyncio.create_task(client.infer(r)) for r in requests]
        await Device.until("both admitted", lambda: c.gateway.batcher.outstanding == 2)
        await channel.close()
        broken = await asyncio.gather(*calls, return_exceptions=True)
        with pytest.raises(Unavailable, match="open a new stream"):
            await client.infer(c.request("r-1", "k-late", samples[0]))
        device.gate.set()  # the batches run to the end and their answers are stored
        await Device.until("both answered", lambda: c.gateway.batcher.metrics.served == 2)
        async with InferStreamClient(c.stub) as again:
            resumed = [await again.infer(r) for r in requests]
        broken = list(broken)

    assert all(isinstance(e, Unavailable) and e.retry_after_s for e in broken)
    assert all(r.replayed for r in resumed)
    for answer, want in zip(resumed, reference(samples), strict=True):
        assert answer.output.values == pytest.approx(want, abs=1e-5)
