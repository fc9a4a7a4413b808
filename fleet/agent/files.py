"""A rollout's files: inputs placed in its machine before the first step, outputs collected
after the last one (also after a failed or timed-out step) and stored on the server.

Inputs come from the server by digest (`GetBlob` with the work id: only the host holding the
lease may read them) and are verified before a machine sees them; a directory travels as one
tar. Where the runtime mounts host paths, a directory input is unpacked on this host by
`fleet.safepath` (never `tarfile.extractall`: nothing in a tenant's tar can name a host path);
elsewhere it is unpacked inside the machine by the machine's own `tar`.

Outputs are read with the machine's own `tar` and `cat` through `exec`, so they work the same
on every runtime; but the workload chose what `tar` is (it controls the machine's PATH and
files), so a directory's stream is only input to `safepath.repack_tar`: what is stored is an
archive fleet wrote (normalised names, no links out of the tree, no devices, no setuid bits, no
owners), or the output carries an error saying why not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import structlog

from fleet import safepath
from fleet.api.pb import host_pb2
from fleet.core.errors import InvalidArgument, Unavailable
from fleet.core.manifest import InputFile, OutputArtifact
from fleet.core.rollout import Assignment
from fleet.runtime.base import Machine

log = structlog.get_logger(__name__)

PLACE_TIMEOUT_S = 600.0
COLLECT_TIMEOUT_S = 600.0
MAX_IN_MEMORY_OUTPUT = 1 << 30
"""A machine that cannot stream its output (a warm parent's child) returns it whole."""
MAX_OUTPUT_BYTES = 4 << 30
"""An output's stream from the machine is spooled on this host's disk up to this many bytes;
a larger one is not collected (the server's own bound, `fleet serve --max-output-mib`, is
usually lower)."""
INPUT_LIMITS = safepath.Limits()
OUTPUT_LIMITS = safepath.Limits(max_bytes=MAX_OUTPUT_BYTES)
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
        except (safepath.UnsafeArchive, safepath.UnsafePath) as exc:
            raise InputPlacementFailed(f"input {item.path}: refused: {exc.message}") from None
        staged.append((str(target), item.path))
        log.info("input_staged", path=item.path, digest=item.digest, bytes=len(data))
    return tuple(staged)


def _unpack(data: bytes, target: Path, directory: bool) -> None:
    """A file's bytes, or a directory's tar unpacked by fleet's own code: no member can be
    placed outside `target`, hard links only join files of the same archive, and no owners,
    setuid bits or device nodes are kept. (`target` is this agent's own staging path.)"""
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    safepath.remove(target.parent, target.name)
    if not directory:
        safepath.write_bytes(target.parent, target.name, data)
        return
    target.mkdir(mode=0o755)
    policy = safepath.ExtractPolicy(limits=INPUT_LIMITS)
    safepath.extract_tar(io.BytesIO(data), target, policy)


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
    made = ""
    try:
        with os.fdopen(fd, "wb") as out:
            streamed = over = 0

            def sink(stream: str, chunk: bytes) -> None:
                nonlocal streamed, over
                if stream != "stdout":
                    return
                if streamed + len(chunk) > MAX_OUTPUT_BYTES:
                    over += len(chunk)  # the rest is counted, not written
                    return
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
            if over or len(result.stdout) > MAX_OUTPUT_BYTES:
                return OutputArtifact(
                    path=path, directory=directory,
                    error=f"not collected: larger than this host's bound of "
                    f"{MAX_OUTPUT_BYTES} bytes for one output",
                )  # fmt: skip
            if streamed == 0 and result.stdout:  # a machine that returns output whole
                out.write(result.stdout)
        if not directory:
            return await upload_output(stub, a, path, directory, Path(name))
        fd, made = tempfile.mkstemp(dir=spool, prefix="output-fleet-")
        os.close(fd)
        try:
            size = await asyncio.to_thread(_repack, Path(name), Path(made))
        except safepath.UnsafeArchive as exc:
            log.warning("output_refused", path=path, why=exc.message)
            return OutputArtifact(path=path, directory=True, error=f"refused: {exc.message}")
        log.info("output_repacked", path=path, streamed=streamed, bytes=size)
        return await upload_output(stub, a, path, directory, Path(made))
    finally:
        for leftover in (name, made):
            with contextlib.suppress(FileNotFoundError):
                if leftover:
                    os.unlink(leftover)


def _repack(raw: Path, made: Path) -> int:
    """The machine's tar stream at `raw`, read strictly and written anew at `made` by fleet
    (device nodes and fifos left out, as a fleet-made archive of the tree would)."""
    with raw.open("rb") as src, made.open("wb") as out:
        return safepath.repack_tar(src, out, OUTPUT_LIMITS, devices="skip")


async def upload_output(
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
MAX_STEP_STREAM_BYTES = 256 << 20
"""What one stream (stdout or stderr) of one step keeps on this host's disk: past it the rest
is counted, not kept, and the kept output says where it was cut. A step that prints without
end cannot fill the host's disk."""


class StepLog:
    """A step's stdout and stderr as they arrive, spooled to this host's disk: where the step
    printed more than the inline limit keeps, what it printed (up to MAX_STEP_STREAM_BYTES a
    stream) is stored as an output named `step-N.stdout` / `step-N.stderr`; one cut at the
    bound ends with a line saying so, and its `error` says it too. (A warm parent's child
    returns its output whole, up to the inline limit: it is not spooled.)"""

    def __init__(self, spool: Path, index: int, *, limit: int | None = None) -> None:
        self.spool = spool
        self.index = index
        self.limit = MAX_STEP_STREAM_BYTES if limit is None else limit
        self._files: dict[str, Any] = {}
        self._held: dict[str, bytearray] = {}
        """What a stream wrote while it was under SPOOL_AFTER: held in memory, not on disk
        (most steps print little, and nothing of theirs is kept beyond the inline output)."""
        self._size: dict[str, int] = {}
        """Bytes of each stream kept (held or spooled)."""
        self._cut: dict[str, int] = {}
        """Bytes of each stream past the bound, not kept."""

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._files.values():
            handle.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(handle.name)

    def sink(self, stream: str, chunk: bytes) -> None:
        size = self._size.get(stream, 0)
        room = self.limit - size
        if len(chunk) > room:
            self._cut[stream] = self._cut.get(stream, 0) + len(chunk) - max(room, 0)
            chunk = chunk[: max(room, 0)]
            if not chunk:
                return
        self._size[stream] = size + len(chunk)
        handle = self._files.get(stream)
        if handle is not None:
            handle.write(chunk)
            return
        held = self._held.setdefault(stream, bytearray())
        held += chunk
        if len(held) > SPOOL_AFTER:
            self._spool(stream)

    def cut(self, stream: str) -> int:
        """Bytes of `stream` past the bound that were not kept (0: it was kept whole)."""
        return self._cut.get(stream, 0)

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
            name = f"step-{self.index}.{stream}"
            note = ""
            if cut := self.cut(stream):
                note = (
                    f"cut at {self.limit} bytes (fleet keeps at most that much of a step's "
                    f"stream): {cut} more bytes were not kept"
                )
                handle.write(f"\n[fleet: {note}]\n".encode())
            handle.flush()
            try:
                stored = await upload_output(stub, a, name, False, Path(handle.name))
            except Unavailable as exc:
                kept.append(OutputArtifact(path=name, error=f"not stored: {exc}"))
                continue
            if note and stored.digest:
                stored = stored.model_copy(update={"error": note})
            kept.append(stored)
        return kept
