"""The server's blob store on its own disk: `<root>/sha256/<2 hex>/<64 hex>`, written once.

A blob arrives as a stream, is hashed while it is written to a temporary file, and is renamed
into place under its digest (the same content twice is stored once). A stream past its limit is
refused and leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

from fleet.core.errors import InvalidArgument, NotFound, ResourceExhausted
from fleet.core.manifest import is_digest

CHUNK_BYTES = 3 << 20
"""Under a client's default 4 MiB receive limit."""


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
            handle.seek(offset)
            while True:
                data = await asyncio.to_thread(handle.read, CHUNK_BYTES)
                if not data:
                    if offset == 0 and total == 0:
                        yield 0, b"", 0
                    return
                yield offset, data, total
                offset += len(data)

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
