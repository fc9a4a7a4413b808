"""The smol runtime without booting: Smolfile -> MachineConfig, error mapping, preflight."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import grpc
import pytest

from fleet.agent.capabilities import choose_runtime
from fleet.api.status import STATUS_FOR
from fleet.core.errors import (
    ErrorCode,
    FailedPrecondition,
    FleetError,
    InvalidArgument,
    Unavailable,
)
from fleet.core.placement import RuntimeKind
from fleet.core.smolfile import parse_smolfile
from fleet.image.store import ImageStore
from fleet.runtime import smol as smol_runtime
from fleet.runtime.base import MachineSpec
from fleet.runtime.namespace_machine import missing_tools
from tests.unit.test_smolfile import EVERY_KEY

SDK_CODES = [
    "NOT_FOUND",
    "CONFLICT",
    "INTERRUPTED",
    "CONFIG_ERROR",
    "INVALID_STATE",
    "STORAGE_ERROR",
    "MOUNT_ERROR",
    "KVM_UNAVAILABLE",
    "HYPERVISOR_UNAVAILABLE",
    "COMMAND_FAILED",
    "SMOLVM_ERROR",
    "TIMEOUT",
    "NOT_SUPPORTED",
    "INVALID_CONFIG",
    "UNSUPPORTED_PLATFORM",
    "RUNTIME_NOT_INSTALLED",
]


def spec(text: str, secrets: dict[str, str] | None = None) -> MachineSpec:
    return MachineSpec(
        name="m1",
        smolfile=parse_smolfile(text).spec,
        image_digest="sha256:x",
        rootfs=Path("/images/rootfs"),
        labels={"fleet": "1", "rollout": "r-1"},
        secrets=secrets or {},
    )


def test_every_key_maps_onto_machine_config() -> None:
    """Each Smolfile key lands in the SDK's config (dev/artifact/init/health are fleet-side)."""
    text = EVERY_KEY.replace("net = false", "net = true")
    config = smol_runtime.machine_config(spec(text, {"TOKEN": "s3cret"}))
    r = config.resources
    assert config.name == "m1" and config.image == "/images/rootfs"
    assert config.labels == {"fleet": "1", "rollout": "r-1"}
    assert config.command == ["python3", "-c", "print(1)"]
    assert config.env == {"A": "1", "B": "two=2", "TOKEN": "s3cret"}
    assert config.workdir == "/root" and config.user == "root"
    assert (r.cpus, r.memory_mb, r.storage_gb, r.overlay_gb) == (2, 1024, 10, 2)
    assert (r.gpu, r.gpu_vram_mib, r.cuda) == (False, 512, False)
    assert r.network is True and config.network is True
    assert r.allow_hosts == ["pypi.org", "*.example.com"]
    assert r.allow_cidrs == ["10.0.0.0/8", "2001:db8::/32"]
    cred = config.credentials[0]
    assert (cred.name, cred.env_var, cred.hosts, cred.value) == (
        "TOKEN",
        "API_TOKEN",
        ["api.example.com"],
        "s3cret",
    )
    assert config.branchable is True


def test_defaults_and_networking_off() -> None:
    """Without keys: upstream defaults (4 cpus, 8192 MiB) and no network."""
    config = smol_runtime.machine_config(spec('image = "minimal"\n'))
    assert (config.resources.cpus, config.resources.memory_mb) == (4, 8192)
    assert config.network is False and config.resources.allow_hosts is None


def test_machines_outlive_their_agent_for_reconciliation() -> None:
    """A rollout's machine is persistent and detached, so a restarted agent can adopt it."""
    config = smol_runtime.machine_config(spec('image = "minimal"\n'))
    assert config.persistent is True and config.detach is True
    assert config.labels == {"fleet": "1", "rollout": "r-1"}


@pytest.mark.parametrize(
    ("labels", "branchable", "adoptable", "why"),
    [
        ({"fleet": "1", "host": "h", "work": "w-1", "fence": "3"}, False, True, ""),
        ({"fleet": "1", "host": "h"}, False, False, "no lease"),
        ({"fleet": "1", "host": "h", "work": "w-1"}, False, False, "no lease"),
        ({"fleet": "1", "host": "h", "parent": "k"}, True, False, "warm parent"),
        ({"fleet": "1", "host": "h", "work": "w-1", "fence": "3"}, True, False, "warm parent"),
    ],
)
def test_which_leftover_machines_a_restarted_agent_may_adopt(
    labels: dict[str, str], branchable: bool, adoptable: bool, why: str
) -> None:
    leftover = smol_runtime.leftover_of("m", labels, branchable)
    assert leftover.adoptable is adoptable and why in leftover.why_not
    assert leftover.is_source is branchable
    assert leftover.lease == (("w-1", 3) if "fence" in labels else None)


def test_allowlist_turns_scoped_networking_on() -> None:
    """allow_hosts alone enables networking, scoped to the list."""
    config = smol_runtime.machine_config(spec('[network]\nallow_hosts = ["pypi.org"]\n'))
    assert config.network is True and config.resources.allow_hosts == ["pypi.org"]


def test_credential_without_a_secret_is_refused() -> None:
    """A credential with no [secrets] value is refused, naming the key."""
    text = (
        '[[network.credentials]]\nname = "T"\nenvironment_variable = "T"\n'
        'allowed_hosts = ["a.io"]\n'
    )
    with pytest.raises(InvalidArgument, match=r"network.credentials\[0\]"):
        smol_runtime.machine_config(spec(text))


def test_restart_policy_other_than_never_is_refused() -> None:
    """restart.policy = always cannot be honoured by a run-once plan and is refused by name."""
    with pytest.raises(FailedPrecondition, match=r"restart\.policy"):
        smol_runtime.machine_config(spec('[restart]\npolicy = "always"\n'))


@pytest.mark.parametrize("code", SDK_CODES)
def test_every_sdk_error_code_maps_to_a_fleet_error_and_grpc_status(code: str) -> None:
    """Each SmolError code becomes a FleetError whose code has a gRPC status."""
    from smol import SmolError

    err = smol_runtime.translate_error(SmolError(code, "boom"))
    assert isinstance(err, FleetError)
    assert code in err.message
    assert isinstance(STATUS_FOR[err.code], grpc.StatusCode)
    assert code in smol_runtime.SMOL_ERROR_MAP


def test_native_error_strings_are_parsed() -> None:
    """A bracketed native error message is translated by its code."""
    err = smol_runtime.translate_error(RuntimeError("[KVM_UNAVAILABLE] no kvm"))
    assert isinstance(err, Unavailable)


def test_every_error_code_has_a_status() -> None:
    """The chokepoint maps every fleet error code to a canonical gRPC status of the same name."""
    for code in ErrorCode:
        assert STATUS_FOR[code].name == code.value


def test_static_check_detects_pvm(tmp_path: Path) -> None:
    """kvm_pvm loaded, or no vmx/svm flag, means microVMs cannot boot."""
    modules = tmp_path / "module"
    (modules / "kvm_pvm").mkdir(parents=True)
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags : fpu vmx sse\n")
    if not Path("/dev/kvm").exists():
        pytest.skip("this host has no /dev/kvm, so the verdict is about that instead")
    assert "PVM" in (smol_runtime.static_kvm_verdict(modules, cpuinfo) or "")
    (modules / "kvm_pvm").rmdir()
    assert smol_runtime.static_kvm_verdict(modules, cpuinfo) is None
    cpuinfo.write_text("flags : fpu sse\n")
    assert "no vmx or svm" in (smol_runtime.static_kvm_verdict(modules, cpuinfo) or "")


def test_preflight_verdict_is_cached_per_boot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The canary runs once per host boot; later calls read the cached verdict."""
    calls: list[Path] = []

    def canary(image: Path, deadline_s: float = 60.0) -> tuple[bool, str]:
        calls.append(image)
        return False, "canary boot failed (exit 1)"

    monkeypatch.setattr(smol_runtime, "sdk_availability", lambda: (True, ""))
    monkeypatch.setattr(smol_runtime, "static_kvm_verdict", lambda: None)
    monkeypatch.setattr(smol_runtime, "kvm_access_verdict", lambda vmm, kvm: None)
    monkeypatch.setattr(smol_runtime, "canary_boot", canary)
    first = smol_runtime.preflight(tmp_path, lambda: Path("/img"))
    second = smol_runtime.preflight(tmp_path, lambda: Path("/img"))
    assert first == second == (False, "canary boot failed (exit 1)")
    assert calls == [Path("/img")]


def test_preflight_on_this_host_matches_the_static_check() -> None:
    """On a PVM host preflight says no without booting, and says why."""
    static = smol_runtime.static_kvm_verdict()
    if static is None:
        pytest.skip("this host has hardware virtualization; the canary decides here")
    ok, reason = smol_runtime.preflight(Path("/nonexistent-cache"), lambda: None)
    assert not ok and reason == static


PER_VM = smol_runtime.VmmIdentity(
    smol_runtime.VM_UID_BASE, frozenset(), "the per-VM uids the smol engine runs VMMs as"
)


def fake_kvm(tmp_path: Path, mode: int) -> Path:
    """A stand-in for /dev/kvm: a file of this user's (root's, where tests run as root)."""
    kvm = tmp_path / "kvm"
    kvm.touch()
    kvm.chmod(mode)
    return kvm


def test_the_engine_runs_vmms_under_per_vm_uids_when_it_runs_as_root() -> None:
    """As root the SDK drops each VMM to a uid of its own, keeping only the kvm group (if the
    host has one), unless told not to; not as root, the VMMs run as the engine's own user."""
    dropped = smol_runtime.vmm_identity(0, {}, lambda: 36)
    assert (dropped.uid, dropped.gids, dropped.own) == (2_000_000, frozenset({36}), False)
    assert "2000000 and up, in group kvm" in dropped.who
    no_group = smol_runtime.vmm_identity(0, {}, lambda: None)
    assert no_group.gids == frozenset() and "no kvm group" in no_group.who
    kept = smol_runtime.vmm_identity(0, {"SMOLVM_VM_UID_DROP": "off"}, lambda: 36)
    assert (kept.uid, kept.own) == (0, True)
    user = smol_runtime.vmm_identity(1000, {}, lambda: 36)
    assert (user.uid, user.own) == (1000, True) and "uid 1000" in user.who


def test_a_kvm_device_only_its_owner_may_open_rules_out_per_vm_uids(tmp_path: Path) -> None:
    """/dev/kvm mode 0600 (owned by root): the engine's per-VM uids cannot open it, so boots
    would fail with KvmOpen(Error(13)); the verdict says so, naming the device and its mode."""
    kvm = fake_kvm(tmp_path, 0o600)
    why = smol_runtime.kvm_access_verdict(PER_VM, kvm)
    assert why is not None
    assert why.startswith(f"{kvm} (owner uid {kvm.stat().st_uid}, ")
    assert "mode 0600" in why and "KvmOpen(Error(13))" in why and PER_VM.who in why
    assert (
        smol_runtime.kvm_access_verdict(smol_runtime.VmmIdentity(0, frozenset(), "root"), kvm)
        is None
    )  # (root opens it whatever its mode)


def test_kvm_access_follows_the_owner_group_and_other_bits(tmp_path: Path) -> None:
    kvm = fake_kvm(tmp_path, 0o666)
    assert smol_runtime.kvm_access_verdict(PER_VM, kvm) is None
    kvm.chmod(0o660)
    gid = kvm.stat().st_gid
    in_group = smol_runtime.VmmIdentity(smol_runtime.VM_UID_BASE, frozenset({gid}), "kvm")
    assert smol_runtime.kvm_access_verdict(in_group, kvm) is None
    assert "mode 0660" in (smol_runtime.kvm_access_verdict(PER_VM, kvm) or "")
    kvm.chmod(0o640)  # (read-only for the group: a VMM opens it read-write)
    assert "mode 0640" in (smol_runtime.kvm_access_verdict(in_group, kvm) or "")
    gone = smol_runtime.kvm_access_verdict(PER_VM, tmp_path / "absent")
    assert gone is not None and "absent cannot be inspected" in gone


def test_preflight_falls_back_without_booting_when_vmms_cannot_open_kvm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hardware would do, but the VMMs could not open /dev/kvm: no canary boot, and an
    earlier verdict cached for this boot does not hide it; the agent falls back with why."""
    kvm = fake_kvm(tmp_path, 0o600)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / f"smol-preflight-{smol_runtime.boot_id()}.txt").write_text("ok\nbooted earlier")

    def canary(image: Path, deadline_s: float = 60.0) -> tuple[bool, str]:
        raise AssertionError("no canary boot may be tried")

    monkeypatch.setattr(smol_runtime, "sdk_availability", lambda: (True, ""))
    monkeypatch.setattr(smol_runtime, "static_kvm_verdict", lambda: None)
    monkeypatch.setattr(smol_runtime, "vmm_identity", lambda: PER_VM)
    monkeypatch.setattr(smol_runtime, "KVM_DEVICE", kvm)
    monkeypatch.setattr(smol_runtime, "canary_boot", canary)
    ok, why = smol_runtime.preflight(cache, lambda: None)
    assert not ok and why == smol_runtime.kvm_access_verdict(PER_VM, kvm)
    kvm.chmod(0o666)  # put right: the verdict cached for this boot stands again
    assert smol_runtime.preflight(cache, lambda: None) == (True, "booted earlier")
    kvm.chmod(0o600)
    if missing_tools():
        pytest.skip(f"the namespace runtime cannot run here either: {missing_tools()}")
    choice = choose_runtime("auto", cache, cast(ImageStore, None))
    assert choice.kind == RuntimeKind.NAMESPACE
    assert choice.reason == f"microVMs cannot boot here: {why}"


def test_errors_subclass_root() -> None:
    """Every mapped fleet error derives from FleetError."""
    for kind in smol_runtime.SMOL_ERROR_MAP.values():
        assert issubclass(kind, FleetError)


class _FakeChild:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self._log = log

    async def delete(self) -> None:
        self._log.append(f"delete {self.name}")


class _FakeSource:
    """Stands in for a branchable AsyncMachine: records calls, refuses overlapping branches."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.busy = False

    async def branch_batch(self, count: int, *, name_prefix: str) -> list[_FakeChild]:
        import asyncio

        assert not self.busy
        self.busy = True
        await asyncio.sleep(0.02)
        self.busy = False
        self.log.append(f"batch {count}")
        return [_FakeChild(f"{name_prefix}-{i}", self.log) for i in range(count)]

    async def delete(self) -> None:
        self.log.append("delete source")


async def test_warm_parent_coalesces_branches_and_deletes_children_first() -> None:
    """Concurrent branch requests become few batches; delete removes children, then the source."""
    import asyncio

    source = _FakeSource()
    parent = smol_runtime.SmolParent(source, spec('image = "minimal"\n[branch]\nenabled = true\n'))
    children = await asyncio.gather(*(parent.branch() for _ in range(6)))
    await parent.delete()
    names, log = [c.name for c in children], source.log

    assert len(set(names)) == 6
    batches = [entry for entry in log if entry.startswith("batch")]
    assert len(batches) <= 2 and sum(int(b.split()[1]) for b in batches) == 6
    assert log[-1] == "delete source"
    assert sum(1 for entry in log if entry.startswith("delete m1-b")) == 6


class _FakeBranchable(_FakeSource):
    """A branchable machine that also branches one child at a time (a session's fork)."""

    async def branch(self, name: str, *, branchable: bool = False) -> _FakeBranchable:
        import asyncio

        assert not self.busy  # one RAM snapshot per source at a time
        self.busy = True
        await asyncio.sleep(0.01)
        self.busy = False
        self.log.append(f"branch {name} branchable={branchable}")
        child = _FakeBranchable()
        child.log = self.log
        child.name = name  # type: ignore[attr-defined]
        return child

    async def delete(self) -> None:
        self.log.append(f"delete {getattr(self, 'name', 'source')}")


async def test_a_sessions_fork_on_a_microvm_host_branches_it_and_its_source_goes_last() -> None:
    """Forks of a machine started branchable are the engine's branches, one at a time; a
    machine without `[branch] enabled` is refused (it was not started branchable); a source
    closed while its forks live is deleted after the last of them."""
    import asyncio

    source = _FakeBranchable()
    machine = smol_runtime.SmolMachine(
        source, spec('image = "minimal"\n[branch]\nenabled = true\n')
    )
    forks = await asyncio.gather(
        *(
            machine.fork(spec('image = "minimal"\n').model_copy(update={"name": f"f{i}"}))
            for i in range(3)
        )
    )
    await machine.delete()  # (forks still live: deferred)
    before = list(source.log)
    for fork in forks:
        await fork.delete()
    plain = smol_runtime.SmolMachine(_FakeBranchable(), spec('image = "minimal"\n'))
    with pytest.raises(FailedPrecondition, match="branch"):
        await plain.fork(spec('image = "minimal"\n'))
    log, _ = [*before, "--", *source.log[len(before) :]], "ok"

    assert sorted(e for e in log if e.startswith("branch")) == [
        f"branch f{i} branchable=True" for i in range(3)
    ]
    assert "delete source" not in log[: log.index("--")]
    assert log[-1] == "delete source"


class _FakeExecResult:
    def __init__(self, exit_code: int, stderr: bytes = b"") -> None:
        self.exit_code = exit_code
        self.stdout, self.stderr = "", stderr.decode()
        self.stdout_bytes, self.stderr_bytes = b"", stderr
        self.stdout_truncated = self.stderr_truncated = False


class _FakeBootable(_FakeSource):
    """A branchable source as `AsyncMachine.create` returns it: runs commands, branches."""

    made: list[tuple[str, bool]] = []

    def __init__(self, fail_warmup: bool = False) -> None:
        super().__init__()
        self.fail_warmup = fail_warmup

    async def exec(self, argv: list[str], opts: object) -> _FakeExecResult:
        self.log.append("exec " + " ".join(argv[:2]))
        if self.fail_warmup and argv[:2] == ["python3", "-c"]:
            return _FakeExecResult(1, b"NameError: oops")
        return _FakeExecResult(0)


def test_a_microvm_hosts_warm_parent_is_made_through_the_runtime_protocol(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`create_parent` on the smol runtime (what the agent calls for any runtime that forks
    children) starts the source branchable, runs `prepare` (the agent's `init`), then the
    warm-up once, and branches children from it; its steps do not carry the warm-up's
    interpreter, so the agent runs the warm-up again in each. A failing warm-up is the
    rollout's error, and the source is deleted."""
    import asyncio

    import smol

    sources: list[_FakeBootable] = []

    async def create(config: object, conn: object) -> _FakeBootable:
        assert getattr(config, "branchable", False) is True
        source = _FakeBootable(fail_warmup=len(sources) == 1)
        sources.append(source)
        return source

    monkeypatch.setattr(smol.AsyncMachine, "create", staticmethod(create))
    runtime = smol_runtime.SmolRuntime()
    assert runtime.forks_children

    async def prepare(machine: object) -> None:
        await machine.exec(["/bin/sh", "-c", "init"], timeout_s=5)  # type: ignore[attr-defined]

    async def go() -> tuple[list[str], bool, list[str]]:
        the_spec = spec('image = "minimal"\n[branch]\nenabled = true\n')
        parent = await runtime.create_parent(the_spec, "X = 1", 4, prepare)
        children = await asyncio.gather(*(parent.branch(f"c{i}") for i in range(3)))
        assert all(child.channel() is None for child in children)  # no relay into a microVM
        await parent.delete()
        with pytest.raises(InvalidArgument, match="its warm-up raised: NameError: oops"):
            await runtime.create_parent(the_spec, "X = ", 0, prepare)
        return sources[0].log, parent.carries_memory, sources[1].log

    log, carries, failed = asyncio.run(go())
    assert log[:2] == ["exec /bin/sh -c", "exec python3 -c"]  # init, then the warm-up, once
    assert sum(int(e.split()[1]) for e in log if e.startswith("batch")) == 3
    assert log[-1] == "delete source" and not carries
    assert failed[-1] == "delete source"
