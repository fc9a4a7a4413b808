"""The relay of an upstream's streamed answer (`gateway.llm.upstream`): the gateway's hot path,
a chunk per token per stream.

It works on the upstream's bytes: events are split out of the body as it arrives, each chunk is
parsed once (to see whether it carries a token, an error or the usage) and passed on as the
upstream wrote it, its `model` swapped and `fleet` added in the text; only a chunk whose shape
does not allow that safely is serialised again. The budgets' counts are taken in the same pass
(`StreamUsage`), so no chunk is parsed twice. After `[DONE]` the body is read to its end, so
that its connection goes back to the upstream's pool rather than being reopened next time.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from gateway.llm.upstream_http import ReadTimedOut, Response, UpstreamError

log = structlog.get_logger(__name__)

NETWORK_ERRORS = (UpstreamError, TimeoutError)
"""What the client raises for an upstream it cannot reach, or that stops answering."""
MAX_EVENT_BYTES = 1 << 20
"""Of a streamed answer, the longest line taken: past it the stream counts as broken."""
_MODEL_FIELD = re.compile(r'"model"\s*:\s*"(?:[^"\\]|\\.)*"')
"""A `"model": "..."` member in a chunk's text. An unescaped quote ends a JSON string, so this
can match only a member (of some object) or a key that ends in `\"model`: when the chunk's
top-level `model` is a string and this matches once, the match is that member."""


class EventSink(Protocol):
    """Where a pushed relay (`Relay.push_to`) writes its events: the HTTP layer's connection to
    the client."""

    def send(self, payloads: list[str], end: bool = False) -> bool:
        """Writes the events (each a `data:` payload) now, with the end of the answer after
        them where `end`; False when the client has gone."""

    def full(self) -> bool:
        """The client reads slower than the events come: the relay waits for `drain`."""

    async def drain(self) -> None:
        """Until the client has taken what was written (ConnectionError: it has gone)."""


class Failed(Exception):
    """An upstream failed: before its answer's first token the chain moves on to its next
    model; after it, the relayed stream ends with a resumable error."""


@dataclass
class StreamUsage:
    """What a relayed stream's chunks said of its tokens, for the budgets
    (`gateway.llm.budgets`): counted by the relay as it parses each chunk anyway."""

    drop_usage: bool = False
    """The usage was asked of the upstream for counting, not by the client: its chunk is not
    relayed (or relayed without it, where it carries choices too)."""
    model: str = ""
    """The model that served (the chain's, once it fell back)."""
    reported: tuple[int, int] | None = None
    """(prompt, completion) as the upstream reported them, where it did."""
    carried: int = 0
    """Choices relayed that carried generated text or a tool call."""


class ReadWatch:
    """The bound on an upstream's silence while a relay waits for its stream's next chunk
    (`read_timeout_s`), kept for every relayed stream by one task that looks at them a few
    times per bound, rather than by a timer cancelled and armed again on every chunk received
    (a timer per chunk per stream, on the gateway's hot path; the response's head has a bound
    of its own, `Pool.request`). An upstream silent past the bound fails its stream with
    `read timed out`: before the first token the chain's to handle, after it a resumable
    error."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.tick_s = min(1.0, timeout_s / 4)
        self.relays: set[Relay] = set()
        self.task: asyncio.Task[None] | None = None

    def add(self, relay: Relay) -> None:
        self.relays.add(relay)
        loop = asyncio.get_running_loop()
        if self.task is None or self.task.done() or self.task.get_loop() is not loop:
            self.task = loop.create_task(self._watch())

    async def _watch(self) -> None:
        """Until no relay is left (the next one starts it again)."""
        while self.relays:
            await asyncio.sleep(self.tick_s)
            now = time.monotonic()
            for relay in list(self.relays):
                if relay.response.finished:
                    self.relays.discard(relay)
                elif relay.waiting_since and now - relay.waiting_since > self.timeout_s:
                    self.relays.discard(relay)
                    relay.expire(self.timeout_s)

    async def aclose(self) -> None:
        self.relays.clear()
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


class Relay:
    """A streamed answer relayed chunk by chunk: each `data:` payload with `model` and `fleet`
    set, scrubbed. The chunks before the first token are held (`first_token`), so that a failure
    before it is the chain's to handle; after it, a failure ends the stream with a resumable
    error. After `[DONE]` the body is read to its end (its connection then goes back to the
    pool); `aclose` closes the upstream's response, whether the relay was read or not.

    After the first token the rest is either read (`async for`) or pushed (`push_to`): each
    piece the upstream sends is relayed inside its connection's `data_received`, written to the
    client there and then, so that a chunk costs the relay no task woken and no future set."""

    def __init__(
        self, response: Response, model: str, fleet: dict[str, Any],
        scrub: Callable[[str], str], usage: StreamUsage | None = None,
        watch: ReadWatch | None = None,
    ) -> None:  # fmt: skip
        self.response = response
        self.model = model
        self.fleet = fleet
        self.scrub = scrub
        self.usage = usage
        if usage is not None:  # (counted afresh on each model of the chain)
            usage.model, usage.reported, usage.carried = model, None, 0
        self._model_member = f'"model": {json.dumps(model)}'
        self._fleet_member = f', "fleet": {json.dumps(self.fleet)}}}'
        self.held: list[str] = []
        self.pending: collections.deque[bytes] = collections.deque()
        self.partial = b""
        """The start of a line whose end has not arrived yet."""
        self.sent = 0
        """Chunks that carried a token (text, a tool call or a finish), relayed."""
        self.last_token = ""
        self.done = False
        self.drained = False
        self.waiting_since = 0.0
        """When the relay began to wait for the upstream's next piece (0: it is not waiting)."""
        self.released = False
        """The response was handed back (`release_after_end`) or closed."""
        self._sink: EventSink | None = None
        self._over: asyncio.Future[None] | None = None
        self._holding: asyncio.Task[None] | None = None
        if watch is not None:
            watch.add(self)

    def _chunk(self, raw: bytes) -> tuple[str | None, bool]:
        """The payload to relay (None: none, a usage chunk the client did not ask for), and
        whether it carries a token."""
        if raw == b"[DONE]":
            return "[DONE]", False
        payload = self.scrub(raw.decode(errors="replace"))
        try:
            chunk = json.loads(payload)
        except ValueError:
            return payload, False
        if not isinstance(chunk, dict):
            return json.dumps(chunk), False
        if "error" in chunk:  # the upstream reports a failure in the stream
            raise Failed(f"the upstream's stream says: {error_message(payload.encode())}")
        token = ""
        carries = False
        carried = 0
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            delta = choice["delta"] if isinstance(choice.get("delta"), dict) else {}
            text = delta.get("content") or choice.get("text") or ""
            if text or delta.get("tool_calls"):
                carried += 1
            if text or delta.get("tool_calls") or choice.get("finish_reason"):
                carries = True
                token = str(text) or token
        if carries and token:
            self.last_token = token
        usage = self.usage
        edited = False
        if usage is not None:
            usage.carried += carried
            if isinstance(chunk.get("usage"), dict):
                usage.reported = usage_of(chunk)
                if usage.drop_usage:
                    if not choices:
                        return None, carries
                    del chunk["usage"]
                    edited = True
        return self._relayed(payload, chunk, edited), carries

    def _relayed(self, payload: str, chunk: dict[str, Any], edited: bool) -> str:
        """The chunk's text with `model` the name served here and `fleet` added: edited in
        place where its one `model` member can be found for certain and it has no `fleet` of
        its own, else serialised again."""
        if not edited and isinstance(chunk.get("model"), str) and "fleet" not in chunk:
            # (the pattern starts with `"model"`: where that text occurs once, one match is
            # the only one)
            found = _MODEL_FIELD.search(payload) if payload.count('"model"') == 1 else None
            if found is not None:
                start, end = found.span()
                text = payload[:start] + self._model_member + payload[end:]
                return text.rstrip()[:-1] + self._fleet_member
        chunk["model"] = self.model
        chunk["fleet"] = self.fleet
        return json.dumps(chunk)

    def _feed(self, piece: bytes) -> None:
        """Splits what arrived into lines, queueing each `data:` payload (server-sent events
        end lines with LF, CRLF or CR; every other field is of no use here)."""
        data = self.partial + piece
        if b"\r" in data:
            if data.endswith(b"\r"):  # (its LF may be in the next piece)
                data, self.partial = data[:-1], b"\r"
            else:
                self.partial = b""
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            lines = data.split(b"\n")
            self.partial = lines.pop() + self.partial
        else:
            lines = data.split(b"\n")
            self.partial = lines.pop()
        if len(self.partial) > MAX_EVENT_BYTES:
            raise Failed(f"a line of the stream is over {MAX_EVENT_BYTES} bytes")
        for line in lines:
            if line.startswith(b"data:"):
                self.pending.append(line[5:].strip())

    async def _next_payload(self) -> bytes:
        """The next `data:` payload; Failed when the stream breaks off or ends without
        `[DONE]` (an upstream that died mid-answer, whatever its framing made it look like).
        (Read with `readany` itself: this is once per chunk, and each wrapper around it, its
        iterator included, is a frame more per chunk.)"""
        pending = self.pending
        while not pending:
            self.waiting_since = time.monotonic()
            try:
                piece = await self.response.readany()
            except NETWORK_ERRORS as exc:
                raise Failed(f"the stream broke off: {transport_error(exc)}") from None
            finally:
                self.waiting_since = 0.0
            if not piece:
                raise Failed("the stream ended without [DONE]")
            self._feed(piece)
        return pending.popleft()

    def _release(self) -> None:
        """The stream ended at `[DONE]`: its connection is handed back once the body's rest is
        read (in the background, within bounds), so that the pool keeps it."""
        self.drained = self.released = True
        self.waiting_since = 0.0
        self.response.release_after_end()

    async def _relay_next(self) -> tuple[str, bool]:
        """The next payload to relay (usage chunks the client did not ask for skipped)."""
        while True:
            payload, carries = self._chunk(await self._next_payload())
            if payload is not None:
                return payload, carries

    async def first_token(self) -> None:
        while True:
            payload, carries = await self._relay_next()
            self.held.append(payload)
            if payload == "[DONE]":
                self.done = True
                return
            if carries:
                self.sent = 1
                return

    def __aiter__(self) -> Relay:
        return self

    async def __anext__(self) -> str:
        if self.held:
            return self.held.pop(0)
        if self.done:
            if not self.drained:
                self._release()
            raise StopAsyncIteration
        try:
            while True:  # (`_relay_next`, inlined: this is the path of every chunk)
                payload, carries = self._chunk(await self._next_payload())
                if payload is not None:
                    break
        except Failed as exc:
            self.done = self.drained = True
            return json.dumps(self._resumable(self.scrub(str(exc))))
        if payload == "[DONE]":
            self.done = True
        self.sent += carries
        return payload

    def expire(self, timeout_s: float) -> None:
        """The upstream was silent past `timeout_s` while the relay waited: its stream ends
        with `read timed out`, and the connection is not kept."""
        self.response.fail(ReadTimedOut(f"no data from the upstream for {timeout_s} s"))

    # -- pushed ------------------------------------------------------------------------------

    async def push_to(self, sink: EventSink) -> None:
        """The rest of the stream written to `sink` as the upstream sends it (what was held
        first), until `[DONE]` or a resumable error; ConnectionResetError when the client
        goes. A client slower than the upstream holds the upstream's reads back (`full`)."""
        if self.held:
            held, self.held = self.held, []
            if not sink.send(held, end=self.done):
                raise ConnectionResetError("the client closed the connection mid-answer")
        if self.done:
            if not self.drained:
                self._release()
            return
        self._sink = sink
        self._over = asyncio.get_running_loop().create_future()
        self.waiting_since = time.monotonic()
        self.response.push(self._pushed, self._pushed_end)
        try:
            await self._over
        finally:
            self._sink = None
            if self._holding is not None:
                self._holding.cancel()

    def _pushed(self, piece: bytes) -> None:
        """A piece of the body, relayed (from the connection's `data_received`)."""
        sink = self._sink
        if self.done or sink is None:
            return
        out: list[str] = []
        failed = False
        try:
            self._feed(piece)
            pending = self.pending
            while pending:
                payload, carries = self._chunk(pending.popleft())
                if payload is None:
                    continue
                out.append(payload)
                self.sent += carries
                if payload == "[DONE]":
                    self.done = True
                    break
        except Failed as exc:
            out.append(json.dumps(self._resumable(self.scrub(str(exc)))))
            self.done = failed = True
        if out and not sink.send(out, end=self.done):
            self._settle(ConnectionResetError("the client closed the connection mid-answer"))
        elif failed:
            self._settle(None)
        elif self.done:
            self._release()
            self._settle(None)
        elif sink.full():
            self._hold(sink)
        else:
            self.waiting_since = time.monotonic()

    def _pushed_end(self, error: UpstreamError | None) -> None:
        """The body ended (or broke off) before `[DONE]`: a resumable error ends the stream."""
        if self.done or self._sink is None:
            return
        why = f"the stream broke off: {error.why}" if error else "the stream ended without [DONE]"
        self.done = True
        self._sink.send([json.dumps(self._resumable(self.scrub(why)))], end=True)
        self._settle(None)

    def _settle(self, error: BaseException | None) -> None:
        """The pushed stream is over (`error`: the client went): the connection is closed
        unless it was handed back at `[DONE]`."""
        self.done = self.drained = True
        self.waiting_since = 0.0
        if not self.released:
            self.released = True
            self.response.close()
        over = self._over
        if over is not None and not over.done():
            if error is None:
                over.set_result(None)
            else:
                over.set_exception(error)

    def _hold(self, sink: EventSink) -> None:
        """The client is behind: the upstream's reads wait until it has caught up."""
        if self._holding is not None and not self._holding.done():
            return
        self.waiting_since = 0.0  # (the silence is the client's, not the upstream's)
        self.response.pause_reading()

        async def catch_up() -> None:
            try:
                await sink.drain()
            except ConnectionError as exc:
                self._settle(exc)
                return
            if not self.done:
                self.waiting_since = time.monotonic()
                self.response.resume_reading()

        self._holding = asyncio.get_running_loop().create_task(catch_up())

    def _resumable(self, why: str) -> dict[str, Any]:
        log.warning("upstream_stream_broke", model=self.model, tokens_sent=self.sent, error=why)
        error = {
            "message": f"upstream model {self.model} failed after {self.sent} tokens were "
            f"sent ({why}); it is not continued elsewhere, since no other model's "
            "continuation can be checked to be the same: resume from the text received",
            "type": "service_unavailable_error",
            "param": None,
            "code": "resumable",
        }
        return {
            "error": error,
            "fleet": {
                **self.fleet,
                "resumable": True,
                "tokens_sent": self.sent,
                "last_token_index": self.sent - 1,
                "last_token": self.last_token,
            },
        }

    async def aclose(self) -> None:
        self.done = self.drained = True
        if not self.released:
            self.released = True
            self.response.close()


def usage_of(body: dict[str, Any]) -> tuple[int, int]:
    """(prompt, completion) of an answer's or a chunk's `usage`; 0 for what it lacks."""
    usage = body.get("usage")
    if not isinstance(usage, dict):
        return 0, 0
    counts = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return tuple(c if type(c) is int and c > 0 else 0 for c in counts)  # type: ignore[return-value]


def error_message(raw: bytes) -> str:
    """An upstream's error, summarised: OpenAI's `error.message` when it sent one, else the
    start of what it sent."""
    text = raw.decode(errors="replace")
    try:
        data = json.loads(text)
        message = data["error"]["message"] if isinstance(data["error"], dict) else data["error"]
        text = str(message)
    except (ValueError, KeyError, TypeError):
        pass
    text = " ".join(text.split())
    return text[:300] + ("…" if len(text) > 300 else "") or "(no message)"


def transport_error(exc: BaseException) -> str:
    """What went wrong reaching an upstream, in words (never the exception's own text, which
    may quote the URL)."""
    if isinstance(exc, UpstreamError):
        return exc.why
    if isinstance(exc, TimeoutError):
        return "timed out"
    return type(exc).__name__
