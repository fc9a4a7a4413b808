"""Bounded capture of a child's output: keep the head, count the rest."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

OutputSink = Callable[[str, bytes], None]
"""Receives (stream name, chunk) as output arrives, for callers that show it live."""


async def read_bounded(
    stream: asyncio.StreamReader | None, limit: int, name: str = "", sink: OutputSink | None = None
) -> tuple[bytes, bool]:
    """Reads to EOF, keeping at most `limit` bytes; returns (kept, truncated)."""
    if stream is None:
        return b"", False
    kept = bytearray()
    truncated = False
    while chunk := await stream.read(65536):
        if sink is not None:
            sink(name, chunk)
        room = limit - len(kept)
        if room > 0:
            kept += chunk[:room]
        if len(chunk) > room:
            truncated = True
    return bytes(kept), truncated
