"""fleet's errors on the wire, both ways.

A server ends a refused call with the canonical gRPC status of the error's code and a
`google.rpc.Status` in the `grpc-status-details-bin` trailer (the gRPC rich error model, read
by any gRPC client) carrying:

- `ErrorInfo`: reason = the error's code (`RESOURCE_EXHAUSTED`, ...), domain "fleet", and
  metadata = the error's details plus the call's `request_id` and `rpc`;
- `RetryInfo`: when trying again may succeed (only where the error says so).

The same hints also travel as plain trailing metadata (`retry-after-s`, `fleet-<key>`), which
clients and agents of earlier releases read.

A client turns a failed call back into fleet's own exception with `error_from_rpc`: the
subclass of the code, the message, the retry hint and the details.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import grpc
import structlog
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from fleet.core.errors import ErrorCode, FleetError, Internal, error_for

log = structlog.get_logger(__name__)

DOMAIN = "fleet"
"""`ErrorInfo.domain` of every refusal a fleet server sends."""
RETRY_AFTER_KEY = "retry-after-s"
DETAILS_PREFIX = "fleet-"
REQUEST_ID = "request_id"
"""The `ErrorInfo.metadata` key of the call's request id."""
RPC = "rpc"

STATUS_FOR: dict[ErrorCode, grpc.StatusCode] = {
    code: grpc.StatusCode[code.name] for code in ErrorCode
}
"""Each of fleet's codes is the canonical gRPC status of the same name."""


@dataclass(frozen=True)
class Refusal:
    """How a server ends a call refused with a FleetError: `context.abort(*refusal.abort_args)`."""

    code: grpc.StatusCode
    message: str
    trailing_metadata: tuple[tuple[str, str | bytes], ...]

    @property
    def abort_args(self) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str | bytes], ...]]:
        return self.code, self.message, self.trailing_metadata


def legacy_metadata(exc: FleetError) -> tuple[tuple[str, str], ...]:
    """The hints as plain trailers: `fleet-<key>` per detail and `retry-after-s`."""
    pairs = [(f"{DETAILS_PREFIX}{key}", value) for key, value in sorted(exc.details.items())]
    if exc.retry_after_s is not None:
        pairs.append((RETRY_AFTER_KEY, f"{exc.retry_after_s:.3f}"))
    return tuple(pairs)


def rich_status(exc: FleetError, *, request_id: str = "", rpc: str = "") -> status_pb2.Status:
    """`exc` as a `google.rpc.Status`: its code and message, ErrorInfo, and RetryInfo when it
    carries a retry hint."""
    metadata = dict(exc.details)
    if request_id:
        metadata[REQUEST_ID] = request_id
    if rpc:
        metadata[RPC] = rpc
    info = error_details_pb2.ErrorInfo(reason=str(exc.code), domain=DOMAIN, metadata=metadata)
    status = status_pb2.Status(code=STATUS_FOR[exc.code].value[0], message=exc.message)
    status.details.add().Pack(info)
    if exc.retry_after_s is not None and math.isfinite(exc.retry_after_s):
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(max(0, round(exc.retry_after_s * 1e9)))
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return status


def refusal(exc: FleetError, *, request_id: str = "", rpc: str = "") -> Refusal:
    """The status, message and trailers a server ends a call refused with `exc` with."""
    rich = rpc_status.to_status(rich_status(exc, request_id=request_id, rpc=rpc))
    return Refusal(
        STATUS_FOR[exc.code], exc.message, (*rich.trailing_metadata, *legacy_metadata(exc))
    )


def as_refusal(exc: Exception, rpc: str) -> FleetError:
    """What the caller is told of `exc` (call it where `exc` is being handled): a FleetError as
    it is, logged as a refusal; anything else as INTERNAL naming only its type, logged with its
    traceback (the details stay in the log: they may carry SQL and other clients' data)."""
    if isinstance(exc, FleetError):
        log.info("request_refused", rpc=rpc, code=str(exc.code), error=exc.message)
        return exc
    log.exception("request_crashed", rpc=rpc)
    return Internal(f"internal error ({type(exc).__name__}) in {rpc}; see the server log")


def _rich(exc: grpc.RpcError) -> status_pb2.Status | None:
    try:
        found: status_pb2.Status | None = rpc_status.from_call(exc)
    except (ValueError, AttributeError, TypeError):  # (inconsistent, or not a call at all)
        return None
    return found


def error_from_rpc(exc: grpc.RpcError) -> FleetError:
    """fleet's exception for a failed call (sync or asyncio): the subclass of its code, its
    message, its retry hint and its details (with `request_id` when the server named one).

    A status without fleet's details (a proxy's, the channel's own UNAVAILABLE, a server of an
    earlier release) is read from its code, message and plain trailers; a code fleet does not
    use (UNIMPLEMENTED, UNKNOWN, ...) becomes Internal naming it."""
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    message = exc.details() if callable(getattr(exc, "details", None)) else None
    message = message or name
    retry_after_s: float | None = None
    details: dict[str, str] = {}
    trailers = exc.trailing_metadata() if callable(getattr(exc, "trailing_metadata", None)) else ()
    for key, value in trailers or ():
        if key == RETRY_AFTER_KEY:
            with contextlib.suppress(ValueError):  # (a malformed hint is no hint)
                retry_after_s = float(value)
        elif key.startswith(DETAILS_PREFIX) and isinstance(value, str):
            details[key.removeprefix(DETAILS_PREFIX)] = value
    rich = _rich(exc)
    if rich is not None:
        message = rich.message or message
        for any_detail in rich.details:
            if any_detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                any_detail.Unpack(retry)
                retry_after_s = retry.retry_delay.ToNanoseconds() / 1e9
            elif any_detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                any_detail.Unpack(info)
                if info.domain == DOMAIN:
                    details.update(info.metadata)
                    if info.reason in ErrorCode.__members__:
                        name = info.reason
    error = error_for(name, message, retry_after_s)
    error.details = details
    return error
