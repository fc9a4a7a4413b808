"""The inference gateway's settings: its tunables (`GatewayConfig`, `BatchConfig`) and what
`fleet gateway` itself reads (where to listen, whom to answer, TLS), each a flag and a
FLEET_GATEWAY_ variable (see `fleet.settings`).

Light to import (no torch): the CLI builds its flags from these models without loading the
model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, field_validator
from pydantic_settings import SettingsConfigDict

from fleet import resources
from fleet.settings import NO_FLAG, Flag, Settings

WEIGHTS_DIR = resources.weights()
"""The shipped models: the repository's gateway/weights/, or their copy in an installed wheel."""


class BatchConfig(BaseModel):
    """The batcher's tunables (each a `fleet gateway` flag and a FLEET_GATEWAY_ variable)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    max_batch: int = 64
    """Most samples in one primary batch."""
    max_wait_ms: float = 2.0
    """How long the oldest request waits for others to join its batch (0: dispatch as soon as
    the device is free; batches then form from requests that arrive while it computes)."""
    max_queue: int = 2048
    """Queued requests beyond this are refused at once (RESOURCE_EXHAUSTED)."""
    max_inflight_per_rollout: int = 16
    """Requests one rollout may have queued or running at once."""
    fallback_max_batch: int = 16
    """Most samples in one batch on the CPU replica (its lower concurrency)."""
    answers_kept: int = 200_000
    """Answers remembered for idempotent retries (oldest forgotten first)."""
    answers_kept_mib: float = 256.0
    """Memory the remembered answers may take (estimated from their outputs' lengths): past
    it the oldest are forgotten too, however few they are (a model with large outputs)."""
    probe_interval_s: float = 5.0
    """After this long with nothing queued, the primary's health is probed with one sample
    (0: never). A failed probe counts as a fault for the breaker; while the breaker is half
    open, a probe that passes closes it, so an idle gateway recovers its device by itself."""
    latency_window_s: float = 30.0
    """The window of the p95 latency the fleet server's promotion gates read."""


class GatewayConfig(BaseModel):
    """The gateway's tunables (each a `fleet gateway` flag and a FLEET_GATEWAY_ variable, but
    the secret, read from the data directory, and the batcher's, flags of their own)."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", use_attribute_docstrings=True, arbitrary_types_allowed=True
    )

    secret: Annotated[bytes, NO_FLAG] = b""
    """Shared with the fleet server, which signs the rollout-scoped tokens."""
    model: str = "gridworld-policy"
    models_toml: Annotated[Path, Flag(metavar="FILE")] = WEIGHTS_DIR / "models.toml"
    """The model manifest (name, revision, weight file, sha256, shape)."""
    device: str = "auto"
    """Primary device: "auto" (cuda:0 when present, else cpu), "cpu" or "cuda:N"."""
    capacity_mib: float = 0.0
    """The primary's memory budget; 0: the device's total (CUDA), a quarter of RAM (CPU)."""
    fallback_capacity_mib: float = 32.0
    """The CPU replica's memory budget."""
    batch: Annotated[BatchConfig, NO_FLAG] = BatchConfig()
    breaker_failures: int = 3
    breaker_open_s: float = 2.0
    dtype: str = ""
    """The primary's precision, over the manifest's (float32, bfloat16). The CPU replica
    always serves float32, the precision the weights are stored in."""
    engine: str = "process"
    """Where the primary's model runs: "process" (an engine process of its own, restarted
    after a device error; `gateway.engine`) or "inline" (a thread of the gateway's process)."""
    llm: str = ""
    """The language model of the OpenAI-compatible API: a model directory, "auto" (the shipped
    fleet-tiny-chat-v1 when present) or "none"; empty: $FLEET_GATEWAY_LLM, else "auto"."""
    engine_threads: int = 0
    """torch's CPU threads in the engine process (0: as many as this process uses)."""
    engine_answer_timeout_s: float = 60.0
    """An engine that has not answered a batch by then is hung: a device error; it is ended
    and started again."""
    llm_hang_s: float = 30.0
    """The language model's engine process is judged hung, ended and started again (its
    answers moving to the CPU replica) when it sends no beat, or makes no step while it has
    work, for this long; longer than the slowest step the model takes on its device."""
    log_level: Annotated[str, NO_FLAG] = "info"
    """The engine process's log level (its events go to stderr, as the gateway's do)."""
    pack_weights: bool = True
    """On a CPU primary, also hold the weights pre-packed for oneDNN and serve the batch sizes
    where that is faster, as timed at load (`gateway.model.pack_for_cpu`)."""
    reserve_device_memory: Annotated[bool, Flag("--reserve")] = True
    """On a CUDA primary, take at load the memory batches up to `batch.max_batch` need
    (`TorchRunner._reserve`), so that another process filling the GPU cannot fail them."""
    stream_outstanding: int = 256
    """Requests one InferStream may have outstanding; at this many the gateway stops reading
    from it (gRPC's flow control then holds the caller back) until one is answered."""
    tokens_without_server: bool = False
    """Serve tokens before any fleet server has sent its list of running rollouts, on their
    signature and deadline alone (a gateway run standalone, that no server polls). Off, the
    gateway fails closed: until a first list arrives, every token is refused (UNAVAILABLE),
    since a token must not outlive its rollout and only the server knows which have ended."""
    tenant_tokens_per_minute: int = 0
    """Prompt and completion tokens each tenant's rollouts may take in any minute, over the
    gateway's own model and upstream ones (0: no limit); a call past it is refused (429,
    code budget_exceeded, with Retry-After). See gateway.llm.budgets."""

    @field_validator("tenant_tokens_per_minute")
    @classmethod
    def _whole_tokens(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"is {value}: it must be at least 0 (0: no limit)")
        return value


class GatewaySettings(GatewayConfig, BatchConfig, Settings):
    """Everything `fleet gateway` takes."""

    model_config = SettingsConfigDict(env_prefix="FLEET_GATEWAY_")

    listen: str = "127.0.0.1:50052"
    """gRPC address."""
    http_listen: str = "0.0.0.0:50053"
    """HTTP address machines call (they reach only it, and only with a rollout token)."""
    http_allow: str = ""
    """Comma-separated CIDRs whose connections the HTTP endpoint answers, besides loopback and
    the machines' address pool (cloud hosts' addresses, say); others are closed unanswered;
    'any' answers everyone."""
    insecure: bool = False
    """No TLS on endpoints beyond loopback (by default they use a certificate from the fleet
    CA in $FLEET_HOME/ca)."""
    san: Annotated[list[str], Flag(metavar="NAME")] = []
    """Another name its certificate carries (repeatable)."""
    upstream: Annotated[list[str], Flag(metavar="NAME=URL")] = []
    """An OpenAI-compatible upstream whose models are served here as NAME/MODEL, URL its API's
    base as OPENAI_BASE_URL would be (repeatable; see gateway.llm.upstream_config)."""
    upstream_key: Annotated[list[str], Flag(metavar="NAME=ENV_VAR|NAME=@FILE")] = []
    """Where upstream NAME's key is read from: an environment variable or a file; never the
    key itself (repeatable)."""
    upstreams: Annotated[Path | None, Flag(metavar="FILE")] = None
    """A TOML file of upstreams ([upstreams.NAME] url, key_env or key_file) and fallbacks."""
    fallback: Annotated[list[str], Flag(metavar="MODEL=UPSTREAM/MODEL,...")] = []
    """The models tried, in order, when MODEL's upstream refuses or fails before the first
    token (repeatable)."""

    def gateway_config(self, secret: bytes, log_level: str) -> GatewayConfig:
        """The gateway's tunables, with the batcher's, the secret and the log level."""
        batch = BatchConfig(**self.model_dump(include=set(BatchConfig.model_fields)))
        tunables = self.model_dump(include=set(GatewayConfig.model_fields) - {"batch"})
        return GatewayConfig(**{**tunables, "secret": secret, "log_level": log_level,
                                "batch": batch})  # fmt: skip
