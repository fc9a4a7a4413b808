"""Fleet errors leave the server through this one chokepoint as canonical gRPC statuses."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import structlog

from fleet.core.errors import ErrorCode, FleetError, Internal

log = structlog.get_logger(__name__)

STATUS_FOR: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.ABORTED: grpc.StatusCode.ABORTED,
    ErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

RETRY_AFTER_KEY = "retry-after-s"


def trailing_metadata(exc: FleetError) -> tuple[tuple[str, str], ...]:
    """A refusal's machine-readable parts: the retry hint and any details."""
    pairs = [(f"fleet-{key}", value) for key, value in sorted(exc.details.items())]
    if exc.retry_after_s is not None:
        pairs.append((RETRY_AFTER_KEY, f"{exc.retry_after_s:.3f}"))
    return tuple(pairs)


def as_refusal(exc: Exception, rpc: str) -> FleetError:
    """What the caller is told of `exc` (call it where `exc` is being handled): a FleetError as
    it is, logged as a refusal; anything else as INTERNAL naming only its type, logged with its
    traceback (the details stay in the log: they may carry SQL and other clients' data)."""
    if isinstance(exc, FleetError):
        log.info("request_refused", rpc=rpc, code=exc.code, error=exc.message)
        return exc
    log.exception("request_crashed", rpc=rpc)
    return Internal(f"internal error ({type(exc).__name__}) in {rpc}; see the server log")


def mapped(method: F) -> F:
    """Turns FleetError into the matching status, anything else into INTERNAL (logged). Every
    line the call logs carries its `rpc` and its `request_id` (where the request has one)."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        bound = {"rpc": method.__name__}
        request_id = getattr(request, "request_id", "")
        if isinstance(request_id, str) and request_id:
            bound["request_id"] = request_id[:128]
        try:
            with structlog.contextvars.bound_contextvars(**bound):
                return await method(self, request, context)
        except Exception as exc:  # the last line of defence: never leak a traceback as a hang
            if isinstance(exc, grpc.aio.AbortError):
                raise
            refusal = as_refusal(exc, method.__name__)
            await context.abort(
                STATUS_FOR[refusal.code], refusal.message, trailing_metadata(refusal)
            )

    return wrapper  # type: ignore[return-value]
