"""The server's blob store on its own disk: `<root>/sha256/<2 hex>/<64 hex>`, written once.

A blob arrives as a stream, is hashed while it is written to a temporary file, and is renamed
into place under its digest (the same content twice is stored once). A stream past its limit is
refused and leaves nothing behind.

Content is stored once, but who may name it is not shared: each tenant's upload leaves an
ownership record, `<root>/owners/<tenant hash>/<2 hex>/<64 hex>` (holding the blob's size), and
a tenant names only blobs it holds a record of, so knowing another tenant's digest reads
nothing of its data. The records are also what a tenant's upload quota counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

from fleet.core.errors import InvalidArgument, NotFound, ResourceExhausted
from fleet.core.manifest import is_digest
from fleet.image import oci

CHUNK_BYTES = 3 << 20
"""Under a client's default 4 MiB receive limit."""
MIB = 1 << 20


def tenant_dir(tenant: str) -> str:
    """A tenant's directory name: a hash, whatever characters the name holds."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:32]


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
        self._usage: dict[str, int] = {}
        """Bytes each tenant's records hold, once counted (cleared by garbage collection)."""
        self._streaming: defaultdict[str, int] = defaultdict(int)
        """Bytes of each tenant's uploads still arriving (counted against its quota)."""

    def path(self, digest: str) -> Path:
        if not is_digest(digest):
            raise InvalidArgument(f"digest {digest[:80]!r} is not sha256:<64 hex digits>")
        hexdigest = digest[7:]
        return self.root / "sha256" / hexdigest[:2] / hexdigest

    def exists(self, digest: str) -> bool:
        return self.path(digest).exists()

    def owner_path(self, tenant: str, digest: str) -> Path:
        hexdigest = self.path(digest).name
        return self.root / "owners" / tenant_dir(tenant) / hexdigest[:2] / hexdigest

    def owns(self, tenant: str, digest: str) -> bool:
        """`tenant` uploaded the blob and it is still here."""
        return self.owner_path(tenant, digest).exists() and self.exists(digest)

    def record_owner(self, tenant: str, digest: str, size: int) -> None:
        """Notes that `tenant` uploaded the blob (written whole, or not at all)."""
        record = self.owner_path(tenant, digest)
        if record.exists():
            return
        record.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=record.parent, prefix=".owner-")
        with os.fdopen(fd, "w") as out:
            out.write(str(size))
        os.replace(name, record)
        if tenant in self._usage:
            self._usage[tenant] += size

    def usage(self, tenant: str) -> int:
        """Bytes the blobs `tenant` uploaded hold (each counted once for it)."""
        if tenant not in self._usage:
            total = 0
            for record in (self.root / "owners" / tenant_dir(tenant)).glob("*/*"):
                with contextlib.suppress(OSError, ValueError):
                    total += int(record.read_text() or 0)
            self._usage[tenant] = total
        return self._usage[tenant]

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
        self, chunks: AsyncIterator[bytes], limit_bytes: int, what: str, *, owner: str = "",
        quota_bytes: int = 0,
    ) -> tuple[str, int]:  # fmt: skip
        """Stores what `chunks` yields; returns (digest, size). Past `limit_bytes` it is refused
        with RESOURCE_EXHAUSTED naming `what` and the limit, and nothing is kept. An upload
        of tenant `owner` is recorded as its own, and refused the same way where what its
        uploads hold (those still arriving included) would pass `quota_bytes` (0: none)."""
        used = await asyncio.to_thread(self.usage, owner) if owner and quota_bytes else 0
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
                            f"{what} is over its limit of {limit_bytes / MIB:g} MiB"
                        )
                    if quota_bytes:
                        self._streaming[owner] += len(data)
                        if used + self._streaming[owner] > quota_bytes:
                            raise ResourceExhausted(
                                f"tenant {owner!r}'s uploads would hold over its quota of "
                                f"{quota_bytes / MIB:g} MiB ({used / MIB:.1f} MiB stored; "
                                "$FLEET_ARTIFACTS_TENANT_QUOTA_GIB): uploads are freed when "
                                "no rollout names them any longer"
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
            if owner:
                await asyncio.to_thread(self.record_owner, owner, digest, size)
            return digest, size
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
            raise
        finally:
            if quota_bytes:
                self._streaming[owner] -= size
                if self._streaming[owner] <= 0:
                    del self._streaming[owner]

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
        self._forget_owners()
        return removed

    def _forget_owners(self) -> None:
        """Drops ownership records whose blob is gone from this store (its bytes no longer
        count against the tenant's quota)."""
        for record in (self.root / "owners").glob("*/*/*"):
            with contextlib.suppress(FileNotFoundError):
                if not (self.root / "sha256" / record.parent.name / record.name).exists():
                    record.unlink()
        self._usage.clear()


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

    @staticmethod
    def _owner_tag(tenant: str, digest: str) -> str:
        """The tag that records, for every replica, that `tenant` uploaded the blob."""
        return f"owner-{tenant_dir(tenant)[:24]}-{digest.removeprefix('sha256:')}"

    def _push(self, digest: str, path: Path, owner: str = "") -> None:
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
            if owner:
                registry.put_manifest(self._owner_tag(owner, digest), manifest)

    def _fetch(self, digest: str) -> None:
        target = self.path(digest)
        if target.exists():
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        with self._registry() as registry:
            registry.download_blob(digest, target)

    async def put(
        self, chunks: AsyncIterator[bytes], limit_bytes: int, what: str, *, owner: str = "",
        quota_bytes: int = 0,
    ) -> tuple[str, int]:  # fmt: skip
        """As the disk store's (the quota counted on this replica's records), then pushed
        with its owner's tag."""
        digest, size = await super().put(chunks, limit_bytes, what, owner=owner,
                                         quota_bytes=quota_bytes)  # fmt: skip
        await asyncio.to_thread(self._push, digest, self.path(digest), owner)
        return digest, size

    def owns(self, tenant: str, digest: str) -> bool:
        """From this replica's record, else from the owner's tag in the registry (an upload
        through another replica), which is then recorded here."""
        if super().owns(tenant, digest):
            return True
        with self._registry() as registry:
            try:
                registry.manifest_digest(self._owner_tag(tenant, digest))
            except NotFound:
                return False
            size = registry.blob_size(digest)
        if size is None:
            return False
        self.record_owner(tenant, digest, size)
        return True

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
                # A blob's own tag, and its owners' (which may hold an older manifest).
                owned = tag.startswith("owner-")
                digest = "sha256:" + tag.rpartition("-")[2]
                if not (owned or tag.startswith("sha256-")) or digest in keep:
                    continue
                try:
                    manifest_digest, manifest = registry.manifest_digest(tag)
                    created = float(manifest.get("annotations", {}).get(
                        "org.opencontainers.image.created", "0"))  # fmt: skip
                    if created < older_than:
                        registry.delete_manifest(manifest_digest)
                        removed += 0 if owned else 1
                except NotFound:  # deleted with another tag of its manifest
                    continue
        return removed
