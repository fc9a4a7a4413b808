"""One fleet server replica in a process of its own, for tests that kill a replica outright
(SIGKILL by its pid): `python -m tests.replica_server LEDGER_URL IMAGES RECIPES LEASE_TTL_S`.

It listens on a free loopback port without TLS, prints `ready PORT` once it serves, and
serves until it is killed. Replicas given the same PostgreSQL URL share one ledger."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from fleet.image.store import ImageStore
from fleet.ledger.store import Ledger
from fleet.server.app import FleetServer, ServerConfig

SECRET = b"replica-token-secret-0123456789"


async def serve(url: str, images: Path, recipes: Path, lease_ttl_s: float) -> None:
    config = ServerConfig(
        lease_ttl_s=lease_ttl_s, heartbeat_interval_s=0.3, sweep_interval_s=0.1,
        token_secret=SECRET,
    )  # fmt: skip
    server = FleetServer(Ledger.open(url), ImageStore(images, recipes), "127.0.0.1:0", config)
    await server.start()
    sys.stdout.write(f"ready {server.port}\n")
    sys.stdout.flush()
    await asyncio.Event().wait()


if __name__ == "__main__":
    url, images, recipes, lease = sys.argv[1:5]
    asyncio.run(serve(url, Path(images), Path(recipes), float(lease)))
