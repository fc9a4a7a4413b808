"""`Fleet` and `Session`: the blocking client, for scripts and notebooks.

Each `Fleet` runs an `AsyncFleet` on an event loop of its own, on a daemon thread, and waits for
its coroutines: the two clients make the same requests, resume watches the same way and raise
the same errors, because they are the same code. Callbacks (`on_output`) run on that thread.
"""

from __future__ import annotations

import asyncio
import builtins
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar, Unpack

from fleet.client.admin import Admin
from fleet.client.aio import AsyncFleet, AsyncSession
from fleet.client.models import (
    EgressEvent,
    Event,
    ExecResult,
    InputFile,
    Page,
    Rollout,
    SessionInfo,
    Smolfile,
    Submission,
)
from fleet.client.wire import CommonOptions, StepLike, SubmitOptions
from fleet.core.errors import FailedPrecondition, FleetError

T = TypeVar("T")


class _Loop:
    """An event loop on a daemon thread, running what the blocking client hands it."""

    def __init__(self) -> None:
        self.stopped = False
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fleet-client",
                                       daemon=True)  # fmt: skip
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self.stopped:
            coro.close()
            raise FailedPrecondition("this fleet client is closed")
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("a blocking fleet client was called from its own callback")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # (Ctrl-C in the caller stops the call too)
            raise

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    yield self.run(agen.__anext__())  # type: ignore[arg-type]
                except StopAsyncIteration:
                    return
        finally:
            close = getattr(agen, "aclose", None)
            if close is not None and not self.stopped:
                if threading.current_thread() is self.thread:  # (collected on the loop itself)
                    self.loop.create_task(close())
                else:
                    self.run(close())

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


class Fleet:
    """A connection to a fleet server, blocking.

    `server` defaults to $FLEET_SERVER, else 127.0.0.1:50051; `key` to $FLEET_KEY, else the
    admin key `fleet up` writes ($FLEET_HOME/admin.key); `ca` (a PEM path or bytes) to
    $FLEET_CA, else $FLEET_HOME/ca/ca.crt when it exists (TLS), else no TLS."""

    def __init__(
        self,
        server: str | None = None,
        *,
        key: str | None = None,
        ca: str | bytes | None = None,
        plaintext: bool = False,
    ) -> None:
        self.aio = AsyncFleet(server, key=key, ca=ca, plaintext=plaintext)
        self.server = self.aio.server
        self.key = self.aio.key
        self._loop = _Loop()
        self._stop = weakref.finalize(self, self._loop.stop)
        self._admin: Admin | None = None

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coro)

    @property
    def admin(self) -> Admin:
        """The operator's calls (AdminService), blocking: `AsyncFleet.admin`'s, which need a
        key with the admin scope."""
        if self._admin is None:
            self._admin = Admin(self.aio.admin, self._run)
        return self._admin

    def close(self) -> None:
        """Closes the connection to the server."""
        if not self._stop.alive:
            return
        try:
            self._run(self.aio.close())
        finally:
            self._stop()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- rollouts ----------------------------------------------------------------------------

    def upload(self, src: str | Path, path: str) -> InputFile:
        """See `AsyncFleet.upload`."""
        return self._run(self.aio.upload(src, path))

    def submit(
        self,
        smolfile: str | Path | Smolfile,
        steps: Sequence[StepLike] = (),
        **options: Unpack[SubmitOptions],
    ) -> Submission:
        """See `AsyncFleet.submit`."""
        return self._run(self.aio.submit(smolfile, steps, **options))

    def submit_many(
        self,
        smolfile: str | Path | Smolfile,
        plans: Sequence[Sequence[StepLike]],
        *,
        idempotency_keys: Sequence[str] | None = None,
        **options: Unpack[CommonOptions],
    ) -> builtins.list[str]:
        """See `AsyncFleet.submit_many`."""
        return self._run(
            self.aio.submit_many(smolfile, plans, idempotency_keys=idempotency_keys, **options)
        )

    def get(self, rollout_id: str) -> Rollout:
        """See `AsyncFleet.get`."""
        return self._run(self.aio.get(rollout_id))

    def list_page(
        self, labels: Mapping[str, str] | None = None, *, could_reach: str = "",
        page_size: int = 50, page_token: str = "",
    ) -> Page:  # fmt: skip
        """See `AsyncFleet.list_page`."""
        page = self.aio.list_page(
            labels, could_reach=could_reach, page_size=page_size, page_token=page_token
        )
        return self._run(page)

    def list(
        self, labels: Mapping[str, str] | None = None, *, could_reach: str = ""
    ) -> builtins.list[Rollout]:
        """See `AsyncFleet.list`."""
        return self._run(self.aio.list(labels, could_reach=could_reach))

    def watch(self, rollout_id: str, after_sequence: int = 0) -> Iterator[Event]:
        """See `AsyncFleet.watch`: events as they come, resumed after a dropped stream."""
        return self._loop.iterate(self.aio.watch(rollout_id, after_sequence))

    def wait(self, rollout_id: str, timeout_s: float = 3600.0) -> Rollout:
        """See `AsyncFleet.wait`."""
        return self._run(self.aio.wait(rollout_id, timeout_s))

    def cancel(self, rollout_id: str, reason: str = "") -> Rollout:
        """See `AsyncFleet.cancel`."""
        return self._run(self.aio.cancel(rollout_id, reason))

    def download(self, rollout_id: str, digest: str) -> bytes:
        """See `AsyncFleet.download`."""
        return self._run(self.aio.download(rollout_id, digest))

    def download_outputs(self, rollout: Rollout | str, into: str | Path) -> builtins.list[str]:
        """See `AsyncFleet.download_outputs`."""
        return self._run(self.aio.download_outputs(rollout, into))

    def egress_events(self, rollout_id: str) -> builtins.list[EgressEvent]:
        """See `AsyncFleet.egress_events`."""
        return self._run(self.aio.egress_events(rollout_id))

    # -- sessions ----------------------------------------------------------------------------

    def session(
        self,
        smolfile: str | Path | Smolfile,
        *,
        idle_timeout_s: float = 600.0,
        max_lifetime_s: float = 3600.0,
        labels: Mapping[str, str] | None = None,
        require_vm: bool = False,
        idempotency_key: str | None = None,
        inference: bool = False,
        models: Sequence[str] = (),
        max_prompt_tokens: int = 0,
        max_completion_tokens: int = 0,
        on_idle: str = "park",
    ) -> Session:
        """See `AsyncFleet.session`; use it as a context manager to close it at the end."""
        opened = self._run(self.aio.session(
            smolfile, idle_timeout_s=idle_timeout_s, max_lifetime_s=max_lifetime_s,
            labels=labels, require_vm=require_vm, idempotency_key=idempotency_key,
            inference=inference, models=models, max_prompt_tokens=max_prompt_tokens,
            max_completion_tokens=max_completion_tokens, on_idle=on_idle,
        ))  # fmt: skip
        return Session(self, opened.id, opened.host_id)

    def sessions(self) -> builtins.list[SessionInfo]:
        """See `AsyncFleet.sessions`."""
        return self._run(self.aio.sessions())


class Session:
    """An open session, blocking: run commands and move files in its machine; `close()` ends
    it. `Session(fleet, id)` attaches to one opened before."""

    def __init__(self, fleet: Fleet, session_id: str, host_id: str = "") -> None:
        self.fleet = fleet
        self.id = session_id
        self.host_id = host_id
        self.aio = AsyncSession(fleet.aio, session_id, host_id)

    def exec(
        self,
        command: Sequence[str] | str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str = "",
        stdin: bytes = b"",
        timeout_s: float = 600.0,
        on_output: Callable[[str, bytes], None] | None = None,
    ) -> ExecResult:
        """See `AsyncSession.exec`."""
        return self.fleet._run(self.aio.exec(command, env=env, cwd=cwd, stdin=stdin,
                                             timeout_s=timeout_s, on_output=on_output))  # fmt: skip

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> int:
        """See `AsyncSession.write_file`."""
        return self.fleet._run(self.aio.write_file(path, data, mode))

    def read_file(self, path: str) -> bytes:
        """See `AsyncSession.read_file`."""
        return self.fleet._run(self.aio.read_file(path))

    def upload_dir(self, local: str | Path, path: str) -> int:
        """See `AsyncSession.upload_dir`."""
        return self.fleet._run(self.aio.upload_dir(local, path))

    def download_dir(self, path: str, local: str | Path) -> builtins.list[str]:
        """See `AsyncSession.download_dir`."""
        return self.fleet._run(self.aio.download_dir(path, local))

    def fork(
        self,
        count: int = 1,
        *,
        idle_timeout_s: float = 0.0,
        max_lifetime_s: float = 3600.0,
        labels: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> builtins.list[Session]:
        """See `AsyncSession.fork`."""
        forks = self.fleet._run(self.aio.fork(
            count, idle_timeout_s=idle_timeout_s, max_lifetime_s=max_lifetime_s, labels=labels,
            idempotency_key=idempotency_key,
        ))  # fmt: skip
        return [Session(self.fleet, f.id, f.host_id) for f in forks]

    def park(self) -> SessionInfo:
        """See `AsyncSession.park`."""
        parked = self.fleet._run(self.aio.park())
        self.host_id = ""
        return parked

    def resume(self, *, ready_timeout_s: float = 0.0) -> Session:
        """See `AsyncSession.resume`."""
        self.host_id = self.fleet._run(self.aio.resume(ready_timeout_s=ready_timeout_s)).host_id
        return self

    def close(self) -> str:
        """See `AsyncSession.close`."""
        return self.fleet._run(self.aio.close())

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.close()
        except FleetError:
            if kind is None:
                raise
