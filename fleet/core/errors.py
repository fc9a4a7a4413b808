"""The one error tree of fleet.

FleetError (code: ErrorCode)
├── InvalidArgument      bad input: a Smolfile, a step, a field
├── NotFound
├── AlreadyExists        idempotency key reused with another body
├── FailedPrecondition   no host can serve it, image missing, schema too new
├── ResourceExhausted    over a size or admission limit
├── Aborted              stale fencing token
├── DeadlineExceeded
├── Unavailable          a runtime or dependency is not there (retryable)
├── Unauthenticated      no or unverifiable credentials (an inference token)
├── PermissionDenied     a valid credential that does not cover this request
├── OutOfRange           a read past the end (of a blob)
└── Internal

Foreign exceptions are translated into these once, at the adapter that caught them; the server
maps each code to the canonical gRPC status of the same name.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    ABORTED = "ABORTED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    UNAVAILABLE = "UNAVAILABLE"
    CANCELLED = "CANCELLED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    INTERNAL = "INTERNAL"


class FleetError(Exception):
    """Root of fleet's errors; `code` is stable and maps to a gRPC status."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: float | None = None,
        details: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        """For RESOURCE_EXHAUSTED and UNAVAILABLE: when trying again may succeed."""
        self.details = details or {}
        """Machine-readable context, sent as `fleet-<key>` trailing metadata."""


class InvalidArgument(FleetError):
    code = ErrorCode.INVALID_ARGUMENT


class NotFound(FleetError):
    code = ErrorCode.NOT_FOUND


class AlreadyExists(FleetError):
    code = ErrorCode.ALREADY_EXISTS


class FailedPrecondition(FleetError):
    code = ErrorCode.FAILED_PRECONDITION


class ResourceExhausted(FleetError):
    code = ErrorCode.RESOURCE_EXHAUSTED


class Aborted(FleetError):
    code = ErrorCode.ABORTED


class DeadlineExceeded(FleetError):
    code = ErrorCode.DEADLINE_EXCEEDED


class Unavailable(FleetError):
    code = ErrorCode.UNAVAILABLE


class Cancelled(FleetError):
    code = ErrorCode.CANCELLED


class Unauthenticated(FleetError):
    code = ErrorCode.UNAUTHENTICATED


class PermissionDenied(FleetError):
    code = ErrorCode.PERMISSION_DENIED


class OutOfRange(FleetError):
    code = ErrorCode.OUT_OF_RANGE


class Internal(FleetError):
    code = ErrorCode.INTERNAL


def error_for(code: str, message: str, retry_after_s: float | None = None) -> FleetError:
    """The error a code's name stands for (as a peer reported it); INTERNAL for an unknown one."""
    kinds = {kind.code: kind for kind in FleetError.__subclasses__()}
    try:
        return kinds.get(ErrorCode(code), Internal)(message, retry_after_s=retry_after_s)
    except ValueError:
        return Internal(f"{message} (unknown code {code!r})")
