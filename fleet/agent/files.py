"""A rollout's files: inputs placed in its machine before the first step, outputs collected
after the last one (also after a failed or timed-out step) and stored on the server.

Inputs come from the server by digest (`GetBlob` with the work id: only the host holding the
lease may read them) and are verified before a machine sees them; a directory travels as one
tar. Both directions use the machine's own `tar`, `cat` and `sh` through `exec`, so they work
the same on every runtime; inputs are made read-only (mode a-w) once placed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import os
import shutil
import tarfile
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import structlog

from fleet._proto.fleet.v1 import host_pb2
from fleet.core.errors import InvalidArgument, Unavailable
from fleet.core.manifest import InputFile, OutputArtifact
from fleet.core.rollout import Assignment
from fleet.runtime.base import Machine

log = structlog.get_logger(__name__)

PLACE_TIMEOUT_S = 600.0
COLLECT_TIMEOUT_S = 600.0
MAX_IN_MEMORY_OUTPUT = 1 << 30
"""A machine that cannot stream its output (a warm parent's child) returns it whole."""
UPLOAD_CHUNK = 1 << 20

PLACE_FILE = 'mkdir -p "$(dirname "$1")" && cat > "$1" && chmod a-w "$1"'
PLACE_DIR = 'mkdir -p "$1" && tar -xf - -C "$1" --no-same-owner && chmod -R a-w "$1"'
KIND = 'if [ -d "$1" ]; then echo dir; elif [ -e "$1" ]; then echo file; else echo none; fi'


class InputPlacementFailed(InvalidArgument):
    """An input the rollout cannot have where it asked (its own doing: not retried)."""


async def fetch_input(stub: Any, a: Assignment, item: InputFile) -> bytes:
    """An input's bytes from the server, verified against its digest."""
    data = bytearray()
    try:
        call = stub.GetBlob(
            host_pb2.GetBlobRequest(digest=item.digest, work_id=a.work_id, offset=0)
        )
        async for chunk in call:
            data += chunk.data
    except grpc.aio.AioRpcError as exc:
        raise Unavailable(
            f"input {item.path} ({item.digest}) could not be fetched: "
            f"{exc.code().name}: {exc.details()}"
        ) from None
    actual = "sha256:" + hashlib.sha256(data).hexdigest()
    if actual != item.digest:
        raise Unavailable(
            f"input {item.path} fetched from the server does not verify: it hashes to {actual}, "
            f"not {item.digest}"
        )
    return bytes(data)


async def stage_inputs(stub: Any, a: Assignment, directory: Path) -> tuple[tuple[str, str], ...]:
    """Fetches the inputs into `directory` on this host (a directory's tar unpacked there,
    refusing links and paths that leave it) for the runtime to mount read-only; returns
    (host path, path in the machine) pairs."""
    staged = []
    for index, item in enumerate(a.manifest.inputs):
        data = await fetch_input(stub, a, item)
        target = directory / str(index)
        try:
            await asyncio.to_thread(_unpack, data, target, item.directory)
        except (tarfile.TarError, ValueError) as exc:
            raise InputPlacementFailed(f"input {item.path}: not a usable tar: {exc}") from None
        staged.append((str(target), item.path))
        log.info("input_staged", path=item.path, digest=item.digest, bytes=len(data))
    return tuple(staged)


def _unpack(data: bytes, target: Path, directory: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    if not directory:
        target.write_bytes(data)
        return
    target.mkdir()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        tar.extractall(target, filter="data")


def remove_staged(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


async def place_inputs(machine: Machine, stub: Any, a: Assignment) -> None:
    """For runtimes that cannot mount host paths: copies each input in through `exec` and
    makes it read-only by mode (root in the machine can still change it)."""
    for item in a.manifest.inputs:
        data = await fetch_input(stub, a, item)
        script = PLACE_DIR if item.directory else PLACE_FILE
        result = await machine.exec(
            ["/bin/sh", "-c", script, "sh", item.path], timeout_s=PLACE_TIMEOUT_S, stdin=data
        )
        if result.exit_code != 0:
            raise InputPlacementFailed(
                f"input {item.path} could not be placed (exit {result.exit_code}): "
                f"{result.stderr.decode(errors='replace')[-500:]}"
            )
        log.info("input_placed", path=item.path, digest=item.digest, bytes=len(data))


async def collect_outputs(
    machine: Machine, stub: Any, a: Assignment, spool: Path
) -> tuple[OutputArtifact, ...]:
    """Each output path: stored on the server by digest, or an error saying why not."""
    found = []
    for path in a.manifest.outputs:
        try:
            found.append(await _collect(machine, stub, a, path, spool))
        except (OSError, Unavailable) as exc:
            found.append(OutputArtifact(path=path, error=f"not collected: {exc}"))
    return tuple(found)


async def _collect(
    machine: Machine, stub: Any, a: Assignment, path: str, spool: Path
) -> OutputArtifact:
    probe = await machine.exec(["/bin/sh", "-c", KIND, "sh", path], timeout_s=60)
    kind = probe.stdout.decode(errors="replace").strip()
    if probe.exit_code != 0 or kind not in ("dir", "file"):
        return OutputArtifact(path=path, error="no such file or directory in the machine")
    directory = kind == "dir"
    argv = ["tar", "-cf", "-", "-C", path, "."] if directory else ["cat", path]
    os.makedirs(spool, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=spool, prefix="output-")
    try:
        with os.fdopen(fd, "wb") as out:
            streamed = 0

            def sink(stream: str, chunk: bytes) -> None:
                nonlocal streamed
                if stream == "stdout":
                    out.write(chunk)
                    streamed += len(chunk)

            result = await machine.exec(
                argv, timeout_s=COLLECT_TIMEOUT_S, on_output=sink,
                max_output_bytes=MAX_IN_MEMORY_OUTPUT,
            )  # fmt: skip
            if result.exit_code != 0:
                return OutputArtifact(
                    path=path, directory=directory,
                    error=f"reading it failed (exit {result.exit_code}): "
                    f"{result.stderr.decode(errors='replace')[-300:]}",
                )  # fmt: skip
            if streamed == 0 and result.stdout:  # a machine that returns output whole
                out.write(result.stdout)
        return await _upload(stub, a, path, directory, Path(name))
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


async def _upload(
    stub: Any, a: Assignment, path: str, directory: bool, file: Path
) -> OutputArtifact:
    async def parts() -> AsyncIterator[host_pb2.ArtifactPart]:
        yield host_pb2.ArtifactPart(work_id=a.work_id, fencing_token=a.fencing_token)
        with file.open("rb") as handle:
            while data := await asyncio.to_thread(handle.read, UPLOAD_CHUNK):
                yield host_pb2.ArtifactPart(data=data)

    try:
        reply = await stub.PutArtifact(parts(), timeout=COLLECT_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return OutputArtifact(path=path, directory=directory, error=exc.details() or "")
        raise Unavailable(f"storing it failed: {exc.code().name}: {exc.details()}") from None
    log.info("output_stored", path=path, digest=reply.digest, bytes=reply.size)
    return OutputArtifact(path=path, digest=reply.digest, size=reply.size, directory=directory)


SPOOL_AFTER = 256 * 1024
"""A step's stream is held in memory up to this many bytes, then spooled to disk."""


class StepLog:
    """A step's stdout and stderr as they arrive, spooled to this host's disk: where the step
    printed more than the inline limit keeps, the whole of it is stored as an output named
    `step-N.stdout` / `step-N.stderr`. (A warm parent's child returns its output whole, up to
    the inline limit: it is not spooled.)"""

    def __init__(self, spool: Path, index: int) -> None:
        self.spool = spool
        self.index = index
        self._files: dict[str, Any] = {}
        self._held: dict[str, bytearray] = {}
        """What a stream wrote while it was under SPOOL_AFTER: held in memory, not on disk
        (most steps print little, and nothing of theirs is kept beyond the inline output)."""

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._files.values():
            handle.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(handle.name)

    def sink(self, stream: str, chunk: bytes) -> None:
        handle = self._files.get(stream)
        if handle is not None:
            handle.write(chunk)
            return
        held = self._held.setdefault(stream, bytearray())
        held += chunk
        if len(held) > SPOOL_AFTER:
            self._spool(stream)

    def _spool(self, stream: str) -> Any:
        """The stream's file on this host's disk, with what was held so far written to it."""
        os.makedirs(self.spool, exist_ok=True)
        handle = self._files[stream] = tempfile.NamedTemporaryFile(  # noqa: SIM115
            dir=self.spool, prefix=f"step-{self.index}-{stream}-", delete=False
        )
        handle.write(self._held.pop(stream, b""))
        return handle

    async def keep(self, stub: Any, a: Assignment, result: Any) -> list[OutputArtifact]:
        kept = []
        for stream, truncated in (("stdout", result.stdout_truncated),
                                  ("stderr", result.stderr_truncated)):  # fmt: skip
            if not truncated or (stream not in self._files and stream not in self._held):
                continue
            handle = self._files.get(stream) or self._spool(stream)
            handle.flush()
            name = f"step-{self.index}.{stream}"
            try:
                kept.append(await _upload(stub, a, name, False, Path(handle.name)))
            except Unavailable as exc:
                kept.append(OutputArtifact(path=name, error=f"not stored: {exc}"))
        return kept
