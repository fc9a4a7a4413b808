"""What the gateway keeps for the server's polls (`gateway.accounting`) and for retried
generations (`gateway.llm.replay`): handed once, handed again until confirmed, bounded."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import ExitStack
from typing import Any

import pytest

from gateway.accounting import HANDOVERS_KEPT, UsageBook
from gateway.llm.openai_schema import ApiError, Reply
from gateway.llm.replay import Replays
from gateway.llm.usage import Tally, counted

# -- hand-overs to the server's poll -------------------------------------------------------


def test_a_poll_that_confirms_nothing_takes_what_it_is_handed_once() -> None:
    book = UsageBook()
    book.add_tokens("r-1", "m", 10, 3)
    book.add_tokens("r-1", "m", 5, 2)
    book.add_tokens("r-2", "other", 7, 0)
    usage, mark = book.hand_over({"r-1": 0.5}, None)
    again, none = book.hand_over({}, None)

    assert usage.tokens_by_rollout() == {"r-1": {"m": (15, 5)}, "r-2": {"other": (7, 0)}}
    assert usage.device_s == {"r-1": 0.5} and mark == (book.run_id, 1)
    assert not again and none is None
    assert (book.prompt_tokens, book.completion_tokens) == (22, 5)


def test_what_the_server_did_not_confirm_is_handed_again_until_it_does() -> None:
    book = UsageBook()
    book.add_tokens("r-1", "m", 10, 3)
    first, mark1 = book.hand_over({"r-1": 1.0}, ("", 0))  # (a server that charged nothing)
    # The answer was lost (or the charge failed): the server confirms what it had before.
    book.add_tokens("r-1", "m", 1, 1)
    second, mark2 = book.hand_over({"r-2": 2.0}, ("", 0))
    # It charged the second hand-over, which held the first: neither comes back.
    third, mark3 = book.hand_over({}, mark2)

    assert first.tokens == {("r-1", "m"): (10, 3)} and mark1 == (book.run_id, 1)
    assert second.tokens == {("r-1", "m"): (11, 4)}
    assert second.device_s == {"r-1": 1.0, "r-2": 2.0} and mark2 == (book.run_id, 2)
    assert not third and mark3 is None and book.unconfirmed == 0


def test_a_late_answer_confirms_only_what_it_covered() -> None:
    book = UsageBook()
    book.add_tokens("r-1", "m", 1, 1)
    _, mark1 = book.hand_over({}, ("", 0))
    book.add_tokens("r-1", "m", 2, 2)
    _, mark2 = book.hand_over({}, ("", 0))  # (a poll the server gave up on: never charged)
    rest, mark3 = book.hand_over({}, mark1)  # the server charged the first one only

    assert rest.tokens == {("r-1", "m"): (2, 2)} and mark3 == mark2


def test_a_mark_of_another_gateway_run_confirms_nothing() -> None:
    book = UsageBook()
    book.add_tokens("r-1", "m", 4, 4)
    book.hand_over({}, ("", 0))
    again, _ = book.hand_over({}, ("a-restarted-gateway", 99))
    assert again.tokens == {("r-1", "m"): (4, 4)}


def test_unconfirmed_hand_overs_are_bounded_and_nothing_is_lost_by_merging() -> None:
    book = UsageBook()
    for i in range(HANDOVERS_KEPT + 10):
        book.add_tokens(f"r-{i}", "m", 1, 0)
        total, mark = book.hand_over({}, ("", 0))
    assert book.unconfirmed == HANDOVERS_KEPT
    assert sum(p for p, _ in total.tokens.values()) == HANDOVERS_KEPT + 10
    assert mark == (book.run_id, HANDOVERS_KEPT + 10)


def test_tokens_past_the_bound_are_counted_as_unkept() -> None:
    book = UsageBook(rollouts_kept=1)
    book.add_tokens("r-1", "m", 1, 1)
    book.add_tokens("r-1", "m", 1, 1)  # (a rollout already waiting is still kept)
    book.add_tokens("r-2", "m", 3, 4)
    usage, _ = book.hand_over({}, None)
    assert usage.tokens == {("r-1", "m"): (2, 2)} and book.tokens_unkept == 7


async def test_a_stream_records_what_it_sent_once_however_it_ends() -> None:
    recorded: list[tuple[int, int]] = []

    async def events(tally: Tally, n: int) -> AsyncIterator[str]:
        for i in range(n):
            tally.completion += 1
            yield str(i)
        yield "[DONE]"

    whole = Tally(5)
    got = [e async for e in counted(events(whole, 3), whole, lambda *a: recorded.append(a))]
    cut = Tally(5)
    left = counted(events(cut, 10), cut, lambda *a: recorded.append(a))
    await anext(left)
    await anext(left)
    await left.aclose()  # type: ignore[attr-defined]  # (the client went away)
    none = Tally(5)
    async for _ in counted(events(none, 0), none, lambda *a: recorded.append(a)):
        pass

    assert got == ["0", "1", "2", "[DONE]"]
    assert recorded == [(5, 3), (5, 2)]  # (a stream that sent no token records nothing)


# -- replays -------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _maker(calls: list[int], body: dict[str, Any] | None = None) -> Any:
    async def make() -> Reply:
        calls.append(1)
        return Reply(200, {"id": f"chatcmpl-{len(calls)}", **(body or {})},
                     headers={"x-fleet-degraded": "0"})  # fmt: skip

    return make


async def _ask(replays: Replays, key: str, body: bytes, make: Any, rollout: str = "r-1") -> Reply:
    holds = ExitStack()
    try:
        return await replays.answer(rollout, {"idempotency-key": key} if key else {},
                                    "/v1/chat/completions", body, holds, make)  # fmt: skip
    finally:
        holds.close()


async def test_a_completed_answer_is_given_again_marked_and_another_body_is_refused() -> None:
    replays, calls = Replays(), list[int]()
    make = _maker(calls, {"fleet": {"served_by": "primary"}})
    first = await _ask(replays, "k1", b'{"model": "m", "n": 1}', make)
    again = await _ask(replays, "k1", b'{"n":1,"model":"m"}', make)  # (same JSON, reordered)
    other_rollout = await _ask(replays, "k1", b'{"model": "m", "n": 1}', make, rollout="r-2")
    no_key = await _ask(replays, "", b'{"model": "m", "n": 1}', make)
    with pytest.raises(ApiError) as refused:
        await _ask(replays, "k1", b'{"model": "m", "n": 2}', make)

    assert first.body is not None and again.body is not None
    assert again.body["id"] == first.body["id"] == "chatcmpl-1"
    assert again.body["fleet"] == {"served_by": "primary", "replayed": True}
    assert again.headers == {"x-fleet-degraded": "0", "x-fleet-replayed": "1"}
    assert "replayed" not in first.body["fleet"]
    assert other_rollout.body is not None and other_rollout.body["id"] == "chatcmpl-2"
    assert no_key.body is not None and no_key.body["id"] == "chatcmpl-3"
    assert refused.value.status == 409 and refused.value.param == "Idempotency-Key"
    assert "different request" in refused.value.message
    assert len(calls) == 3 and replays.replayed == 1


async def test_a_bad_key_is_refused_naming_the_header() -> None:
    with pytest.raises(ApiError) as refused:
        await _ask(Replays(), "x" * 300, b"{}", _maker([]))
    assert refused.value.status == 400 and "Idempotency-Key" in refused.value.message


async def test_a_retry_waits_for_the_first_and_takes_its_answer() -> None:
    replays, calls = Replays(), list[int]()
    gate = asyncio.Event()

    async def slow() -> Reply:
        calls.append(1)
        await gate.wait()
        return Reply(200, {"id": "chatcmpl-slow"})

    first = asyncio.create_task(_ask(replays, "k", b"{}", slow))
    await asyncio.sleep(0)
    retry = asyncio.create_task(_ask(replays, "k", b"{}", slow))
    await asyncio.sleep(0.01)
    assert not retry.done()
    gate.set()
    a, b = await first, await retry
    assert a.body == {"id": "chatcmpl-slow"} and b.body is not None
    assert b.body["id"] == "chatcmpl-slow" and b.headers["x-fleet-replayed"] == "1"
    assert len(calls) == 1


async def test_a_retry_gives_up_waiting_with_409_and_generates_after_a_failure() -> None:
    replays, calls = Replays(wait_s=0.05), list[int]()
    gate = asyncio.Event()

    async def stuck() -> Reply:
        await gate.wait()
        raise ApiError(503, "the device failed")

    first = asyncio.create_task(_ask(replays, "k", b"{}", stuck))
    await asyncio.sleep(0)
    with pytest.raises(ApiError) as waited:
        await _ask(replays, "k", b"{}", _maker(calls))
    gate.set()
    with pytest.raises(ApiError):
        await first
    after = await _ask(replays, "k", b"{}", _maker(calls))  # (nothing was kept: it generates)

    assert waited.value.status == 409 and "still running" in waited.value.message
    assert after.body is not None and after.body["id"] == "chatcmpl-1" and len(calls) == 1


async def test_answers_expire_and_the_least_recently_used_go_first() -> None:
    clock = Clock()
    replays, calls = Replays(max_entries=2, ttl_s=60.0, clock=clock), list[int]()
    make = _maker(calls)
    for key in ("a", "b"):
        await _ask(replays, key, b"{}", make)
    await _ask(replays, "a", b"{}", make)  # (a is used again: b is now the oldest)
    await _ask(replays, "c", b"{}", make)
    assert len(replays) == 2
    b = await _ask(replays, "b", b"{}", make)  # generated again: b was dropped
    assert b.body is not None and b.body["id"] == "chatcmpl-4"
    clock.now += 61
    a = await _ask(replays, "c", b"{}", make)  # expired
    assert a.body is not None and a.body["id"] == "chatcmpl-5"
    small = Replays(max_bytes=40)
    await _ask(small, "big", b"{}", _maker([], {"text": "x" * 100}))
    assert len(small) == 0 and small.stored_bytes == 0


async def test_a_stream_is_kept_once_it_completes_and_replayed_event_for_event() -> None:
    replays = Replays()

    def streamer(events: list[str]) -> Any:
        async def gen() -> AsyncIterator[str]:
            for e in events:
                yield e

        async def make() -> Reply:
            return Reply(200, headers={"x-fleet-degraded": "0"}, events=gen())

        return make

    chunk = json.dumps({"id": "chatcmpl-s", "choices": [], "fleet": {"device": "cpu"}})
    broken = [chunk, json.dumps({"error": {"message": "device failed"}})]
    first = await _ask(replays, "s1", b"{}", streamer(broken))
    assert first.events is not None
    assert [e async for e in first.events] == broken
    second = await _ask(replays, "s1", b"{}", streamer([chunk, "[DONE]"]))  # (none kept)
    assert second.events is not None
    assert [e async for e in second.events] == [chunk, "[DONE]"]
    third = await _ask(replays, "s1", b"{}", streamer(["never"]))
    assert third.events is not None and third.headers["x-fleet-replayed"] == "1"
    replayed = [e async for e in third.events]
    assert replayed[-1] == "[DONE]" and len(replayed) == 2
    assert json.loads(replayed[0]) == {
        **json.loads(chunk),
        "fleet": {"device": "cpu", "replayed": True},
    }
