"""The smol runtime: microVMs through the smolmachines SDK. With its preflight
(`fleet.runtime.smol_preflight`), the only module importing `smol`.

The Smolfile maps onto `smol.MachineConfig` here, key by key: mapped, emulated honestly (`init`
becomes recorded first-boot execs run by the agent; `[health]` a readiness probe), or refused
with an error naming the key. Nothing is dropped in silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import structlog

from fleet.core.egress import EgressEvent
from fleet.core.errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    FleetError,
    Internal,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from fleet.core.placement import Isolation, RuntimeKind
from fleet.core.rollout import MAX_OUTPUT_BYTES
from fleet.core.smolfile import Smolfile
from fleet.runtime.base import (
    Channel,
    ExecResult,
    Leftover,
    Machine,
    MachineSpec,
    Usage,
    machine_env,
)
from fleet.runtime.branching import BranchCoalescer
from fleet.runtime.output import OutputSink
from fleet.runtime.smol_preflight import (
    KVM_DEVICE,
    VM_UID_BASE,
    VmmIdentity,
    boot_id,
    canary_boot,
    kvm_access_verdict,
    kvm_group,
    sdk_availability,
    static_kvm_verdict,
    vmm_identity,
)

# The host's checks have a module of their own (`fleet.runtime.smol_preflight`); the agent, the
# command line and the tests reach them, and `preflight`, through this one.
__all__ = [
    "ADOPT_READY_S",
    "KVM_DEVICE",
    "SMOL_ERROR_MAP",
    "VM_UID_BASE",
    "WARMUP_TIMEOUT_S",
    "SmolMachine",
    "SmolParent",
    "SmolRuntime",
    "VmmIdentity",
    "boot_id",
    "canary_boot",
    "kvm_access_verdict",
    "kvm_group",
    "leftover_of",
    "machine_config",
    "preflight",
    "sdk_availability",
    "static_kvm_verdict",
    "translate_error",
    "vmm_identity",
]

log = structlog.get_logger(__name__)
WARMUP_TIMEOUT_S = 300.0
"""How long a warm parent's warm-up may run."""

# Every SmolError code the SDK documents, translated once.
SMOL_ERROR_MAP: dict[str, type[FleetError]] = {
    "NOT_FOUND": NotFound,
    "CONFLICT": AlreadyExists,
    "INTERRUPTED": Aborted,
    "CONFIG_ERROR": InvalidArgument,
    "INVALID_CONFIG": InvalidArgument,
    "INVALID_STATE": FailedPrecondition,
    "STORAGE_ERROR": Unavailable,
    "MOUNT_ERROR": Unavailable,
    "KVM_UNAVAILABLE": Unavailable,
    "HYPERVISOR_UNAVAILABLE": Unavailable,
    "UNSUPPORTED_PLATFORM": Unavailable,
    "RUNTIME_NOT_INSTALLED": Unavailable,
    "COMMAND_FAILED": Internal,
    "SMOLVM_ERROR": Internal,
    "TIMEOUT": DeadlineExceeded,
    "NOT_SUPPORTED": FailedPrecondition,
    "CANCELLED": Cancelled,
}


def translate_error(exc: BaseException) -> FleetError:
    """A SmolError (or any SDK exception) as the fleet error of the same meaning."""
    from smol import wrap_native_error

    err = wrap_native_error(exc)
    kind = SMOL_ERROR_MAP.get(err.code, Internal)
    return kind(f"smol {err.code}: {err.message}")


def machine_config(spec: MachineSpec) -> Any:
    """The `smol.MachineConfig` for a machine spec; refuses what the SDK cannot express."""
    from smol import CredentialSpec, MachineConfig, ResourceSpec

    sf: Smolfile = spec.smolfile
    network = sf.network
    allow_hosts = list(network.allow_hosts) if network else []
    allow_cidrs = list(network.allow_cidrs) if network else []
    if spec.gateway is not None:
        if spec.gateway[0] == "host":
            raise InvalidArgument(
                "gateway 'host' names the namespace runtime's link; on smol give the gateway's "
                "address as the machine reaches it (fleet agent --gateway ADDRESS:PORT)"
            )
        allow_cidrs.append(f"{spec.gateway[0]}/32")  # the engine allows addresses, not ports
    egress = bool(sf.net) or bool(allow_hosts or allow_cidrs)
    credentials = []
    for index, cred in enumerate(network.credentials if network else []):
        if cred.name not in spec.secrets:
            raise InvalidArgument(
                f"network.credentials[{index}]: credential {cred.name!r} has no value: declare "
                f'it in [secrets] as {cred.name} = {{ from_env = "VAR" }}'
            )
        credentials.append(
            CredentialSpec(
                name=cred.name,
                env_var=cred.environment_variable,
                hosts=list(cred.allowed_hosts),
                value=spec.secrets[cred.name],
            )
        )
    if sf.restart and sf.restart.policy not in (None, "never"):
        raise FailedPrecondition(
            f"restart.policy = {sf.restart.policy!r}: a rollout's machine runs its plan once; "
            "retries follow the rollout's retry policy (use 'never' or leave it out)"
        )
    resources = ResourceSpec(
        cpus=sf.cpus_effective,
        memory_mb=sf.memory_mib_effective,
        network=egress,
        allow_hosts=allow_hosts or None,
        allow_cidrs=allow_cidrs or None,
        storage_gb=sf.storage,
        overlay_gb=sf.overlay,
        gpu=sf.gpu,
        gpu_vram_mib=sf.gpu_vram,
        cuda=sf.cuda,
    )
    command = [*sf.entrypoint, *sf.cmd] or None
    env = dict(sf.env_map)
    env.update(spec.secrets)
    return MachineConfig(
        name=spec.name,
        image=str(spec.rootfs),
        labels=dict(spec.labels),
        command=command,
        env=env or None,
        workdir=sf.workdir,
        user=sf.user,
        resources=resources,
        network=egress,
        branchable=bool(sf.branch and sf.branch.enabled) or None,
        credentials=credentials or None,
        # A rollout's machine outlives a crash of its agent, so the restarted agent can adopt
        # it if the work is still leased to this host (and deletes it otherwise).
        persistent=True,
        detach=True,
    )


class SmolMachine:
    def __init__(self, machine: Any, spec: MachineSpec, source: SmolMachine | None = None) -> None:
        self._machine = machine
        self.spec = spec
        self._seen_events = 0
        self._source = source
        """The machine this one was branched from (a session's fork)."""
        self._forks: set[SmolMachine] = set()
        self._fork_lock = asyncio.Lock()
        self._delete_pending = False
        """Deleted while forks of it lived: the engine deletes it after the last of them."""

    async def pack_layer(self, archive: Path, scratch: Path) -> int:
        """Not on microVMs: a session on one cannot be parked (only closed or forked)."""
        raise FailedPrecondition(
            f"machine {self.name}: the smol runtime cannot archive a microVM's disk as a "
            "writable layer, so its sessions cannot be parked or moved; open sessions that "
            "should park on namespace-runtime hosts"
        )

    async def fork(self, spec: MachineSpec) -> SmolMachine:
        """A copy-on-write branch of this machine (RAM and disk), named by `spec`. The engine
        branches only a machine started branchable: one whose Smolfile sets `[branch]
        enabled`."""
        from smol import SmolError

        sf = self.spec.smolfile
        if not (sf.branch and sf.branch.enabled):
            raise FailedPrecondition(
                f"machine {self.name} cannot be forked on a microVM host: its Smolfile does not "
                "set [branch] enabled = true, so it was not started branchable"
            )
        async with self._fork_lock:  # one RAM snapshot per source at a time
            try:
                child = await self._machine.branch(spec.name, branchable=True)
            except SmolError as exc:
                raise translate_error(exc) from exc
        machine = SmolMachine(child, spec, source=self)
        self._forks.add(machine)
        return machine

    @property
    def name(self) -> str:
        return self.spec.name

    async def usage(self) -> Usage:
        return Usage()  # the SDK reports no per-machine CPU time, nor memory

    async def egress_events(self) -> list[EgressEvent]:
        """The engine's egress denials for this machine (`smol-vmm machine egress-events`)."""
        proc = await asyncio.create_subprocess_exec(
            "smol-vmm", "machine", "egress-events", "--name", self.spec.name, "--json",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await proc.communicate()
        if proc.returncode != 0:
            log.warning("egress_events_unavailable", machine=self.spec.name,
                        error=err.decode(errors="replace").strip()[-300:])  # fmt: skip
            return []
        rows = json.loads(out or b"[]")
        events = [
            EgressEvent(
                at=float(row.get("time", time.time())), machine=self.spec.name,
                kind="dns" if row.get("kind") == "dns" else "connect",
                destination=str(row.get("destination") or row.get("host") or "?"),
                reason=str(row.get("reason", "denied by the engine's allowlist")),
            )
            for row in rows[self._seen_events :]
        ]  # fmt: skip
        self._seen_events = len(rows)
        return events

    async def exec(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        timeout_s: float,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
        on_output: OutputSink | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        from smol import ExecOptions, SmolError

        opts = ExecOptions(
            env=machine_env(self.spec, env),
            workdir=workdir or self.spec.smolfile.workdir,
            timeout=timeout_s,
            stdin=stdin,
        )
        started = time.monotonic()
        try:
            result = await self._machine.exec(argv, opts)
        except SmolError as exc:
            if exc.code == "TIMEOUT":
                return ExecResult(exit_code=-9, timed_out=True, duration_s=timeout_s)
            raise translate_error(exc) from exc
        out, err = result.stdout_bytes or result.stdout.encode(), result.stderr_bytes or b""
        if not err and result.stderr:
            err = result.stderr.encode()
        if on_output is not None:  # the SDK's exec returns output whole, not as it arrives
            on_output("stdout", out)
            on_output("stderr", err)
        return ExecResult(
            exit_code=result.exit_code,
            stdout=out[:max_output_bytes],
            stderr=err[:max_output_bytes],
            stdout_truncated=len(out) > max_output_bytes or result.stdout_truncated,
            stderr_truncated=len(err) > max_output_bytes or result.stderr_truncated,
            duration_s=time.monotonic() - started,
        )

    async def stay_resident(self) -> None:
        """Nothing to keep: the engine's machine runs its commands itself."""

    def channel(self) -> Channel | None:
        """None: the engine offers no way for the agent to serve a microVM (no socket in it,
        no namespace to listen in), so it gets no checkpoint relay."""
        return None

    async def read_file(self, path: str) -> bytes:
        from smol import SmolError

        try:
            data: bytes = await self._machine.read_file(path)
        except SmolError as exc:
            raise translate_error(exc) from exc
        return data

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        from smol import SmolError

        try:
            await self._machine.write_file(path, data, mode)
        except SmolError as exc:
            raise translate_error(exc) from exc

    async def delete(self) -> None:
        from smol import SmolError

        if self._forks:  # children go before their source
            self._delete_pending = True
            return
        try:
            await self._machine.delete()
        except SmolError as exc:
            raise translate_error(exc) from exc
        source = self._source
        if source is not None:
            source._forks.discard(self)
            if source._delete_pending and not source._forks:
                source._delete_pending = False
                await source.delete()


class SmolParent:
    """A warm, branchable source machine and the children branched from it.

    Branch operations on the source never overlap, concurrent requests are coalesced into one
    `branch_batch`, and children are always deleted before their source. A child resumes the
    source's RAM and disk, but a step is a new process: the warm-up's Python state is not in
    it, so each step runs the warm-up again (what the parent saves is its boot and `init`).
    """

    carries_memory = False

    def __init__(self, source: Any, spec: MachineSpec, max_batch: int = 64) -> None:
        self._source = source
        self.spec = spec
        self._children: dict[str, Any] = {}
        self._count = 0
        self._coalescer: BranchCoalescer[Any] = BranchCoalescer(
            self._make_batch, self._delete_child, max_batch
        )

    async def _make_batch(self, count: int) -> list[Any]:
        self._count += 1
        prefix = f"{self.spec.name}-b{self._count}"
        try:
            children = list(await self._source.branch_batch(count, name_prefix=prefix))
        except Exception as exc:
            raise translate_error(exc) from exc
        for child in children:
            self._children[child.name] = child
        return children

    async def _delete_child(self, child: Any) -> None:
        self._children.pop(child.name, None)
        try:
            await child.delete()
        except Exception as exc:
            raise translate_error(exc) from exc

    async def branch(self, name: str = "") -> SmolMachine:
        """A copy-on-write child of the warm source (RAM and disk). The engine names it (one
        batch names its children together); `name` is what the agent calls it."""
        child = await self._coalescer.branch()
        return SmolMachine(child, self.spec.model_copy(update={"name": child.name}))

    @property
    def batches(self) -> list[int]:
        """The sizes of its last branching batches (`Coalescer.batches`)."""
        return list(self._coalescer.batches)

    async def delete(self) -> None:
        """Children first, then the source."""
        for child in list(self._children.values()):
            await self._delete_child(child)
        try:
            await self._source.delete()
        except Exception as exc:
            raise translate_error(exc) from exc


class SmolRuntime:
    kind = RuntimeKind.SMOL
    isolation = Isolation.VM
    mounts_read_only = False

    async def create(self, spec: MachineSpec) -> SmolMachine:
        from smol import AsyncMachine, ConnectOptions, SmolError

        config = machine_config(spec)
        try:
            machine = await AsyncMachine.create(config, ConnectOptions(target="local"))
        except SmolError as exc:
            raise translate_error(exc) from exc
        return SmolMachine(machine, spec)

    forks_children = True

    async def create_parent(
        self, spec: MachineSpec, warmup: str, pool_size: int,
        prepare: Callable[[Machine], Awaitable[None]],
    ) -> SmolParent:  # fmt: skip
        """Starts a branchable source, `prepare`s it (its `init`), runs the warm-up in it once
        (what it leaves on disk and in the page cache, children resume) and returns it as a
        parent. The engine keeps no pool of children ahead of need: `pool_size` is not used."""
        from smol import AsyncMachine, ConnectOptions, SmolError

        config = machine_config(spec)
        config.branchable = True
        try:
            source = await AsyncMachine.create(config, ConnectOptions(target="local"))
        except SmolError as exc:
            raise translate_error(exc) from exc
        machine = SmolMachine(source, spec)
        try:
            await prepare(machine)
            if warmup:
                warmed = await machine.exec(["python3", "-c", warmup], timeout_s=WARMUP_TIMEOUT_S)
                if warmed.exit_code != 0:
                    tail = warmed.stderr.decode(errors="replace")[-800:]
                    raise InvalidArgument(f"warm parent {spec.name}: its warm-up raised: {tail}")
        except BaseException:
            await machine.delete()
            raise
        return SmolParent(source, spec)

    async def pack(self, spec: MachineSpec, out: Path) -> Path:
        """Boots the image once, marks it with its digest, stops it and packs its disk.

        The marker (`/etc/fleet-image`) is how a pack is verified: boot it and read the file.
        """
        machine = await self.create(spec)
        try:
            await machine._machine.write_file("/etc/fleet-image", spec.image_digest + "\n")
            await machine._machine.stop()
            out.parent.mkdir(parents=True, exist_ok=True)
            from smol import SmolError

            try:
                await machine._machine.pack(str(out))
            except SmolError as exc:
                raise translate_error(exc) from exc
        finally:
            await machine.delete()
        return out

    async def list_machines(self, labels: Mapping[str, str]) -> list[str]:
        from smol import ConnectOptions, Machine

        found = await asyncio.to_thread(Machine.list, ConnectOptions(target="local"), dict(labels))
        return [m.name for m in found]

    async def leftovers(self, host_id: str) -> list[Leftover]:
        """Machines labelled with this host that a previous run of its agent left behind."""
        from smol import ConnectOptions, Machine, SmolError

        try:
            found = await asyncio.to_thread(
                Machine.list, ConnectOptions(target="local"), {"fleet": "1", "host": host_id}
            )
        except SmolError as exc:
            raise translate_error(exc) from exc
        return [leftover_of(m.name, dict(m.labels or {}), bool(m.branchable)) for m in found]

    async def adopt(self, leftover: Leftover, spec: MachineSpec) -> SmolMachine:
        from smol import AsyncMachine, ConnectOptions, SmolError

        if not leftover.adoptable:
            raise InvalidArgument(f"machine {leftover.name} cannot be adopted: {leftover.why_not}")
        conn = ConnectOptions(target="local")
        try:
            machine = await AsyncMachine.connect(leftover.name, conn)
            await machine.wait_until_ready(timeout_s=ADOPT_READY_S)
        except SmolError as exc:
            # Not adoptable after all: not kept either (its attempt is reported failed).
            with contextlib.suppress(SmolError):
                await AsyncMachine.delete_by_name(leftover.name, conn)
            raise translate_error(exc) from exc
        log.info("machine_adopted", machine=leftover.name, runtime="smol", **spec.labels)
        return SmolMachine(machine, spec.model_copy(update={"name": leftover.name}))

    async def reap(self, host_id: str, keep: Collection[str] = ()) -> int:
        """Deletes machines labelled with this host that a previous run left behind, but
        those in `keep`; a warm parent's children go before it."""
        from smol import ConnectOptions, Machine, SmolError

        conn = ConnectOptions(target="local")
        gone = [m for m in await self.leftovers(host_id) if m.name not in keep]
        gone.sort(key=lambda m: m.is_source)  # children and plain machines first
        for m in gone:
            try:
                await asyncio.to_thread(Machine.delete_by_name, m.name, conn)
            except SmolError as exc:
                if exc.code != "NOT_FOUND":
                    raise translate_error(exc) from exc
        return len(gone)


ADOPT_READY_S = 60.0


def leftover_of(name: str, labels: dict[str, str], branchable: bool) -> Leftover:
    """Whether a machine found by label can be adopted by a restarted agent, and why not."""
    why = ""
    if "parent" in labels or branchable:
        why = "a warm parent is rebuilt, not adopted (its children go with it)"
    elif "work" not in labels or "fence" not in labels:
        why = "it is labelled with no lease"
    return Leftover(name=name, labels=labels, adoptable=not why, why_not=why, is_source=branchable)


# -- preflight -------------------------------------------------------------------------------
# The checks live in `fleet.runtime.smol_preflight`; the verdict that puts them together stays
# here and calls each through this module's names, the ones callers and tests know it by.


def preflight(cache_dir: Path, canary_image: Callable[[], Path | None]) -> tuple[bool, str]:
    """Can microVMs boot on this host? Cached per host boot; never makes a user wait.

    `canary_image` is asked for only when a canary boot is really needed, so a host that the
    static checks rule out never unpacks an image for it. Those checks (the hardware, and
    whether the engine's VMMs may open /dev/kvm) are cheap and run every time: a udev rule
    can change /dev/kvm's mode between two agent starts of the same boot.
    """
    ok, reason = sdk_availability()
    if not ok:
        return False, reason
    static = static_kvm_verdict() or kvm_access_verdict(vmm_identity(), KVM_DEVICE)
    if static:
        return False, static
    cache = cache_dir / f"smol-preflight-{boot_id()}.txt"
    if cache.exists():
        verdict, _, cached_reason = cache.read_text().partition("\n")
        return verdict == "ok", cached_reason
    image = canary_image()
    if image is None:
        return False, "no image to run the canary boot with"
    ok, reason = canary_boot(image)
    cache_dir.mkdir(parents=True, exist_ok=True)
    cache.write_text(("ok" if ok else "no") + "\n" + reason)
    os.chmod(cache, 0o644)
    return ok, reason
