"""The language model's engine in a process of its own: `python -m gateway.llm.worker`.

Why a process (as for the policy's engine, `gateway.engine`): a device error may leave the
device unusable for the process that met it (CUDA's sticky errors), a hung kernel must be
ended from outside, and the gateway's event loop must not share an interpreter lock with the
model. The process runs an `LLMEngine` (continuous batching over a paged KV cache) and speaks
with the gateway over one end of a socket pair (`--fd`), in frames of a 4-byte little-endian
length and a JSON object:

from the gateway
    {"op": "generate", "id", "prompt": [ids], "params": {SamplingParams' fields},
     "resume_from": [ids], "rng_draws_used": n | null}
    {"op": "abort", "id"}
from the engine
    {"op": "ready", "pid", "stats": {...}} once the model is loaded, or {"op": "failed",
    "reason"} after which it exits;
    {"op": "events", "id", "events": [[token, text, logprob, finish_reason], ...]};
    {"op": "error", "id", "code" (a fleet error code) or "fault" ("oom", "device_error"),
     "message", "retry_after_s"} ending a request;
    {"op": "beat", "stats": {...}, "free_bytes": n | -1} every `--beat-s` seconds: the engine's
    counters (steps, blocks free, running, waiting) for admission and for the gateway's
    watchdog, which judges an engine whose step counter stands still while it has work hung.

After a device error (a fault of kind "device_error") the engine answers every live request
with it and exits: the gateway starts another from the same checksum-verified files. It exits
too when the gateway's end closes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from fleet import logs
from fleet.core.errors import FleetError

log = structlog.get_logger(__name__)

FRAME = struct.Struct("<I")
MAX_FRAME = 64 << 20
"""The largest frame either side accepts (a prompt of a full context is far smaller)."""


def encode(message: dict[str, Any]) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return FRAME.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next frame, or None at the end of the stream; a frame past `MAX_FRAME` or not a
    JSON object is a broken peer (ValueError)."""
    try:
        head = await reader.readexactly(FRAME.size)
    except asyncio.IncompleteReadError:
        return None
    (size,) = FRAME.unpack(head)
    if size > MAX_FRAME:
        raise ValueError(f"a frame of {size} bytes, over {MAX_FRAME}")
    try:
        body = await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        return None
    message = json.loads(body)
    if not isinstance(message, dict):
        raise ValueError("a frame that is not a JSON object")
    return message


def fault_plan(spec: str) -> Callable[[int], None] | None:
    """A fault to inject (tests, benchmarks): "KIND@STEP" fails the engine's step STEP (0 is
    its first) once, as the device would: KIND "oom" (an allocation failure) or "device"
    (a device error); "hang@STEP" stops the scheduler there for good; "slow@STEP" makes every
    step from there on take 50 ms more (a busy device)."""
    if not spec:
        return None
    kind, _, at = spec.partition("@")
    if kind not in ("oom", "device", "hang", "slow") or not at.isdigit():
        raise ValueError(f"--inject-fault {spec!r}: expected oom@N, device@N, hang@N or slow@N")
    step = int(at)
    fired = False

    def fault(steps: int) -> None:
        nonlocal fired
        if kind == "slow" and steps >= step:
            time.sleep(0.05)
            return
        if fired or steps < step:
            return
        fired = True
        import threading

        import torch

        if kind == "oom":
            raise torch.OutOfMemoryError(f"injected allocation failure at step {steps}")
        if kind == "device":
            raise RuntimeError(f"injected device error at step {steps}")
        threading.Event().wait()  # hung, as a kernel that never returns

    return fault


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.llm.worker")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=0, help="KV blocks (0: a full batch)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--beat-s", type=float, default=0.25)
    parser.add_argument("--inject-fault", default="", help=argparse.SUPPRESS)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logs.configure(args.log_level)
    sock = socket.socket(fileno=args.fd)
    try:
        import torch

        from gateway.llm.engine import DTYPES, LLMEngine

        if args.threads > 0:
            torch.set_num_threads(args.threads)
        engine = LLMEngine(
            args.model_dir, args.device, DTYPES[args.dtype], block_size=args.block_size,
            num_blocks=args.blocks or None, max_batch=args.max_batch,
            fault=fault_plan(args.inject_fault),
        )  # fmt: skip
    except Exception as exc:  # the reason goes back to the gateway, which says it
        sock.sendall(encode({"op": "failed", "reason": f"{type(exc).__name__}: {exc}"}))
        return 1
    try:
        return asyncio.run(_serve(sock, engine, args.beat_s))
    except (BrokenPipeError, ConnectionResetError):
        return 0
    finally:
        engine.close(5.0)


def _free_bytes(device: str) -> int:
    if not device.startswith("cuda"):
        return -1
    try:
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    except Exception:  # a context an error left unusable
        return -1


async def _serve(sock: socket.socket, engine: Any, beat_s: float) -> int:
    from gateway.llm.sampling import SamplingParams
    from gateway.model import DeviceFault

    reader, writer = await asyncio.open_connection(sock=sock)
    device = str(engine.device)
    tasks: dict[str, asyncio.Task[None]] = {}
    broken = asyncio.Event()

    def send(message: dict[str, Any]) -> None:
        if not writer.is_closing():
            writer.write(encode(message))

    async def generate(message: dict[str, Any]) -> None:
        rid = str(message["id"])
        try:
            raw = dict(message["params"])
            raw["stop"] = tuple(raw.get("stop", ()))
            raw["stop_token_ids"] = tuple(raw.get("stop_token_ids", ()))
            params = SamplingParams(**raw)
            stream = engine.generate(
                list(message["prompt"]), params, request_id=rid,
                resume_from=list(message.get("resume_from") or ()),
                rng_draws_used=message.get("rng_draws_used"),
            )  # fmt: skip
            async for event in stream:
                send({"op": "events", "id": rid, "events": [
                    [event.token_id, event.text, event.logprob, event.finish_reason]]})  # fmt: skip
        except FleetError as exc:
            send({"op": "error", "id": rid, "code": str(exc.code), "message": exc.message,
                  "retry_after_s": exc.retry_after_s})  # fmt: skip
        except DeviceFault as exc:
            send({"op": "error", "id": rid, "fault": exc.kind, "message": str(exc)})
            if exc.kind == "device_error":
                broken.set()
        except asyncio.CancelledError:
            pass  # aborted: the generator's close freed its blocks
        finally:
            tasks.pop(rid, None)

    async def beat() -> None:
        while True:
            send({"op": "beat", "stats": engine.stats(), "free_bytes": _free_bytes(device)})
            await writer.drain()
            await asyncio.sleep(beat_s)

    send({"op": "ready", "pid": os.getpid(), "stats": engine.stats(),
          "free_bytes": _free_bytes(device)})  # fmt: skip
    beating = asyncio.create_task(beat())
    ending = asyncio.create_task(broken.wait())
    code = 0
    try:
        while True:
            reading = asyncio.create_task(read_frame(reader))
            done, _ = await asyncio.wait({reading, ending}, return_when=asyncio.FIRST_COMPLETED)
            if ending in done:
                reading.cancel()
                log.error("llm_engine_device_error", device=device,
                          effect="this engine exits; the gateway starts another")  # fmt: skip
                code = 3
                break
            message = reading.result()
            if message is None:
                break  # the gateway went away
            op = message.get("op")
            if op == "generate" and str(message.get("id")) not in tasks:
                rid = str(message["id"])
                tasks[rid] = asyncio.create_task(generate(message))
            elif op == "abort":
                task = tasks.get(str(message.get("id")))
                if task is not None:
                    task.cancel()
            else:
                log.warning("llm_engine_frame_ignored", op=op)
    finally:
        beating.cancel()
        for task in list(tasks.values()):
            task.cancel()
        await asyncio.gather(*tasks.values(), beating, return_exceptions=True)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
