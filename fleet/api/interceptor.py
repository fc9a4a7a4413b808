"""The one server interceptor: request context, authentication and error mapping, for every
call kind (unary and streaming, either way).

For each call it:

1. names the call: its `rpc` (the method's short name), its `request_id` (the request's own
   `request_id` field where it has one, else the caller's `x-request-id` metadata, else one made
   here) and its `peer`, bound into structlog's context so that every line the call logs carries
   them (`current_call()` gives them to the handler);
2. authenticates the caller with the server's `authenticate` hook (none: every caller is let
   through, as on a loopback server without TLS);
3. runs the handler, and ends the call with fleet's status for any FleetError it raises, before
   or after a streaming handler's first message: the canonical code, the message, and the rich
   details (`ErrorInfo`, `RetryInfo`; see `fleet.api.status`). Anything else becomes INTERNAL
   naming only the exception's type, its traceback logged.

Handlers therefore just raise FleetError subclasses; none calls `context.abort`.

What is bound is not unbound: grpc.aio serves each call on an asyncio task of its own, whose
context (a copy) ends with the call. Resetting instead would fail when a streaming handler is
closed from another task.
"""

from __future__ import annotations

import contextvars
import inspect
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
import structlog

from fleet.api.status import as_refusal, refusal

REQUEST_ID_METADATA = "x-request-id"
"""The metadata key a caller may name its call with (a request's own `request_id` wins)."""
MAX_REQUEST_ID = 128

Authenticate = Callable[[str, grpc.aio.ServicerContext], Awaitable[None]]
"""Checks the caller of the method (its full name) and makes it current for the handler; raises
FleetError (UNAUTHENTICATED, PERMISSION_DENIED, ...) to refuse the call."""


@dataclass(frozen=True)
class Call:
    """What names the call being served."""

    method: str
    """Full method name: `/fleet.v1.FleetService/WatchRollout`."""
    request_id: str
    peer: str

    @property
    def rpc(self) -> str:
        return self.method.rsplit("/", 1)[-1]


CALL: contextvars.ContextVar[Call | None] = contextvars.ContextVar("fleet_call", default=None)


def current_call() -> Call | None:
    """The call being served (None outside a call)."""
    return CALL.get()


def _clean(value: object) -> str:
    """A request id as logs and trailers may carry it: printable ASCII, bounded."""
    if not isinstance(value, str):
        return ""
    clean = value.isascii() and value.isprintable() and " " not in value
    if clean and len(value) <= MAX_REQUEST_ID:
        return value  # (the usual id: not rebuilt a character at a time)
    return "".join(c for c in value if " " < c <= "~")[:MAX_REQUEST_ID]


def request_id_of(request: object, context: grpc.aio.ServicerContext) -> str:
    """The request's `request_id` field, else the `x-request-id` metadata, else a new id."""
    found = _clean(getattr(request, "request_id", ""))
    if not found:
        for key, value in context.invocation_metadata() or ():
            if key == REQUEST_ID_METADATA:
                found = _clean(value)
                break
    return found or uuid.uuid4().hex[:16]


class ApiInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """See the module's docstring. One wrapped handler is made per method, on its first call."""

    def __init__(self, authenticate: Authenticate | None = None) -> None:
        self._authenticate = authenticate
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = details.method
        wrapped = self._wrapped.get(method)
        if wrapped is not None:
            return wrapped
        handler = await continuation(details)
        if handler is None:  # (an unknown method: gRPC answers UNIMPLEMENTED)
            return handler
        wrapped = self._wrap(method, handler)
        self._wrapped[method] = wrapped
        return wrapped

    async def _begin(
        self, method: str, context: grpc.aio.ServicerContext, request: object = None
    ) -> Call:
        """Names the call, binds its context and authenticates its caller."""
        call = Call(method, request_id_of(request, context), context.peer() or "")
        CALL.set(call)
        structlog.contextvars.bind_contextvars(
            rpc=call.rpc, request_id=call.request_id, peer=call.peer
        )
        if self._authenticate is not None:
            await self._authenticate(method, context)
        return call

    @staticmethod
    async def _refuse(exc: Exception, context: grpc.aio.ServicerContext, rpc: str) -> NoReturn:
        """Ends the call with fleet's status for `exc` (an abort already under way goes on)."""
        if isinstance(exc, grpc.aio.AbortError):
            raise exc
        call = current_call()
        error = as_refusal(exc, rpc)
        request_id = call.request_id if call is not None else ""
        await context.abort(*refusal(error, request_id=request_id, rpc=rpc).abort_args)
        raise AssertionError("context.abort returned")  # (it raises AbortError)

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        rpc = method.rsplit("/", 1)[-1]
        begin, refuse = self._begin, self._refuse
        serialize = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    await begin(method, context, request)
                    return await inner_uu(request, context)
                except Exception as exc:
                    await refuse(exc, context, rpc)

            return grpc.unary_unary_rpc_method_handler(unary_unary, **serialize)
        if handler.stream_unary is not None:
            inner_su = handler.stream_unary

            async def stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    await begin(method, context)
                    return await inner_su(requests, context)
                except Exception as exc:
                    await refuse(exc, context, rpc)

            return grpc.stream_unary_rpc_method_handler(stream_unary, **serialize)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream
            make = grpc.unary_stream_rpc_method_handler
            return make(_streaming(inner_us, begin, refuse, method, rpc, True), **serialize)
        if handler.stream_stream is not None:
            inner_ss = handler.stream_stream
            make = grpc.stream_stream_rpc_method_handler
            return make(_streaming(inner_ss, begin, refuse, method, rpc, False), **serialize)
        return handler


def _streaming(
    inner: Callable[..., Any],
    begin: Callable[..., Awaitable[Call]],
    refuse: Callable[[Exception, grpc.aio.ServicerContext, str], Awaitable[NoReturn]],
    method: str,
    rpc: str,
    unary_request: bool,
) -> Callable[..., Any]:
    """A streaming handler wrapped: as an async generator where the handler yields its
    messages, as a coroutine where it writes them with `context.write` (gRPC tells the two
    apart by their kind, so the wrapper must be the same kind)."""
    if inspect.isasyncgenfunction(inner):

        async def generator(arg: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                await begin(method, context, arg if unary_request else None)
                async for item in inner(arg, context):
                    yield item
            except Exception as exc:
                await refuse(exc, context, rpc)

        return generator

    async def writer(arg: Any, context: grpc.aio.ServicerContext) -> None:
        try:
            await begin(method, context, arg if unary_request else None)
            await inner(arg, context)
        except Exception as exc:
            await refuse(exc, context, rpc)

    return writer
