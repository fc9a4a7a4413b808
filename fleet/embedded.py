"""An embedded fleet in one process: server, agents, SQLite ledger (`fleet up`, `fleet demo`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from fleet.agent.agent import Agent, default_host_id
from fleet.agent.capabilities import RuntimeChoice, capabilities, choose_runtime
from fleet.agent.config import AgentConfig
from fleet.config import Paths
from fleet.connect import ClientAuth
from fleet.core.credentials import format_join_token
from fleet.core.errors import Unavailable
from fleet.core.hostnames import GATEWAY_NAME
from fleet.core.placement import HostClass
from fleet.identity.ca import CertificateAuthority
from fleet.identity.local import ensure_admin_key, local_host_identity
from fleet.identity.tls import ServerTls, server_names, server_ssl_context
from fleet.image.store import ImageStore
from fleet.ledger.store import Ledger
from fleet.server.app import FleetServer, ServerConfig
from fleet.server.auth import Security


@dataclass
class Fleet:
    server: FleetServer
    agents: list[Agent]
    runtime: RuntimeChoice
    auth: ClientAuth
    """How a client of this fleet connects: its CA and the local admin key."""

    @property
    def address(self) -> str:
        return self.server.address

    def channel(self) -> grpc.aio.Channel:
        """A channel to the server's API, with TLS and the local admin key."""
        return self.auth.channel(self.address)

    def join_token(self, host_class: HostClass) -> str:
        """A one-use join token, for an agent started as a process of its own."""
        _, presented = self.server.core.ledger.identities.create_join_token(
            host_class, {}, 3600, 1, time.time(), runtimes=frozenset({self.runtime.kind})
        )
        return format_join_token(presented)


REGISTER_WAIT_S = 60.0
"""How long the embedded fleet waits for its agents to register before it gives up."""


async def until_registered(
    server: FleetServer, agents: list[Agent], tasks: list[asyncio.Task[None]]
) -> None:
    """Until every agent has registered its host: a submission before then finds no host that
    could serve it and is refused. An agent that stops first raises what stopped it."""
    want = {agent.config.host_id for agent in agents}
    deadline = time.monotonic() + REGISTER_WAIT_S
    while True:
        for agent, task in zip(agents, tasks, strict=True):
            if task.done():
                task.result()  # (its error, if it failed)
                raise Unavailable(f"agent {agent.config.host_id} stopped before it registered")
        known = {host.host_id for host in await server.core.read(server.core.ledger.hosts)}
        if want <= known:
            return
        if time.monotonic() > deadline:
            raise Unavailable(
                f"agents {', '.join(sorted(want - known))} did not register within "
                f"{REGISTER_WAIT_S:.0f} s"
            )
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def embedded_fleet(
    paths: Paths,
    db: Path,
    *,
    listen: str = "127.0.0.1:0",
    gpu_agents: int = 1,
    cpu_agents: int = 2,
    runtime: str = "auto",
    slots: int = 2,
    config: ServerConfig | None = None,
    gateway: tuple[str, int] | None = None,
    gateway_tls: bool = False,
) -> AsyncIterator[Fleet]:
    """`gateway_tls`: the gateway's HTTP endpoint serves TLS from this fleet's CA."""
    images = ImageStore(paths.images, paths.recipes)
    choice = await asyncio.to_thread(choose_runtime, runtime, paths.home, images)
    config = config or ServerConfig()
    if not config.token_secret:
        config = config.model_copy(update={"token_secret": paths.token_secret()})
    # TLS and keys even on loopback: the CA, the admin key and the agents' certificates are
    # made here, so the embedded default needs no set-up and runs the path cloud hosts run.
    ca = await asyncio.to_thread(CertificateAuthority.load_or_init, paths.ca)
    ledger = Ledger.sqlite(db)
    server = FleetServer(ledger, images, listen, config, Security(ca))
    await server.start()
    await asyncio.to_thread(ensure_admin_key, paths, ledger)
    stop = asyncio.Event()
    agents: list[Agent] = []
    for host_class, count in ((HostClass.GPU, gpu_agents), (HostClass.CPU, cpu_agents)):
        for index in range(count):
            host_id = default_host_id(host_class, index)
            # CUDA remoting shares one GPU: a gpu host is single-tenant.
            host_slots = 1 if host_class == HostClass.GPU else slots
            caps = capabilities(host_id, host_class, choice, host_slots).model_copy(
                update={"gateway": gateway is not None}
            )
            identity = await asyncio.to_thread(
                local_host_identity, ca, ledger, caps, server.address, server.core.host_port
            )
            agents.append(
                Agent(
                    AgentConfig(
                        server=server.address,
                        host_id=host_id,
                        host_class=host_class,
                        runtime=choice,
                        machines_dir=paths.machines,
                        images=images,
                        slots=host_slots,
                        gateway=gateway,
                        gateway_ca=ca.pem if gateway_tls else b"",
                        identity=identity,
                    )
                )
            )
    tasks = [asyncio.create_task(a.run(stop)) for a in agents]
    try:
        await until_registered(server, agents, tasks)
        yield Fleet(
            server, agents, choice, ClientAuth.find(paths.home, ca=str(paths.ca / "ca.crt"))
        )
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.stop()


@dataclass
class GatewayHandle:
    """A gateway started beside an embedded fleet (`fleet up --gateway`, `fleet demo`)."""

    gateway: Any
    grpc_server: Any
    grpc_port: int
    http_server: asyncio.Server
    http_port: int

    async def stop(self) -> None:
        self.http_server.close()
        await self.gateway.stop()
        await self.grpc_server.stop(1)

    def server_config(self, **more: Any) -> ServerConfig:
        """The embedded server's settings, watching this gateway (backpressure, the list of
        running rollouts its tokens are checked against, the tokens it counted)."""
        return ServerConfig(gateway_address=f"127.0.0.1:{self.grpc_port}", **more)


async def start_gateway(
    paths: Paths, log_level: str = "info", upstreams: Any = None
) -> GatewayHandle:
    """The gateway with the shipped policy and language model: gRPC on loopback, HTTP where
    machines reach it; `upstreams` (a checked `gateway.llm.upstream_config.UpstreamConfig`)
    adds upstream models."""
    from gateway import require_torch

    require_torch()
    from gateway.http import serve_http
    from gateway.llm.upstream import Upstreams
    from gateway.service import Gateway, GatewayConfig, serve

    # Off the event loop: starting the model engine takes seconds, and the fleet's agents
    # heartbeat on this loop meanwhile.
    config = GatewayConfig(secret=paths.token_secret(), device="auto", log_level=log_level)
    gw = await asyncio.to_thread(Gateway.build, config)
    if upstreams is not None and upstreams.upstreams:
        gw.upstreams = Upstreams(upstreams)
    server, port = await serve(gw, "127.0.0.1:0")
    # Machines reach this host at their link's host address; only their firewall rule (for
    # rollouts that use inference) and a rollout token get a request through. Beyond loopback,
    # so over TLS from the fleet's CA, as `fleet gateway` serves it.
    ca = await asyncio.to_thread(CertificateAuthority.load_or_init, paths.ca)
    tls = await asyncio.to_thread(ServerTls.issue, ca, server_names("0.0.0.0:0", [GATEWAY_NAME]))
    http, http_port = await serve_http(gw, "0.0.0.0", 0, tls=server_ssl_context(tls))
    return GatewayHandle(gw, server, port, http, http_port)
