"""Branch coalescing: serialized per source, concurrent requests in one batch, nothing leaked."""

from __future__ import annotations

import asyncio

import pytest

from fleet.runtime.branching import BranchCoalescer


class FakeSource:
    """A source that records its batch calls and refuses overlapping ones, like smolvm."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[int] = []
        self.busy = False
        self.deleted: list[str] = []
        self.fail = fail
        self.made = 0

    async def branch_batch(self, count: int) -> list[str]:
        assert not self.busy, "two branch operations overlapped on one source"
        self.busy = True
        try:
            await asyncio.sleep(0.05)
            self.calls.append(count)
            if self.fail:
                raise RuntimeError("snapshot failed")
            out = [f"child-{self.made + i}" for i in range(count)]
            self.made += count
            return out
        finally:
            self.busy = False

    async def delete(self, child: str) -> None:
        self.deleted.append(child)


async def test_concurrent_requests_share_one_batch_and_never_overlap() -> None:
    """Ten requests at once: the first batch takes one, the next takes the other nine."""

    source = FakeSource()
    c = BranchCoalescer(source.branch_batch, source.delete)
    children = await asyncio.gather(*(c.branch() for _ in range(10)))
    children, calls = list(children), source.calls

    assert len(set(children)) == 10
    assert sum(calls) == 10 and len(calls) <= 2


async def test_max_batch_splits_large_fan_outs() -> None:
    """No batch exceeds max_batch."""

    source = FakeSource()
    c = BranchCoalescer(source.branch_batch, source.delete, max_batch=4)
    await asyncio.gather(*(c.branch() for _ in range(10)))
    calls = source.calls

    assert sum(calls) == 10 and max(calls) <= 4


async def test_a_failed_batch_fails_every_request_in_it() -> None:
    """All or nothing: each waiting request sees the batch's error."""

    source = FakeSource(fail=True)
    c = BranchCoalescer(source.branch_batch, source.delete)
    results = await asyncio.gather(*(c.branch() for _ in range(3)), return_exceptions=True)

    assert all(isinstance(r, RuntimeError) for r in results)


async def test_children_of_callers_who_gave_up_are_deleted() -> None:
    """A request cancelled while its batch is made does not leak the child made for it."""

    source = FakeSource()
    c = BranchCoalescer(source.branch_batch, source.delete)
    doomed = asyncio.create_task(c.branch())
    kept = asyncio.create_task(c.branch())
    await asyncio.sleep(0.01)
    doomed.cancel()
    child = await kept
    with pytest.raises(asyncio.CancelledError):
        await doomed

    assert source.made == 2 and len(source.deleted) == 1 and child not in source.deleted
