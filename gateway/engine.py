"""The primary device's model in a process of its own (the engine), fed batches over a socket.

Why a process: the gateway's event loop (gRPC, HTTP, tokens, batching) and a model run in one
of its threads share one interpreter lock. Every operator of a forward pass gives the lock up
and must take it back, and the thread that hands the batch over must take it to start: under
load, with the loop busy, each of those waits lasts up to the interpreter's switch interval.
In a process of its own the model waits on nothing but its next batch. And a device error,
which may leave the device unusable (CUDA's sticky errors poison the process's context), ends
with the process: the engine answers the batch with the error and exits, is started again from
the same checksum-verified weights, and the breaker's next probe finds it fresh, where an
in-process model would stay broken until the gateway restarted.

The engine is `python -m gateway.engine` with one end of a socket pair (`--fd`). Frames,
little-endian:

- the engine's first one, once the model is loaded: a reply (sequence 0) whose payload is JSON
  `{"device", "capacity_bytes", "pid", "weights_bytes", "packed_from_rows", "uuid",
  "reserved_rows"}` (uuid: the CUDA device's, for its utilization, null on a CPU;
  reserved_rows: the largest batch whose memory it took at load, `TorchRunner._reserve`, 0 on a
  CPU), or status FAILED with the reason, after which it exits;
- a batch: `REQUEST` (magic, sequence, samples, width) then samples x width float32;
- its answer: `REPLY` (magic, status, sequence, payload bytes, free device bytes or -1) then
  samples x outputs float32, or, for a fault, the message in UTF-8 (after a device error,
  status DEVICE_ERROR, the engine exits).

It exits when the gateway's end closes (the gateway stopped or died).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from array import array
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import structlog

from fleet import logs
from fleet.core.errors import FailedPrecondition, InvalidArgument
from gateway.model import DeviceFault, ModelSpec, TorchRunner, memory_model
from gateway.nvml import UtilizationProbe

log = structlog.get_logger(__name__)

REQUEST = struct.Struct("<2sxxIII")
REPLY = struct.Struct("<2sBxIIq")
OK, OOM, DEVICE_ERROR, INVALID, FAILED = 0, 1, 2, 3, 4
_FAULT_KINDS = {OOM: "oom", DEVICE_ERROR: "device_error"}
MAX_PAYLOAD = 1 << 30
REPO = Path(__file__).resolve().parent.parent


# -- the engine process ---------------------------------------------------------------------


def _recv_exactly(sock: socket.socket, size: int) -> bytearray | None:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return buffer


def _reply(sock: socket.socket, status: int, sequence: int, payload: bytes, free: int) -> None:
    sock.sendall(REPLY.pack(b"FR", status, sequence, len(payload), free) + payload)


def engine_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.engine")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--manifest", type=Path, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="")
    parser.add_argument("--device", required=True)
    parser.add_argument("--capacity-bytes", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument(
        "--reserve-rows",
        type=int,
        default=0,
        help="on CUDA, take the memory batches up to this size need at load",
    )
    parser.add_argument("--no-pack", action="store_true", help="never pre-pack the weights")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logs.configure(args.log_level)
    sock = socket.socket(fileno=args.fd)
    try:
        import torch

        from gateway.model import cuda_uuid, device_capacity_bytes, load_network, select_model

        if args.threads > 0:
            torch.set_num_threads(args.threads)
        spec = select_model(args.manifest, args.model, args.dtype, "engine dtype")
        capacity = args.capacity_bytes or device_capacity_bytes(args.device, 0.0)
        runner = TorchRunner(spec, load_network(spec), args.device, capacity,
                             pack=not args.no_pack, reserve_rows=args.reserve_rows)  # fmt: skip
        uuid = cuda_uuid(args.device)
    except Exception as exc:  # the reason goes back to the gateway, which refuses to start
        _reply(sock, FAILED, 0, f"{type(exc).__name__}: {exc}".encode(), -1)
        return 1
    ready = {
        "device": args.device, "capacity_bytes": capacity, "pid": os.getpid(),
        "weights_bytes": runner.memory.weights_bytes,
        "packed_from_rows": runner.packed.from_rows if runner.packed else None, "uuid": uuid,
        "reserved_rows": runner.reserved_rows,
    }  # fmt: skip
    try:
        _reply(sock, OK, 0, json.dumps(ready).encode(), _free(runner))
        return _serve(sock, runner)
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the gateway went away mid-answer


def _serve(sock: socket.socket, runner: TorchRunner) -> int:
    while True:
        header = _recv_exactly(sock, REQUEST.size)
        if header is None:
            return 0
        magic, sequence, samples, width = REQUEST.unpack(header)
        if magic != b"FQ" or samples * width * 4 > MAX_PAYLOAD:
            return 2  # not the gateway speaking: nothing sensible to answer
        data = _recv_exactly(sock, samples * width * 4)
        if data is None:
            return 0
        try:
            out = runner.run_flat(data, samples, width)
            status, payload = OK, out.tobytes()
        except DeviceFault as exc:
            status = OOM if exc.kind == "oom" else DEVICE_ERROR
            payload = str(exc).encode()
        except InvalidArgument as exc:
            status, payload = INVALID, exc.message.encode()
        except Exception as exc:  # anything else the device raised: a device error
            status, payload = DEVICE_ERROR, f"{type(exc).__name__}: {exc}".encode()
        _reply(sock, status, sequence, payload, _free(runner))
        if status == DEVICE_ERROR:
            # A device that raised may be unusable for good (an error on CUDA can poison the
            # process's context: every later call fails), so this engine ends; the gateway
            # starts a fresh one from the same weights.
            log.error("engine_device_error", device=runner.device, error=payload.decode())
            return 3


def _free(runner: TorchRunner) -> int:
    """The device's free bytes as admission sees them, or -1 where it cannot tell (a CPU, or
    a CUDA context an error left unusable)."""
    try:
        free = runner.observed_free_bytes()
    except Exception:  # whatever the broken device raises
        return -1
    return -1 if free is None else free


# -- the gateway's side ---------------------------------------------------------------------


class _Process:
    """One started engine: its process and the gateway's end of the socket."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket, ready: dict) -> None:  # type: ignore[type-arg]
        self.proc = proc
        self.sock = sock
        self.ready = ready

    def end(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


class EngineRunner:
    """A `Runner` whose batches run in an engine process (see the module docstring).

    Faults come back as `DeviceFault`, as from an in-process runner. An engine that dies, does
    not answer a batch within `answer_timeout_s`, or answers one with a device error (after
    which it ends itself), is a device error: it is ended and started again in the background
    at once, and batches fault (the breaker sends them to the CPU replica) until it is ready.
    A restart that fails is tried again after a wait (`restart_backoff_s`) that doubles with
    each failure in a row. An out-of-memory answer keeps the engine. `fault` (tests,
    benchmarks) is called on the event loop before each batch is sent and may raise
    DeviceFault; it must not block.
    """

    def __init__(
        self,
        spec: ModelSpec,
        manifest: Path,
        device: str,
        capacity_bytes: int = 0,
        *,
        threads: int = 0,
        fault: Callable[[], None] | None = None,
        answer_timeout_s: float = 60.0,
        start_timeout_s: float = 180.0,
        pack: bool = True,
        log_level: str = "info",
        reserve_rows: int = 0,
        restart_backoff_s: tuple[float, float] = (1.0, 60.0),
    ) -> None:
        self.spec = spec
        self.manifest = manifest
        self.device = device
        self.memory = memory_model(spec)
        self.capacity_bytes = capacity_bytes
        self.fault = fault
        self.threads = threads
        self.answer_timeout_s = answer_timeout_s
        self.start_timeout_s = start_timeout_s
        self.pack = pack
        self.log_level = log_level
        self.reserve_rows = reserve_rows
        self.reserved_rows = 0
        """What the engine reserved at its last start (`TorchRunner.reserved_rows`)."""
        self.restarts = 0
        self.restart_backoff_s = restart_backoff_s
        """The wait after a failed restart before the next try, doubled at each failure in a
        row up to the second figure: a device that cannot start an engine (a GPU lost from the
        bus) costs a failed start now and then, not one at every probe."""
        self.failed_starts = 0
        """Restarts that failed since the engine last started."""
        self._retry_at = 0.0
        self._engine: _Process | None = None
        self._closed = False
        self._down = "not started"
        self._restarting: asyncio.Task[None] | None = None
        self._free: int | None = None
        self._sequence = 0
        self._lock = threading.Lock()  # start/stop from a thread and from the loop
        self._turn = asyncio.Lock()  # one batch on the socket at a time
        self._utilization = UtilizationProbe(device, None)  # (its GPU's UUID: when ready)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the engine and waits until its model is loaded; raises FailedPrecondition
        with the engine's own reason when it cannot be."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
        )}  # fmt: skip
        argv = [
            sys.executable, "-m", "gateway.engine", "--fd", str(child.fileno()),
            "--manifest", str(self.manifest), "--model", self.spec.name,
            "--dtype", self.spec.dtype, "--device", self.device,
            "--capacity-bytes", str(self.capacity_bytes), "--threads", str(self.threads),
            "--reserve-rows", str(self.reserve_rows), "--log-level", self.log_level,
            *(() if self.pack else ("--no-pack",)),
        ]  # fmt: skip
        started = time.monotonic()
        try:
            # Its own session: a terminal's ^C is for the gateway, which ends it by closing the
            # socket (the engine exits at end of input).
            proc = subprocess.Popen(
                argv, pass_fds=(child.fileno(),), env=env, cwd=REPO,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            parent.close()
            why = f"model engine for {self.device} did not start: {exc}"
            raise FailedPrecondition(why) from exc
        finally:
            child.close()
        try:
            parent.settimeout(self.start_timeout_s)
            header = _recv_exactly(parent, REPLY.size)
            if header is None:
                code = proc.wait(10)
                raise FailedPrecondition(
                    f"model engine for {self.device} exited with code {code} before its model "
                    "was loaded (its error is in this gateway's stderr)"
                )
            _magic, status, _seq, length, free = REPLY.unpack(header)
            payload = bytes(_recv_exactly(parent, length) or b"")
            if status != OK:
                proc.wait(10)
                raise FailedPrecondition(
                    f"model engine for {self.device} could not load {self.spec.name}: "
                    f"{payload.decode(errors='replace')}"
                )
        except (OSError, FailedPrecondition, subprocess.TimeoutExpired) as exc:
            parent.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            if isinstance(exc, FailedPrecondition):
                raise
            raise FailedPrecondition(
                f"model engine for {self.device} did not report ready within "
                f"{self.start_timeout_s:g} s: {exc}"
            ) from exc
        ready = json.loads(payload)
        parent.setblocking(False)
        with self._lock:
            if self._closed:  # closed while this one started (a restart racing a stop)
                _Process(proc, parent, ready).end()
                raise FailedPrecondition(f"model engine for {self.device}: the gateway stopped")
            self._engine = _Process(proc, parent, ready)
            # Ended with this runner if nothing closed it (a gateway dropped without stop()).
            weakref.finalize(self, self._engine.end)
            self.capacity_bytes = int(ready["capacity_bytes"])
            # What the engine holds: its packed copy of the weights too, if it made one.
            self.memory = replace(self.memory, weights_bytes=int(ready["weights_bytes"]))
            self._free = None if free < 0 else free
            self.reserved_rows = int(ready.get("reserved_rows") or 0)
            self._down = ""
            if ready.get("uuid") and ready["uuid"] != self._utilization.uuid:
                self._utilization.close()
                self._utilization = UtilizationProbe(self.device, str(ready["uuid"]))
        log.info("engine_ready", device=self.device, model=self.spec.name, pid=proc.pid,
                 load_s=round(time.monotonic() - started, 3),
                 packed_from_rows=ready.get("packed_from_rows"),
                 reserved_rows=ready.get("reserved_rows"))  # fmt: skip

    @property
    def pid(self) -> int | None:
        """The engine process's pid while it runs (tests, diagnostics)."""
        engine = self._engine
        return engine.proc.pid if engine is not None else None

    def close(self) -> None:
        with self._lock:
            engine, self._engine = self._engine, None
            self._closed = True
            self._down = "closed"
        if engine is not None:
            engine.end()
        self._utilization.close()

    def _lost(self, why: str) -> None:
        """The engine is unusable: end it and start another in the background."""
        with self._lock:
            engine, self._engine = self._engine, None
            self._down = why
        if engine is not None:
            engine.end()
        log.warning("engine_lost", device=self.device, reason=why)
        self._restart()

    def _restart(self) -> None:
        if self._closed or (self._restarting is not None and not self._restarting.done()):
            return
        if time.monotonic() < self._retry_at:  # waiting after a failed restart
            return

        async def again() -> None:
            try:
                await asyncio.to_thread(self.start)
            except FailedPrecondition as exc:
                self.failed_starts += 1
                first, most = self.restart_backoff_s
                wait = min(most, first * 2 ** (self.failed_starts - 1))
                self._retry_at = time.monotonic() + wait
                with self._lock:
                    self._down = (f"restart failed ({self.failed_starts} in a row; next try in "
                                  f"{wait:g} s): {exc.message}")  # fmt: skip
                log.error("engine_restart_failed", device=self.device, error=exc.message,
                          failed_starts=self.failed_starts, retry_in_s=wait)  # fmt: skip
                return
            self.failed_starts, self._retry_at = 0, 0.0
            self.restarts += 1
            log.info("engine_restarted", device=self.device, restarts=self.restarts)

        self._restarting = asyncio.get_running_loop().create_task(again())

    # -- Runner ---------------------------------------------------------------------------------

    def observed_free_bytes(self) -> int | None:
        return self._free if self.device.startswith("cuda") else None

    def utilization(self) -> float | None:
        """Read by this process from the driver (NVML), by the UUID the engine reported: the
        driver sees the GPU whichever process holds it."""
        return self._utilization.read()

    async def infer(self, inputs: list[list[float]]) -> list[list[float]]:
        async with self._turn:
            return await self._infer(inputs)

    async def _infer(self, inputs: list[list[float]]) -> list[list[float]]:
        if self.fault is not None:
            self.fault()
        if not inputs:
            return []
        width = self.spec.input_dim
        if any(len(sample) != width for sample in inputs):
            raise InvalidArgument(f"model {self.spec.name} takes {width} inputs per sample")
        engine = self._engine
        if engine is None:
            self._restart()
            raise DeviceFault("device_error", f"{self.device}: model engine down ({self._down})")
        flat = array("f")
        for sample in inputs:
            flat.extend(sample)
        self._sequence += 1
        sequence = self._sequence
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.answer_timeout_s):
                await loop.sock_sendall(
                    engine.sock, REQUEST.pack(b"FQ", sequence, len(inputs), width) + flat.tobytes()
                )
                header = await _recv_async(loop, engine.sock, REPLY.size)
                magic, status, answered, length, free = REPLY.unpack(header)
                if magic != b"FR" or answered != sequence or length > MAX_PAYLOAD:
                    raise ConnectionError(f"engine answered out of turn ({answered}, {sequence})")
                payload = await _recv_async(loop, engine.sock, length)
        except TimeoutError:
            self._lost(f"no answer to a batch of {len(inputs)} within {self.answer_timeout_s:g} s")
            raise DeviceFault(
                "device_error", f"{self.device}: model engine did not answer within "
                f"{self.answer_timeout_s:g} s; restarting it"
            ) from None  # fmt: skip
        except (ConnectionError, OSError) as exc:
            code = engine.proc.poll()
            why = f"exited with code {code}" if code is not None else f"connection lost: {exc}"
            self._lost(why)
            raise DeviceFault(
                "device_error", f"{self.device}: model engine {why}; restarting it"
            ) from exc
        self._free = None if free < 0 else free
        if status == OK:
            out = array("f")
            out.frombytes(payload)
            k = self.spec.output_dim
            return [out[i * k : (i + 1) * k].tolist() for i in range(len(inputs))]
        message = payload.decode(errors="replace")
        if status == INVALID:
            raise InvalidArgument(message)
        if status == DEVICE_ERROR:  # the engine ends after one (`_serve`): start another now
            self._lost(f"its device raised an error: {message}")
            raise DeviceFault("device_error", f"{message}; restarting the model engine")
        raise DeviceFault(_FAULT_KINDS.get(status, "device_error"), message)


async def _recv_async(loop: asyncio.AbstractEventLoop, sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise ConnectionError("the engine closed its end")
        got += n
    return bytes(buffer)


if __name__ == "__main__":
    sys.exit(engine_main())
