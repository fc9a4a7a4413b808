"""The gateway's sweep of open streams (`gateway.http._Leavers`): a stream whose client has
closed its end has its task cancelled and is marked as left; one whose client is there is
left alone; once its streams have ended the sweep ends, and nothing it kept holds its event
loop (a loop per test, or per `asyncio.run`, is collected)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import cast

from gateway import http


class Writer:
    """What the sweep asks of a stream's writer."""

    def __init__(self, closing: bool) -> None:
        self.closing = closing

    def is_closing(self) -> bool:
        return self.closing


def writer(closing: bool) -> asyncio.StreamWriter:
    return cast(asyncio.StreamWriter, Writer(closing))


LOOPS: list[weakref.ref[asyncio.AbstractEventLoop]] = []


async def sweep_once() -> tuple[bool, bool, bool, bool]:
    loop = asyncio.get_running_loop()
    LOOPS.append(weakref.ref(loop))
    leavers = http._leavers_of(loop)
    ended = asyncio.StreamReader()
    ended.feed_eof()  # (its client closed its end)
    gone = asyncio.create_task(asyncio.sleep(60))
    there = asyncio.create_task(asyncio.sleep(60))
    left = http._Watched(gone, ended, writer(closing=False))
    stays = http._Watched(there, asyncio.StreamReader(), writer(closing=False))
    leavers.add(left)
    leavers.add(stays)
    await asyncio.sleep(3 * http.GONE_POLL_S)
    result = (gone.cancelled(), left.left, there.done(), stays.left)
    leavers.discard(stays)  # (its stream ended: the sweep ends at its next look)
    there.cancel()
    await asyncio.sleep(2 * http.GONE_POLL_S)
    assert leavers.task is None
    return result


def test_the_sweep_cancels_streams_whose_clients_left_and_lets_its_loop_go() -> None:
    for _ in range(3):
        assert asyncio.run(sweep_once()) == (True, True, False, False)
    gc.collect()
    assert len(LOOPS) == 3 and all(ref() is None for ref in LOOPS)  # (collected: none kept)
