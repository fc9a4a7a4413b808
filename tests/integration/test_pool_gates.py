"""A promotion gate on the gateway's latency, end to end: a real gateway whose device is slowed
on purpose, a real server watching it; the pool pauses with the numbers that caused it (in its
events, the metrics and GET /pools) and resumes once the latency recovers. And the gateway
hands each rollout's device seconds to the server's poll, once."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from fleet.api.pb import inference_pb2
from fleet.core.gates import Gates
from fleet.core.placement import HostClass, Pool
from fleet.core.tokens import issue, sign_running
from fleet.image.store import ImageStore
from fleet.prom import parse
from fleet.server.core import ServerConfig
from gateway.batcher import BatchConfig
from tests.integration.harness import harness
from tests.integration.test_gateway import SECRET, gateway, observations


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return str(reply.read().decode())


async def _until(check: Any, what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = await check()
        if found:
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_latency_gate_pauses_on_an_injected_slow_device_and_resumes(
    tmp_path: Path, images: ImageStore
) -> None:
    delay = {"s": 0.0}

    def device() -> None:  # the injected latency: a device that takes `delay` per batch
        time.sleep(delay["s"])

    batch = BatchConfig(max_batch=4, max_wait_ms=1, latency_window_s=1.0)
    async with gateway(fault=device, batch=batch, engine="inline") as gw:
        config = ServerConfig(
            token_secret=SECRET,
            gateway_address=gw.address,
            gateway_poll_s=0.1,
            govern_interval_s=0.1,
            metrics_listen="127.0.0.1:0",
        )
        async with harness(tmp_path, images, config) as h:
            ledger = h.server.core.ledger
            pool = Pool(name="cloud", host_class=HostClass.CPU, gates=Gates(p95_ms=150))
            await asyncio.to_thread(ledger.set_pool, pool, time.time())
            samples = observations(8)
            delay["s"] = 0.25
            now = time.time()
            await asyncio.gather(
                *(
                    gw.stub.Infer(
                        gw.request(f"r-{i}", "slow", s, issue(SECRET, f"r-{i}", now + 60, now))
                    )
                    for i, s in enumerate(samples)
                )
            )

            async def paused() -> Any:
                found = await asyncio.to_thread(ledger.pool_events, 0.0)
                return [e for e in found if e.kind == "paused"]

            [pause] = await _until(paused, "the gate to pause the pool")
            metrics = await asyncio.to_thread(
                _get, f"http://127.0.0.1:{h.server.metrics_port}/metrics"
            )
            pools = json.loads(
                await asyncio.to_thread(_get, f"http://127.0.0.1:{h.server.metrics_port}/pools")
            )
            delay["s"] = 0.0

            async def resumed() -> Any:
                # Fast answers keep coming; the slow ones leave the 1 s window.
                # (a token issued now: the server's list of running rollouts is empty)
                token = issue(SECRET, "r-fast", time.time() + 60, time.time())
                key = f"k{time.monotonic()}"
                await gw.stub.Infer(gw.request("r-fast", key, samples[0], token))
                found = await asyncio.to_thread(ledger.pool_events, 0.0)
                return [e for e in found if e.kind == "resumed"]

            [resume] = await _until(resumed, "the pool to resume")

    assert pause.figures["p95_ms"] > 150 and "gateway p95 latency" in pause.message
    figures = parse(metrics)
    assert figures['fleet_pool_paused{pool="cloud"}'] == 1
    assert figures['fleet_pool_events_total{kind="paused",pool="cloud"}'] == 1
    [shown] = pools["pools"]
    assert shown["paused_at"] and "gateway p95 latency" in shown["paused_why"]
    assert pools["events"][0]["kind"] == "paused"
    assert pools["events"][0]["figures"]["p95_ms"] == pause.figures["p95_ms"]
    assert resume.figures["p95_ms"] <= 150 * 0.8 and resume.at > pause.at


async def test_the_gateway_hands_device_seconds_to_the_servers_poll_once() -> None:
    async with gateway(engine="inline") as gw:
        for i, sample in enumerate(observations(3)):
            await gw.infer("r-1" if i < 2 else "r-2", f"k{i}", sample)
        plain = await gw.stub.Status(inference_pb2.GatewayStatusRequest())
        now = time.time()
        poll = inference_pb2.GatewayStatusRequest(
            running=inference_pb2.RunningRollouts(
                rollout_ids=["r-1", "r-2"],
                as_of=now,
                signature=sign_running(SECRET, ["r-1", "r-2"], now),
            )
        )
        first = await gw.stub.Status(poll)
        second = await gw.stub.Status(poll)

    assert dict(plain.device_seconds) == {}  # another caller's status takes nothing
    assert sorted(first.device_seconds) == ["r-1", "r-2"]
    assert all(s > 0 for s in first.device_seconds.values())
    assert dict(second.device_seconds) == {}
    assert first.p95_latency_ms > 0 and first.latency_window_s == 30.0
