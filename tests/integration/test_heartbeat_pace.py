"""A server paces a fleet larger than its heartbeat rate allows (`max_heartbeats_per_s`): once
it has counted its live hosts, each beat's answer tells the host a longer interval, the lease a
beat or a claim gives lasts three such intervals, and a real agent beats at the interval it was
last told."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import fleet
from fleet.api.pb import host_pb2, types_pb2
from fleet.core.placement import HostCapabilities, HostClass, Isolation, RuntimeKind
from fleet.image.store import ImageStore
from fleet.ledger.store import Ledger
from fleet.server.app import ServerConfig
from tests.integration.harness import SECRET, harness, request

RATE = 1.0
"""Beats a second the test's server asks of its whole fleet."""
OTHERS = 5
"""Hosts registered beside the one under test: with it, 6 live hosts at 1 beat a second."""


def config() -> ServerConfig:
    return ServerConfig(
        lease_ttl_s=5.0, heartbeat_interval_s=0.5, max_heartbeats_per_s=RATE,
        token_secret=SECRET,
    )  # fmt: skip


def register_others(ledger: Ledger, now: float) -> None:
    for n in range(OTHERS):
        caps = HostCapabilities(
            host_id=f"other-{n}", host_class=HostClass.CPU, runtime=RuntimeKind.NAMESPACE,
            isolation=Isolation.NAMESPACE, cpus=1, memory_mib=512, cuda_devices=0,
        )  # fmt: skip
        ledger.register_host(caps, now)


async def test_beats_and_claims_follow_the_pace_of_the_fleets_size(
    tmp_path: Path, images: ImageStore
) -> None:
    async with harness(tmp_path, images, config()) as h:
        core = h.server.core
        await h.register_host("h1")
        alone = await h.hosts.Heartbeat(host_pb2.HeartbeatRequest(host_id="h1"))
        assert alone.heartbeat_interval_s == 0.5  # one live host: the base pace
        await core.db(register_others, core.ledger, time.time())
        paced = await core.refresh_pace()
        assert (paced.heartbeat_interval_s, paced.lease_ttl_s) == (6.0, 18.0)

        before = time.time()
        beat = await h.hosts.Heartbeat(host_pb2.HeartbeatRequest(host_id="h1"))
        assert beat.heartbeat_interval_s == 6.0
        assert beat.lease_expires_at.ToSeconds() >= int(before + 18.0) - 1

        await h.fleet.SubmitRollout(request())
        claim = await h.hosts.ClaimWork(
            host_pb2.ClaimWorkRequest(request_id="c", host_id="h1", max_items=1, wait_s=5)
        )
        [item] = claim.items
        assert item.lease_expires_at.ToSeconds() >= int(before + 18.0) - 1  # not the base 5 s
        # A host registering now is told the paced interval at once.
        reply = await h.hosts.RegisterHost(
            host_pb2.RegisterHostRequest(
                host_id="h2",
                host_class=types_pb2.HOST_CLASS_CPU,
                agent_version=fleet.__version__,
                capabilities=host_pb2.Capabilities(
                    runtime=types_pb2.RUNTIME_KIND_NAMESPACE,
                    isolation=types_pb2.ISOLATION_NAMESPACE,
                    cpus=1,
                ),
            )
        )
        assert (reply.heartbeat_interval_s, reply.lease_ttl_s) == (6.0, 18.0)


async def test_an_agent_beats_at_the_interval_its_last_beat_was_told(
    tmp_path: Path, images: ImageStore
) -> None:
    async with harness(tmp_path, images, config()) as h:
        core = h.server.core
        agent = await h.start_agent("a", HostClass.CPU)
        assert agent._heartbeat_s == 0.5  # one live host: the base pace
        await core.db(register_others, core.ledger, time.time())
        assert (await core.refresh_pace()).heartbeat_interval_s == 6.0
        for _ in range(100):  # (its next beat is within 0.5 s: bounded at 10 s)
            if agent._heartbeat_s == 6.0:
                break
            await asyncio.sleep(0.1)
        assert agent._heartbeat_s == 6.0
