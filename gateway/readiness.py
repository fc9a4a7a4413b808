"""Readiness that proves inference works: a one-token generation on each of the language
model's devices (its primary and its CPU replica), within a bound, and the policy's breaker.

`/readyz` (HTTP) and the gRPC health service both answer from here: ready when the language
model answered on at least one device (degraded when only the replica did) and the policy can
be served. A check's result is kept for `fresh_s`, so readiness polled by many cannot make the
gateway generate more than one probe at a time. `/healthz` stays a liveness check.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

import structlog
from grpc_health.v1 import health, health_pb2

from gateway.batcher import Batcher
from gateway.llm.serving import LanguageModel
from gateway.model import ModelSpec

log = structlog.get_logger(__name__)

SERVICES = ("", "fleet.v1.InferenceService")
"""The names the gateway's health service answers for (the empty name: the whole server)."""


class Served(Protocol):
    """What readiness reads of the gateway."""

    spec: ModelSpec
    batcher: Batcher
    llm: LanguageModel | None


class Readiness:
    def __init__(self, gateway: Served, *, timeout_s: float = 10.0, fresh_s: float = 1.0) -> None:
        self.gateway = gateway
        self.timeout_s = timeout_s
        self.fresh_s = fresh_s
        self._last: tuple[float, dict[str, Any], bool] | None = None
        self._lock = asyncio.Lock()
        self._health: asyncio.Task[None] | None = None

    async def check(self, *, start: bool = True) -> dict[str, Any]:
        """{"ready", "degraded", "devices": {name: {"device", "ok", "seconds", "error"?}},
        "policy": {...}}; at most one probe runs at a time, its result reused while fresh.
        With `start` False (the background checks) a language model not started yet is not
        started for it: it starts on its first request, and counts as ready."""
        async with self._lock:
            last = self._last
            if (
                last is not None
                and time.monotonic() - last[0] < self.fresh_s
                and (not start or last[2])
            ):
                return last[1]
            result = await self._check(start)
            self._last = (time.monotonic(), result, start)
            return result

    async def _check(self, start: bool) -> dict[str, Any]:
        gw = self.gateway
        breaker = gw.batcher.breaker
        policy = {"model": gw.spec.name, "breaker": str(breaker.state),
                  "device": gw.batcher.primary.device}  # fmt: skip
        devices: dict[str, Any] = {}
        llm_ok, degraded = True, str(breaker.state) != "closed"
        if gw.llm is not None:
            devices = await gw.llm.probe(self.timeout_s, start=start)
            oks = [state.get("ok") for state in devices.values()]
            llm_ok = any(ok is not False for ok in oks) if None in oks else any(oks)
            primary = devices.get("primary", {})
            degraded = degraded or primary.get("ok") is False
        result = {"ready": llm_ok, "degraded": degraded, "devices": devices, "policy": policy}
        if not llm_ok:
            log.warning("gateway_not_ready", devices=devices)
        return result

    def start_health(self, servicer: health.aio.HealthServicer, every_s: float) -> None:
        """Keeps `servicer` current in the background until `stop`."""
        if self._health is None or self._health.done():
            self._health = asyncio.create_task(self.serve_health(servicer, every_s))

    async def stop(self) -> None:
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)

    async def serve_health(self, servicer: health.aio.HealthServicer, every_s: float) -> None:
        """Keeps the gRPC health service's answers current: SERVING while ready."""
        status = health_pb2.HealthCheckResponse
        while True:
            try:
                ready = (await self.check(start=False))["ready"]
            except Exception:  # a check that itself failed: not ready, said in the log
                log.exception("readiness_check_failed")
                ready = False
            state = status.SERVING if ready else status.NOT_SERVING
            for name in SERVICES:
                await servicer.set(name, state)
            await asyncio.sleep(every_s)
