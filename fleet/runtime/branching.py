"""Branching from a warm parent: one branch operation per source at a time, and concurrent
requests coalesced into one batch.

A source holds one RAM snapshot at a time, so its branch operations must not overlap; and one
`branch_batch(n)` is far cheaper than n single branches. Requests that arrive while a batch is
being made wait for the next one, which takes all of them (up to `max_batch`). A batch is all
or nothing: if it fails, every request in it gets the error. A child made for a request whose
caller has given up is handed to `orphan` to be deleted, never leaked.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from fleet.core.coalesce import Coalescer

C = TypeVar("C")


class BranchCoalescer(Coalescer[None, C]):
    """`branch()` calls coalesced into `make_batch(n)` calls (see `fleet.core.coalesce`):
    callers who gave up before their batch are left out of it, and a child made for one who
    gave up during it goes to `orphan`."""

    def __init__(
        self,
        make_batch: Callable[[int], Awaitable[list[C]]],
        orphan: Callable[[C], Awaitable[None]],
        max_batch: int = 64,
    ) -> None:
        async def run(requests: list[None]) -> list[C]:
            return await make_batch(len(requests))

        super().__init__(run, max_batch=max_batch, drop_abandoned=True, orphan=orphan)

    async def branch(self) -> C:
        return await self.submit(None)
