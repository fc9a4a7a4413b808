"""`Fleet`'s and `Session`'s calls, awaitable (for harnesses written with asyncio): each runs on
a worker thread over the same connection, so an event loop is never blocked by one.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from fleet.client import Event, ExecResult, Fleet, Rollout, Session


class AsyncFleet:
    """`Fleet`'s calls, awaitable: each runs on a worker thread over the same connection, so
    an event loop is never blocked by one (for harnesses written with asyncio)."""

    def __init__(
        self,
        server: str | None = None,
        *,
        key: str | None = None,
        ca: str | bytes | None = None,
        plaintext: bool = False,
    ) -> None:
        self.sync = Fleet(server, key=key, ca=ca, plaintext=plaintext)

    async def submit(self, smolfile: str | Path, steps: Sequence[Sequence[str] | str],
                     **kw: Any) -> Rollout:  # fmt: skip
        """See `Fleet.submit`."""
        return await asyncio.to_thread(self.sync.submit, smolfile, steps, **kw)

    async def submit_many(
        self, smolfile: str | Path, plans: Sequence[Sequence[Sequence[str] | str]], **kw: Any
    ) -> builtins.list[str]:
        """See `Fleet.submit_many`."""
        return await asyncio.to_thread(self.sync.submit_many, smolfile, plans, **kw)

    async def get(self, rollout_id: str) -> Rollout:
        """See `Fleet.get`."""
        return await asyncio.to_thread(self.sync.get, rollout_id)

    async def list(self, labels: Mapping[str, str] | None = None) -> builtins.list[Rollout]:
        """See `Fleet.list`."""
        return await asyncio.to_thread(self.sync.list, labels)

    async def wait(self, rollout_id: str, timeout_s: float = 3600.0) -> Rollout:
        """See `Fleet.wait`."""
        return await asyncio.to_thread(self.sync.wait, rollout_id, timeout_s)

    async def cancel(self, rollout_id: str, reason: str = "") -> Rollout:
        """See `Fleet.cancel`."""
        return await asyncio.to_thread(self.sync.cancel, rollout_id, reason)

    async def download(self, rollout_id: str, digest: str) -> bytes:
        """See `Fleet.download`."""
        return await asyncio.to_thread(self.sync.download, rollout_id, digest)

    async def watch(self, rollout_id: str, after_sequence: int = 0) -> AsyncIterator[Event]:
        """See `Fleet.watch`: events as they come, resumed after a dropped connection."""
        events = self.sync.watch(rollout_id, after_sequence)
        done = object()
        while True:
            event = await asyncio.to_thread(next, events, done)
            if event is done:
                return
            yield event  # type: ignore[misc]

    async def session(self, smolfile: str | Path, **kw: Any) -> AsyncSession:
        """See `Fleet.session`; use it with `async with`."""
        return AsyncSession(await asyncio.to_thread(self.sync.session, smolfile, **kw))

    async def close(self) -> None:
        """See `Fleet.close`."""
        await asyncio.to_thread(self.sync.close)

    async def __aenter__(self) -> AsyncFleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncSession:
    """`Session`'s calls, awaitable."""

    def __init__(self, session: Session) -> None:
        self.sync = session
        self.id = session.id
        self.host_id = session.host_id

    async def exec(self, command: Sequence[str] | str, **kw: Any) -> ExecResult:
        """See `Session.exec`."""
        return await asyncio.to_thread(self.sync.exec, command, **kw)

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> int:
        """See `Session.write_file`."""
        return await asyncio.to_thread(self.sync.write_file, path, data, mode)

    async def read_file(self, path: str) -> bytes:
        """See `Session.read_file`."""
        return await asyncio.to_thread(self.sync.read_file, path)

    async def upload_dir(self, local: str | Path, path: str) -> int:
        """See `Session.upload_dir`."""
        return await asyncio.to_thread(self.sync.upload_dir, local, path)

    async def download_dir(self, path: str, local: str | Path) -> builtins.list[str]:
        """See `Session.download_dir`."""
        return await asyncio.to_thread(self.sync.download_dir, path, local)

    async def fork(self, count: int = 1, **kw: Any) -> builtins.list[AsyncSession]:
        """See `Session.fork`."""
        forks = await asyncio.to_thread(self.sync.fork, count, **kw)
        return [AsyncSession(f) for f in forks]

    async def close(self) -> str:
        """See `Session.close`."""
        return await asyncio.to_thread(self.sync.close)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.sync.__exit__, kind, exc, tb)
