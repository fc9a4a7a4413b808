"""Idempotent generations: a request that carries an `Idempotency-Key` header gets, when asked
again with the same key, the answer the first one completed (same id, same tokens) without a
new generation, the way `/v1/infer`'s idempotency keys work for the policy model.

Keys belong to the token's rollout: another rollout's same key is another answer. What is kept
is the first request's fingerprint (its route and its body, as JSON with sorted keys) and, once
it completed, its answer: the JSON body, or the stream's events up to `[DONE]`. A request with a
key already used:

- answered completely: the stored answer again, marked `x-fleet-replayed: 1` and
  `"replayed": true` in its `fleet` object (in every event of a replayed stream);
- a different body or route: 409, naming the header (a key names one request);
- the first is still running: it waits for that one, up to `wait_s`, then takes its answer (or,
  if the first ended without a complete answer, generates itself); past `wait_s`, 409 saying
  the first is still running.

Answers that failed, and streams that ended with an error event or whose client went away,
are not kept: a retry generates. Memory is bounded: least recently used answers go first past
`max_entries` or `max_bytes`, and each is kept at most `ttl_s`. Replays bypass admission and
are not counted as new tokens (`gateway.accounting`).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import structlog

from gateway.llm.openai_schema import ApiError, Reply

log = structlog.get_logger(__name__)

HEADER = "idempotency-key"
REPLAYED_HEADER = "x-fleet-replayed"
MAX_KEY_CHARS = 255


@dataclass
class _Stored:
    fingerprint: str
    status: int
    headers: dict[str, str]
    body: dict[str, Any] | None
    events: list[str] | None
    size: int
    expires: float


@dataclass
class _Running:
    fingerprint: str
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Replays:
    """Completed answers by (rollout, key), and the requests still making theirs."""

    max_entries: int = 1024
    max_bytes: int = 64 << 20
    ttl_s: float = 600.0
    wait_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    replayed: int = 0
    """Answers given again from the store (for the metrics)."""
    _stored: collections.OrderedDict[tuple[str, str], _Stored] = field(
        default_factory=collections.OrderedDict
    )
    _running: dict[tuple[str, str], _Running] = field(default_factory=dict)
    _bytes: int = 0

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._stored)

    async def answer(
        self, rollout_id: str, headers: dict[str, str], route: str, body: bytes,
        holds: ExitStack, make: Callable[[], Awaitable[Reply]],
    ) -> Reply:  # fmt: skip
        """The request's answer: `make()`'s, kept when the request carries a key, or the one
        kept for its key. `holds` is closed when the answer is written or abandoned."""
        key = headers.get(HEADER, "")
        if not key:
            return await make()
        _check_key(key)
        fingerprint = _fingerprint(route, body)
        slot = (rollout_id, key)
        deadline = self.clock() + self.wait_s
        while True:
            stored = self._get(slot)
            if stored is not None:
                _same(stored.fingerprint, fingerprint)
                self.replayed += 1
                log.info("llm_answer_replayed", rollout_id=rollout_id, route=route)
                return _replay(stored)
            running = self._running.get(slot)
            if running is None:
                break
            _same(running.fingerprint, fingerprint)
            try:
                await asyncio.wait_for(running.done.wait(), max(0.0, deadline - self.clock()))
            except TimeoutError:
                raise ApiError(
                    409, f"header Idempotency-Key: the request that first sent {key[:60]!r} "
                    f"is still running after {self.wait_s:g} s; retry later",
                    param="Idempotency-Key", code="idempotency_key_in_use",
                ) from None  # fmt: skip
        mine = _Running(fingerprint)
        self._running[slot] = mine

        def release() -> None:
            if self._running.get(slot) is mine:
                del self._running[slot]
            mine.done.set()

        holds.callback(release)  # (on every way out: the answer written, abandoned, refused)
        reply = await make()
        if reply.status != 200:
            return reply
        if reply.events is None:
            self._keep(slot, _Stored(fingerprint, reply.status, dict(reply.headers), reply.body,
                                     None, _size(reply.body), 0.0))  # fmt: skip
            return reply
        reply.events = self._capture(slot, fingerprint, reply, reply.events)
        return reply

    async def _capture(
        self, slot: tuple[str, str], fingerprint: str, reply: Reply, events: AsyncIterator[str]
    ) -> AsyncIterator[str]:
        """The stream's events as they go, kept once it ends with `[DONE]`."""
        seen: list[str] = []
        async for event in events:
            seen.append(event)
            if event == "[DONE]":
                size = sum(len(e) for e in seen)
                self._keep(slot, _Stored(fingerprint, reply.status, dict(reply.headers), None,
                                         seen, size, 0.0))  # fmt: skip
            yield event

    def _get(self, slot: tuple[str, str]) -> _Stored | None:
        stored = self._stored.get(slot)
        if stored is None:
            return None
        if stored.expires <= self.clock():
            self._drop(slot)
            return None
        self._stored.move_to_end(slot)
        return stored

    def _keep(self, slot: tuple[str, str], stored: _Stored) -> None:
        if stored.size > self.max_bytes or self.max_entries < 1:
            log.info("llm_answer_not_kept", bytes=stored.size, max_bytes=self.max_bytes)
            return
        if slot in self._stored:
            self._drop(slot)
        stored.expires = self.clock() + self.ttl_s
        self._stored[slot] = stored
        self._bytes += stored.size
        while len(self._stored) > self.max_entries or self._bytes > self.max_bytes:
            self._drop(next(iter(self._stored)))

    def _drop(self, slot: tuple[str, str]) -> None:
        self._bytes -= self._stored.pop(slot).size


def _check_key(key: str) -> None:
    if len(key) > MAX_KEY_CHARS or not key.isprintable() or not key.isascii():
        raise ApiError(400, f"header Idempotency-Key: expected up to {MAX_KEY_CHARS} printable "
                       "ASCII characters", param="Idempotency-Key",
                       code="invalid_idempotency_key")  # fmt: skip


def _same(first: str, this: str) -> None:
    if first != this:
        raise ApiError(
            409, "header Idempotency-Key: this key was first sent with a different request "
            "(route or body); a key names one request, so send a new key for a new one",
            param="Idempotency-Key", code="idempotency_key_reused",
        )  # fmt: skip


def _fingerprint(route: str, body: bytes) -> str:
    try:
        canonical = json.dumps(json.loads(body), sort_keys=True, separators=(",", ":"))
    except ValueError:  # (refused by the request's own checks; the raw bytes tell it apart)
        canonical = body.decode("latin-1")
    return hashlib.sha256(f"{route}\n{canonical}".encode()).hexdigest()


def _size(body: dict[str, Any] | None) -> int:
    return len(json.dumps(body)) if body is not None else 0


def _marked(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "fleet": {**payload.get("fleet", {}), "replayed": True}}


def _replay(stored: _Stored) -> Reply:
    headers = {**stored.headers, REPLAYED_HEADER: "1"}
    if stored.events is None:
        return Reply(stored.status, _marked(stored.body or {}), headers=headers)
    return Reply(stored.status, headers=headers, events=_replayed_events(stored.events))


async def _replayed_events(events: list[str]) -> AsyncIterator[str]:
    for event in events:
        if event.startswith("{"):
            payload = json.loads(event)
            if isinstance(payload, dict):
                event = json.dumps(_marked(payload))
        yield event
