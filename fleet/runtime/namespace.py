"""The namespace runtime: a Smolfile's machine in Linux namespaces, for hosts without VT-x.

Each machine is a directory holding a writable overlay layer over the image's read-only rootfs.
Each command runs in fresh user/pid/mount/net/uts/ipc namespaces (bubblewrap) on that overlay,
so files persist from step to step while no process outlives its command: when the command
ends or times out, its pid namespace and everything in it is killed.

Networking is off unless the Smolfile asks for it: the only interface is loopback. A machine
with `net = true` or an allowlist gets its own network namespace, firewall and DNS forwarder
(see `netns.py` and `dnsfwd.py`), entered with `nsenter` before the sandbox starts.
Isolation is weaker than a microVM's (one shared kernel) and the host reports it as such.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping
from pathlib import Path

import structlog

from fleet.config import Paths
from fleet.core.egress import EgressRules, effective_egress
from fleet.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from fleet.core.hostnames import GATEWAY_NAME
from fleet.core.placement import Isolation, RuntimeKind
from fleet.runtime import capabilities, cgroups, disk, helpers, seccomp, users
from fleet.runtime.base import (
    Leftover,
    Machine,
    MachineSpec,
    Parent,
    to_thread_to_the_end,
)
from fleet.runtime.dnsfwd import DnsForwarder
from fleet.runtime.namespace_machine import NamespaceMachine, missing_tools
from fleet.runtime.netns import (
    DNS_ADDRESS,
    MachineNet,
    NetConfig,
    destroy_netns,
    host_addresses,
    release_leases,
)
from fleet.runtime.users import StepUser
from fleet.runtime.view import etc_files, lay_out

log = structlog.get_logger(__name__)

SOCKET_LINKS = Path("/run/fleet-zygotes")
"""Short links to warm parents' control directories (a Unix socket path has 108 bytes)."""


def _netns_alive(entry: Path) -> bool:
    try:
        netns = json.loads((entry / "net.json").read_text())["netns"]
    except (OSError, ValueError, KeyError):
        return False
    return Path(f"/run/netns/{netns}").exists()


def _drop_dangling_links() -> None:
    """Warm parents reach their fork server through short links; drop those of gone machines."""
    for link in SOCKET_LINKS.iterdir() if SOCKET_LINKS.exists() else []:
        if link.is_symlink() and not link.exists():
            link.unlink(missing_ok=True)


class NamespaceRuntime:
    """Machines as namespace sandboxes under `machines_dir`."""

    kind = RuntimeKind.NAMESPACE
    isolation = Isolation.NAMESPACE
    mounts_read_only = True
    forks_children = False
    """Warm parents are `fleet.runtime.warm.WarmNamespaceRuntime`'s."""

    async def create_parent(
        self, spec: MachineSpec, warmup: str, pool_size: int,
        prepare: Callable[[Machine], Awaitable[None]],
    ) -> Parent:  # fmt: skip
        raise FailedPrecondition("this namespace runtime makes no warm parents")

    def __init__(
        self,
        machines_dir: Path,
        net: NetConfig | None = None,
        default_disk_gib: int | None = disk.DEFAULT_DISK_GIB,
        tools: Path | None = None,
    ) -> None:
        self.machines_dir = machines_dir
        self.net = net or NetConfig()
        self.default_disk_gib = default_disk_gib
        """The writable layer's bound where a Smolfile sets none (None: the host's disk)."""
        missing = missing_tools()
        if missing:
            raise Unavailable(
                f"the namespace runtime needs {', '.join(missing)} on PATH "
                "(scripts/setup installs bubblewrap)"
            )
        version = cgroups.detect()
        if version is None:
            raise Unavailable(
                "the namespace runtime enforces Smolfile limits with cgroups, and no usable "
                "cgroup hierarchy (v1 memory/pids/cpu, or v2) is mounted at /sys/fs/cgroup"
            )
        self.cgroup_version = version
        self._seccomp = seccomp.program()
        self.tools = tools or Paths.from_env().tools
        """The C helpers' programs, one per host (`fleet.runtime.helpers`): those `fleet host
        prepare` did not build are built here, when an agent starts, never during a rollout."""
        helpers.ensure(self.tools)

    async def _user(self, spec: MachineSpec) -> tuple[StepUser, Path | None]:
        """Whom the machine's commands run as, and the helper that switches to them."""
        user = await asyncio.to_thread(users.resolve, spec.smolfile.user, spec.rootfs)
        if user.is_root:
            return user, None
        return user, await asyncio.to_thread(users.helper, self.tools)

    async def _bounder(self) -> Path:
        """The helper that cuts every command's bounding set (built when the runtime was made)."""
        return await asyncio.to_thread(capabilities.bounder, self.tools)

    async def create(self, spec: MachineSpec, copy_of: Path | None = None) -> NamespaceMachine:
        """A new machine; its writable layer starts as a copy of `copy_of` (a fork) or empty."""
        user, helper = await self._user(spec)  # refused before anything is made
        bounder = await self._bounder()
        # Grouped by host, so a reaper finds even a machine whose creation a kill interrupted.
        host = spec.labels.get("host", "local")
        root = self.machines_dir / host / f"{spec.name}-{uuid.uuid4().hex[:8]}"
        root.mkdir(parents=True, exist_ok=True)
        # The host's root only: a machine's root is the host's root user, so a file it marks
        # setuid in its layer is a setuid-root file on the host, for any user who reaches it.
        root.chmod(0o700)
        (root / "labels.json").write_text(json.dumps(spec.labels, sort_keys=True))
        gib = disk.bound_gib(spec.smolfile) or self.default_disk_gib
        networked = spec.smolfile.egress_requested or spec.gateway is not None
        cgroup = cgroups.MachineCgroup(root.name, self.cgroup_version)
        limits = cgroups.Limits(
            memory_mib=spec.smolfile.memory_mib_effective, cpus=spec.smolfile.cpus_effective
        )
        userns: int | None = None
        # Each step runs to its end even when the creation is cancelled (the claim's work
        # stopped, the agent refused), so that the cleanup below never races a disk still
        # being mounted or a cgroup still being made.
        try:
            layer = root if gib is None else await to_thread_to_the_end(disk.make, root, gib)
            await to_thread_to_the_end(
                lay_out,
                root,
                layer,
                spec,
                etc_files(spec.name[:63], DNS_ADDRESS if networked else None),
                copy_of,
            )
            (root / "seccomp.bpf").write_bytes(self._seccomp)
            await to_thread_to_the_end(cgroup.create, limits)
            userns = await users.user_namespace()
        except BaseException:
            if userns is not None:
                os.close(userns)
            await to_thread_to_the_end(cgroup.remove)
            await to_thread_to_the_end(disk.remove, root)
            shutil.rmtree(root, ignore_errors=True)
            raise
        machine = NamespaceMachine(
            spec, root, cgroup, layer=layer, userns=userns, user=user, helper=helper,
            disk_gib=gib, bounder=bounder,
        )  # fmt: skip
        machine.runtime = self
        if networked:
            try:
                await self._network(machine)
            except BaseException:
                await machine.delete()
                raise
        log.info(
            "machine_created", machine=spec.name, runtime="namespace",
            memory_mib=limits.memory_mib, cpus=limits.cpus, pids_max=limits.pids_max,
            disk_gib=gib, uid=user.uid,
            **spec.labels,
        )  # fmt: skip
        return machine

    async def _network(self, machine: NamespaceMachine, existing: str | None = None) -> None:
        """The machine's namespace, link, firewall and resolver (its Smolfile asked for egress):
        made anew, or, for a machine adopted after an agent crash, the `existing` namespace with
        its link and firewall as the dead agent left them, and a new resolver."""
        spec = machine.spec
        rules = EgressRules.of(
            effective_egress(spec.smolfile, "namespace"),
            await asyncio.to_thread(host_addresses, self.net.uplink_netns),
        )
        if existing is None:
            name = f"fleet-{uuid.uuid4().hex[:12]}"
            # Written before the namespace exists, so a reaper after kill -9 knows what to remove.
            (machine.root / "net.json").write_text(json.dumps({"netns": name}))
            net = MachineNet(self.net, self.machines_dir, spec.name, name)
        else:
            name = existing
            net = await to_thread_to_the_end(
                MachineNet.attach, self.net, self.machines_dir, spec.name, name, rules
            )
        machine.net = net
        gateway = spec.gateway
        if gateway is not None and gateway[0] == "host":
            # This host as the machine sees it: its end of the machine's link.
            gateway = (net.reserve_link_host(), gateway[1])
        if existing is None:
            await net.create(rules, gateway)
        machine.gateway = gateway
        dns = DnsForwarder(
            spec.name, rules, name, self.net.uplink_path, self.net.dns_upstream, net.admit,
            machine.record, local={GATEWAY_NAME: gateway[0]} if gateway is not None else None,
        )  # fmt: skip
        machine.dns = dns
        await dns.start()

    async def leftovers(self, host_id: str) -> list[Leftover]:
        """Machines a previous run of this host left behind (after kill -9).

        Their layers, cgroups and network namespaces survive the agent; their processes do
        not (every sandbox dies with it). A rollout machine can be adopted: its files are all
        there is to it, and a network it had is found again (namespace, link and firewall as
        they were; the DNS forwarder, which ran inside the agent, is started anew). A warm
        parent cannot (its fork server is gone), nor a machine whose namespace is gone.
        """
        found: list[Leftover] = []
        mine = self.machines_dir / host_id
        for entry in sorted(mine.iterdir()) if mine.exists() else []:
            try:
                labels = json.loads((entry / "labels.json").read_text())
            except (OSError, ValueError):
                labels = {}
            why = ""
            if not isinstance(labels, dict) or not labels:
                labels, why = {}, "it has no labels (its creation was interrupted)"
            elif "parent" in labels:
                why = "a warm parent's fork server does not survive its agent"
            elif (entry / "net.json").exists() and not _netns_alive(entry):
                why = "its network namespace is gone"
            elif "work" not in labels or "fence" not in labels:
                why = "it is labelled with no lease"
            found.append(Leftover(name=entry.name, labels=labels, adoptable=not why, why_not=why))
        return found

    async def adopt(self, leftover: Leftover, spec: MachineSpec) -> NamespaceMachine:
        if not leftover.adoptable:
            raise InvalidArgument(f"machine {leftover.name} cannot be adopted: {leftover.why_not}")
        root = self.machines_dir / spec.labels.get("host", "local") / leftover.name
        layer = await to_thread_to_the_end(disk.attach, root) or root
        if not (layer / "upper").is_dir():
            raise NotFound(f"machine {leftover.name} has no layer at {layer}")
        if not (root / "lower").is_symlink():
            raise NotFound(f"machine {leftover.name} has no link to its image")
        user, helper = await self._user(spec)
        bounder = await self._bounder()
        cgroup = cgroups.MachineCgroup(root.name, self.cgroup_version)
        machine = NamespaceMachine(
            spec, root, cgroup, layer=layer, user=user, helper=helper,
            disk_gib=None if layer == root else disk.size_gib(root), bounder=bounder,
        )  # fmt: skip
        machine.runtime = self
        netns = None
        if (root / "net.json").exists():
            netns = json.loads((root / "net.json").read_text())["netns"]
        limits = cgroups.Limits(
            memory_mib=spec.smolfile.memory_mib_effective, cpus=spec.smolfile.cpus_effective
        )
        try:
            # Each step to its end, so the cleanup below never runs beside one.
            await to_thread_to_the_end(cgroup.kill_all)  # nothing of the old agent's commands runs
            await to_thread_to_the_end(cgroup.create, limits)
            if not (root / "seccomp.bpf").exists():
                (root / "seccomp.bpf").write_bytes(self._seccomp)
            machine.userns = await users.user_namespace()
            if netns is not None:
                await self._network(machine, existing=netns)
        except BaseException:  # not adoptable after all: not kept either
            if netns is not None and machine.net is None:  # what delete() cannot know of
                await destroy_netns(netns)
                await asyncio.to_thread(release_leases, self.machines_dir, netns)
            await machine.delete()
            raise
        log.info("machine_adopted", machine=spec.name, runtime="namespace", **spec.labels)
        return machine

    async def reap(self, host_id: str, keep: Collection[str] = ()) -> int:
        """Removes machines a previous run of this host left behind, but those in `keep`."""
        reaped = 0
        mine = self.machines_dir / host_id
        for entry in sorted(mine.iterdir()) if mine.exists() else []:
            if entry.name in keep:
                continue
            with contextlib.suppress(OSError, ValueError, KeyError):
                netns = json.loads((entry / "net.json").read_text())["netns"]
                await destroy_netns(netns)
                await asyncio.to_thread(release_leases, self.machines_dir, netns)
            group = cgroups.MachineCgroup(entry.name, self.cgroup_version)
            for child in await asyncio.to_thread(group.children):  # a warm parent's children
                await asyncio.to_thread(child.remove)
            await asyncio.to_thread(group.remove)
            await asyncio.to_thread(disk.remove, entry)
            await asyncio.to_thread(shutil.rmtree, entry, True)
            reaped += 1
        await asyncio.to_thread(_drop_dangling_links)
        if reaped:
            log.info("machines_reaped", host_id=host_id, count=reaped)
        return reaped

    async def list_machines(self, labels: Mapping[str, str]) -> list[str]:
        found: list[str] = []
        if not self.machines_dir.exists():
            return found
        for entry in sorted(self.machines_dir.glob("*/*")):
            try:
                have = json.loads((entry / "labels.json").read_text())
            except (OSError, ValueError):
                continue
            if all(have.get(k) == v for k, v in labels.items()):
                found.append(entry.name)
        return found
