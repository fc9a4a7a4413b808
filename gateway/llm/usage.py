"""Counting a streamed answer's tokens as its client receives them, for the rollout's usage
(`gateway.accounting`): the stream counts its tokens in a `Tally`, and `counted` records them
once, however the stream ends (completed, ended by an error event, or its client gone)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass


@dataclass
class Tally:
    """An answer's prompt tokens, and the completion tokens sent so far."""

    prompt: int
    completion: int = 0


async def counted(
    events: AsyncIterator[str], tally: Tally, record: Callable[[int, int], None]
) -> AsyncIterator[str]:
    """`events`, then `record(prompt, completion)` with what was sent (nothing when no token
    was: a stream refused before its first token used none)."""
    try:
        async for event in events:
            yield event
    finally:
        try:
            if tally.completion:
                record(tally.prompt, tally.completion)
        finally:
            close = getattr(events, "aclose", None)
            if close is not None:  # (its generation ends with it: the client went away)
                await close()
