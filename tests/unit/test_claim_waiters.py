"""Claims waiting for work are woken in the order they began to wait, only as many as asked
(`WAKE_AT_LEAST` at least, unless told otherwise), all of them on request; a claim not woken
still returns at its own timeout."""

from __future__ import annotations

import asyncio

from fleet.server.core import WAKE_AT_LEAST, ClaimWaiters

WAITERS = WAKE_AT_LEAST * 2 + 4


async def waiting(waiters: ClaimWaiters) -> tuple[list[asyncio.Task[None]], list[int]]:
    woken: list[int] = []

    async def one(n: int) -> None:
        await waiters.wait(60)
        woken.append(n)

    tasks = []
    for n in range(WAITERS):
        tasks.append(asyncio.create_task(one(n)))
        await asyncio.sleep(0)  # (each begins to wait in turn)
    assert len(waiters) == WAITERS
    return tasks, woken


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_the_longest_waiting_are_woken_as_many_as_asked_and_at_least_the_floor() -> None:
    waiters = ClaimWaiters()
    tasks, woken = await waiting(waiters)
    waiters.fire(1)
    await settle()
    assert woken == list(range(WAKE_AT_LEAST))
    waiters.fire(2, at_least=0)
    await settle()
    assert woken == list(range(WAKE_AT_LEAST + 2))
    waiters.fire(0)
    await settle()
    assert len(woken) == WAKE_AT_LEAST + 2 and len(waiters) == WAITERS - WAKE_AT_LEAST - 2
    waiters.fire(None)
    await asyncio.gather(*tasks)
    assert sorted(woken) == list(range(WAITERS)) and len(waiters) == 0


async def test_a_claim_not_woken_returns_at_its_timeout_and_stops_waiting() -> None:
    waiters = ClaimWaiters()
    await waiters.wait(0.01)
    assert len(waiters) == 0
