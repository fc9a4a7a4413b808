"""Branching from a warm parent: one branch operation per source at a time, and concurrent
requests coalesced into one batch.

A source holds one RAM snapshot at a time, so its branch operations must not overlap; and one
`branch_batch(n)` is far cheaper than n single branches. Requests that arrive while a batch is
being made wait for the next one, which takes all of them (up to `max_batch`). A batch is all
or nothing: if it fails, every request in it gets the error. A child made for a request whose
caller has given up is handed to `orphan` to be deleted, never leaked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import structlog

log = structlog.get_logger(__name__)

C = TypeVar("C")


class BranchCoalescer(Generic[C]):
    def __init__(
        self,
        make_batch: Callable[[int], Awaitable[list[C]]],
        orphan: Callable[[C], Awaitable[None]],
        max_batch: int = 64,
    ) -> None:
        self._make_batch = make_batch
        self._orphan = orphan
        self._max_batch = max_batch
        self._waiting: list[asyncio.Future[C]] = []
        self._task: asyncio.Task[None] | None = None
        self.batches: list[int] = []
        """Sizes of the batches made so far, in order (for metrics and tests)."""

    async def branch(self) -> C:
        future: asyncio.Future[C] = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._waiting:
            take = [f for f in self._waiting[: self._max_batch] if not f.done()]
            del self._waiting[: self._max_batch]
            if not take:
                continue
            self.batches.append(len(take))
            try:
                children = await self._make_batch(len(take))
            except Exception as exc:
                for future in take:
                    if not future.done():
                        future.set_exception(exc)
                continue
            if len(children) != len(take):
                error = RuntimeError(f"asked for {len(take)} children, got {len(children)}")
                for child in children:
                    await self._orphan(child)
                for future in take:
                    if not future.done():
                        future.set_exception(error)
                continue
            for future, child in zip(take, children, strict=True):
                if future.done():  # its caller was cancelled while the batch was made
                    log.info("branch_orphaned", reason="caller gave up")
                    await self._orphan(child)
                else:
                    future.set_result(child)
