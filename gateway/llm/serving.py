"""The gateway's language model: which one (a setting), its engine, and the bounds that keep
what waits for it finite.

The model directory comes from the gateway's `llm` setting when it has one (and it is not
empty), else from FLEET_GATEWAY_LLM: a directory, "auto" (the default: the shipped
fleet-tiny-chat-v1 when it is there) or "none". The manifest is read, and every file's
checksum verified, when the gateway is built, so a corrupt model stops the gateway at start;
the engine itself (its weights on the device and its KV cache) starts on the first request
that needs it, so a gateway that only serves the policy holds no cache. The engine runs in the
gateway's process, its scheduler on a thread of its own.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from fleet.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from gateway.llm.engine import LLMEngine
from gateway.llm.manifest import ModelManifest, load_manifest, load_tokenizer
from gateway.settings import WEIGHTS_DIR

log = structlog.get_logger(__name__)

SHIPPED = "fleet-tiny-chat-v1"
ENV = "FLEET_GATEWAY_LLM"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LOAD_RETRY_S = 5.0


@dataclass(frozen=True)
class Limits:
    """What one gateway takes at once, stated in /v1/models."""

    max_n: int = 8
    """Choices one request may ask for (`n`, and each prompt of a completion batch)."""
    max_prompts: int = 16
    """Prompts one /v1/completions request may carry."""
    max_waiting: int = 256
    """Sequences waiting for the engine beyond which a request is refused (429, Retry-After)."""
    max_inflight_per_rollout: int = 32
    """Sequences one rollout may have waiting or generating at once."""
    max_batch: int = 32
    """Sequences the engine decodes together."""
    retry_after_s: float = 1.0


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
    """One language model the gateway serves, its engine started on first use."""

    directory: Path
    manifest: ModelManifest
    device: str
    dtype: str
    limits: Limits = Limits()
    tokenizer: Any = None
    _engine: LLMEngine | None = None
    _starting: asyncio.Lock | None = None
    _failed_at: float = 0.0
    _inflight: collections.Counter[str] = field(default_factory=collections.Counter)
    _admitted: int = 0
    """Sequences admitted here and not yet finished (waiting for the engine or generating)."""

    @classmethod
    def open(
        cls, directory: Path, device: str, dtype: str = "", limits: Limits = Limits()
    ) -> LanguageModel:
        """The model in `directory`, its manifest and tokenizer checked now (FailedPrecondition
        naming the file at fault); `dtype` "" takes the manifest's."""
        manifest = load_manifest(directory)
        dtype = dtype or manifest.dtype
        if dtype not in DTYPES:
            raise InvalidArgument(
                f"language model dtype {dtype!r} is not one of {', '.join(DTYPES)}"
            )
        tokenizer = load_tokenizer(directory, manifest)
        log.info(
            "llm_configured", model=manifest.model_id, device=device, dtype=dtype,
            directory=str(directory), effect="the engine starts on the first request",
        )  # fmt: skip
        return cls(directory, manifest, device, dtype, limits, tokenizer)

    @property
    def model_id(self) -> str:
        return self.manifest.model_id

    async def engine(self) -> LLMEngine:
        """The running engine, started now if this is the first request (off the event loop:
        loading takes a moment). A failed start is Unavailable with a retry hint; the next
        request after it tries again."""
        if self._engine is not None:
            return self._engine
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._engine is None:
                since = time.monotonic() - self._failed_at
                if self._failed_at and since < LOAD_RETRY_S:
                    raise Unavailable(
                        f"language model {self.model_id} failed to start {since:.1f} s ago",
                        retry_after_s=LOAD_RETRY_S - since,
                    )
                try:
                    self._engine = await asyncio.to_thread(
                        LLMEngine, self.directory, self.device, DTYPES[self.dtype],
                        max_batch=self.limits.max_batch,
                    )  # fmt: skip
                except Exception as exc:
                    self._failed_at = time.monotonic()
                    log.exception("llm_engine_start_failed", model=self.model_id)
                    raise Unavailable(
                        f"language model {self.model_id} could not start on {self.device}: {exc}",
                        retry_after_s=LOAD_RETRY_S,
                    ) from exc
        return self._engine

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
        if self._admitted + sequences > lim.max_waiting + lim.max_batch:
            raise ResourceExhausted(
                f"the language model has {self._admitted} sequences waiting or generating; "
                f"{sequences} more would pass its bound of {lim.max_waiting} waiting",
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

    def served_by(self) -> dict[str, Any]:
        """Who serves this model's answers (the `fleet` object of every answer)."""
        return {
            "model": self.model_id, "name": self.manifest.name,
            "revision": self.manifest.revision, "device": self.device, "dtype": self.dtype,
            "degraded": False,
        }  # fmt: skip

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None


def open_language_model(setting: str | None, device: str, dtype: str = "") -> LanguageModel | None:
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
    return LanguageModel.open(directory, device, dtype)
