"""The jobs of one OpenAI-compatible request (a choice of a prompt each), generated together
through the language model's failover (`LanguageModel.generate`): their events merged as they
come, collected whole for an answer not streamed, and the error event that ends a stream that
failed after it began.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import structlog

from fleet.core.errors import FleetError
from gateway.llm.engine import TokenEvent
from gateway.llm.openai_schema import ApiError, from_fleet
from gateway.llm.sampling import SamplingParams
from gateway.llm.serving import RESTART_TOKEN, LanguageModel, Resumable, Route
from gateway.model import DeviceFault

log = structlog.get_logger(__name__)


@dataclass
class Job:
    """One sequence to generate: a choice of a request."""

    index: int
    prompt: list[int]
    params: SamplingParams


@dataclass
class Choice:
    events: list[TokenEvent] = field(default_factory=list)
    text: str = ""


def device_error(exc: DeviceFault | Resumable) -> ApiError:
    """A device's failure that no engine could take over, as an answer (503, retry)."""
    code = "resumable" if isinstance(exc, Resumable) and exc.sent else (
        exc.cause.kind if isinstance(exc, Resumable) and isinstance(exc.cause, DeviceFault)
        else getattr(exc, "kind", "device_error"))  # fmt: skip
    return ApiError(503, f"the model's device failed: {exc}", "service_unavailable_error",
                    code=code, retry_after_s=1.0)  # fmt: skip


def stream_error(exc: Exception, fleet: dict[str, Any] | None = None) -> dict[str, Any]:
    """The event that ends a stream that failed after it began (its status already sent). A
    resumable one says how many tokens were sent and the last one, so a client can resume."""
    if isinstance(exc, FleetError):
        error = from_fleet(exc)
    elif isinstance(exc, DeviceFault | Resumable):
        error = device_error(exc)
    else:
        log.exception("openai_stream_crashed", exc_info=exc)
        error = ApiError(500, "internal error; see the gateway's log", "server_error",
                         code="internal_error")  # fmt: skip
    body = error.reply().body
    assert body is not None
    if fleet is not None:
        body = {**body, "fleet": fleet}
    if isinstance(exc, Resumable) and exc.sent:
        body["fleet"] = {**body.get("fleet", {}), "resumable": True,
                         "tokens_sent": len(exc.sent), "last_token_index": len(exc.sent) - 1,
                         "last_token_id": exc.sent[-1]}  # fmt: skip
    return body


async def merge_events(
    lm: LanguageModel, route: Route, jobs: list[Job], request_id: str
) -> AsyncGenerator[tuple[int, TokenEvent], None]:
    """The jobs' events as they come, tagged with each job's index; the first failure ends it.
    Leaving early (the client went away) cancels every job, which aborts its sequence."""
    queue: asyncio.Queue[tuple[int, TokenEvent | Exception | None]] = asyncio.Queue()

    async def one(job: Job) -> None:
        try:
            events = lm.generate(
                job.prompt, job.params, request_id=f"{request_id}-{job.index}", route=route
            )
            async with aclosing(events) as generated:
                async for event in generated:
                    queue.put_nowait((job.index, event))
            queue.put_nowait((job.index, None))
        except Exception as exc:
            queue.put_nowait((job.index, exc))

    tasks = [asyncio.create_task(one(job)) for job in jobs]
    try:
        left = len(tasks)
        while left:
            index, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_jobs(
    lm: LanguageModel, route: Route, jobs: list[Job], request_id: str
) -> list[Choice]:
    """Every job to its end; their events and text, in the jobs' order."""
    choices = {job.index: Choice() for job in jobs}
    async with aclosing(merge_events(lm, route, jobs, request_id)) as merged:
        async for index, event in merged:
            if event.token_id == RESTART_TOKEN:  # begun again whole on the replica
                choices[index] = Choice()
                continue
            choices[index].events.append(event)
            choices[index].text += event.text
    return [choices[job.index] for job in jobs]
