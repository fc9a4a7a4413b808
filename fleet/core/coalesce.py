"""Coalescing: calls that arrive while a batch is in flight go together into the next one.

One pattern with three users: the server's group commit (completions, checkpoints: one durable
transaction for many), the agent's checkpoint sender (one PutCheckpoints call for many) and a
microVM parent's branching (one `branch_batch` for many children; a source must never branch
twice at once). The rules, the same for all:

- One batch at a time, of at most `max_batch` items, in arrival order.
- `run(items)` answers each item (a result, or the exception that refused that item alone), or
  raises, which fails every item of that batch; an answer of the wrong length fails them too.
- A caller that gives up (its task cancelled) gets nothing. Its item, if already in a batch,
  is still carried out (a write is made durable regardless: the caller retries idempotently);
  with `drop_abandoned`, an item abandoned before its batch starts is left out (a child no one
  waits for is never made). A result nobody waits for goes to `orphan` (a child is deleted,
  never leaked).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


RECENT_BATCHES = 1024
"""How many of its last batches' sizes a coalescer keeps."""


class Coalescer(Generic[T, R]):
    def __init__(
        self,
        run: Callable[[list[T]], Awaitable[Sequence[R | BaseException]]],
        *,
        max_batch: int = 256,
        drop_abandoned: bool = False,
        orphan: Callable[[R], Awaitable[None]] | None = None,
        after_batch: Callable[[], None] | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._run = run
        self._max_batch = max_batch
        self._drop_abandoned = drop_abandoned
        self._orphan = orphan
        self._after_batch = after_batch
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._task: asyncio.Task[None] | None = None
        self.batches: deque[int] = deque(maxlen=RECENT_BATCHES)
        """The sizes of the last RECENT_BATCHES batches, in order (for metrics and tests): a
        long-lived server runs millions of batches, so older ones are let go."""

    @property
    def waiting(self) -> int:
        """Items submitted that no batch has taken yet."""
        return len(self._pending)

    async def submit(self, item: T) -> R:
        """`item`'s answer, from the batch it goes in."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            batch = self._pending[: self._max_batch]
            del self._pending[: self._max_batch]
            if self._drop_abandoned:
                batch = [(item, future) for item, future in batch if not future.done()]
                if not batch:
                    continue
            self.batches.append(len(batch))
            try:
                answers = list(await self._run([item for item, _ in batch]))
                if len(answers) != len(batch):
                    for answer in answers:
                        await self._discard(answer)
                    raise RuntimeError(f"{len(answers)} answers for a batch of {len(batch)}")
            except Exception as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), answer in zip(batch, answers, strict=True):
                if future.done():  # its caller gave up while the batch ran
                    await self._discard(answer)
                elif isinstance(answer, BaseException):
                    future.set_exception(answer)
                else:
                    future.set_result(answer)
            if self._after_batch is not None:
                self._after_batch()

    async def _discard(self, answer: R | BaseException) -> None:
        if self._orphan is not None and not isinstance(answer, BaseException):
            await self._orphan(answer)
