"""What a warm parent's child reaches beyond its loopback: Unix sockets the agent serves.

A warm child has a network namespace with nothing in it but its loopback, and making it a link
and a firewall would cost more than forking it. What its rollout needs from outside, the agent
serves on Unix sockets in the child's `sockets` directory, which the child sees read-only at
`/run/fleet` (`fleet.runtime.zygote`):

- `gateway.sock`: the inference gateway. Each connection is joined to a new TCP connection to
  the gateway's HTTP endpoint, made from the uplink's namespace, bytes as they are; the gateway
  checks the rollout's token as for any machine.
- `checkpoints.sock`: the checkpoint relay (`fleet.agent.checkpoints`).

Nothing else is reachable: there is no route out of the child's namespace, and the directory
holds only the sockets of what its rollout asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
from pathlib import Path

import structlog

from fleet.httpd import retry_later
from fleet.runtime.netns import in_netns

log = structlog.get_logger(__name__)

CHILD_DIR = "/run/fleet"
GATEWAY_SOCKET = "gateway.sock"
CHECKPOINTS_SOCKET = "checkpoints.sock"
CHUNK = 1 << 16
MAX_LINKS = 32
"""Connections one child may hold to the gateway at once (each costs the agent two
descriptors): past that, a refusal the client retries after a moment."""


def child_address(name: str) -> str:
    """How a step inside the child names one of these sockets (`unix:` + its path there)."""
    return f"unix:{CHILD_DIR}/{name}"


def bind_unix(directory: Path, name: str) -> socket.socket:
    """A listening socket at `directory/name` (made if missing), however long its path is.

    A socket address holds at most 107 bytes of path, so it is bound through a descriptor of
    the directory (`/proc/self/fd/N/name`), which the kernel resolves to the directory itself.
    """
    directory.mkdir(parents=True, exist_ok=True)  # (a child not forked yet has none)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(f"/proc/self/fd/{fd}/{name}")
            sock.listen(64)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        return sock
    finally:
        os.close(fd)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(CHUNK):
        writer.write(data)
        await writer.drain()


class GatewaySplice:
    """`gateway.sock` in a warm child's directory, joined to the gateway's TCP endpoint."""

    def __init__(
        self, directory: Path, gateway: tuple[str, int], uplink_path: str | None,
        tls: ssl.SSLContext | None = None,
    ) -> None:  # fmt: skip
        self.directory = directory
        self.gateway = gateway
        self.uplink_path = uplink_path
        self.tls = tls
        """The gateway serves TLS: the agent speaks it upstream (the child speaks plain HTTP to
        its own socket)."""
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        sock = await asyncio.to_thread(bind_unix, self.directory, GATEWAY_SOCKET)
        self._server = await asyncio.start_unix_server(self._accept, sock=sock)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._links) >= MAX_LINKS:
            task = asyncio.create_task(self._refuse(writer))
        else:
            task = asyncio.create_task(self._link(reader, writer))
        self._links.add(task)
        task.add_done_callback(self._links.discard)

    def _connect(self) -> socket.socket:
        def connect() -> socket.socket:
            sock = socket.create_connection(self.gateway, timeout=10)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
            return sock

        return in_netns(self.uplink_path, connect)

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: asyncio.StreamWriter | None = None
        try:
            try:
                sock = await asyncio.to_thread(self._connect)
                up_reader, upstream = await asyncio.open_connection(
                    sock=sock, ssl=self.tls,
                    server_hostname=self.gateway[0] if self.tls is not None else None,
                )  # fmt: skip
            except OSError as exc:
                where = f"{self.gateway[0]}:{self.gateway[1]}"
                log.warning("gateway_unreachable", gateway=where, error=str(exc))
                # An answer the in-machine client retries, as for a gateway that is failing over.
                writer.write(retry_later(f"gateway {where} unreachable: {exc}"))
                await writer.drain()
                return
            pumps = [asyncio.create_task(_pump(reader, upstream)),
                     asyncio.create_task(_pump(up_reader, writer))]  # fmt: skip
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        except (ConnectionError, OSError):
            pass
        finally:
            for end in (writer, upstream):
                if end is not None:
                    end.close()
                    with contextlib.suppress(ConnectionError, OSError):
                        await end.wait_closed()

    async def _refuse(self, writer: asyncio.StreamWriter) -> None:
        writer.write(
            retry_later(f"this machine holds {MAX_LINKS} connections to the gateway, its limit")
        )
        with contextlib.suppress(ConnectionError, OSError):
            await writer.drain()
        writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._links):
            task.cancel()
        await asyncio.gather(*self._links, return_exceptions=True)
