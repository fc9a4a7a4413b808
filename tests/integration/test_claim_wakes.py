"""A rollout submitted to a server where many hosts' claims wait wakes a few of them, not all:
one takes it, and the claims the ledger runs for it are bounded by `WAKE_AT_LEAST` (plus the
one its filled claim wakes), however many hosts wait. The others go on waiting. A retry whose
backoff ends, which no submission announces, wakes a waiting claim too (the sweeper's). Work
for a gpu host wakes the gpu hosts' claims, however many cpu hosts' claims waited longer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import fleet
from fleet.api.pb import host_pb2, types_pb2
from fleet.image.store import ImageStore
from fleet.server import core as server_core
from fleet.server.app import ServerConfig
from fleet.server.core import WAKE_AT_LEAST
from tests.integration.harness import SECRET, harness, request

HOSTS = WAKE_AT_LEAST * 3


async def test_one_rollout_wakes_a_bounded_few_of_many_waiting_claims(
    tmp_path: Path, images: ImageStore
) -> None:
    async with harness(tmp_path, images) as h:
        core = h.server.core
        for n in range(HOSTS):
            await h.register_host(f"h{n}")
        claims = [
            asyncio.ensure_future(
                h.hosts.ClaimWork(
                    host_pb2.ClaimWorkRequest(
                        request_id=f"c{n}", host_id=f"h{n}", max_items=1, wait_s=20
                    )
                )
            )
            for n in range(HOSTS)
        ]
        try:
            for _ in range(400):  # (every claim has looked once and waits: bounded at 20 s)
                if len(core.work_pulse) == HOSTS:
                    break
                await asyncio.sleep(0.05)
            assert len(core.work_pulse) == HOSTS
            batches = h.server.host_servicer.claims.coalescer.batches
            before = sum(batches)

            await h.fleet.SubmitRollout(request())
            done, _ = await asyncio.wait(claims, timeout=15, return_when=asyncio.FIRST_COMPLETED)
            [answered] = done
            assert len(answered.result().items) == 1
            for _ in range(200):  # (the woken ones that found nothing wait again: 10 s)
                if len(core.work_pulse) == HOSTS - 1:
                    break
                await asyncio.sleep(0.05)
            assert len(core.work_pulse) == HOSTS - 1
            ran = sum(batches) - before
            assert 1 <= ran <= WAKE_AT_LEAST + 1, ran  # (HOSTS is three times that)
        finally:
            for claim in claims:
                claim.cancel()
            await asyncio.gather(*claims, return_exceptions=True)


async def test_a_retry_whose_backoff_ends_wakes_a_waiting_claim(
    tmp_path: Path, images: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Claims look again only when woken: a retry's backoff ending wakes none, but the sweeper.
    monkeypatch.setattr(server_core, "CLAIM_POLL_S", 1000.0)
    monkeypatch.setattr(server_core, "SIGNALLED_CLAIM_POLL_S", 1000.0)
    async with harness(tmp_path, images) as h:
        await h.register_host("h1")
        await h.register_host("h2")
        retry = types_pb2.RetryPolicy(max_attempts=2, initial_backoff_s=2.0, max_backoff_s=2.0)
        await h.fleet.SubmitRollout(request(retry=retry))
        first = await h.hosts.ClaimWork(
            host_pb2.ClaimWorkRequest(request_id="c1", host_id="h1", max_items=1, wait_s=5)
        )
        [item] = first.items
        await h.hosts.CompleteWork(
            host_pb2.CompleteWorkRequest(
                request_id="r1", host_id="h1", work_id=item.work_id,
                fencing_token=item.fencing_token, outcome=types_pb2.OUTCOME_TRANSIENT_ERROR,
                error="the machine did not start",
            )
        )  # fmt: skip
        # Its retry is due in 1-2 s; the claim waits up to 20 s but is answered within 10 s.
        again = await h.hosts.ClaimWork(
            host_pb2.ClaimWorkRequest(request_id="c2", host_id="h2", max_items=1, wait_s=20),
            timeout=10,
        )
        [retried] = again.items
        assert (retried.rollout_id, retried.attempt) == (item.rollout_id, 2)


async def test_a_report_wakes_a_claim_only_while_work_waits_for_room(
    tmp_path: Path, images: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant at its cap: a report of its running rollout lets a waiting claim take the next
    one at once. With nothing queued, a report wakes no claim: there is nothing to take."""
    monkeypatch.setattr(server_core, "CLAIM_POLL_S", 1000.0)
    monkeypatch.setattr(server_core, "SIGNALLED_CLAIM_POLL_S", 1000.0)
    config = ServerConfig(lease_ttl_s=5.0, heartbeat_interval_s=0.5, max_running_per_tenant=1,
                          token_secret=SECRET)  # fmt: skip
    async with harness(tmp_path, images, config) as h:
        core = h.server.core
        for host in ("h1", "h2"):
            await h.register_host(host)
        await h.fleet.SubmitRollout(request(tenant="t"))
        await h.fleet.SubmitRollout(request(tenant="t"))
        [first] = (
            await h.hosts.ClaimWork(
                host_pb2.ClaimWorkRequest(request_id="c1", host_id="h1", max_items=1, wait_s=5)
            )
        ).items
        # The second is due but over the tenant's cap: h2's claim waits for room.
        waiting = asyncio.ensure_future(
            h.hosts.ClaimWork(
                host_pb2.ClaimWorkRequest(request_id="c2", host_id="h2", max_items=1, wait_s=20),
                timeout=10,
            )
        )
        for _ in range(200):  # (bounded: 10 s)
            if len(core.work_pulse) == 1:
                break
            await asyncio.sleep(0.05)
        assert len(core.work_pulse) == 1 and not waiting.done()
        await h.hosts.CompleteWork(done(first, "h1", "r1"))
        [second] = (await waiting).items
        assert second.rollout_id != first.rollout_id

        # Nothing is queued now: h1's claim waits, and h2's report wakes it for nothing.
        idle = asyncio.ensure_future(
            h.hosts.ClaimWork(
                host_pb2.ClaimWorkRequest(request_id="c3", host_id="h1", max_items=1, wait_s=20)
            )
        )
        try:
            for _ in range(200):
                if len(core.work_pulse) == 1:
                    break
                await asyncio.sleep(0.05)
            batches = h.server.host_servicer.claims.coalescer.batches
            before = sum(batches)
            await h.hosts.CompleteWork(done(second, "h2", "r2"))
            await asyncio.sleep(0.5)  # (a woken claim would have run its batch by now)
            assert sum(batches) == before and len(core.work_pulse) == 1
        finally:
            idle.cancel()
            await asyncio.gather(idle, return_exceptions=True)


def done(
    item: host_pb2.WorkAssignment, host_id: str, request_id: str
) -> host_pb2.CompleteWorkRequest:
    return host_pb2.CompleteWorkRequest(
        request_id=request_id, host_id=host_id, work_id=item.work_id,
        fencing_token=item.fencing_token, outcome=types_pb2.OUTCOME_SUCCEEDED,
    )  # fmt: skip


async def test_a_gpu_rollout_wakes_the_gpu_hosts_claim_behind_many_cpu_hosts(
    tmp_path: Path, images: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More cpu hosts' claims than `WAKE_AT_LEAST` began to wait before the one gpu host's,
    and claims look again only when woken: work for a gpu host is taken by the gpu host's
    claim (woken in the order of the cpu claims, it would wait for its poll)."""
    monkeypatch.setattr(server_core, "CLAIM_POLL_S", 1000.0)
    monkeypatch.setattr(server_core, "SIGNALLED_CLAIM_POLL_S", 1000.0)
    async with harness(tmp_path, images) as h:
        core = h.server.core
        for n in range(HOSTS):
            await h.register_host(f"cpu{n}")
        await h.hosts.RegisterHost(
            host_pb2.RegisterHostRequest(
                request_id="gpu-joins", host_id="gpu0", host_class=types_pb2.HOST_CLASS_GPU,
                capabilities=host_pb2.Capabilities(
                    runtime=types_pb2.RUNTIME_KIND_NAMESPACE,
                    isolation=types_pb2.ISOLATION_NAMESPACE, cpus=1,
                ),
                agent_version=fleet.__version__,
            )
        )  # fmt: skip
        waiting = [(f"cpu{n}", f"c{n}") for n in range(HOSTS)] + [("gpu0", "g0")]
        claims = {}
        for host, request_id in waiting:  # (in this order: the gpu host's claim last)
            claims[host] = asyncio.ensure_future(
                h.hosts.ClaimWork(
                    host_pb2.ClaimWorkRequest(
                        request_id=request_id, host_id=host, max_items=1, wait_s=20
                    )
                )
            )
            for _ in range(200):  # (bounded: 10 s)
                if len(core.work_pulse) == len(claims):
                    break
                await asyncio.sleep(0.05)
        try:
            assert len(core.work_pulse) == HOSTS + 1 and core.work_pulse.waiting("gpu") == 1
            near = types_pb2.Requirements(near_gateway=True)  # (a gpu host's work)
            submitted = await h.fleet.SubmitRollout(request(requirements=near))
            reply = await asyncio.wait_for(claims["gpu0"], 15)
            assert [i.rollout_id for i in reply.items] == [submitted.rollout.id]
            assert not any(claims[f"cpu{n}"].done() for n in range(HOSTS))
        finally:
            for claim in claims.values():
                claim.cancel()
            await asyncio.gather(*claims.values(), return_exceptions=True)
