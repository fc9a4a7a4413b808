"""Reaching a server: where a client's CA and API key come from (flags, the environment,
`fleet up`'s files), channels whose every call carries the key, and paging through rollouts.

Used by the command line, the Python client, the embedded fleet and the demo alike."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from fleet.api.pb import fleet_pb2, types_pb2
from fleet.config import Paths
from fleet.core.errors import InvalidArgument

DEFAULT_SERVER = "127.0.0.1:50051"


def default_server() -> str:
    """$FLEET_SERVER, else DEFAULT_SERVER: where clients and agents find the server."""
    return os.environ.get("FLEET_SERVER") or DEFAULT_SERVER


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

    def channel(self, address: str) -> grpc.aio.Channel:
        """An asyncio channel to `address` whose every call carries the key."""
        credentials = self._credentials()
        channel = (
            grpc.aio.insecure_channel(address) if credentials is None
            else grpc.aio.secure_channel(address, credentials)
        )  # fmt: skip
        return _KeyedChannel(channel, self.key) if self.key else channel

    def blocking_channel(self, address: str) -> grpc.Channel:
        """A blocking channel to `address` (its calls pass `metadata` themselves)."""
        credentials = self._credentials()
        if credentials is None:
            return grpc.insecure_channel(address)
        return grpc.secure_channel(address, credentials)
