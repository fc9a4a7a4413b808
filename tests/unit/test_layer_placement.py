"""Where a machine may start from a parked session's layer: only on a host of the namespace
runtime, which made the layer (the smol runtime can neither archive a microVM's disk nor
unpack a layer), with the session's other requirements kept."""

from __future__ import annotations

from fleet.core.placement import (
    HostCapabilities,
    HostClass,
    Isolation,
    Requirements,
    RuntimeKind,
    refusal,
    unservable_reason,
)
from fleet.server.session_moves import layer_refusal, layer_requirements


def _host(host_id: str, runtime: RuntimeKind, host_class: HostClass = HostClass.CPU,
          **kw: object) -> HostCapabilities:  # fmt: skip
    isolation = Isolation.VM if runtime == RuntimeKind.SMOL else Isolation.NAMESPACE
    return HostCapabilities(
        host_id=host_id, host_class=host_class, runtime=runtime, isolation=isolation, cpus=2,
        memory_mib=1024, cuda_devices=0, **kw,
    )  # fmt: skip


def test_a_layer_requires_namespace_isolation_and_keeps_the_rest() -> None:
    asked = Requirements(inference=True, near_gateway=True, cuda_device=True)
    needs = layer_requirements(asked)
    assert needs.isolation == Isolation.NAMESPACE
    assert (needs.inference, needs.near_gateway, needs.cuda_device) == (True, True, True)
    assert layer_requirements(Requirements()).isolation == Isolation.NAMESPACE


def test_a_class_of_microvm_hosts_alone_cannot_start_from_a_layer() -> None:
    needs = layer_requirements(Requirements())
    vm = _host("vm-1", RuntimeKind.SMOL)
    why = layer_refusal([vm], HostClass.CPU, needs)
    assert why is not None
    assert "namespace runtime" in why and "cpu-class" in why and "microVMs" in why

    # A class that mixes both runtimes can: its namespace hosts.
    assert layer_refusal([vm, _host("ns-1", RuntimeKind.NAMESPACE)], HostClass.CPU, needs) is None
    # A namespace host of another class cannot.
    gpu = _host("ns-gpu", RuntimeKind.NAMESPACE, HostClass.GPU)
    assert layer_refusal([vm, gpu], HostClass.CPU, needs) is not None


def test_what_no_host_of_either_runtime_offers_is_named_as_for_any_rollout() -> None:
    needs = layer_requirements(Requirements(inference=True))
    why = layer_refusal([_host("ns-1", RuntimeKind.NAMESPACE)], HostClass.CPU, needs)
    assert why is not None and "gateway" in why
    assert layer_refusal([_host("ns-2", RuntimeKind.NAMESPACE, gateway=True)],
                         HostClass.CPU, needs) is None  # fmt: skip
    assert "no hosts are registered" in (layer_refusal([], HostClass.CPU, needs) or "")


def test_placement_refuses_a_microvm_host_work_that_needs_namespace_isolation() -> None:
    needs = Requirements(isolation=Isolation.NAMESPACE)
    vm, ns = _host("vm-1", RuntimeKind.SMOL), _host("ns-1", RuntimeKind.NAMESPACE)
    assert "requires namespace" in (refusal(vm, HostClass.CPU, needs) or "")
    assert refusal(ns, HostClass.CPU, needs) is None
    assert "with namespace isolation" in (unservable_reason([vm], HostClass.CPU, needs) or "")
