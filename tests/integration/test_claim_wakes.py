"""A rollout submitted to a server where many hosts' claims wait wakes a few of them, not all:
one takes it, and the claims the ledger runs for it are bounded by `WAKE_AT_LEAST` (plus the
one its filled claim wakes), however many hosts wait. The others go on waiting."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fleet.api.pb import host_pb2
from fleet.image.store import ImageStore
from fleet.server.core import WAKE_AT_LEAST
from tests.integration.harness import harness, request

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
            assert 1 <= ran <= WAKE_AT_LEAST + 1 < HOSTS, ran
        finally:
            for claim in claims:
                claim.cancel()
            await asyncio.gather(*claims, return_exceptions=True)
