"""The gateway's language model: which one (a setting), where it runs, where each request goes,
and how an answer survives the loss of its device.

The model directory comes from the gateway's `llm` setting when it has one (and it is not
empty), else from FLEET_GATEWAY_LLM: a directory, "auto" (the default: the shipped
fleet-tiny-chat-v1 when it is there) or "none". The manifest is read, and every file's
checksum verified, when the gateway is built, so a corrupt model stops the gateway at start;
the engines start on the first request that needs them (or the first readiness check), so a
gateway that only serves the policy holds no cache.

Two engines serve it. The primary runs on the gateway's device in an engine process of its
own (`gateway.llm.remote`; "inline": a thread of the gateway's process); the CPU replica runs
float32 in the gateway's process, with its own smaller batch, bounded queue and shorter
context for new requests: a planned execution mode, stated in /v1/models and in every answer.
Each request is placed by `gateway.llm.admission.decide` before any memory is spent.

Failover keeps the answer: when the primary fails under a request (its process died or hung,
its device raised, an allocation failed), the request goes on on the replica from the tokens
already produced, its KV cache recomputed from the prompt plus those tokens and its sampler's
stream advanced past them (`LLMEngine.generate(resume_from=...)`), so the client sees no token
twice and none missing. That continuation is exact only where the replica computes what the
primary did: the same device kind and precision (`continuation_verified`; the float32 CPU
pair is what tests/integration/test_llm_equivalence.py checks on 200+ prompts). Elsewhere a
stream that already sent tokens ends with a resumable error naming the last token sent, and an
answer not yet sent (not streamed) starts again whole on the replica: never an answer that
mixes two precisions.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from collections.abc import AsyncGenerator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import structlog
import torch

from fleet.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from gateway.breaker import CircuitBreaker
from gateway.llm.admission import Decision, DeviceView, decide
from gateway.llm.engine import DTYPES, LLMEngine, TokenEvent
from gateway.llm.kv_cache import Admission
from gateway.llm.llama import LlamaSpec
from gateway.llm.manifest import ModelManifest, load_manifest, load_tokenizer
from gateway.llm.remote import EngineProcess, ProcessConfig
from gateway.llm.sampling import SamplingParams
from gateway.model import DeviceFault
from gateway.settings import WEIGHTS_DIR

log = structlog.get_logger(__name__)

SHIPPED = "fleet-tiny-chat-v1"
ENV = "FLEET_GATEWAY_LLM"
LOAD_RETRY_S = 5.0
PROBE_TIMEOUT_S = 10.0
RESTART_TOKEN = -2
"""The token id of the event that tells a collector of a whole answer (not a stream) that the
answer starts again on the replica: what it collected is dropped."""


@dataclass(frozen=True)
class Limits:
    """What one gateway takes at once, stated in /v1/models."""

    max_n: int = 8
    """Choices one request may ask for (`n`, and each prompt of a completion batch)."""
    max_prompts: int = 16
    """Prompts one /v1/completions request may carry."""
    max_waiting: int = 256
    """Sequences waiting for the primary beyond which a request goes elsewhere or is refused."""
    max_wait_s: float = 30.0
    """How long the primary's oldest waiting request may have waited before new ones stop
    joining its queue."""
    max_inflight_per_rollout: int = 32
    """Sequences one rollout may have waiting or generating at once."""
    max_batch: int = 32
    """Sequences the primary decodes together."""
    retry_after_s: float = 1.0
    replica_max_batch: int = 8
    """Sequences the CPU replica decodes together."""
    replica_max_waiting: int = 32
    """New requests waiting for the replica beyond which they are refused (continuations of
    answers already begun are never refused)."""
    replica_context_length: int = 0
    """The longest new request (prompt + max_tokens) the replica takes; 0: half the model's
    context. Its cache holds `replica_max_batch` full-context sequences, so a continuation of
    any accepted request fits."""
    headroom_mib: float = 256.0
    """On a CUDA primary, memory kept free beside what admission predicts."""


class Engine(Protocol):
    """What the failover needs of an engine, in this process or in one of its own."""

    context_length: int

    def check(
        self, prompt_ids: Sequence[int], params: SamplingParams, resume_from: Sequence[int] = ()
    ) -> Admission: ...

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, request_id: str,
        resume_from: Sequence[int] = (), rng_draws_used: int | None = None,
    ) -> AsyncGenerator[TokenEvent, None]: ...  # fmt: skip

    def stats(self) -> dict[str, Any]: ...


class Resumable(Exception):
    """The answer's device failed after tokens were sent and no engine can continue it
    exactly: the client resumes (or retries) knowing what it already has."""

    def __init__(self, cause: BaseException, sent: Sequence[int]) -> None:
        last = f"; the last token sent was #{len(sent) - 1} (id {sent[-1]})" if sent else ""
        super().__init__(f"{cause}{last}")
        self.cause = cause
        self.sent = list(sent)


@dataclass
class Route:
    """Where one request's answer is served, and what happened on the way (every answer says
    it: the `x-fleet-*` headers and the `fleet` object)."""

    target: str
    """"primary" or "replica"."""
    decision: str
    reason: str
    streaming: bool
    no_fallback: bool = False
    failovers: list[dict[str, Any]] = field(default_factory=list)


def model_directory(setting: str | None) -> Path | None:
    """The language model to serve for a setting (None or "": FLEET_GATEWAY_LLM, else
    "auto")."""
    value = (setting or os.environ.get(ENV, "")).strip() or "auto"
    if value == "none":
        return None
    if value == "auto":
        shipped = WEIGHTS_DIR / SHIPPED
        return shipped if (shipped / "manifest.toml").is_file() else None
    return Path(value)


@dataclass
class LanguageModel:
    """One language model the gateway serves: its primary and its CPU replica."""

    directory: Path
    manifest: ModelManifest
    device: str
    dtype: str
    limits: Limits = Limits()
    tokenizer: Any = None
    spec: LlamaSpec | None = None
    engine_kind: str = "process"
    """"process" (the primary in an engine process of its own) or "inline"."""
    replica_enabled: bool = True
    inject_fault: str = ""
    """A fault the primary engine injects into itself (tests, benchmarks)."""
    hang_s: float = 30.0
    log_level: str = "info"
    """The engine process's log level (its events go to stderr, as the gateway's do)."""
    breaker: CircuitBreaker = field(default_factory=lambda: CircuitBreaker(1, 2.0))
    _primary: EngineProcess | LLMEngine | None = None
    _replica: LLMEngine | None = None
    _starting: asyncio.Lock | None = None
    _failed_at: float = 0.0
    _inflight: collections.Counter[str] = field(default_factory=collections.Counter)
    _admitted: int = 0
    """Sequences admitted here and not yet finished (waiting for an engine or generating)."""
    _queued: dict[str, tuple[str, float, int]] = field(default_factory=dict)
    """Requests given to an engine that have no token yet: (target, since, blocks)."""
    counters: collections.Counter[str] = field(default_factory=collections.Counter)

    @classmethod
    def open(
        cls, directory: Path, device: str, dtype: str = "", limits: Limits = Limits(),
        *, engine_kind: str = "process", replica: bool = True, inject_fault: str = "",
    ) -> LanguageModel:  # fmt: skip
        """The model in `directory`, its manifest and tokenizer checked now (FailedPrecondition
        naming the file at fault); `dtype` "" takes the manifest's."""
        manifest = load_manifest(directory)
        dtype = dtype or manifest.dtype
        if dtype not in DTYPES:
            raise InvalidArgument(
                f"language model dtype {dtype!r} is not one of {', '.join(DTYPES)}"
            )
        if engine_kind not in ("process", "inline"):
            raise InvalidArgument(f"language model engine {engine_kind!r}: process or inline")
        tokenizer = load_tokenizer(directory, manifest)
        spec = LlamaSpec.load(directory)
        log.info(
            "llm_configured", model=manifest.model_id, device=device, dtype=dtype,
            directory=str(directory), engine=engine_kind, replica=replica,
            effect="the engines start on the first request",
        )  # fmt: skip
        return cls(directory, manifest, device, dtype, limits, tokenizer, spec, engine_kind,
                   replica, inject_fault)  # fmt: skip

    @property
    def model_id(self) -> str:
        return self.manifest.model_id

    @property
    def replica_context_length(self) -> int:
        return self.limits.replica_context_length or self.manifest.context_length // 2

    # -- engines ---------------------------------------------------------------------------

    async def engine(self) -> Engine:
        """The primary, started now if this is the first request (off the event loop: loading
        takes a moment), with the replica. A failed start is Unavailable with a retry hint
        when there is no replica to serve meanwhile; the next request tries again."""
        await self._start()
        assert self._primary is not None or self._replica is not None
        return self._primary or self._replica  # type: ignore[return-value]

    async def _start(self) -> None:
        if self._primary is not None:
            return
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._primary is not None:
                return
            since = time.monotonic() - self._failed_at
            if self._failed_at and since < LOAD_RETRY_S:
                if self._replica is not None:
                    return  # the replica serves until the primary's next try
                raise Unavailable(
                    f"language model {self.model_id} failed to start {since:.1f} s ago",
                    retry_after_s=LOAD_RETRY_S - since,
                )
            if self.replica_enabled and self._replica is None:
                self._replica = await asyncio.to_thread(
                    LLMEngine, self.directory, "cpu", torch.float32,
                    max_batch=self.limits.replica_max_batch,
                )  # fmt: skip
            try:
                self._primary = await self._start_primary()
            except Exception as exc:
                self._failed_at = time.monotonic()
                log.exception("llm_engine_start_failed", model=self.model_id)
                if self._replica is None:
                    raise Unavailable(
                        f"language model {self.model_id} could not start on {self.device}: "
                        f"{exc}", retry_after_s=LOAD_RETRY_S,
                    ) from exc  # fmt: skip

    async def _start_primary(self) -> EngineProcess | LLMEngine:
        if self.engine_kind == "inline":
            return await asyncio.to_thread(
                LLMEngine, self.directory, self.device, DTYPES[self.dtype],
                max_batch=self.limits.max_batch,
            )  # fmt: skip
        assert self.spec is not None
        config = ProcessConfig(
            self.directory, self.device, self.dtype, max_batch=self.limits.max_batch,
            threads=torch.get_num_threads(), hang_s=self.hang_s,
            inject_fault=self.inject_fault, log_level=self.log_level,
        )  # fmt: skip
        process = EngineProcess(config, self.manifest, self.spec.vocab_size)
        await process.start()
        return process

    @property
    def primary(self) -> EngineProcess | LLMEngine | None:
        return self._primary

    @property
    def replica(self) -> LLMEngine | None:
        return self._replica

    def _primary_serving(self) -> bool:
        p = self._primary
        return p is not None and (not isinstance(p, EngineProcess) or p.serving)

    def continuation_verified(self) -> bool:
        """Whether the replica continues the primary's answers exactly: the same device kind
        and precision, the pair whose equivalence is tested."""
        return self.device.split(":")[0] == "cpu" and self.dtype == "float32"

    # -- admission -------------------------------------------------------------------------

    def _view(self, engine: Engine | None, target: str) -> DeviceView | None:
        if engine is None:
            return None
        stats = engine.stats()
        lim, spec = self.limits, self.spec
        assert spec is not None
        primary = target == "primary"
        queued = [(since, blocks) for t, since, blocks in self._queued.values() if t == target]
        now = time.monotonic()
        width = 2 if (self.dtype == "bfloat16" and primary) else 4
        free = getattr(engine, "free_bytes", None) if primary else None
        return DeviceView(
            serving=(self._primary_serving() and self.breaker.state != "open")
            if primary else True,
            context_length=self.manifest.context_length if primary
            else self.replica_context_length,
            block_size=int(stats.get("block_size", 16)),
            blocks_total=int(stats.get("blocks_total", 0)),
            blocks_free=int(stats.get("blocks_free", 0)) - sum(b for _, b in queued),
            waiting=len(queued),
            max_waiting=lim.max_waiting if primary else lim.replica_max_waiting,
            oldest_wait_s=max((now - s for s, _ in queued), default=0.0),
            max_wait_s=lim.max_wait_s,
            kv_bytes_per_token=spec.kv_bytes_per_token(width),
            # A prefill's temporaries per prompt token: the residual stream and attention's
            # and the MLP's intermediates, a few times over (their float32 upcasts included).
            activation_bytes_per_token=4 * (8 * spec.hidden_size + 3 * spec.intermediate_size),
            observed_free_bytes=free,
            headroom_bytes=int(lim.headroom_mib * 2**20),
        )  # fmt: skip

    async def plan(
        self,
        jobs: Sequence[tuple[Sequence[int], SamplingParams]],
        *,
        streaming: bool,
        no_fallback: bool = False,
        shrink_floor: int | None = None,
    ) -> tuple[Route, list[SamplingParams]]:
        """Where a request's jobs go (one decision for all of its choices, taken on the
        largest), and their parameters (shrunk where the decision shrank them). Refusals are
        ResourceExhausted (429) or Unavailable (503), with the reason and a retry hint."""
        await self._start()
        for prompt, asked in jobs:  # what no engine could ever serve: 400 naming the field
            (self._primary or self._replica).check(prompt, asked)  # type: ignore[union-attr]
        prompt_tokens = max(len(p) for p, _ in jobs)
        max_tokens = max(sp.max_tokens for _, sp in jobs)
        now = time.monotonic()
        use_primary = self._primary_serving() and self.breaker.use_primary(now)
        primary_view = self._view(self._primary, "primary")
        if primary_view is None or not use_primary:
            primary_view = _not_serving(primary_view, self)
        replica_view = self._view(self._replica, "replica")
        decision = decide(
            primary_view, replica_view, prompt_tokens, max_tokens, no_fallback=no_fallback,
            shrink_floor=shrink_floor, retry_after_s=self.limits.retry_after_s,
        )  # fmt: skip
        self.counters[decision.kind] += 1
        if decision.kind not in ("primary", "wait", "shrink") and self.breaker.probing:
            self.breaker.probing = False  # the half-open probe goes to the next request
        if decision.kind == "refuse":
            log.info("llm_request_refused", reason=decision.reason, status=decision.status)
            kind = Unavailable if decision.status == 503 else ResourceExhausted
            raise kind(
                f"language model {self.model_id}: {decision.reason}",
                retry_after_s=decision.retry_after_s,
            )
        params = [_shrunk(sp, decision) for _, sp in jobs]
        target = "replica" if decision.kind == "replica" else "primary"
        return Route(target, decision.kind, decision.reason, streaming, no_fallback), params

    @contextmanager
    def admitted(self, rollout_id: str, sequences: int) -> Iterator[None]:
        """Holds a place for `sequences` of one rollout while they wait and generate; refuses
        at once (ResourceExhausted with a retry hint) past the rollout's share or past the
        gateway's bound on waiting sequences, so nothing waits without bound."""
        lim = self.limits
        if self._inflight[rollout_id] + sequences > lim.max_inflight_per_rollout:
            raise ResourceExhausted(
                f"rollout {rollout_id} has {self._inflight[rollout_id]} sequences in flight; "
                f"{sequences} more would pass its limit of {lim.max_inflight_per_rollout}",
                retry_after_s=lim.retry_after_s,
            )
        bound = lim.max_waiting + lim.max_batch
        if self.replica_enabled:
            bound += lim.replica_max_waiting + lim.replica_max_batch
        if self._admitted + sequences > bound:
            raise ResourceExhausted(
                f"the language model has {self._admitted} sequences waiting or generating; "
                f"{sequences} more would pass its bound of {bound}",
                retry_after_s=lim.retry_after_s,
            )
        self._inflight[rollout_id] += sequences
        self._admitted += sequences
        try:
            yield
        finally:
            self._admitted -= sequences
            self._inflight[rollout_id] -= sequences
            if self._inflight[rollout_id] <= 0:
                del self._inflight[rollout_id]

    # -- generation with failover ----------------------------------------------------------

    async def generate(
        self, prompt: Sequence[int], params: SamplingParams, *, request_id: str, route: Route
    ) -> AsyncGenerator[TokenEvent, None]:
        """The answer's events from the route's engine, moved to the replica if the primary
        fails under it (see the module docstring); Resumable when it cannot go on exactly."""
        sent: list[int] = []
        target = route.target
        for attempt in range(3):
            engine = self._primary if target == "primary" else self._replica
            if engine is None:
                raise Unavailable(f"language model {self.model_id}: no {target} engine")
            key = f"{request_id}.{attempt}"
            block_size = int(engine.stats().get("block_size") or 16)
            blocks = -(-(len(prompt) + params.max_tokens) // block_size)
            self._queued[key] = (target, time.monotonic(), blocks)
            try:
                events = engine.generate(prompt, params, request_id=key, resume_from=sent)
                async for event in events:
                    self._queued.pop(key, None)
                    if event.finish_reason != "abort":
                        sent.append(event.token_id)
                    yield event
                if target == "primary":
                    self.breaker.success(time.monotonic())
                return
            except DeviceFault as fault:
                self._queued.pop(key, None)
                target = self._failed(fault, target, route, sent)
                if target == "restart":  # the collector drops what it has (not sent yet)
                    sent, target = [], "replica"
                    yield TokenEvent(RESTART_TOKEN, "", None, None)
            finally:
                self._queued.pop(key, None)
        raise Unavailable(f"language model {self.model_id}: every engine failed this request")

    def _failed(self, fault: DeviceFault, target: str, route: Route, sent: list[int]) -> str:
        """Where an answer goes after its engine failed: "replica" (continued), "restart"
        (begun again on the replica, nothing having been sent), or Resumable."""
        now = time.monotonic()
        if target == "primary":
            self.breaker.failure(now, str(fault))
        self.counters[f"fault_{fault.kind}"] += 1
        route.failovers.append({
            "from": target, "error": fault.kind, "message": str(fault), "after_tokens": len(sent),
        })  # fmt: skip
        log.warning("llm_request_failed_over", target=target, fault=fault.kind,
                    after_tokens=len(sent), no_fallback=route.no_fallback)  # fmt: skip
        if target != "primary" or self._replica is None or route.no_fallback:
            raise Resumable(fault, sent)
        if sent and not self.continuation_verified():
            if route.streaming:
                raise Resumable(fault, sent)
            self.counters["failover_restart"] += 1
            route.target = "replica"
            return "restart"
        self.counters["failover"] += 1
        route.target = "replica"
        return "replica"

    def served_by(self, route: Route | None = None) -> dict[str, Any]:
        """Who serves this model's answers (the `fleet` object of every answer)."""
        on_replica = route is not None and route.target == "replica"
        out: dict[str, Any] = {
            "model": self.model_id, "name": self.manifest.name,
            "revision": self.manifest.revision,
            "device": "cpu" if on_replica else self.device,
            "dtype": "float32" if on_replica else self.dtype,
            "served_by": "replica" if on_replica else "primary",
            "degraded": on_replica,
        }  # fmt: skip
        if route is not None:
            out["admission"] = route.decision
            if route.failovers:
                out["failovers"] = route.failovers
        return out

    def headers(self, route: Route | None) -> dict[str, str]:
        who = self.served_by(route)
        out = {
            "x-fleet-served-by": f"{who['served_by']}; device={who['device']}; "
            f"model={self.model_id}; dtype={who['dtype']}",
            "x-fleet-degraded": "1" if who["degraded"] else "0",
        }  # fmt: skip
        if route is not None:
            out["x-fleet-admission"] = route.decision
        return out

    # -- readiness, stats ------------------------------------------------------------------

    async def probe(
        self, timeout_s: float = PROBE_TIMEOUT_S, *, start: bool = True
    ) -> dict[str, dict[str, Any]]:
        """A one-token generation on each engine within `timeout_s`: each one's state. With
        `start` False, engines not started yet are left so and said to be ("ok": None)."""
        if not start and self._primary is None and self._replica is None:
            return {"primary": {"device": self.device, "ok": None,
                                "state": "not started: starts on the first request"}}  # fmt: skip
        try:
            await self._start()
        except Unavailable as exc:
            return {"primary": {"device": self.device, "ok": False, "error": exc.message}}
        out: dict[str, dict[str, Any]] = {}
        prompt = [self.manifest.bos_token_id]
        params = SamplingParams(max_tokens=1, temperature=0)
        engines = (("primary", self._primary, self.device), ("replica", self._replica, "cpu"))
        for name, engine, device in engines:
            if engine is None:
                continue
            started = time.monotonic()
            state: dict[str, Any] = {"device": device}
            try:
                key = f"probe-{name}-{time.time_ns()}"
                async with asyncio.timeout(timeout_s):
                    async for _ in engine.generate(prompt, params, request_id=key):
                        pass
                state["ok"] = True
            except (DeviceFault, TimeoutError, Unavailable) as exc:
                state["ok"] = False
                state["error"] = str(exc) or f"no token within {timeout_s:g} s"
                if name == "primary":
                    self.breaker.failure(time.monotonic(), f"readiness probe: {state['error']}")
            state["seconds"] = round(time.monotonic() - started, 4)
            out[name] = state
        return out

    def stats(self) -> dict[str, Any]:
        return {
            "primary": self._primary.stats() if self._primary is not None else None,
            "replica": self._replica.stats() if self._replica is not None else None,
            "breaker": str(self.breaker.state),
            **{f"requests_{k}": v for k, v in sorted(self.counters.items())},
        }

    async def aclose(self) -> None:
        primary, self._primary = self._primary, None
        if isinstance(primary, EngineProcess):
            await primary.close()
        elif primary is not None:
            await asyncio.to_thread(primary.close)
        if self._replica is not None:
            await asyncio.to_thread(self._replica.close)
            self._replica = None


def _not_serving(view: DeviceView | None, lm: LanguageModel) -> DeviceView:
    if view is not None:
        return DeviceView(**{**view.__dict__, "serving": False})
    return DeviceView(False, lm.manifest.context_length, 16, 0, 0, 0, 0, 0.0, 0.0, 0, 0)


def _shrunk(params: SamplingParams, decision: Decision) -> SamplingParams:
    if params.max_tokens <= decision.max_tokens:
        return params
    return replace(params, max_tokens=decision.max_tokens)


def open_language_model(
    setting: str | None, device: str, dtype: str = "", *, engine_kind: str = "process",
    log_level: str = "info",
) -> LanguageModel | None:  # fmt: skip
    """The gateway's language model for its setting, on its device; None when it serves none.
    A model named but unreadable is refused (FailedPrecondition naming the file)."""
    directory = model_directory(setting)
    if directory is None:
        return None
    if not (directory / "manifest.toml").is_file():
        raise FailedPrecondition(
            f"language model {directory}: no manifest.toml there (set {ENV} to a model "
            "directory, 'auto' or 'none')"
        )
    model = LanguageModel.open(directory, device, dtype, engine_kind=engine_kind)
    model.log_level = log_level
    return model
