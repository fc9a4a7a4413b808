"""A session's disk kept without its machine: the writable layer archived and stored as an
artifact of the session's attempt (a park), and a new machine started from such a layer (a
resume, or a fork of a parked session) on whichever host the server placed it.

The archive is made and checked by `fleet.runtime.layers`; it travels as any artifact does
(`PutArtifact` under the lease that parks, `GetBlob` under the lease that resumes: the server
allows a lease only the layer its manifest names), verified against its digest on arrival. No
process carries over: the machine that starts from it runs nothing of the old one's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import shutil
from pathlib import Path
from typing import Any

import grpc
import structlog

from fleet.agent.files import upload_output
from fleet.api.pb import host_pb2
from fleet.core.errors import FailedPrecondition, Unavailable
from fleet.core.manifest import SESSION_LAYER_OUTPUT, OutputArtifact
from fleet.core.rollout import Assignment
from fleet.runtime import layers
from fleet.runtime.base import Machine, MachineSpec, Parkable, Runtime
from fleet.runtime.namespace import NamespaceRuntime

log = structlog.get_logger(__name__)


async def park_layer(machine: Parkable, stub: Any, a: Assignment, spool: Path) -> OutputArtifact:
    """The machine's writable layer archived in `spool` and stored as an artifact of the
    lease `a` (the server's bound on one output bounds it too); FailedPrecondition where the
    machine cannot archive it or the server did not store it."""
    archive = spool / f"layer-{a.work_id}.tar"
    scratch = spool / f"layer-{a.work_id}.d"
    await asyncio.to_thread(spool.mkdir, parents=True, exist_ok=True, mode=0o700)
    try:
        await machine.pack_layer(archive, scratch)
        stored = await upload_output(stub, a, SESSION_LAYER_OUTPUT, True, archive)
    finally:
        await asyncio.to_thread(_remove, archive, scratch)
    if not stored.digest:
        raise FailedPrecondition(f"its writable layer was not stored: {stored.error}")
    log.info("layer_stored", work_id=a.work_id, digest=stored.digest, bytes=stored.size)
    return stored


async def machine_from_layer(
    runtime: Runtime, stub: Any, a: Assignment, spool: Path, spec: MachineSpec, digest: str
) -> Machine:
    """A machine made from `spec` whose writable layer starts as the stored layer `digest`
    (fetched under the lease `a`, verified, checked member by member as it is unpacked)."""
    if not isinstance(runtime, NamespaceRuntime):
        raise FailedPrecondition(
            f"this host's {runtime.kind.value} runtime cannot start a machine from a parked "
            "session's layer (only the namespace runtime can)"
        )
    archive = spool / f"resume-{a.work_id}.tar"
    scratch = spool / f"resume-{a.work_id}.d"
    await asyncio.to_thread(spool.mkdir, parents=True, exist_ok=True, mode=0o700)
    try:
        await fetch_blob(stub, a, digest, archive)
        await asyncio.to_thread(layers.unpack, archive, scratch)
        return await runtime.create(spec, copy_of=scratch)
    finally:
        await asyncio.to_thread(_remove, archive, scratch)


async def fetch_blob(stub: Any, a: Assignment, digest: str, into: Path) -> None:
    """A blob the lease `a` may read, streamed to `into` (never held whole) and verified
    against its digest; UNAVAILABLE where it cannot be fetched or does not verify."""
    hasher = hashlib.sha256()
    try:
        with into.open("wb") as out:
            call = stub.GetBlob(host_pb2.GetBlobRequest(digest=digest, work_id=a.work_id))
            async for chunk in call:
                hasher.update(chunk.data)
                await asyncio.to_thread(out.write, chunk.data)
    except grpc.aio.AioRpcError as exc:
        raise Unavailable(
            f"layer {digest} could not be fetched: {exc.code().name}: {exc.details()}"
        ) from None
    if "sha256:" + hasher.hexdigest() != digest:
        raise Unavailable(f"layer {digest} fetched from the server does not verify")


def _remove(*paths: Path) -> None:
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
