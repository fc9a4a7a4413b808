"""The one coalescer behind group commit, checkpoint sending and microVM branching."""

from __future__ import annotations

import asyncio

import pytest

from fleet.core.coalesce import RECENT_BATCHES, Coalescer


class Recorder:
    """A batch call that records its batches, never overlaps, and refuses odd items alone."""

    def __init__(self, gate: asyncio.Event | None = None) -> None:
        self.batches: list[list[int]] = []
        self.running = False
        self.gate = gate

    async def run(self, items: list[int]) -> list[int | BaseException]:
        assert not self.running, "two batches at once"
        self.running = True
        try:
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(0)
            self.batches.append(list(items))
            return [ValueError(f"odd {i}") if i % 2 else i * 10 for i in items]
        finally:
            self.running = False


async def test_calls_during_a_batch_go_together_into_the_next_one_each_with_its_answer() -> None:
    gate = asyncio.Event()
    rec = Recorder(gate)
    c: Coalescer[int, int] = Coalescer(rec.run, max_batch=3)
    calls = [asyncio.create_task(c.submit(i)) for i in range(7)]
    await asyncio.sleep(0.01)
    gate.set()
    answers = await asyncio.gather(*calls, return_exceptions=True)
    answers, batches, sizes = (
        [a if isinstance(a, int) else str(a) for a in answers],
        rec.batches,
        list(c.batches),
    )

    assert answers == [0, "odd 1", 20, "odd 3", 40, "odd 5", 60]  # refused alone
    assert batches == [[0, 1, 2], [3, 4, 5], [6]] and sizes == [3, 3, 1]


async def test_a_failed_batch_or_a_wrong_count_fails_every_item_of_it() -> None:
    async def broken(items: list[int]) -> list[int]:
        raise ConnectionError("the server is gone")

    async def short(items: list[int]) -> list[int]:
        return items[:-1]

    out = []
    for run in (broken, short):
        c: Coalescer[int, int] = Coalescer(run)
        got = await asyncio.gather(*(c.submit(i) for i in range(3)), return_exceptions=True)
        out.append([str(g) for g in got])
    broken, short = out[0], out[1]

    assert broken == ["the server is gone"] * 3
    assert short == ["2 answers for a batch of 3"] * 3


@pytest.mark.parametrize("drop", [False, True])
async def test_an_abandoned_call_is_carried_out_or_left_out_and_its_result_orphaned(
    drop: bool,
) -> None:
    gate = asyncio.Event()
    rec = Recorder(gate)
    orphans: list[int] = []

    async def orphan(result: int) -> None:
        orphans.append(result)

    c: Coalescer[int, int] = Coalescer(rec.run, drop_abandoned=drop, orphan=orphan)
    first = asyncio.create_task(c.submit(0))  # in the running batch
    await asyncio.sleep(0.01)
    waiting = asyncio.create_task(c.submit(2))  # queued for the next batch
    kept = asyncio.create_task(c.submit(4))
    await asyncio.sleep(0.01)
    first.cancel()
    waiting.cancel()
    gate.set()
    assert await kept == 40
    batches, sizes = rec.batches, list(c.batches)

    if drop:  # a child nobody waits for is never made
        assert batches == [[0], [4]] and orphans == [0] and sizes == [1, 1]
    else:  # a write is made durable regardless; its answer goes nowhere
        assert batches == [[0], [2, 4]] and orphans == [0, 20] and sizes == [1, 2]


async def test_after_batch_runs_once_per_written_batch() -> None:
    seen = []

    async def broken(items: list[int]) -> list[int]:
        raise ConnectionError("gone")

    c: Coalescer[int, int] = Coalescer(Recorder().run, after_batch=lambda: seen.append(1))
    await asyncio.gather(*(c.submit(i * 2) for i in range(4)))
    await c.submit(8)
    failing: Coalescer[int, int] = Coalescer(broken, after_batch=lambda: seen.append(1))
    with pytest.raises(ConnectionError):
        await failing.submit(1)  # nothing written: nobody is woken
    woken, sizes = len(seen), list(c.batches)

    assert sizes == [4, 1] and woken == 2
    with pytest.raises(ValueError, match="max_batch"):
        Coalescer(Recorder().run, max_batch=0)


async def test_only_the_last_batches_sizes_are_kept() -> None:
    """A long-lived server runs millions of batches: the record of their sizes is bounded."""
    c: Coalescer[int, int] = Coalescer(Recorder().run)
    for i in range(RECENT_BATCHES + 5):
        await c.submit(i * 2)  # (even: the recorder refuses odd items)
    assert len(c.batches) == RECENT_BATCHES and set(c.batches) == {1}
