"""What this host offers: runtime (by preflight), isolation, cpus, memory, CUDA devices."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import structlog

from fleet.core.errors import FailedPrecondition, InvalidArgument
from fleet.core.placement import HostCapabilities, HostClass, Isolation, RuntimeKind
from fleet.image.store import ImageStore
from fleet.runtime import smol as smol_runtime
from fleet.runtime.disk import DEFAULT_DISK_GIB
from fleet.runtime.namespace_machine import missing_tools
from fleet.runtime.netns import NetConfig
from fleet.runtime.warm import WarmNamespaceRuntime

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class RuntimeChoice:
    kind: RuntimeKind
    reason: str


def cuda_device_count() -> int:
    """NVIDIA GPUs the driver exposes (no torch here: the agent stays light)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    try:
        return len(list(gpus.iterdir()))
    except OSError:
        return 0


def memory_mib() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


CANARY_IMAGE = "minimal"


def canary_image(images: ImageStore) -> Path | None:
    """The default image's unpacked tree, for the preflight's canary boot."""
    record = images.record(CANARY_IMAGE)
    return images.rootfs(record.digest) if record else None


def choose_runtime(requested: str, cache_dir: Path, images: ImageStore) -> RuntimeChoice:
    """`auto`: smol when microVMs really boot here, namespace otherwise, with the reason."""
    if requested not in ("auto", "smol", "namespace"):
        raise InvalidArgument(f"--runtime must be auto, smol or namespace, not {requested!r}")
    if requested == "namespace":
        return RuntimeChoice(RuntimeKind.NAMESPACE, "namespace runtime requested")
    ok, why = smol_runtime.preflight(cache_dir, lambda: canary_image(images))
    if requested == "smol":
        if not ok:
            raise FailedPrecondition(f"--runtime smol, but microVMs cannot boot here: {why}")
        return RuntimeChoice(RuntimeKind.SMOL, why or "smol runtime requested")
    if ok:
        return RuntimeChoice(RuntimeKind.SMOL, why)
    missing = missing_tools()
    if missing:
        raise FailedPrecondition(
            f"microVMs cannot boot here ({why}) and the namespace runtime needs "
            f"{', '.join(missing)}"
        )
    return RuntimeChoice(RuntimeKind.NAMESPACE, f"microVMs cannot boot here: {why}")


def make_runtime(
    choice: RuntimeChoice,
    machines_dir: Path,
    net: NetConfig | None = None,
    default_disk_gib: int | None = DEFAULT_DISK_GIB,
) -> WarmNamespaceRuntime | smol_runtime.SmolRuntime:
    if choice.kind == RuntimeKind.SMOL:
        return smol_runtime.SmolRuntime()
    return WarmNamespaceRuntime(machines_dir, net, default_disk_gib)


def capabilities(
    host_id: str, host_class: HostClass, choice: RuntimeChoice, slots: int
) -> HostCapabilities:
    cuda = cuda_device_count() if host_class == HostClass.GPU else 0
    return HostCapabilities(
        host_id=host_id,
        host_class=host_class,
        runtime=choice.kind,
        isolation=Isolation.VM if choice.kind == RuntimeKind.SMOL else Isolation.NAMESPACE,
        cpus=os.cpu_count() or 1,
        memory_mib=memory_mib(),
        cuda_devices=cuda,
        slots=slots,
        device="cuda:0" if cuda else "cpu",
        runtime_reason=choice.reason,
    )
