"""Capability routing: which class of host a rollout needs and which hosts can serve it."""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field

from fleet.core.adaptive import Adaptive
from fleet.core.gates import Gates
from fleet.core.smolfile import Smolfile


class HostClass(enum.StrEnum):
    GPU = "gpu"
    CPU = "cpu"


class Isolation(enum.StrEnum):
    ANY = "any"
    NAMESPACE = "namespace"
    VM = "vm"


class RuntimeKind(enum.StrEnum):
    SMOL = "smol"
    NAMESPACE = "namespace"


class Requirements(BaseModel):
    """What a rollout needs from its host beyond the Smolfile."""

    model_config = ConfigDict(frozen=True)

    isolation: Isolation = Isolation.ANY
    cuda_device: bool = False
    inference: bool = False
    """Steps call the inference gateway (the machine may reach it, with a rollout token)."""
    near_gateway: bool = False
    """Run the CPU steps on the GPU host, next to the gateway (a loop that calls the model at
    every step trades cloud capacity for per-action latency)."""


class HostCapabilities(BaseModel):
    """What a registered host offers."""

    model_config = ConfigDict(frozen=True)

    host_id: str
    host_class: HostClass
    runtime: RuntimeKind
    isolation: Isolation
    cpus: int
    memory_mib: int
    cuda_devices: int
    slots: int = 1
    device: str = "cpu"
    runtime_reason: str = ""
    gateway: bool = False
    """The agent knows the inference gateway's address (it may run rollouts that use it)."""
    agent_version: str = ""
    """The fleet version its agent runs (as it registered)."""
    labels: dict[str, str] = Field(default_factory=dict)
    """What pools select it by: its join token's (an enrolled host), or its agent's
    `--label`s (a server without TLS)."""


class Pool(BaseModel):
    """A set of hosts chosen by class and labels, and the cap on what they run at once."""

    model_config = ConfigDict(frozen=True)

    name: str
    host_class: HostClass
    labels: dict[str, str] = Field(default_factory=dict)
    max_running: int = 0
    """Leases its hosts may hold at once, across every server replica (0: no cap). An adaptive
    pool's is its controller's current cap."""
    gates: Gates = Field(default_factory=Gates)
    """Limits that pause new dispatches to it while passed."""
    adaptive: Adaptive | None = None
    """How the server seeks its cap (None: `max_running` is fixed)."""

    def holds(self, host: HostCapabilities) -> bool:
        """Whether `host` is in this pool: its class, and every one of the pool's labels."""
        return host.host_class == self.host_class and all(
            host.labels.get(k) == v for k, v in self.labels.items()
        )


def host_class_for(spec: Smolfile, needs: Requirements | None = None) -> HostClass:
    """CUDA work, and work that asks to run next to the gateway, goes to gpu hosts."""
    if spec.needs_cuda or (needs is not None and needs.near_gateway):
        return HostClass.GPU
    return HostClass.CPU


def refusal(host: HostCapabilities, host_class: HostClass, needs: Requirements) -> str | None:
    """Why `host` can never serve such work, or None when it can."""
    if host.host_class != host_class:
        return f"host {host.host_id} is {host.host_class}-class, the rollout needs {host_class}"
    if needs.isolation == Isolation.VM and host.isolation != Isolation.VM:
        return f"host {host.host_id} offers {host.isolation} isolation, the rollout requires vm"
    if needs.isolation == Isolation.NAMESPACE and host.isolation != Isolation.NAMESPACE:
        return (
            f"host {host.host_id} offers {host.isolation} isolation, the rollout requires namespace"
        )
    if needs.cuda_device and host.cuda_devices == 0:
        return f"host {host.host_id} has no CUDA device, the rollout requires one"
    if needs.inference and not host.gateway:
        return f"host {host.host_id} has no inference gateway configured (fleet agent --gateway)"
    return None


def unservable_reason(
    hosts: list[HostCapabilities], host_class: HostClass, needs: Requirements
) -> str | None:
    """None when some registered host could serve the work; else a reason naming the gap."""
    if any(refusal(h, host_class, needs) is None for h in hosts):
        return None
    why = f"it needs a {host_class}-class host"
    if host_class == HostClass.GPU:
        why += " (the Smolfile sets cuda = true)"
    if needs.isolation == Isolation.VM:
        why += " with vm isolation"
    if needs.isolation == Isolation.NAMESPACE:
        why += " with namespace isolation"
    if needs.cuda_device:
        why += " with a CUDA device"
    if needs.inference:
        why += " whose agent knows the inference gateway (fleet agent --gateway)"
    if not hosts:
        have = "no hosts are registered"
    else:
        counts: dict[str, int] = {}
        for h in hosts:
            label = f"{h.host_class}-class {h.isolation}-isolation"
            if h.host_class == HostClass.GPU:
                label += f" ({h.cuda_devices} CUDA devices)"
            if h.gateway:
                label += " with the gateway"
            counts[label] = counts.get(label, 0) + 1
        have = "the fleet has " + ", ".join(f"{n} {label}" for label, n in sorted(counts.items()))
    return f"no registered host can ever serve this rollout: {why}, and {have}"


LOCAL_LABEL = "fleet.local"
"""The label of the embedded fleet's agents (`fleet up`): in the local pool by default."""


def is_local(host: HostCapabilities, local_pool: Pool | None = None) -> bool:
    """Whether `host` is in the local pool a rollback keeps: the named pool's hosts, or, by
    default, `fleet up`'s agents and every gpu-class host."""
    if local_pool is not None:
        return local_pool.holds(host)
    return host.labels.get(LOCAL_LABEL) == "1" or host.host_class == HostClass.GPU
