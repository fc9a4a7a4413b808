"""An agent's settings, and what an attempt uses of the agent that runs it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from fleet.agent.capabilities import RuntimeChoice
from fleet.agent.checkpoints import CheckpointSender
from fleet.agent.images import ImageCache
from fleet.agent.sessions import SessionHost
from fleet.agent.settings import DEFAULT_DRAIN_S, DEFAULT_SLOTS
from fleet.api.pb import host_pb2_grpc
from fleet.core.placement import HostCapabilities, HostClass
from fleet.core.rollout import Assignment
from fleet.identity.tls import HostFiles, HostIdentityMaterial
from fleet.image.store import ImageStore
from fleet.runtime.base import MachineSpec, Parent, Runtime
from fleet.runtime.disk import DEFAULT_DISK_GIB
from fleet.runtime.netns import NetConfig


@dataclass
class AgentConfig:
    """One agent's settings."""

    server: str
    """host:port of a fleet server; of several replicas sharing one ledger, comma-separated
    in the order the agent tries them (see `fleet.agent.link.Link`)."""
    host_id: str
    """Stable name of this host in the fleet."""
    host_class: HostClass
    runtime: RuntimeChoice
    """The runtime preflight chose, and why."""
    machines_dir: Path
    images: ImageStore
    slots: int = DEFAULT_SLOTS
    """Work items run at once."""
    claim_wait_s: float = 20.0
    """Long-poll wait per ClaimWork call. Work reaches a waiting claim when it is queued (the
    server wakes it), so the wait sets only how often an idle host asks again: every 20 s,
    1,000 idle hosts are 50 calls a second."""
    net: NetConfig | None = None
    """Where machine links end and which resolver the DNS forwarder asks (namespace runtime)."""
    gateway: tuple[str, int] | None = None
    """The inference gateway's HTTP endpoint as machines reach it ("host": this host)."""
    identity: HostIdentityMaterial | None = None
    """This host's certificate and the CA, for a server with TLS (None: a server without)."""
    identity_files: HostFiles | None = None
    """Where the identity lives, rewritten at renewal."""
    gateway_ca: bytes = b""
    """The fleet CA, when the gateway's HTTP endpoint serves TLS ("https://" given): machines
    and the warm children's splice verify it against this."""
    registry_ca: bytes = b""
    """A CA the image registry's certificate chains to, besides the system's and the fleet's."""
    image_cache_gib: float | None = None
    """Bound on the images fetched from the server kept here (None: no bound)."""
    default_disk_gib: int | None = DEFAULT_DISK_GIB
    """A namespace machine's writable layer where its Smolfile bounds none (None: unbounded)."""
    labels: dict[str, str] = field(default_factory=dict)
    """What pools select this host by (an enrolled host's come from its join token)."""
    drain_deadline_s: float = DEFAULT_DRAIN_S
    """On stopping (SIGTERM), how long running work may go on; the host takes no new work
    meanwhile, and what still runs after it is released for retry elsewhere."""


class AttemptHost(Protocol):
    """What an attempt uses of the agent that runs it: the host's settings and capabilities,
    its runtime, image cache and sessions, the link to the server, and its warm parents."""

    config: AgentConfig
    caps: HostCapabilities
    runtime: Runtime
    images: ImageCache
    sessions: SessionHost
    journal_dir: Path
    stub: host_pb2_grpc.HostServiceStub | None
    checkpoints: CheckpointSender | None

    async def warm_parent(self, a: Assignment, spec: MachineSpec, warmup: str) -> Parent:
        """The warm parent a `[branch]` rollout's child is forked from (made once)."""
        ...
