"""Claims waiting for work are woken in the order they began to wait, only as many as asked
(`WAKE_AT_LEAST` at least, unless told otherwise), of hosts of the class the work needs when it
is known, all of them on request; a claim not woken still returns at its own timeout."""

from __future__ import annotations

import asyncio

from fleet.server.core import WAKE_AT_LEAST, ClaimWaiters
from fleet.server.work_signal import counts_of, payload_of

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


async def test_work_of_a_class_wakes_the_claims_of_hosts_of_that_class() -> None:
    """Many cpu hosts' claims began to wait before the one gpu host's: a gpu rollout wakes
    the gpu host's claim (the floor made up with the longest-waiting others), a cpu rollout
    wakes only cpu hosts' claims, and a count for any class the longest waiting."""
    waiters = ClaimWaiters()
    woken: list[str] = []

    async def one(name: str, host_class: str) -> None:
        await waiters.wait(60, host_class)
        woken.append(name)

    tasks = []
    for n in range(WAITERS):
        tasks.append(asyncio.create_task(one(f"cpu{n}", "cpu")))
        await asyncio.sleep(0)
    tasks.append(asyncio.create_task(one("gpu", "gpu")))
    await asyncio.sleep(0)
    assert len(waiters) == WAITERS + 1 and waiters.waiting("gpu") == 1

    waiters.fire({"gpu": 1})
    await settle()
    assert woken[0] == "gpu"
    assert woken[1:] == [f"cpu{n}" for n in range(WAKE_AT_LEAST - 1)]
    assert waiters.waiting("gpu") == 0

    woken.clear()
    tasks.append(asyncio.create_task(one("gpu", "gpu")))
    await asyncio.sleep(0)
    waiters.fire({"cpu": 1})
    await settle()
    cpu_left = WAITERS - (WAKE_AT_LEAST - 1)
    assert woken == [f"cpu{n}" for n in range(WAKE_AT_LEAST - 1, 2 * WAKE_AT_LEAST - 1)]
    assert waiters.waiting("gpu") == 1 and waiters.waiting("cpu") == cpu_left - WAKE_AT_LEAST

    woken.clear()
    waiters.fire({"cpu": 0, "gpu": 0})
    waiters.fire({})
    await settle()
    assert woken == []
    waiters.fire(None)
    await asyncio.gather(*tasks)
    assert len(waiters) == 0 and waiters.waiting("cpu") == waiters.waiting("gpu") == 0


def test_a_notifications_payload_says_how_many_of_each_class_and_falls_back_to_all() -> None:
    counts = {"cpu": 3, "gpu": 1, "": 2}
    assert payload_of(counts) == "cpu=3,gpu=1,2"
    assert counts_of(payload_of(counts)) == counts
    assert counts_of("5") == {"": 5}  # (a replica of the version before: a bare count)
    assert payload_of(None) == "" and counts_of("") is None
    assert payload_of({"cpu": 0}) == ""
    for unreadable in ("cpu=x", "gpu=-1", "a b=1", "=", "cpu=1,,gpu=2"):
        assert counts_of(unreadable) is None, unreadable  # (every claim: none is missed)
