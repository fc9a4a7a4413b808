"""The gateway's pure decisions: the breaker's transitions, memory admission, and what the
batcher does with a runner that fails in ways no device should (fakes of the Runner port)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from fleet.cli.top import parse
from fleet.core.errors import Unavailable
from gateway.admission import MemoryModel, admissible
from gateway.batcher import Answer, BatchConfig, Batcher, kept_bytes
from gateway.breaker import HISTORY_KEPT, BreakerState, CircuitBreaker
from gateway.model import ModelSpec


def test_breaker_opens_after_consecutive_faults_only() -> None:
    """A success in between resets the count; the threshold-th fault in a row opens it."""
    b = CircuitBreaker(failure_threshold=3, open_s=1.0)
    b.failure(0.0, "x")
    b.failure(0.1, "x")
    b.success(0.2)
    b.failure(0.3, "x")
    b.failure(0.4, "x")
    assert b.state == BreakerState.CLOSED and b.use_primary(0.5)
    b.failure(0.5, "oom")
    assert b.state == BreakerState.OPEN and not b.use_primary(0.6)


def test_breaker_probes_once_half_open_then_closes_or_reopens() -> None:
    b = CircuitBreaker(failure_threshold=1, open_s=1.0)
    b.failure(0.0, "device error")
    assert not b.use_primary(0.9)
    assert b.use_primary(1.0) and b.state == BreakerState.HALF_OPEN  # the probe
    assert not b.use_primary(1.0)  # one probe at a time
    b.failure(1.1, "still broken")
    assert b.state == BreakerState.OPEN and not b.use_primary(1.5)
    assert b.use_primary(2.2)
    b.success(2.3)
    assert b.state == BreakerState.CLOSED
    assert [(t.before, t.after) for t in b.history] == [
        (BreakerState.CLOSED, BreakerState.OPEN),
        (BreakerState.OPEN, BreakerState.HALF_OPEN),
        (BreakerState.HALF_OPEN, BreakerState.OPEN),
        (BreakerState.OPEN, BreakerState.HALF_OPEN),
        (BreakerState.HALF_OPEN, BreakerState.CLOSED),
    ]


def test_a_flapping_breaker_keeps_only_its_latest_transitions() -> None:
    b = CircuitBreaker(failure_threshold=1, open_s=1.0)
    for i in range(HISTORY_KEPT):  # each round: closed -> open -> half open -> closed
        b.failure(2.0 * i, f"fault {i}")
        assert b.use_primary(2.0 * i + 1.0)
        b.success(2.0 * i + 1.0)
    assert len(b.history) == HISTORY_KEPT
    assert b.history[-1].after == BreakerState.CLOSED
    assert b.history[-3].reason == f"a fault: fault {HISTORY_KEPT - 1}"


def test_breaker_refuses_illegal_moves() -> None:
    b = CircuitBreaker()
    with pytest.raises(RuntimeError, match="cannot go from closed to half_open"):
        b._move(BreakerState.HALF_OPEN, 0.0, "no")


MODEL = MemoryModel(weights_bytes=1000, activation_bytes_per_sample=100, headroom_bytes=500)


@pytest.mark.parametrize(
    ("capacity", "in_use", "wanted", "observed", "admit"),
    [
        (10_000, 0, 50, None, 50),  # fits whole
        (5_000, 0, 64, None, 35),  # shrunk to what is free: (5000-1000-500)//100
        (5_000, 2_000, 64, None, 15),  # other batches hold memory
        (10_000, 0, 64, 2_500, 20),  # the driver says less is free than predicted
        (1_400, 0, 8, None, 0),  # not even one sample
    ],
)
def test_admission_shrinks_batches_to_what_fits(
    capacity: int, in_use: int, wanted: int, observed: int | None, admit: int
) -> None:
    decision = admissible(MODEL, capacity, in_use, wanted, observed)
    assert decision.admit == admit
    if admit:
        used = MODEL.weights_bytes + MODEL.headroom_bytes + in_use + MODEL.batch_bytes(admit)
        assert used <= capacity
    else:
        assert "no room" in decision.reason


class FakeRunner:
    """A Runner whose answers (or failures) a test chooses: output = [sum of the sample]."""

    spec = ModelSpec(name="m", revision="r", file="f", sha256="", input_dim=2, hidden=(),
                     output_dim=1)  # fmt: skip
    memory = MemoryModel(weights_bytes=0, activation_bytes_per_sample=1)
    capacity_bytes = 1 << 30
    restarts = 0

    def __init__(self, device: str, answer: Callable[[list[list[float]]], list[list[float]]]):
        self.device = device
        self.answer = answer
        self.calls = 0
        self.gpu: float | None = None

    async def infer(self, inputs: list[list[float]]) -> list[list[float]]:
        self.calls += 1
        return self.answer(inputs)

    def observed_free_bytes(self) -> int | None:
        return None

    def utilization(self) -> float | None:
        return self.gpu

    def close(self) -> None:
        pass


def sums(inputs: list[list[float]]) -> list[list[float]]:
    return [[sum(sample)] for sample in inputs]


def boom(inputs: list[list[float]]) -> list[list[float]]:
    raise RuntimeError("boom")


def run_batch(
    primary: FakeRunner, fallback: FakeRunner
) -> tuple[list[Answer | BaseException], Batcher]:
    async def body() -> tuple[list[Answer | BaseException], Batcher]:
        batcher = Batcher(primary, fallback, BatchConfig(max_batch=4, max_wait_ms=5),
                          CircuitBreaker(failure_threshold=1, open_s=60))  # fmt: skip
        batcher.start()
        try:
            calls = [batcher.infer("r", f"k{i}", [i, 1.0], time.time() + 30) for i in range(4)]
            # A request left waiting would hang here: the timeout turns that into a failure.
            return await asyncio.wait_for(
                asyncio.gather(*calls, return_exceptions=True), 10
            ), batcher
        finally:
            await batcher.stop()

    return asyncio.run(body())


@pytest.mark.parametrize(
    ("broken", "why"),
    [(boom, "RuntimeError: boom"), (lambda inputs: [[1.0]], "1 outputs for a batch of 4")],
)
def test_a_runner_failing_unlike_a_device_is_a_device_error_and_fails_over(
    broken: Callable[[list[list[float]]], list[list[float]]], why: str
) -> None:
    """An exception that is not a DeviceFault, or answers that do not match the batch: the
    batch is re-run on the replica, and the breaker counts a fault saying what happened."""
    primary, fallback = FakeRunner("gpu", broken), FakeRunner("cpu", sums)
    answers, batcher = run_batch(primary, fallback)
    assert [a.output for a in answers if isinstance(a, Answer)] == [[1.0], [2.0], [3.0], [4.0]]
    assert all(isinstance(a, Answer) and a.degraded for a in answers)
    assert batcher.breaker.state == BreakerState.OPEN and why in batcher.breaker.history[0].reason


def test_the_primary_gpus_utilization_is_a_metric_only_where_its_driver_gives_one() -> None:
    primary = FakeRunner("cuda:0", sums)
    _, batcher = run_batch(primary, FakeRunner("cpu", sums))
    assert "fleet_gateway_gpu_utilization" not in batcher.metrics_text()  # never a made-up 0
    primary.gpu = 0.42
    lines = batcher.metrics_text().splitlines()
    assert "fleet_gateway_gpu_utilization 0.42" in lines
    assert "# TYPE fleet_gateway_gpu_utilization gauge" in lines


async def test_remembered_answers_are_bounded_by_memory_as_well_as_by_count() -> None:
    """Answers of 1,000 values each, a budget of about ten of them: the oldest are forgotten
    (a retry of one is computed again), the newest are replayed, and the estimate stays under
    the budget."""
    wide = FakeRunner("cpu", lambda inputs: [[sum(x)] * 1000 for x in inputs])
    budget_mib = 10 * kept_bytes(("r", "k00"), Answer([0.0] * 1000, "", "", 1, 0.0, False)) / 2**20

    batcher = Batcher(
        wide, None, BatchConfig(max_batch=1, max_wait_ms=0, answers_kept_mib=budget_mib)
    )
    batcher.start()
    try:
        for i in range(30):
            await batcher.infer("r", f"k{i:02d}", [i, 0.0], time.time() + 30)
        again = [
            await batcher.infer("r", key, [0.0, 0.0], time.time() + 30) for key in ("k29", "k00")
        ]
        (newest, oldest) = again
    finally:
        await batcher.stop()

    assert newest.replayed and newest.output[0] == 29.0  # remembered: the stored answer
    assert not oldest.replayed and oldest.output[0] == 0.0  # forgotten: computed again
    assert wide.calls == 31 and batcher.metrics.replayed == 1
    kept = parse(batcher.metrics_text())
    assert kept["fleet_gateway_answers_kept"] == 10  # the budget: ten answers of this size
    assert kept["fleet_gateway_answers_kept_bytes"] <= budget_mib * 2**20


def test_when_every_runner_fails_each_request_gets_a_resumable_refusal() -> None:
    answers, batcher = run_batch(FakeRunner("gpu", boom), FakeRunner("cpu", boom))
    assert len(answers) == 4 and all(isinstance(a, Unavailable) for a in answers)
    assert all("retry with the same idempotency key" in str(a) for a in answers)
    assert batcher.metrics.failovers == 1 and batcher.metrics.served == 0


@pytest.mark.parametrize(
    ("timings", "expected"),
    [
        # Plain wins at 1 and 2 rows (a matrix-vector product), packed from 4 on.
        ({1: (3.2, 3.5), 2: (3.2, 5.5), 4: (6.5, 6.3), 8: (9.4, 7.2), 64: (22.3, 19.4)}, 4),
        ({1: (3.0, 2.0), 4: (6.0, 5.0), 64: (20.0, 19.0)}, 1),  # packed wins everywhere
        ({1: (0.03, 0.1), 8: (0.04, 0.1), 64: (0.1, 0.2)}, None),  # a small model: never
        ({1: (3.0, 2.0), 8: (9.0, 7.0), 64: (20.0, 20.0)}, None),  # a tie at the largest: no
        # A loss in the middle: only the sizes past it, where it won every time.
        ({1: (3.0, 4.0), 4: (6.0, 5.0), 16: (11.0, 12.0), 32: (16.0, 13.0), 64: (22.0, 19.0)}, 32),
    ],
)
def test_packed_weights_serve_from_the_size_past_their_last_loss(
    timings: dict[int, tuple[float, float]], expected: int | None
) -> None:
    from gateway.model import packed_from

    assert packed_from(timings) == expected


def test_the_gateway_without_torch_says_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    from fleet.core.errors import FailedPrecondition
    from gateway import require_torch

    real = importlib.util.find_spec
    require_torch()  # installed here
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    with pytest.raises(FailedPrecondition, match=r"pip install 'fleet\[gateway\]'"):
        require_torch()


async def test_device_seconds_wait_for_the_server_and_what_cannot_wait_is_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gateway import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "DEVICE_ROLLOUTS_KEPT", 1)

    b = Batcher(FakeRunner("cpu", sums), None, BatchConfig(max_batch=1, max_wait_ms=0))
    b.start()
    try:
        await b.infer("r-kept", "k1", [1.0, 1.0], time.time() + 30)
        await b.infer("r-kept", "k2", [2.0, 1.0], time.time() + 30)
        await b.infer("r-late", "k1", [3.0, 1.0], time.time() + 30)  # the table is full
        first, second = b.take_device_seconds(), b.take_device_seconds()
        unkept = b.metrics.device_seconds_unkept
    finally:
        await b.stop()

    assert list(first) == ["r-kept"] and first["r-kept"] > 0 and second == {}
    assert unkept > 0  # said, in the log and as fleet_gateway_device_seconds_unkept_total
