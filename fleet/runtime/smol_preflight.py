"""Whether this host can boot microVMs, read without a user waiting on it: the SDK and its own
host checks, the hardware (no PVM, a vmx or svm flag), whether the engine's VMMs may open
/dev/kvm, and, once per host boot, a canary machine booted in a child process that can be
killed. Each check says why a boot cannot happen, in words an operator can act on;
`fleet.runtime.smol.preflight` puts them together and caches the verdict.
"""

from __future__ import annotations

import grp
import os
import stat
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path


def sdk_availability() -> tuple[bool, str]:
    """Whether the SDK loads and its own host checks pass (it cannot see PVM)."""
    try:
        from smol import local_availability
    except ImportError as exc:
        return False, (
            f"the smolmachines SDK does not import ({exc}): install fleet's `smol` extra "
            "(pip install 'fleet[smol]') on a host that boots microVMs"
        )
    ok, code, reason = local_availability()
    return bool(ok), "" if ok else f"{code}: {reason}"


def static_kvm_verdict(
    sys_module: Path = Path("/sys/module"), cpuinfo: Path = Path("/proc/cpuinfo")
) -> str | None:
    """A reason microVMs cannot boot, read from the host without booting; None if none found."""
    if not Path("/dev/kvm").exists():
        return "/dev/kvm does not exist"
    if (sys_module / "kvm_pvm").exists():
        return (
            "/dev/kvm is PVM nested virtualization (kvm_pvm module loaded): "
            "libkrun guests cannot boot on it"
        )
    try:
        flags = cpuinfo.read_text()
    except OSError:
        return None
    if " vmx" not in flags and " svm" not in flags:
        return "the CPU exposes no hardware virtualization (no vmx or svm flag)"
    return None


KVM_DEVICE = Path("/dev/kvm")
VM_UID_BASE = 2_000_000
"""The first of the uids a smol engine running as root gives its microVMs, one each."""


@dataclass(frozen=True)
class VmmIdentity:
    """Who a microVM's VMM process runs as: what decides whether it may open /dev/kvm."""

    uid: int
    gids: frozenset[int]
    who: str
    """In words, for a reason given to an operator."""
    own: bool = False
    """Whether that is this process's own user (its access can then be asked of the kernel)."""


def kvm_group() -> int | None:
    """The gid of the host's `kvm` group, if it has one."""
    try:
        return grp.getgrnam("kvm").gr_gid
    except KeyError:
        return None


def vmm_identity(
    euid: int | None = None,
    env: Mapping[str, str] | None = None,
    kvm_gid: Callable[[], int | None] = kvm_group,
) -> VmmIdentity:
    """Who the SDK will run each microVM's VMM as. An engine running as root drops every VMM
    to a uid of its own (2000000 and up, not a user of this host) that keeps only the host's
    `kvm` group, unless SMOLVM_VM_UID_DROP=off; one not running as root cannot drop, and its
    VMMs run as the engine's own user, with that user's groups."""
    euid = os.geteuid() if euid is None else euid
    env = os.environ if env is None else env
    if euid == 0 and env.get("SMOLVM_VM_UID_DROP", "").strip().lower() != "off":
        gid = kvm_gid()
        kept = "in group kvm" if gid is not None else "in no group: this host has no kvm group"
        who = f"the per-VM uids ({VM_UID_BASE} and up, {kept}) the smol engine runs VMMs as"
        return VmmIdentity(VM_UID_BASE, frozenset(() if gid is None else (gid,)), who)
    groups = frozenset({os.getegid(), *os.getgroups()})
    return VmmIdentity(euid, groups, f"uid {euid}, the agent's own, which runs the VMMs", True)


def kvm_access_verdict(vmm: VmmIdentity, kvm: Path = KVM_DEVICE) -> str | None:
    """Why `vmm` could not open `kvm` read-write (the SDK's boot would then fail with
    `KvmOpen(Error(13))`), read from its owner, group and mode; None if it could."""
    try:
        st = kvm.stat()
    except OSError as exc:
        return f"{kvm} cannot be inspected: {exc.strerror or exc}"
    if vmm.uid == 0:
        return None
    if vmm.own:  # (the kernel's answer for this process: ACLs and all)
        allowed = os.access(kvm, os.R_OK | os.W_OK)
    else:  # (the permission class that applies is the first that matches, as in the kernel)
        if st.st_uid == vmm.uid:
            need = stat.S_IRUSR | stat.S_IWUSR
        elif st.st_gid in vmm.gids:
            need = stat.S_IRGRP | stat.S_IWGRP
        else:
            need = stat.S_IROTH | stat.S_IWOTH
        allowed = st.st_mode & need == need
    if allowed:
        return None
    return (
        f"{kvm} (owner uid {st.st_uid}, group gid {st.st_gid}, mode "
        f"{stat.S_IMODE(st.st_mode):04o}) cannot be opened read-write by {vmm.who}: "
        "microVMs would fail to boot with KvmOpen(Error(13)); make it mode 0666, or give it "
        "the group kvm with mode 0660"
    )


def canary_boot(image: Path, deadline_s: float = 60.0) -> tuple[bool, str]:
    """Boots one machine in a killable child process with a hard deadline."""
    code = (
        "import sys\n"
        "from smol import Machine, MachineConfig, ConnectOptions\n"
        "with Machine.create(MachineConfig(name='fleet-canary', image=sys.argv[1],"
        " labels={'fleet': 'canary'}), ConnectOptions(target='local')) as m:\n"
        "    r = m.exec(['/bin/sh', '-c', 'echo fleet-canary-ok'])\n"
        "    sys.exit(0 if b'fleet-canary-ok' in (r.stdout_bytes or r.stdout.encode()) else 3)\n"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, str(image)],
            capture_output=True,
            text=True,
            timeout=deadline_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return False, f"canary boot did not finish within {deadline_s:.0f}s"
    if proc.returncode == 0:
        return True, "canary microVM booted and ran a command"
    return False, f"canary boot failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}"


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"
