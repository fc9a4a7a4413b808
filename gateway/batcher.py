"""Dynamic batching with a bounded queue, memory admission, a breaker and CPU failover.

Requests join one queue. A batch starts when `max_batch` requests wait or the oldest has waited
`max_wait_ms`. Before it runs, admission shrinks it to what the device's memory takes; the rest
stay queued, first in line. The breaker picks the device: the primary while it is healthy, the
CPU replica (its own, smaller batches) while it is open. A batch that faults on the primary is
re-run at once on the replica, so an accepted request is answered, or refused with a resumable
UNAVAILABLE, and never lost. A full queue refuses at once with RESOURCE_EXHAUSTED and a retry
hint; requests never time out in a pile.

Answers are kept by (rollout, idempotency key): a retried request gets the stored answer, and
a duplicate of one still in flight waits for the same answer.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from dataclasses import dataclass, field

import structlog

from fleet.core.errors import (
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from fleet.prom import (
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    counter,
    exposition,
    gauge,
)
from gateway.admission import admissible
from gateway.breaker import CircuitBreaker
from gateway.model import DeviceFault, Runner
from gateway.settings import BatchConfig as BatchConfig  # (re-exported: callers build it)

log = structlog.get_logger(__name__)


LATENCIES_KEPT = 100_000
"""Answered requests' latencies kept for the p95 (the oldest go first)."""
DEVICE_ROLLOUTS_KEPT = 65_536
"""Rollouts whose device seconds wait for the fleet server's next poll, at most."""


@dataclass(frozen=True)
class Answer:
    output: list[float]
    device: str
    revision: str
    batch_size: int
    queue_ms: float
    degraded: bool
    replayed: bool = False


ANSWER_BYTES, VALUE_BYTES = 640, 34
"""What one remembered answer takes beyond its output (the answer, its key, the table's entry),
and per output value (a float and its place in the list): measured on CPython 3.11, rounded
up."""


def kept_bytes(key: tuple[str, str], answer: Answer) -> int:
    return ANSWER_BYTES + VALUE_BYTES * len(answer.output) + len(key[0]) + len(key[1])


@dataclass
class _Pending:
    rollout_id: str
    key: tuple[str, str]
    sample: list[float]
    deadline: float
    enqueued: float
    future: asyncio.Future[Answer]


@dataclass
class Metrics:
    served: int = 0
    replayed: int = 0
    refused_full: int = 0
    failovers: int = 0
    degraded: int = 0
    batches: int = 0
    batch_sizes: collections.Counter[int] = field(default_factory=collections.Counter)
    busy_s: float = 0.0
    started: float = field(default_factory=time.monotonic)
    shrunk: int = 0
    oom_faults: int = 0
    probes: int = 0
    probes_failed: int = 0
    device_seconds_unkept: float = 0.0
    """Device seconds not kept for the fleet server (no server polled and the table was full)."""


class Batcher:
    def __init__(
        self,
        primary: Runner,
        fallback: Runner | None,
        config: BatchConfig | None = None,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        self.primary = primary
        self.fallback = fallback
        self.config = config or BatchConfig()
        self.breaker = breaker or CircuitBreaker()
        self.metrics = Metrics()
        self._queue: collections.deque[_Pending] = collections.deque()
        self._wake = asyncio.Event()
        self._inflight: dict[str, int] = collections.Counter()
        self._pending: dict[tuple[str, str], asyncio.Future[Answer]] = {}
        self._answers: collections.OrderedDict[tuple[str, str], Answer] = collections.OrderedDict()
        self._answers_bytes = 0
        self._task: asyncio.Task[None] | None = None
        self._rate = 1000.0  # samples/s, updated per batch, for retry hints
        self._latencies: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=LATENCIES_KEPT
        )
        """(answered at, seconds in the gateway) of recent requests."""
        self._device_s: dict[str, float] = {}
        """Device seconds per rollout not yet taken by the fleet server."""

    # -- API ----------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for item in self._queue:
            if not item.future.done():
                item.future.set_exception(
                    Unavailable("the gateway is shutting down; retry", retry_after_s=1.0)
                )
                item.future.exception()  # its caller may be gone: no "never retrieved" noise
        self._queue.clear()
        for runner in (self.primary, self.fallback):
            if runner is not None:
                runner.close()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def outstanding(self) -> int:
        """Requests admitted and not answered yet (queued, or in a batch on a device)."""
        return sum(self._inflight.values())

    def oldest_queued_s(self) -> float:
        return time.monotonic() - self._queue[0].enqueued if self._queue else 0.0

    def p95_latency_s(self) -> float:
        """The 95th percentile of the time requests answered in the last `latency_window_s`
        spent in the gateway (0.0: none were)."""
        since = time.monotonic() - self.config.latency_window_s
        while self._latencies and self._latencies[0][0] < since:
            self._latencies.popleft()
        if not self._latencies:
            return 0.0
        ordered = sorted(seconds for _, seconds in self._latencies)
        return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]

    def take_device_seconds(self) -> dict[str, float]:
        """Device seconds per rollout since the last call (the fleet server charges them)."""
        taken, self._device_s = self._device_s, {}
        return taken

    async def infer(
        self, rollout_id: str, idempotency_key: str, sample: list[float], deadline: float
    ) -> Answer:
        """The model's output for one sample (see the module docstring for the rules)."""
        if not idempotency_key:
            raise InvalidArgument("idempotency_key is empty: every inference request needs one")
        key = (rollout_id, idempotency_key)
        stored = self._answers.get(key)
        if stored is not None:
            self.metrics.replayed += 1
            return Answer(**{**stored.__dict__, "replayed": True})
        running = self._pending.get(key)
        if running is not None:
            return await asyncio.shield(running)
        if len(self._queue) >= self.config.max_queue:
            self.metrics.refused_full += 1
            raise ResourceExhausted(
                f"gateway queue is full ({len(self._queue)} waiting); retry shortly",
                retry_after_s=round(max(0.01, len(self._queue) / max(self._rate, 1.0)), 3),
            )
        if self._inflight[rollout_id] >= self.config.max_inflight_per_rollout:
            raise ResourceExhausted(
                f"rollout {rollout_id} has {self._inflight[rollout_id]} inference requests in "
                f"flight, its limit; wait for one to finish",
                retry_after_s=0.05,
            )
        if time.time() >= deadline:
            raise DeadlineExceeded("the request's deadline passed before it was queued")
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        self._inflight[rollout_id] += 1
        self._queue.append(_Pending(rollout_id, key, sample, deadline, time.monotonic(), future))
        self._wake.set()
        try:
            return await asyncio.shield(future)
        finally:
            self._inflight[rollout_id] -= 1
            if self._inflight[rollout_id] <= 0:
                del self._inflight[rollout_id]
            if self._pending.get(key) is future and future.done():
                del self._pending[key]

    # -- the batch loop -----------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                if self.config.probe_interval_s <= 0:
                    await self._wake.wait()
                    continue
                try:
                    await asyncio.wait_for(self._wake.wait(), self.config.probe_interval_s)
                except TimeoutError:
                    await self._probe()
                continue
            oldest = self._queue[0].enqueued
            wait = oldest + self.config.max_wait_ms / 1000 - time.monotonic()
            if len(self._queue) < self.config.max_batch and wait > 0:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)
                if len(self._queue) < self.config.max_batch and (
                    oldest + self.config.max_wait_ms / 1000 > time.monotonic()
                ):
                    continue
            try:
                await self._one_batch()
            except Exception:  # never let one batch stop the loop
                log.exception("batch_failed")

    async def _probe(self) -> None:
        """One sample of zeros on the primary, as the breaker's health probe (see
        `BatchConfig.probe_interval_s`); nothing is probed while the breaker keeps it shut."""
        if not self.breaker.use_primary(time.monotonic()):
            return
        self.metrics.probes += 1
        try:
            await self.primary.infer([[0.0] * self.primary.spec.input_dim])
        except Exception as exc:  # any failure of the probe is the device's
            self.metrics.probes_failed += 1
            kind = exc.kind if isinstance(exc, DeviceFault) else type(exc).__name__
            self.breaker.failure(time.monotonic(), f"health probe: {kind}: {exc}")
            log.warning("health_probe_failed", device=self.primary.device, kind=kind,
                        error=str(exc), breaker=str(self.breaker.state))  # fmt: skip
            return
        self.breaker.success(time.monotonic())

    def _take(self, limit: int) -> list[_Pending]:
        batch: list[_Pending] = []
        now = time.time()
        while self._queue and len(batch) < limit:
            item = self._queue.popleft()
            if item.future.done():
                continue
            if now >= item.deadline:
                item.future.set_exception(
                    DeadlineExceeded("the request's deadline passed while it was queued")
                )
                continue
            batch.append(item)
        return batch

    async def _one_batch(self) -> None:
        use_primary = self.breaker.use_primary(time.monotonic()) or self.fallback is None
        runner = self.primary if use_primary else self.fallback
        assert runner is not None
        limit = self.config.max_batch if use_primary else self.config.fallback_max_batch
        wanted = min(limit, len(self._queue))
        decision = admissible(
            runner.memory, runner.capacity_bytes, 0, wanted, runner.observed_free_bytes()
        )
        if decision.admit == 0:
            if use_primary and self.fallback is not None:
                runner, use_primary = self.fallback, False
                decision = admissible(
                    runner.memory, runner.capacity_bytes, 0,
                    min(self.config.fallback_max_batch, wanted), runner.observed_free_bytes(),
                )  # fmt: skip
            if decision.admit == 0:
                for item in self._take(1):
                    item.future.set_exception(
                        ResourceExhausted(
                            f"one sample does not fit in the device's memory: {decision.reason}"
                        )
                    )
                return
        if decision.admit < wanted:
            self.metrics.shrunk += 1
        batch = self._take(decision.admit)
        if not batch:
            return
        try:
            await self._answer(batch, runner, use_primary)
        except BaseException:  # whatever went wrong, no request of the batch is left waiting
            why = "the gateway failed this batch; retry with the same idempotency key"
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(Unavailable(why, retry_after_s=0.5))
            raise

    async def _answer(self, batch: list[_Pending], runner: Runner, use_primary: bool) -> None:
        answers = await self._execute(runner, batch, degraded=not use_primary)
        if answers is None and use_primary and self.fallback is not None:
            self.metrics.failovers += 1
            answers = await self._execute(self.fallback, batch, degraded=True)
        if answers is None:
            why = "inference failed on every device; retry with the same idempotency key"
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(Unavailable(why, retry_after_s=0.5))
            return
        answered = time.monotonic()
        for item, answer in zip(batch, answers, strict=True):
            self._latencies.append((answered, answered - item.enqueued))
            self._remember(item.key, answer)
            if not item.future.done():
                item.future.set_result(answer)
            if self._pending.get(item.key) is item.future:
                del self._pending[item.key]

    def _remember(self, key: tuple[str, str], answer: Answer) -> None:
        """Keeps `answer` for retries of `key`, forgetting the oldest past either bound."""
        old = self._answers.pop(key, None)
        if old is not None:
            self._answers_bytes -= kept_bytes(key, old)
        self._answers[key] = answer
        self._answers_bytes += kept_bytes(key, answer)
        most = self.config.answers_kept_mib * 1024 * 1024
        while self._answers and (
            len(self._answers) > self.config.answers_kept or self._answers_bytes > most
        ):
            gone = self._answers.popitem(last=False)
            self._answers_bytes -= kept_bytes(*gone)

    async def _execute(
        self, runner: Runner, batch: list[_Pending], *, degraded: bool
    ) -> list[Answer] | None:
        started = time.monotonic()
        try:
            try:
                outputs = await runner.infer([item.sample for item in batch])
            except DeviceFault:
                raise
            except Exception as exc:  # a runner's own failure is its device's, too
                raise DeviceFault("device_error", f"{type(exc).__name__}: {exc}") from exc
            if len(outputs) != len(batch):
                raise DeviceFault(
                    "device_error", f"{len(outputs)} outputs for a batch of {len(batch)}"
                )
        except DeviceFault as exc:
            if exc.kind == "oom":
                self.metrics.oom_faults += 1
            if runner is self.primary:
                self.breaker.failure(time.monotonic(), f"{exc.kind}: {exc}")
            log.warning("batch_fault", device=runner.device, kind=exc.kind, size=len(batch),
                        error=str(exc), breaker=str(self.breaker.state))  # fmt: skip
            return None
        took = time.monotonic() - started
        if runner is self.primary:
            self.breaker.success(time.monotonic())
        self.metrics.batches += 1
        self.metrics.batch_sizes[len(batch)] += 1
        self.metrics.busy_s += took
        self.metrics.served += len(batch)
        if degraded:
            self.metrics.degraded += len(batch)
        self._rate = 0.8 * self._rate + 0.2 * (len(batch) / max(took, 1e-6))
        share = took / len(batch)
        for item in batch:
            spent = self._device_s.get(item.rollout_id)
            if spent is not None or len(self._device_s) < DEVICE_ROLLOUTS_KEPT:
                self._device_s[item.rollout_id] = (spent or 0.0) + share
            else:
                if not self.metrics.device_seconds_unkept:
                    log.warning("device_seconds_unkept", rollouts_waiting=len(self._device_s),
                                why="no fleet server has polled this gateway for them")  # fmt: skip
                self.metrics.device_seconds_unkept += share
        device = runner.device + (" (failover)" if degraded else "")
        return [
            Answer(
                output=out, device=device, revision=runner.spec.revision, batch_size=len(batch),
                queue_ms=(started - item.enqueued) * 1000, degraded=degraded,
            )
            for item, out in zip(batch, outputs, strict=True)
        ]  # fmt: skip

    def metric_families(self) -> list[Metric]:
        """What the batcher counts, for the gateway's metrics."""
        m = self.metrics
        elapsed = max(1e-9, time.monotonic() - m.started)
        spec = self.primary.spec
        info = GaugeMetricFamily(
            "fleet_gateway_model_info", "What the primary serves: model, revision, device, "
            "precision.", labels=["model", "revision", "device", "dtype"],
        )  # fmt: skip
        info.add_metric([spec.name, spec.revision, self.primary.device, spec.dtype], 1)
        total = sum(size * n for size, n in m.batch_sizes.items())
        buckets = [
            (str(bound), sum(n for size, n in m.batch_sizes.items() if size <= bound))
            for bound in (1, 2, 4, 8, 16, 32, 64, 128, 256)
        ]
        sizes = HistogramMetricFamily(
            "fleet_gateway_batch_size", "Samples per batch run.",
            buckets=[*buckets, ("+Inf", m.batches)], sum_value=total,
        )  # fmt: skip
        families: list[Metric] = [
            info,
            counter("fleet_gateway_served_total", "Requests answered.", m.served),
            counter("fleet_gateway_replayed_total", "Retries answered from memory.", m.replayed),
            counter("fleet_gateway_refused_queue_full_total", "Requests refused: queue full.",
                    m.refused_full),
            counter("fleet_gateway_failovers_total", "Batches re-run on the CPU replica.",
                    m.failovers),
            gauge("fleet_gateway_answers_kept", "Answers remembered for idempotent retries.",
                  len(self._answers)),
            gauge("fleet_gateway_answers_kept_bytes", "The memory they are estimated to take.",
                  self._answers_bytes),
            gauge("fleet_gateway_queue_depth", "Requests queued.", self.queue_depth),
            gauge("fleet_gateway_queue_oldest_seconds", "How long the oldest queued request "
                  "has waited.", self.oldest_queued_s()),
            gauge("fleet_gateway_latency_p95_seconds", "The 95th percentile of requests' time "
                  "in the gateway (queue and device) over its latency window.",
                  self.p95_latency_s()),
            counter("fleet_gateway_device_seconds_total", "Seconds the devices ran batches.",
                    m.busy_s),
            counter("fleet_gateway_device_seconds_unkept_total", "Device seconds no attempt "
                    "will be charged: no fleet server polled for them before the table filled.",
                    m.device_seconds_unkept),
            gauge("fleet_gateway_device_busy_fraction", "Share of the gateway's life a device "
                  "ran batches.", min(1.0, m.busy_s / elapsed)),
            counter("fleet_gateway_engine_restarts_total", "Times the primary's model engine "
                    "was started again after a device error, a hang or its exit.",
                    self.primary.restarts),
            counter("fleet_gateway_health_probes_total", "Probes of an idle primary.", m.probes),
            counter("fleet_gateway_health_probes_failed_total", "Probes that failed.",
                    m.probes_failed),
            gauge("fleet_gateway_breaker_open", "1 while the breaker sends batches to the CPU "
                  "replica.", int(str(self.breaker.state) != "closed")),
            sizes,
        ]  # fmt: skip
        share = self.primary.utilization()
        if share is not None:  # the primary GPU's utilization, where its driver reports one
            families.append(gauge(
                "fleet_gateway_gpu_utilization", "Share of the driver's last sample period in "
                "which a kernel ran on the primary GPU (NVML; nvidia-smi's GPU-Util).", share,
            ))  # fmt: skip
        return families

    def metrics_text(self) -> str:
        """Prometheus text format."""
        return exposition(self.metric_families())
