"""The gateway's side of a language-model engine process (`gateway.llm.worker`).

`EngineProcess` has the request side of an in-process `LLMEngine` (`check`, `admission`,
`generate`, `abort`, `stats`), so the API and the failover above it need not know where the
engine runs. Requests and their events travel over a socket pair; one reader task routes
the engine's frames to each request's queue.

The engine is judged lost, and every request still live in it ends with a `DeviceFault`
("device_error") that the failover above turns into a continuation elsewhere, when its
process exits, when its socket breaks, when it says its device failed, or when it is hung:
it has work but its step counter has not moved for `hang_s`, or no beat came for `hang_s`.
A lost engine is ended (killed, by its pid) and started again in the background; a restart
that fails waits before the next, twice as long each time in a row (up to a minute).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from fleet.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    error_for,
)
from gateway.llm.engine import TokenEvent, check_request
from gateway.llm.kv_cache import Admission
from gateway.llm.manifest import ModelManifest
from gateway.llm.sampling import SamplingParams
from gateway.llm.worker import encode, read_frame
from gateway.model import DeviceFault

log = structlog.get_logger(__name__)

REPO = Path(__file__).resolve().parent.parent.parent


@dataclass
class ProcessConfig:
    """How an engine process is started."""

    model_dir: Path
    device: str
    dtype: str
    max_batch: int = 32
    blocks: int = 0
    """KV blocks (0: room for a full batch of full-context sequences)."""
    block_size: int = 16
    threads: int = 0
    beat_s: float = 0.25
    hang_s: float = 10.0
    start_timeout_s: float = 180.0
    log_level: str = "info"
    inject_fault: str = ""
    """A fault the engine injects into itself (tests, benchmarks: `worker.fault_plan`)."""
    restart_backoff_s: tuple[float, float] = (0.5, 60.0)


@dataclass
class _Live:
    queue: asyncio.Queue[list[TokenEvent] | BaseException] = field(default_factory=asyncio.Queue)


class EngineProcess:
    """A language-model engine in a process of its own (see the module docstring)."""

    def __init__(self, config: ProcessConfig, manifest: ModelManifest, vocab_size: int) -> None:
        self.config = config
        self.manifest = manifest
        self.vocab_size = vocab_size
        self.device = config.device
        self.dtype = config.dtype
        self.context_length = manifest.context_length
        self.restarts = 0
        self.failed_starts = 0
        self.down = "not started"
        """Why the engine is not serving ("" while it is)."""
        self.stats_seen: dict[str, Any] = {}
        self.free_bytes: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._restarting: asyncio.Task[None] | None = None
        self._retry_at = 0.0
        self._live: dict[str, _Live] = {}
        self._closed = False
        self._last_beat = 0.0
        self._last_progress = (0.0, -1)  # (when the step counter last moved, its value)
        self._block_size = config.block_size
        self._blocks_total = 0

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def serving(self) -> bool:
        return not self.down

    async def start(self) -> None:
        """Starts the engine and waits for its model to load; FailedPrecondition with the
        engine's own reason when it cannot."""
        c = self.config
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}  # fmt: skip
        argv = [
            sys.executable, "-m", "gateway.llm.worker", "--fd", str(child.fileno()),
            "--model-dir", str(c.model_dir), "--device", c.device, "--dtype", c.dtype,
            "--max-batch", str(c.max_batch), "--blocks", str(c.blocks),
            "--block-size", str(c.block_size), "--threads", str(c.threads),
            "--beat-s", str(c.beat_s), "--log-level", c.log_level,
            *(("--inject-fault", c.inject_fault) if c.inject_fault else ()),
        ]  # fmt: skip
        started = time.monotonic()
        try:
            # A session of its own: a terminal's ^C is the gateway's, which ends the engine.
            proc = await asyncio.to_thread(
                subprocess.Popen, argv, pass_fds=(child.fileno(),), env=env,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            parent.close()
            why = f"language model engine on {c.device} did not start: {exc}"
            raise FailedPrecondition(why) from exc
        finally:
            child.close()
        writer: asyncio.StreamWriter | None = None
        try:
            reader, writer = await asyncio.open_connection(sock=parent)
            async with asyncio.timeout(c.start_timeout_s):
                ready = await read_frame(reader)
        except asyncio.CancelledError:  # the gateway stopped while this engine started
            _end(proc)
            writer.close() if writer is not None else parent.close()
            raise
        except (TimeoutError, OSError, ValueError) as exc:
            _end(proc)
            writer.close() if writer is not None else parent.close()
            raise FailedPrecondition(
                f"language model engine on {c.device} did not report ready within "
                f"{c.start_timeout_s:g} s: {exc or type(exc).__name__}"
            ) from exc
        if ready is None or ready.get("op") != "ready":
            writer.close()
            code = _end(proc)
            why = (ready or {}).get("reason") or f"it exited with code {code} before loading"
            raise FailedPrecondition(f"language model engine on {c.device}: {why}")
        if self._closed:
            writer.close()
            _end(proc)
            raise FailedPrecondition("the gateway stopped while its engine started")
        self._proc, self._writer = proc, writer
        self._take_stats(ready)
        self._blocks_total = int(ready["stats"]["blocks_total"])
        self._block_size = int(ready["stats"]["block_size"])
        self.down = ""
        now = time.monotonic()
        self._last_beat, self._last_progress = now, (now, int(ready["stats"]["steps"]))
        self._reader_task = asyncio.create_task(self._read(reader, proc))
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.create_task(self._watch())
        log.info("llm_engine_process_ready", device=c.device, dtype=c.dtype, pid=proc.pid,
                 load_s=round(time.monotonic() - started, 3))  # fmt: skip

    async def close(self) -> None:
        self._closed = True
        self.down = "closed"
        tasks = [t for t in (self._watch_task, self._restarting) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._lost_now("the gateway stopped", restart=False)
        if self._reader_task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader_task

    def kill(self) -> None:
        """Ends the engine process at once (tests, the demo's failover drill)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def _lost_now(self, why: str, restart: bool = True) -> None:
        """The engine is unusable: every live request ends with a device error (the failover
        continues it), the process is ended, and another is started."""
        proc, writer = self._proc, self._writer
        self._proc, self._writer = None, None
        if not self.down:
            self.down = why
            log.warning("llm_engine_lost", device=self.device, reason=why)
        fault = DeviceFault("device_error", f"{self.device}: language model engine {why}")
        for live in self._live.values():
            live.queue.put_nowait(fault)
        self._live.clear()
        if writer is not None:
            writer.close()
        if proc is not None:
            _end(proc)
        if restart and not self._closed:
            self._restart()

    def _restart(self) -> None:
        if self._restarting is not None and not self._restarting.done():
            return

        async def again() -> None:
            wait = self._retry_at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                await self.start()
            except FailedPrecondition as exc:
                self.failed_starts += 1
                first, most = self.config.restart_backoff_s
                backoff = min(most, first * 2 ** (self.failed_starts - 1))
                self._retry_at = time.monotonic() + backoff
                self.down = (f"restart failed ({self.failed_starts} in a row; next try in "
                             f"{backoff:g} s): {exc.message}")  # fmt: skip
                log.error("llm_engine_restart_failed", device=self.device, error=exc.message,
                          retry_in_s=backoff)  # fmt: skip
                if not self._closed:
                    self._restarting = None
                    self._restart()
                return
            self.failed_starts, self._retry_at = 0, 0.0
            self.restarts += 1
            log.info("llm_engine_restarted", device=self.device, restarts=self.restarts)

        self._restarting = asyncio.get_running_loop().create_task(again())

    async def _read(self, reader: asyncio.StreamReader, proc: subprocess.Popen[bytes]) -> None:
        why = "closed its end"
        try:
            while True:
                message = await read_frame(reader)
                if message is None:
                    break
                op = message.get("op")
                if op == "beat":
                    self._take_stats(message)
                    continue
                live = self._live.get(str(message.get("id")))
                if live is None:
                    continue  # an aborted request's last words
                if op == "events":
                    live.queue.put_nowait([TokenEvent(int(t), str(x), lp, f)
                                           for t, x, lp, f in message["events"]])  # fmt: skip
                elif op == "error":
                    live.queue.put_nowait(_error(message))
        except (OSError, ValueError) as exc:
            why = f"broke its connection: {exc}"
        if proc is self._proc:  # (not an engine already replaced)
            code = proc.poll()
            if code is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = await asyncio.to_thread(proc.wait, 2.0)
            self._lost_now(f"exited with code {code}" if code is not None else why)

    def _take_stats(self, message: dict[str, Any]) -> None:
        now = time.monotonic()
        self._last_beat = now
        stats = message.get("stats") or {}
        self.stats_seen = stats
        free = message.get("free_bytes", -1)
        self.free_bytes = None if free is None or free < 0 else int(free)
        steps = int(stats.get("steps", 0))
        if steps != self._last_progress[1] or not (stats.get("running") or stats.get("waiting")):
            self._last_progress = (now, steps)

    async def _watch(self) -> None:
        """Judges a live engine hung when it has work and no step moved, or no beat came,
        for `hang_s`."""
        c = self.config
        while not self._closed:
            await asyncio.sleep(min(1.0, c.hang_s / 4))
            if self.down or self._proc is None:
                continue
            now = time.monotonic()
            if now - self._last_beat > c.hang_s:
                self._lost_now(f"sent no beat for {now - self._last_beat:.1f} s: hung")
            elif now - self._last_progress[0] > c.hang_s:
                self._lost_now(f"made no step for {now - self._last_progress[0]:.1f} s with "
                               "work queued: hung")  # fmt: skip

    # -- the request side ------------------------------------------------------------------

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self._block_size)

    def admission(self, prompt_tokens: int, max_tokens: int) -> Admission:
        """A snapshot from the engine's last beat (at most `beat_s` old)."""
        tokens = prompt_tokens + max_tokens
        free = int(self.stats_seen.get("blocks_free", 0))
        return Admission(tokens, self.blocks_for(tokens), free, self._blocks_total)

    def check(
        self, prompt_ids: Sequence[int], params: SamplingParams, resume_from: Sequence[int] = ()
    ) -> Admission:
        """What `LLMEngine.check` refuses, refused here before a frame is sent (the cache's
        size from the engine's reports: 0 until its first, when only the engine judges it)."""
        return check_request(
            prompt_ids, params, resume_from, vocab_size=self.vocab_size,
            context_length=self.context_length, admission=self.admission,
        )  # fmt: skip

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str,
        resume_from: Sequence[int] = (),
        rng_draws_used: int | None = None,
    ) -> AsyncGenerator[TokenEvent, None]:
        """As `LLMEngine.generate`; a lost engine ends the stream with DeviceFault."""
        self.check(prompt_ids, params, resume_from)
        writer = self._writer
        if writer is None or self.down:
            if not self._closed:
                self._restart()
            raise DeviceFault("device_error", f"{self.device}: language model engine down "
                              f"({self.down or 'starting'})")  # fmt: skip
        if request_id in self._live:
            raise AlreadyExists(f"request {request_id!r} is already generating")
        live = self._live[request_id] = _Live()
        params_json = {**asdict(params), "stop": list(params.stop),
                       "stop_token_ids": list(params.stop_token_ids)}  # fmt: skip
        writer.write(encode({
            "op": "generate", "id": request_id, "prompt": list(prompt_ids),
            "params": params_json, "resume_from": list(resume_from),
            "rng_draws_used": rng_draws_used,
        }))  # fmt: skip
        finished = False
        try:
            while not finished:
                item = await live.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                for event in item:
                    finished = event.finish_reason is not None
                    yield event
        finally:
            if self._live.get(request_id) is live:
                del self._live[request_id]
                if not finished and self._writer is writer and not writer.is_closing():
                    writer.write(encode({"op": "abort", "id": request_id}))

    def abort(self, request_id: str) -> None:
        writer = self._writer
        if request_id in self._live and writer is not None and not writer.is_closing():
            writer.write(encode({"op": "abort", "id": request_id}))

    def stats(self) -> dict[str, Any]:
        return {**self.stats_seen, "pid": self.pid, "restarts": self.restarts,
                "down": self.down, "process": True}  # fmt: skip


def _error(message: dict[str, Any]) -> BaseException:
    text = str(message.get("message", ""))
    if "fault" in message:
        return DeviceFault(str(message["fault"]), text)
    return error_for(str(message.get("code")), text, message.get("retry_after_s"))


def _end(proc: subprocess.Popen[bytes]) -> int | None:
    """Ends an engine this gateway started (by its pid) and reaps it."""
    if proc.poll() is None:
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        return proc.wait(10)
    return None
