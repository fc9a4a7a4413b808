"""InferenceService over gRPC, plus the gateway's assembly and its Prometheus metrics.

A thin servicer: check the token, the model, the revision and the input, then hand the sample
to the batcher. Errors leave through fleet's one chokepoint, the server interceptor of
`fleet.api.interceptor` (InferStream answers each request's refusal in-band instead).
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import UTC

import grpc
import structlog
from grpc_health.v1 import health, health_pb2_grpc

from fleet.api.interceptor import ApiInterceptor
from fleet.api.pb import inference_pb2, inference_pb2_grpc
from fleet.api.status import as_refusal
from fleet.core.errors import (
    FailedPrecondition,
    FleetError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from fleet.core.tokens import TokenClaims, check_running, verify
from fleet.prom import CounterMetricFamily, counter, exposition, gauge
from gateway.accounting import Mark, UsageBook
from gateway.batcher import Answer, Batcher
from gateway.breaker import CircuitBreaker
from gateway.engine import EngineRunner
from gateway.llm.generate import generate_events
from gateway.llm.replay import Replays
from gateway.llm.serving import LanguageModel, open_language_model
from gateway.llm.upstream import Upstreams
from gateway.model import (
    DeviceFault,
    ModelSpec,
    Runner,
    TorchRunner,
    device_capacity_bytes,
    load_network,
    select_model,
)
from gateway.readiness import Readiness
from gateway.settings import GatewayConfig as GatewayConfig  # (re-exported: callers build it)

log = structlog.get_logger(__name__)

MAX_REQUEST_BYTES = 1 << 20


def _primary_device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if choice.startswith("cuda") and not torch.cuda.is_available():
        raise FailedPrecondition(f"device {choice!r}: no CUDA device here")
    return choice


ENGINES = ("process", "inline")


def _check_limits(config: GatewayConfig) -> None:
    """Refuses a limit that would make the gateway refuse, or never bound, what it serves."""
    b = config.batch
    least = {
        "max_batch": (b.max_batch, 1), "max_queue": (b.max_queue, 1),
        "max_inflight_per_rollout": (b.max_inflight_per_rollout, 1),
        "fallback_max_batch": (b.fallback_max_batch, 1), "answers_kept": (b.answers_kept, 0),
        "max_wait_ms": (b.max_wait_ms, 0), "probe_interval_s": (b.probe_interval_s, 0),
        "answers_kept_mib": (b.answers_kept_mib, 0),
        "stream_outstanding": (config.stream_outstanding, 1),
        "breaker_failures": (config.breaker_failures, 1),
    }  # fmt: skip
    for name, (value, floor) in least.items():
        if not value >= floor:  # (NaN too)
            raise InvalidArgument(f"gateway {name} is {value}: it must be at least {floor}")


RUNNING_STALE_S = 10.0
"""A list of running rollouts older than this cannot be trusted (the server stopped polling):
tokens are refused until a fresh one arrives."""
RUNNING_GRACE_S = 1.0
"""A token issued this close before the list was read may belong to an attempt it missed."""
STALE_RETRY_S = 1.0
"""The retry hint of a request refused while the list is stale."""


@dataclass
class Gateway:
    """One model on a primary device with a CPU replica behind a breaker."""

    config: GatewayConfig
    spec: ModelSpec
    batcher: Batcher
    requests: collections.Counter[str] = field(default_factory=collections.Counter)
    """Inference requests received, by how they came (`VIA`)."""
    streams_open: int = 0
    """InferStream calls open now."""
    running: frozenset[str] = frozenset()
    """The rollouts the fleet server last said are running (`note_running`)."""
    running_as_of: float = 0.0
    """When the server read them (0: no server has said yet; tokens are then refused, unless
    the gateway runs standalone: `GatewayConfig.tokens_without_server`)."""
    running_received: float = 0.0
    """When they arrived here (monotonic)."""
    llm: LanguageModel | None = None
    """The language model served through the OpenAI-compatible endpoints (`gateway.http`);
    None when the gateway serves none."""
    usage: UsageBook = field(default_factory=UsageBook)
    """The language model's tokens per rollout, and what the server's polls were handed."""
    replays: Replays = field(default_factory=Replays)
    """Generations kept for their Idempotency-Key, shared by every HTTP endpoint."""
    upstreams: Upstreams | None = None
    """Upstream models the OpenAI-compatible endpoints forward to (`gateway.llm.upstream`),
    with the keys the gateway holds; None: none."""
    _readiness: Readiness | None = field(default=None, init=False, repr=False)

    @property
    def readiness(self) -> Readiness:
        """What /readyz and the gRPC health service answer from."""
        if self._readiness is None:
            self._readiness = Readiness(self)
        return self._readiness

    def note_running(self, ids: list[str], as_of: float, signature: str) -> None:
        """The server's list of running rollouts, signed with the token secret."""
        check_running(self.config.secret, ids, as_of, signature)
        if as_of >= self.running_as_of:  # (an older poll arriving late changes nothing)
            if self._stale_said or (self._unknown_said and not self.running_as_of):
                log.info("running_rollouts_fresh", effect="tokens are served again")
            self.running, self.running_as_of = frozenset(ids), as_of
            self.running_received = time.monotonic()
            self._stale_said = False

    def check_running(self, rollout_id: str, issued_at: float) -> None:
        """PermissionDenied for a rollout the server no longer runs, when the token is older
        than the server's list (a token issued since the list was read belongs to an attempt
        the list could not yet hold). The gateway fails closed: until a server sends a first
        list (a gateway started while its server is down), and while the newest is over
        RUNNING_STALE_S old (the server stopped polling, or cannot reach this gateway), every
        token is refused, Unavailable with a retry hint, since which rollouts have ended cannot
        be learned and a token must not outlive its rollout. A gateway run standalone
        (`tokens_without_server`) serves tokens on their own until a server sends a list."""
        if not self.running_as_of:
            if self.config.tokens_without_server:
                return
            if not self._unknown_said:
                log.warning(
                    "running_rollouts_unknown",
                    effect="tokens are refused until a fleet server polls this gateway",
                )
                self._unknown_said = True
            raise Unavailable(
                "no fleet server has said yet which rollouts are running: tokens are refused "
                "until one polls this gateway (a gateway run without one: "
                "--tokens-without-server)",
                retry_after_s=STALE_RETRY_S,
            )
        quiet_s = time.monotonic() - self.running_received
        if quiet_s > RUNNING_STALE_S:
            if not self._stale_said:
                log.warning(
                    "running_rollouts_stale", seconds=RUNNING_STALE_S,
                    effect="tokens are refused until the server polls again",
                )  # fmt: skip
                self._stale_said = True
            raise Unavailable(
                f"the fleet server has not said which rollouts are running for {quiet_s:.0f} s "
                f"(over {RUNNING_STALE_S:g} s): tokens are refused until it does",
                retry_after_s=STALE_RETRY_S,
            )
        if rollout_id not in self.running and issued_at < self.running_as_of - RUNNING_GRACE_S:
            raise PermissionDenied(
                f"rollout {rollout_id} is not running: its inference token ended with it"
            )

    _stale_said: bool = False
    _unknown_said: bool = False

    @classmethod
    def build(cls, config: GatewayConfig, fault_primary: object | None = None) -> Gateway:
        if not config.secret:
            raise InvalidArgument(
                "the gateway needs the token secret it shares with the fleet server"
            )
        _check_limits(config)
        spec = select_model(config.models_toml, config.model, config.dtype, "gateway dtype")
        if config.engine not in ENGINES:
            raise InvalidArgument(
                f"gateway engine {config.engine!r} is not one of {', '.join(ENGINES)}"
            )
        device = _primary_device(config.device)
        # The gateway's `llm` setting where it has one, else FLEET_GATEWAY_LLM (serving); its
        # manifest and checksums are checked before any engine starts.
        llm = open_language_model(config.llm, device, config.dtype, engine_kind=config.engine,
                                  log_level=config.log_level)  # fmt: skip
        if llm is not None:
            if config.llm_hang_s <= 0:
                raise InvalidArgument(f"llm_hang_s must be above 0, not {config.llm_hang_s}")
            llm.hang_s = config.llm_hang_s
        # Both replicas load the same checksum-verified file.
        stored = replace(spec, dtype="float32")
        fallback = TorchRunner(
            stored, load_network(stored), "cpu",
            device_capacity_bytes("cpu", config.fallback_capacity_mib),
        )  # fmt: skip
        primary: Runner
        reserve = config.batch.max_batch if config.reserve_device_memory else 0
        if config.engine == "process":
            import torch

            engine = EngineRunner(
                spec, config.models_toml, device,
                int(config.capacity_mib * 1024 * 1024) if config.capacity_mib > 0 else 0,
                threads=config.engine_threads or torch.get_num_threads(),
                fault=fault_primary,  # type: ignore[arg-type]
                answer_timeout_s=config.engine_answer_timeout_s, pack=config.pack_weights,
                log_level=config.log_level, reserve_rows=reserve,
            )  # fmt: skip
            engine.start()
            primary = engine
        else:
            primary = TorchRunner(
                spec, load_network(spec), device,
                device_capacity_bytes(device, config.capacity_mib),
                fault=fault_primary,  # type: ignore[arg-type]
                pack=config.pack_weights, reserve_rows=reserve,
            )  # fmt: skip
        breaker = CircuitBreaker(config.breaker_failures, config.breaker_open_s)
        log.info("gateway_model_loaded", model=spec.name, revision=spec.revision,
                 sha256=spec.sha256[:16], device=device, dtype=spec.dtype,
                 engine=config.engine, fallback="cpu float32")  # fmt: skip
        gateway = cls(config, spec, Batcher(primary, fallback, config.batch, breaker), llm=llm)
        gateway.usage.budgets.tenant_tokens_per_minute = config.tenant_tokens_per_minute
        return gateway

    def authorize(self, token: str, rollout_id: str = "") -> TokenClaims:
        """The claims of a request's token, checked as every inference request's are: its
        signature and expiry (and its rollout, when the request names one), then the server's
        list of running rollouts."""
        claims = verify(self.config.secret, token, time.time(), rollout_id)
        self.check_running(claims.rollout_id, claims.issued_at)
        return claims

    async def stop(self) -> None:
        """Stops the readiness checks, the batcher and the language model's engine."""
        if self._readiness is not None:
            await self._readiness.stop()
        if self.upstreams is not None:
            await self.upstreams.aclose()
        await self.batcher.stop()
        if self.llm is not None:
            await self.llm.aclose()

    async def infer(
        self,
        *,
        via: str,
        token: str,
        rollout_id: str,
        idempotency_key: str,
        model: str,
        revision: str,
        shape: list[int],
        values: list[float],
        deadline: float | None,
    ) -> Answer:
        """One checked request through the batcher (shared by gRPC and the HTTP endpoint);
        `via`: how it came (one of `VIA`), for the metrics."""
        self.requests[via] += 1
        now = time.time()
        self.authorize(token, rollout_id)
        if not rollout_id:
            raise InvalidArgument("rollout_id is empty")
        if model != self.spec.name:
            raise NotFound(f"model {model!r} is not served here (serving {self.spec.name})")
        if revision and revision != self.spec.revision:
            raise FailedPrecondition(
                f"model {self.spec.name} revision {revision!r} is not served "
                f"(serving {self.spec.revision})"
            )
        if shape != [self.spec.input_dim] or len(values) != self.spec.input_dim:
            raise InvalidArgument(
                f"input: model {self.spec.name} takes one sample of shape "
                f"[{self.spec.input_dim}], got shape {shape} with {len(values)} values"
            )
        if not all(map(math.isfinite, values)):
            at = next(i for i, v in enumerate(values) if not math.isfinite(v))
            raise InvalidArgument(f"input[{at}] is {values[at]}: inputs must be finite numbers")
        return await self.batcher.infer(
            rollout_id, idempotency_key, values, deadline if deadline is not None else now + 30
        )

    def metrics_text(self) -> str:
        """Prometheus text: the batcher's figures and how requests reach this gateway."""
        requests = CounterMetricFamily(
            "fleet_gateway_requests_total", "Inference requests received, by how they came: "
            "grpc (Infer), grpc_stream (InferStream), http (POST /v1/infer), openai (the "
            "OpenAI-compatible endpoints).", labels=["via"],
        )  # fmt: skip
        for via in VIA:
            requests.add_metric([via], self.requests[via])
        streams = gauge("fleet_gateway_streams_open", "InferStream calls open now.",
                        self.streams_open)  # fmt: skip
        return exposition([*self.batcher.metric_families(), requests, streams,
                           *self._usage_families()])  # fmt: skip

    def _usage_families(self) -> list[CounterMetricFamily]:
        """The language model's tokens, and the answers given again for an Idempotency-Key."""
        u = self.usage
        tokens = CounterMetricFamily(
            "fleet_gateway_llm_tokens_total", "Tokens of the language model's answers, by kind "
            "(prompt, completion); replays not counted.", labels=["kind"],
        )  # fmt: skip
        tokens.add_metric(["prompt"], u.prompt_tokens)
        tokens.add_metric(["completion"], u.completion_tokens)
        return [
            tokens,
            counter("fleet_gateway_llm_tokens_unkept_total", "Tokens no attempt will be charged: "
                    "no fleet server polled for them and their table was full.",
                    u.tokens_unkept),
            counter("fleet_gateway_llm_replayed_total", "Generations answered again from memory "
                    "for their Idempotency-Key.", self.replays.replayed),
        ]  # fmt: skip


VIA = ("grpc", "grpc_stream", "http", "openai")


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):  # type: ignore[misc]
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateEvent]:
        """One generation by the language model, streamed (see `gateway.llm.generate`)."""
        gw = self.gateway
        events = generate_events(request, llm=gw.llm, authorize=gw.authorize, usage=gw.usage)
        async for event in events:
            yield event

    async def Infer(
        self, request: inference_pb2.InferRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.InferResponse:
        return await self._answer(request, "grpc")

    async def InferStream(
        self,
        requests: AsyncIterator[inference_pb2.InferRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Each request served as by Infer, on a task of its own, answered when ready."""
        room = asyncio.Semaphore(self.gateway.config.stream_outstanding)
        outstanding: dict[str, asyncio.Task[None]] = {}
        writing = asyncio.Lock()  # one message on the stream at a time

        async def write(response: inference_pb2.InferStreamResponse) -> None:
            async with writing:
                await context.write(response)

        async def serve_one(request: inference_pb2.InferRequest) -> None:
            try:
                try:
                    response = inference_pb2.InferStreamResponse(
                        request_id=request.request_id,
                        answer=await self._answer(request, "grpc_stream"),
                    )
                except Exception as exc:  # answered in-band, as the interceptor would end a call
                    response = _refusal(request.request_id, as_refusal(exc, "InferStream"))
                try:
                    await write(response)
                except Exception as exc:  # the stream is gone: its caller retries, or went away
                    log.info("stream_answer_undelivered", request_id=request.request_id,
                             error=f"{type(exc).__name__}: {exc}")  # fmt: skip
            finally:  # answered (or cancelled): its place is free
                outstanding.pop(request.request_id, None)
                room.release()

        self.gateway.streams_open += 1
        try:
            async for request in requests:
                await room.acquire()
                rid = request.request_id
                if not rid or rid in outstanding:
                    room.release()
                    why = (
                        "request_id is empty: on a stream, answers are matched to requests by it"
                        if not rid
                        else f"request_id {rid!r} is already outstanding on this stream"
                    )
                    await write(_refusal(rid, InvalidArgument(why)))
                    continue
                outstanding[rid] = asyncio.create_task(serve_one(request))
            # Half-closed by the caller: answer what it is waiting for, then end with OK.
            while outstanding:
                await asyncio.gather(*outstanding.values(), return_exceptions=True)
        finally:  # the caller went away (cancelled): nothing left to answer
            self.gateway.streams_open -= 1
            for task in list(outstanding.values()):
                task.cancel()

    async def _answer(
        self, request: inference_pb2.InferRequest, via: str
    ) -> inference_pb2.InferResponse:
        deadline = None
        if request.HasField("deadline"):
            deadline = request.deadline.ToDatetime(tzinfo=UTC).timestamp()
        answer = await self.gateway.infer(
            via=via, token=request.token, rollout_id=request.rollout_id,
            idempotency_key=request.idempotency_key, model=request.model,
            revision=request.revision, shape=list(request.input.shape),
            values=list(request.input.values), deadline=deadline,
        )  # fmt: skip
        return inference_pb2.InferResponse(
            output=inference_pb2.Tensor(shape=[len(answer.output)], values=answer.output),
            model=self.gateway.spec.name, revision=answer.revision, device=answer.device,
            batch_size=answer.batch_size, queue_ms=answer.queue_ms,
            degraded=answer.degraded or answer.replayed, replayed=answer.replayed,
        )  # fmt: skip

    async def Status(
        self, request: inference_pb2.GatewayStatusRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GatewayStatus:
        gw = self.gateway
        b = gw.batcher
        device_seconds: dict[str, float] = {}
        tokens: dict[str, inference_pb2.RolloutTokens] = {}
        mark: inference_pb2.UsageMark | None = None
        if request.HasField("running"):  # (the server's poll: it charges what it is handed)
            r = request.running
            gw.note_running(list(r.rollout_ids), r.as_of, r.signature)
            charged: Mark | None = None
            if request.HasField("charged"):
                charged = (request.charged.gateway, request.charged.seq)
            usage, handed = gw.usage.hand_over(b.take_device_seconds(), charged)
            device_seconds = usage.device_s
            tokens = {
                rollout: inference_pb2.RolloutTokens(counts=[
                    inference_pb2.TokenCount(model=m, prompt=p, completion=c)
                    for m, (p, c) in by_model.items()
                ])
                for rollout, by_model in usage.tokens_by_rollout().items()
            }  # fmt: skip
            if handed is not None:
                mark = inference_pb2.UsageMark(gateway=handed[0], seq=handed[1])
        return inference_pb2.GatewayStatus(
            models=[
                inference_pb2.ModelInfo(
                    name=gw.spec.name, revision=gw.spec.revision, sha256=gw.spec.sha256,
                    primary_device=b.primary.device, dtype=b.primary.spec.dtype,
                )
            ],
            breaker=str(b.breaker.state), queue_depth=b.queue_depth,
            oldest_queued_ms=b.oldest_queued_s() * 1000, served=b.metrics.served,
            failovers=b.metrics.failovers, oom_faults=b.metrics.oom_faults,
            p95_latency_ms=b.p95_latency_s() * 1000, device_seconds=device_seconds,
            latency_window_s=b.config.latency_window_s, tokens=tokens, usage_mark=mark,
        )  # fmt: skip


def _refusal(request_id: str, exc: FleetError) -> inference_pb2.InferStreamResponse:
    return inference_pb2.InferStreamResponse(
        request_id=request_id,
        error=inference_pb2.InferError(
            code=str(exc.code), message=exc.message,
            **({} if exc.retry_after_s is None else {"retry_after_s": exc.retry_after_s}),
        ),
    )  # fmt: skip


async def serve(
    gateway: Gateway, listen: str, credentials: grpc.ServerCredentials | None = None
) -> tuple[grpc.aio.Server, int]:
    """Starts the batcher and a gRPC server on `listen` (port 0 picks one), over TLS with
    `credentials`; returns both."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
            ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
        ],
        interceptors=[ApiInterceptor()],  # (the token is checked per request, not per call)
    )
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(gateway), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if credentials is None:
        port = server.add_insecure_port(listen)
    else:
        port = server.add_secure_port(listen, credentials)
    gateway.batcher.start()
    await server.start()
    # Health answers NOT_SERVING until the first readiness check (one token per device).
    gateway.readiness.start_health(health_servicer, HEALTH_EVERY_S)
    log.info("gateway_listening", address=listen.rsplit(":", 1)[0] + f":{port}")
    return server, port


HEALTH_EVERY_S = 15.0
"""How often the gRPC health service's answer is checked again."""


def failing(kind: str = "device_error") -> object:
    """A fault hook for tests and benchmarks: while `.on`, every primary batch fails."""

    class Fault:
        on = False

        def __call__(self) -> None:
            if self.on:
                raise DeviceFault(kind, f"injected {kind}")

    return Fault()
