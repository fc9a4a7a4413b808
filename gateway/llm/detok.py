"""Incremental detokenization with stop strings: which text a token releases, and when to stop.

A byte-level BPE token may end in the middle of a UTF-8 character, and a stop string may be
spread over several tokens. So the text of new tokens is decoded only once it ends on a whole
character, and of the decoded text the longest tail that could still become a stop string is
held back. What is released can never be part of a stop string: a stop string that completes
later starts at or after the first held-back character, so nothing of it has been sent.

The stream is a pure function of the token sequence, which is what lets a continuation on
another replica rebuild it from the tokens already sent (`push` them without forwarding the
text) and release exactly what the uninterrupted stream would have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

REPLACEMENT = "\ufffd"
MAX_PENDING_TOKENS = 8
"""A UTF-8 character spans at most 4 bytes; tokens that stay undecodable past this many are
let through as they decode (the model emitted bytes that are not UTF-8)."""

Decode = Callable[[Sequence[int]], str]


@dataclass
class Released:
    text: str
    """Text this token lets out (may be empty: an incomplete character or a possible stop)."""
    stopped: bool
    """A stop string completed: the answer ends here, its text not included."""


class TextStream:
    def __init__(self, decode: Decode, stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self._pending: list[int] = []
        self._text = ""
        """Decoded text not yet released (the held-back tail, and what a push adds)."""
        self.released = ""
        self.stopped = False

    def push(self, token_id: int) -> Released:
        """Add one generated token; what it releases, and whether a stop string completed."""
        if self.stopped:
            raise RuntimeError("the text stream already stopped")
        self._pending.append(token_id)
        piece = self._decode(self._pending)
        if piece.endswith(REPLACEMENT) and len(self._pending) < MAX_PENDING_TOKENS:
            return Released("", False)
        self._pending.clear()
        self._text += piece
        return self._scan(final=False)

    def finish(self) -> str:
        """The answer ended without a stop string: everything held back, released."""
        if self.stopped:
            return ""
        if self._pending:
            self._text += self._decode(self._pending)
            self._pending.clear()
        return self._scan(final=True).text

    def _scan(self, *, final: bool) -> Released:
        text = self._text
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        if hits:
            out = text[: min(hits)]
            self.stopped = True
            self._text = ""
            self.released += out
            return Released(out, True)
        keep = 0 if final else self._held(text)
        out = text[: len(text) - keep]
        self._text = text[len(text) - keep :]
        self.released += out
        return Released(out, False)

    def _held(self, text: str) -> int:
        """The length of the longest tail of `text` that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
