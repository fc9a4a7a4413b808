"""Failed calls as fleet's own errors, for everything the client raises.

`fleet.api.status.error_from_rpc` reads a status back into fleet's exception (its class by
code, its message, retry hint and details). The client adds what only it knows: which server
it could not reach, and, when it was TLS that failed, what to change.
"""

from __future__ import annotations

import grpc

from fleet.api.status import error_from_rpc as _from_status
from fleet.core.errors import FleetError, Unavailable

TLS_HINT = (
    " (TLS failed: a server started without TLS, on loopback without --tls, needs --plaintext; "
    "one with TLS needs the fleet CA: --ca FILE or $FLEET_CA)"
)


def error_from_rpc(exc: grpc.RpcError, server: str = "") -> FleetError:
    """fleet's error for a failed call to `server`: an UNAVAILABLE one names the server."""
    error = _from_status(exc)
    if isinstance(error, Unavailable) and server and server not in error.message:
        message = f"{server}: {error.message}"
        if "ssl" in message.lower() or "handshake" in message.lower():
            message += TLS_HINT
        error.message = message
        error.args = (message,)
    return error


def unreachable(server: str, why: str) -> Unavailable:
    """The error for a server the client could not reach again after a dropped stream."""
    return Unavailable(f"{server}: {why}", retry_after_s=1.0)
