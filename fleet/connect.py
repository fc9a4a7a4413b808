"""Reaching a server: where a client's CA and API key come from (flags, the environment,
`fleet up`'s files), channels whose every call carries the key, the replicas a client or agent
moves between when one is gone, and paging through rollouts.

Used by the command line, the Python client, the agent, the embedded fleet and the demo alike."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog

from fleet.api.pb import fleet_pb2, types_pb2
from fleet.config import Paths
from fleet.core.errors import InvalidArgument

log = structlog.get_logger(__name__)

DEFAULT_SERVER = "127.0.0.1:50051"
DNS_SCHEME = "dns:"
UNIX_SCHEME = "unix:"
STATUS_DETAILS = "grpc-status-details-bin"
"""The trailer every refusal of a fleet server carries (`fleet.api.status`): a status without
it is the channel's own, or a proxy's."""
NEVER_SENT = "failed to connect to all addresses"
"""How gRPC words an UNAVAILABLE whose call never reached a server (no connection was made)."""


def default_server() -> str:
    """$FLEET_SERVER, else DEFAULT_SERVER: where clients and agents find the server (several
    replicas: comma-separated)."""
    return os.environ.get("FLEET_SERVER") or DEFAULT_SERVER


# -- replicas ----------------------------------------------------------------------------------


def parse_servers(value: str | Sequence[str], source: str = "--server") -> list[str]:
    """The server addresses in `value` (one string, comma-separated, or several), in order,
    each once. Each is HOST:PORT, [IPv6]:PORT, dns:[//RESOLVER/]NAME:PORT (a name that may
    resolve to several replicas: gRPC's resolver tries them in turn) or unix:PATH. Anything
    else is refused naming `source` (the flag or variable it came from) and the address."""
    items = [value] if isinstance(value, str) else list(value)
    servers: list[str] = []
    for item in items:
        for part in item.split(","):
            address = part.strip()
            if not address:
                continue
            _check_address(address, source)
            if address not in servers:
                servers.append(address)
    if not servers:
        raise InvalidArgument(
            f"{source}: no server address given (expected HOST:PORT, several comma-separated)"
        )
    return servers


def _check_address(address: str, source: str) -> None:
    if address.startswith(UNIX_SCHEME) and len(address) > len(UNIX_SCHEME):
        return
    rest = _name_and_port(address)
    host, sep, port = rest.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    ok = (
        bool(sep) and port.isdigit() and 0 < int(port) < 65536 and bool(host.strip("[]"))
        and (":" not in host or bracketed) and "/" not in host and " " not in host
    )  # fmt: skip
    if not ok:
        raise InvalidArgument(
            f"{source}: {address!r} is not a server address (HOST:PORT, [IPv6]:PORT or "
            f"dns:[//RESOLVER/]NAME:PORT; several are comma-separated)"
        )


def _name_and_port(address: str) -> str:
    """NAME:PORT of a dns: target (its resolver dropped); the address itself otherwise."""
    if not address.startswith(DNS_SCHEME):
        return address
    rest = address.removeprefix(DNS_SCHEME)
    if rest.startswith("//"):
        rest = rest[2:].partition("/")[2]
    return rest


def with_port(address: str, port: int) -> str:
    """`address` (as `parse_servers` takes it) with another port: where the same replica
    serves another endpoint (its hosts' mutual-TLS port)."""
    if address.startswith(UNIX_SCHEME):
        raise InvalidArgument(f"{address}: a unix socket has no port for the host endpoint")
    name = _name_and_port(address)
    prefix = address[: len(address) - len(name)]
    return f"{prefix}{name.rpartition(':')[0]}:{port}"


def is_gone(exc: BaseException) -> bool:
    """Whether a failed call says its server is out of reach (the connection refused or lost):
    UNAVAILABLE from the channel itself. A fleet server's own UNAVAILABLE refusals (a host not
    connected, say) carry fleet's status details and are not this."""
    if not isinstance(exc, grpc.RpcError) or not callable(getattr(exc, "code", None)):
        return False
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    trailers = exc.trailing_metadata() if callable(getattr(exc, "trailing_metadata", None)) else ()
    return not any(key == STATUS_DETAILS for key, _ in trailers or ())


def never_sent(exc: BaseException) -> bool:
    """Whether a failed call is known not to have reached any server (so sending it to
    another replica cannot do it twice)."""
    details = getattr(exc, "details", None)
    return is_gone(exc) and callable(details) and NEVER_SENT in str(details() or "").lower()


class Replicas:
    """The servers a client or an agent may use, in order, and the one it uses now. When that
    one is gone, `move_from` turns to the next (round the list): calls that failed at once on
    the same dead replica move it one step, not one step each."""

    def __init__(self, servers: str | Sequence[str], source: str = "--server") -> None:
        self.servers = parse_servers(servers, source)
        self.index = 0
        self.moves = 0
        """How often this moved to another replica."""

    @property
    def current(self) -> str:
        return self.servers[self.index]

    @property
    def several(self) -> bool:
        return len(self.servers) > 1

    def move_from(self, index: int, why: str) -> bool:
        """Turns to the replica after `index` if `index` is still the one in use (another
        caller may have moved already); returns whether it moved."""
        if not self.several or index != self.index:
            return False
        gone = self.current
        self.index = (self.index + 1) % len(self.servers)
        self.moves += 1
        log.warning("server_replica_gone", server=gone, next_server=self.current, error=why)
        return True

    def __str__(self) -> str:
        return ",".join(self.servers)


async def list_all(stub: Any, labels: dict[str, str]) -> list[types_pb2.Rollout]:
    """Every rollout carrying `labels`, newest first, page after page (a page ends early when
    its results pass the server's byte limit). For code that holds a raw stub; clients call
    `fleet.client.AsyncFleet.list`."""
    rollouts: list[types_pb2.Rollout] = []
    token = ""
    while True:
        reply = await stub.ListRollouts(
            fleet_pb2.ListRolloutsRequest(page_size=500, page_token=token, labels=labels)
        )
        rollouts += list(reply.rollouts)
        token = reply.next_page_token
        if not token:
            return rollouts


# -- credentials -------------------------------------------------------------------------------


class _WithKey:
    """A method of a stub whose every call carries the API key."""

    def __init__(self, call: Any, pair: tuple[str, str]) -> None:
        self._call = call
        self._pair = pair

    def __call__(self, request: Any, *, metadata: Any = None, **kwargs: Any) -> Any:
        return self._call(request, metadata=(*(metadata or ()), self._pair), **kwargs)


class _KeyedChannel:
    """A channel whose calls carry `authorization: Bearer <API key>`. (A client interceptor
    does the same at about 120 us of Python per call; this costs one function call.)"""

    def __init__(self, channel: grpc.aio.Channel, key: str) -> None:
        self._channel = channel
        self._pair = ("authorization", f"Bearer {key}")

    def unary_unary(self, *args: Any, **kwargs: Any) -> _WithKey:
        return _WithKey(self._channel.unary_unary(*args, **kwargs), self._pair)

    def unary_stream(self, *args: Any, **kwargs: Any) -> _WithKey:
        return _WithKey(self._channel.unary_stream(*args, **kwargs), self._pair)

    def stream_unary(self, *args: Any, **kwargs: Any) -> _WithKey:
        return _WithKey(self._channel.stream_unary(*args, **kwargs), self._pair)

    def stream_stream(self, *args: Any, **kwargs: Any) -> _WithKey:
        return _WithKey(self._channel.stream_stream(*args, **kwargs), self._pair)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._channel, name)

    async def __aenter__(self) -> _KeyedChannel:
        await self._channel.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._channel.__aexit__(*exc)


@dataclass(frozen=True)
class ClientAuth:
    """How a client reaches a server: its CA (None: no TLS) and an API key ("": none)."""

    ca_pem: bytes | None
    key: str

    @classmethod
    def find(
        cls, home: Path, *, ca: str | bytes = "", key: str = "", plaintext: bool = False
    ) -> ClientAuth:
        """--ca (a path, or the PEM itself), else $FLEET_CA, else `$FLEET_HOME/ca/ca.crt` when
        it exists (no TLS without one, or with --plaintext); --key, else $FLEET_KEY, else
        `$FLEET_HOME/admin.key` when it exists (written by `fleet up` and by `fleet serve` on
        first start)."""
        paths = Paths(home, home)
        ca_pem: bytes | None = None
        if isinstance(ca, bytes):
            ca_pem = ca
        elif not plaintext:
            path = ca or os.environ.get("FLEET_CA", "")
            if path:
                try:
                    ca_pem = Path(path).read_bytes()
                except OSError as exc:
                    raise InvalidArgument(
                        f"the CA certificate {path} (--ca, ca= or $FLEET_CA): cannot read: {exc}"
                    ) from None
            elif (paths.ca / "ca.crt").exists():
                ca_pem = (paths.ca / "ca.crt").read_bytes()
        key = key or os.environ.get("FLEET_KEY", "")
        admin = paths.admin_key
        if not key and admin.exists():
            key = admin.read_text().strip()
        return cls(ca_pem, key)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call carries: the API key, when there is one."""
        return (("authorization", f"Bearer {self.key}"),) if self.key else ()

    def _credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials trusting the CA; None without one (no TLS)."""
        if self.ca_pem is None:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem)

    def channel(
        self, address: str, options: Sequence[tuple[str, Any]] | None = None
    ) -> grpc.aio.Channel:
        """An asyncio channel to `address` whose every call carries the key."""
        credentials = self._credentials()
        channel = (
            grpc.aio.insecure_channel(address, options) if credentials is None
            else grpc.aio.secure_channel(address, credentials, options)
        )  # fmt: skip
        return _KeyedChannel(channel, self.key) if self.key else channel

    def blocking_channel(self, address: str) -> grpc.Channel:
        """A blocking channel to `address` (its calls pass `metadata` themselves)."""
        credentials = self._credentials()
        if credentials is None:
            return grpc.insecure_channel(address)
        return grpc.secure_channel(address, credentials)
