"""The server's blob store on its own disk: `<root>/sha256/<2 hex>/<64 hex>`, written once.

A blob arrives as a stream, is hashed while it is written to a temporary file, and is renamed
into place under its digest (the same content twice is stored once). A stream past its limit is
refused and leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

from fleet.core.errors import InvalidArgument, NotFound, ResourceExhausted
from fleet.core.manifest import is_digest
from fleet.image import oci

CHUNK_BYTES = 3 << 20
"""Under a client's default 4 MiB receive limit."""


async def file_chunks(handle: BinaryIO, offset: int) -> AsyncIterator[tuple[int, bytes, int]]:
    """(offset, data, total size) of an open file from `offset` to its end, read off the
    event loop; an empty file is one empty chunk."""
    total = os.fstat(handle.fileno()).st_size
    handle.seek(offset)
    while True:
        data = await asyncio.to_thread(handle.read, CHUNK_BYTES)
        if not data:
            if offset == 0 and total == 0:
                yield 0, b"", 0
            return
        yield offset, data, total
        offset += len(data)


class BlobStore:
    """Blobs by sha256 digest in a directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, digest: str) -> Path:
        if not is_digest(digest):
            raise InvalidArgument(f"digest {digest[:80]!r} is not sha256:<64 hex digits>")
        hexdigest = digest[7:]
        return self.root / "sha256" / hexdigest[:2] / hexdigest

    def exists(self, digest: str) -> bool:
        return self.path(digest).exists()

    def local_path(self, digest: str) -> Path:
        """The blob as a file on this host (NotFound: there is no such blob)."""
        path = self.path(digest)
        if not path.exists():
            raise NotFound(f"no blob {digest}")
        return path

    def size(self, digest: str) -> int:
        try:
            return self.path(digest).stat().st_size
        except FileNotFoundError:
            raise NotFound(f"no blob {digest}") from None

    def open(self, digest: str) -> BinaryIO:
        try:
            return self.path(digest).open("rb")
        except FileNotFoundError:
            raise NotFound(f"no blob {digest}") from None

    async def put(
        self, chunks: AsyncIterator[bytes], limit_bytes: int, what: str
    ) -> tuple[str, int]:
        """Stores what `chunks` yields; returns (digest, size). Past `limit_bytes` it is refused
        with RESOURCE_EXHAUSTED naming `what` and the limit, and nothing is kept."""
        tmp_dir = self.root / "tmp"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=tmp_dir, prefix="put-")
        hasher = hashlib.sha256()
        size = 0
        try:
            with os.fdopen(fd, "wb") as out:
                async for data in chunks:
                    size += len(data)
                    if size > limit_bytes:
                        raise ResourceExhausted(
                            f"{what} is over its limit of {limit_bytes / (1 << 20):g} MiB"
                        )
                    hasher.update(data)
                    await asyncio.to_thread(out.write, data)
                await asyncio.to_thread(out.flush)
                await asyncio.to_thread(os.fsync, out.fileno())
            digest = "sha256:" + hasher.hexdigest()
            target = self.path(digest)
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                os.unlink(name)
            else:
                os.replace(name, target)
            return digest, size
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
            raise

    async def chunks(self, digest: str, offset: int = 0) -> AsyncIterator[tuple[int, bytes, int]]:
        """(offset, data, total size) from `offset` to the end."""
        handle = await asyncio.to_thread(self.open, digest)
        with handle:
            total = os.fstat(handle.fileno()).st_size
            if offset > total:
                raise InvalidArgument(f"offset {offset} is past the blob's end ({total} bytes)")
            async for chunk in file_chunks(handle, offset):
                yield chunk

    def collect_garbage(self, keep: set[str], older_than: float) -> int:
        """Removes blobs not in `keep` written before `older_than` (epoch seconds): inputs no
        remaining rollout names, outputs of deleted rollouts, uploads never submitted.
        Returns how many."""
        removed = 0
        base = self.root / "sha256"
        if not base.exists():
            return 0
        for path in base.glob("*/*"):
            digest = "sha256:" + path.name
            try:
                if digest not in keep and path.stat().st_mtime < older_than:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
        return removed


EMPTY_CONFIG = b"{}"
EMPTY_MEDIA_TYPE = "application/vnd.oci.empty.v1+json"
ARTIFACT_MEDIA_TYPE = "application/vnd.fleet.artifact.v1"


class RegistryBlobStore(BlobStore):
    """Blobs kept in an OCI registry repository, for server replicas that share a ledger:
    each blob is pushed with a manifest of its own, tagged `sha256-<hex>` (so the registry's
    garbage collection keeps it until retention deletes the tag), and read through a local
    cache (`root`), which the disk store's methods serve."""

    def __init__(self, root: Path, repository: str, ca_pem: bytes | None = None) -> None:
        super().__init__(root)
        self.repository = repository
        self.reference = oci.Reference.parse(repository)
        self._ca = ca_pem

    def _registry(self) -> oci.Registry:
        return oci.Registry(self.reference, oci.Credentials.from_env(), self._ca)

    @staticmethod
    def _tag(digest: str) -> str:
        return digest.replace(":", "-")

    def _push(self, digest: str, path: Path) -> None:
        empty = "sha256:" + hashlib.sha256(EMPTY_CONFIG).hexdigest()
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": oci.OCI_MANIFEST,
            "artifactType": ARTIFACT_MEDIA_TYPE,
            "config": {"mediaType": EMPTY_MEDIA_TYPE, "digest": empty,
                       "size": len(EMPTY_CONFIG)},
            "layers": [{"mediaType": "application/octet-stream", "digest": digest,
                        "size": path.stat().st_size}],
            "annotations": {"org.opencontainers.image.created": str(time.time())},
        }, sort_keys=True).encode()  # fmt: skip
        with self._registry() as registry:
            registry.put_blob(digest, path=path)
            registry.put_blob(empty, data=EMPTY_CONFIG)
            registry.put_manifest(self._tag(digest), manifest)

    def _fetch(self, digest: str) -> None:
        target = self.path(digest)
        if target.exists():
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        with self._registry() as registry:
            registry.download_blob(digest, target)

    async def put(
        self, chunks: AsyncIterator[bytes], limit_bytes: int, what: str
    ) -> tuple[str, int]:
        digest, size = await super().put(chunks, limit_bytes, what)
        await asyncio.to_thread(self._push, digest, self.path(digest))
        return digest, size

    def local_path(self, digest: str) -> Path:
        self._fetch(digest)
        return super().local_path(digest)

    def size(self, digest: str) -> int:
        """From the cache, else from the registry's HEAD (nothing is downloaded to learn it)."""
        if self.path(digest).exists():
            return super().size(digest)
        with self._registry() as registry:
            size = registry.blob_size(digest)
        if size is None:
            raise NotFound(f"no blob {digest}")
        return size

    def open(self, digest: str) -> BinaryIO:
        self._fetch(digest)
        return super().open(digest)

    def exists(self, digest: str) -> bool:
        try:
            self.size(digest)
        except NotFound:
            return False
        return True

    def collect_garbage(self, keep: set[str], older_than: float) -> int:
        """Removes unkept blobs from the local cache, and their tags from the registry (its
        own garbage collection then frees them)."""
        removed = super().collect_garbage(keep, older_than)
        with self._registry() as registry:
            for tag in registry.tags():
                digest = tag.replace("-", ":", 1)
                if not tag.startswith("sha256-") or digest in keep:
                    continue
                manifest_digest, manifest = registry.manifest_digest(tag)
                created = float(manifest.get("annotations", {}).get(
                    "org.opencontainers.image.created", "0"))  # fmt: skip
                if created < older_than:
                    registry.delete_manifest(manifest_digest)
                    removed += 1
        return removed
