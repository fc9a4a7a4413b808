"""An embedded fleet in one process: server, agents, SQLite ledger (`fleet up`, `fleet demo`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from fleet.agent.agent import Agent, AgentConfig, default_host_id
from fleet.agent.capabilities import RuntimeChoice, choose_runtime
from fleet.config import Paths
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from fleet.ledger.store import Ledger
from fleet.server.app import FleetServer, ServerConfig


@dataclass
class Fleet:
    server: FleetServer
    agents: list[Agent]
    runtime: RuntimeChoice

    @property
    def address(self) -> str:
        return self.server.address


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
) -> AsyncIterator[Fleet]:
    images = ImageStore(paths.images, paths.recipes)
    choice = await asyncio.to_thread(choose_runtime, runtime, paths.home, images)
    config = config or ServerConfig()
    if not config.token_secret:
        config = dataclasses.replace(config, token_secret=paths.token_secret())
    server = FleetServer(Ledger.sqlite(db), images, listen, config)
    await server.start()
    stop = asyncio.Event()
    agents: list[Agent] = []
    for host_class, count in ((HostClass.GPU, gpu_agents), (HostClass.CPU, cpu_agents)):
        for index in range(count):
            agents.append(
                Agent(
                    AgentConfig(
                        server=server.address,
                        host_id=default_host_id(host_class, index),
                        host_class=host_class,
                        runtime=choice,
                        machines_dir=paths.machines,
                        images=images,
                        # CUDA remoting shares one GPU: a gpu host is single-tenant.
                        slots=1 if host_class == HostClass.GPU else slots,
                        gateway=gateway,
                    )
                )
            )
    tasks = [asyncio.create_task(a.run(stop)) for a in agents]
    try:
        yield Fleet(server, agents, choice)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.stop()
