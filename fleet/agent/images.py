"""Images a host lacks, fetched by digest from the server's store, verified, and cached.

A rollout's manifest pins its image's digest. A host that does not hold the archive asks the
server for it (`HostService.GetBlob`, in chunks, resumed from where an interrupted download
stopped), hashes it as it arrives, and keeps it only if it hashes to the digest. Concurrent
needs of one digest share one download. Images fetched this way are a cache bounded in size
(`fleet agent --image-cache-gib`): past the bound the least recently used are removed, never
one a machine of this agent uses, nor one built or named on this host.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import structlog

from fleet.api.pb import host_pb2
from fleet.core.errors import FailedPrecondition, Unavailable
from fleet.core.manifest import is_digest
from fleet.image import oci
from fleet.image.store import ImageStore

log = structlog.get_logger(__name__)

RETRIES = 5
"""Interrupted downloads resumed before the attempt fails (as a host error: retried)."""


def _name(digest: str) -> str:
    return digest.replace(":", "-")


class ImageCache:
    """Fetches missing images from the server and bounds what fetched images hold on disk."""

    def __init__(self, images: ImageStore, cap_bytes: int | None) -> None:
        self.images = images
        self.cap_bytes = cap_bytes
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._in_use: collections.Counter[str] = collections.Counter()
        self.fetches = 0
        """Downloads completed by this process (tests and benchmarks read it)."""
        self.busy: Callable[[], set[str]] = set
        """Digests in use besides attempts' (the warm parents' images)."""
        self.registry = ""
        """An OCI registry repository to fetch from ("": the server's GetBlob)."""
        self.sources: list[str] = []
        """Where each completed download came from ("server" or the registry)."""
        self._registry_ca: bytes | None = None

    def use_registry(self, registry: str, ca_pem: bytes | None) -> None:
        """Where the server says images come from (`fleet serve --registry`)."""
        if registry:
            oci.Reference.parse(registry)  # a malformed one is refused at once
        self.registry, self._registry_ca = registry, ca_pem

    def _used_marker(self, digest: str) -> Path:
        return self.images.root / "fetched" / _name(digest)

    async def acquire(self, stub: Any, digest: str, reference: str = "") -> None:
        """Makes sure the archive is here (fetching it if not: from `reference`, a registry
        image pinned by digest, where given) and marks it in use until `release(digest)`."""
        self._in_use[digest] += 1
        try:
            if not self.images.blob_path(digest).exists():
                task = self._inflight.get(digest)
                if task is None:
                    task = asyncio.create_task(self._fetch(stub, digest, reference))
                    self._inflight[digest] = task
                    task.add_done_callback(lambda _t: self._inflight.pop(digest, None))
                await asyncio.shield(task)
            marker = self._used_marker(digest)
            if marker.exists():
                os.utime(marker)
        except BaseException:
            self.release(digest)
            raise

    def release(self, digest: str) -> None:
        self._in_use[digest] -= 1
        if self._in_use[digest] <= 0:
            del self._in_use[digest]

    async def _fetch(self, stub: Any, digest: str, reference: str = "") -> None:
        if reference:
            started = time.monotonic()
            target = self.images.blob_path(digest)
            target.parent.mkdir(parents=True, exist_ok=True)
            configured = (self.registry,) if self.registry else ()
            size = await asyncio.to_thread(
                oci.fetch, reference, digest, target, self._registry_ca, configured
            )
            await self._fetched(digest, size, started, source=reference)
            return
        if self.registry:
            started = time.monotonic()
            size = await asyncio.to_thread(self._pull, digest)
            await self._fetched(digest, size, started, source=self.registry)
            return
        tmp = self.images.root / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        partial = tmp / f"{_name(digest)}.partial"
        started = time.monotonic()
        hasher = hashlib.sha256()
        offset = 0
        if partial.exists():  # an earlier run's interrupted download: hash what it has
            offset, hasher = await asyncio.to_thread(oci.hashed_file, partial)
        failures = 0
        while True:
            try:
                with partial.open("ab") as out:
                    call = stub.GetBlob(host_pb2.GetBlobRequest(digest=digest, offset=offset))
                    async for chunk in call:
                        if chunk.offset != offset:
                            raise Unavailable(f"image {digest}: the server sent offset "
                                              f"{chunk.offset}, expected {offset}")  # fmt: skip
                        # One hop for both: hashing and writing release the GIL, so the
                        # next chunk arrives meanwhile.
                        await asyncio.to_thread(_write_hashed, out, hasher, chunk.data)
                        offset += len(chunk.data)
                    await asyncio.to_thread(out.flush)
                    await asyncio.to_thread(os.fsync, out.fileno())
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or failures >= RETRIES:
                    raise Unavailable(
                        f"image {digest} could not be fetched from the server: "
                        f"{exc.code().name}: {exc.details()}"
                    ) from None
                failures += 1
                log.info("image_fetch_resumed", digest=digest, offset=offset, failures=failures)
                await asyncio.sleep(0.2 * failures)
        actual = "sha256:" + hasher.hexdigest()
        if actual != digest:
            partial.unlink(missing_ok=True)
            raise FailedPrecondition(
                f"image {digest} fetched from the server does not verify: its content hashes "
                f"to {actual}; it was discarded"
            )
        blob = self.images.blob_path(digest)
        blob.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial, blob)
        await self._fetched(digest, offset, started, source="server")

    def _pull(self, digest: str) -> int:
        """The image's one layer from the registry, by digest, verified (resumable)."""
        ref = oci.Reference.parse(self.registry)
        target = self.images.blob_path(digest)
        target.parent.mkdir(parents=True, exist_ok=True)
        with oci.Registry(ref, oci.Credentials.from_env(), self._registry_ca) as registry:
            return registry.download_blob(digest, target)

    async def _fetched(self, digest: str, size: int, started: float, source: str) -> None:
        marker = self._used_marker(digest)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(digest)
        self.images.mark_verified(digest)
        self.fetches += 1
        self.sources.append(source)
        seconds = time.monotonic() - started
        log.info("image_fetched", digest=digest, bytes=size, seconds=round(seconds, 3),
                 mib_per_s=round(size / (1 << 20) / max(seconds, 1e-6), 1),
                 source=source)  # fmt: skip
        await asyncio.to_thread(self.evict)

    def cached(self) -> list[str]:
        """The digests of the images on this host's disk: built here or fetched."""
        fetched_dir = self.images.root / "fetched"
        digests = {r.digest for r in self.images.list_images()}
        if fetched_dir.exists():
            for marker in fetched_dir.iterdir():
                with contextlib.suppress(OSError):
                    digests.add(marker.read_text().strip())
        return sorted(d for d in digests if d)

    def evict(self) -> list[str]:
        """Removes fetched images, least recently used first, until they fit the cap; never
        one in use. Returns the digests removed."""
        if self.cap_bytes is None:
            return []
        fetched_dir = self.images.root / "fetched"
        if not fetched_dir.exists():
            return []
        busy = self.busy()
        entries = []
        for marker in fetched_dir.iterdir():
            digest = marker.read_text().strip()
            if not is_digest(digest):  # (not one this agent wrote: nothing it names is ours)
                log.warning("image_marker_ignored", marker=str(marker))
                continue
            blob = self.images.blob_path(digest)
            size = blob.stat().st_size if blob.exists() else 0
            entries.append((marker.stat().st_mtime, digest, size, marker))
        # An unpacked tree takes about what its archive does: count both.
        total = sum(2 * size for _, _, size, _ in entries)
        removed = []
        for _, digest, size, marker in sorted(entries):
            if total <= self.cap_bytes:
                break
            if self._in_use.get(digest) or digest in self._inflight or digest in busy:
                continue
            self.images.blob_path(digest).unlink(missing_ok=True)
            shutil.rmtree(self.images.root / "rootfs" / _name(digest), ignore_errors=True)
            marker.unlink(missing_ok=True)
            self.images.forget_verified(digest)
            total -= 2 * size
            removed.append(digest)
            log.info("image_evicted", digest=digest, bytes=size)
        return removed


def _write_hashed(out: Any, hasher: Any, data: bytes) -> None:
    hasher.update(data)
    out.write(data)
