"""The namespace runtime with real sandboxes on the real default image."""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from pathlib import Path

import pytest

from fleet.core.errors import InvalidArgument
from fleet.core.smolfile import parse_smolfile
from fleet.runtime import disk
from fleet.runtime.base import MachineSpec
from fleet.runtime.cgroups import MachineCgroup
from fleet.runtime.namespace import NamespaceRuntime
from fleet.runtime.namespace_machine import NamespaceMachine

pytestmark = pytest.mark.sandbox

CONNECT = """
import socket, sys
s = socket.socket()
s.settimeout(3)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
except OSError as exc:
    print(f"refused: {exc}")
    sys.exit(3)
print("connected")
"""


def make(
    rootfs: Path, tmp_path: Path, text: str = 'image = "minimal"\n'
) -> tuple[NamespaceRuntime, MachineSpec]:
    runtime = NamespaceRuntime(tmp_path / "machines")
    spec = MachineSpec(
        name=f"t-{uuid.uuid4().hex[:8]}",
        smolfile=parse_smolfile(text).spec,
        image_digest="sha256:x",
        rootfs=rootfs,
        labels={"fleet": "test", "case": tmp_path.name},
    )
    return runtime, spec


async def _with_machine(rootfs: Path, tmp_path: Path, text: str, body):  # type: ignore[no-untyped-def]
    runtime, spec = make(rootfs, tmp_path, text)
    machine = await runtime.create(spec)
    try:
        return await body(machine)
    finally:
        await machine.delete()


def run(rootfs: Path, tmp_path: Path, body, text: str = 'image = "minimal"\n'):  # type: ignore[no-untyped-def]
    return asyncio.run(_with_machine(rootfs, tmp_path, text, body))


def test_runs_python_in_the_image_with_env_and_workdir(rootfs: Path, tmp_path: Path) -> None:
    """A step sees the image's python3, the Smolfile env, the step env and its workdir."""

    async def body(m: NamespaceMachine):  # type: ignore[no-untyped-def]
        return await m.exec(
            [
                "python3",
                "-c",
                "import os,sys; e = os.environ; "
                "print(sys.version_info[0], os.getcwd(), e['A'], e['B'])",
            ],
            env={"B": "step"},
            workdir="/tmp",
            timeout_s=30,
        )

    result = run(rootfs, tmp_path, body, 'image = "minimal"\nenv = ["A=smol", "B=smol"]\n')
    assert result.exit_code == 0, result.stderr
    assert result.stdout.split() == [b"3", b"/tmp", b"smol", b"step"]


def test_a_step_cannot_read_the_agents_environment(
    rootfs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No process a step can see holds the agent's environment: /proc/1/environ (bwrap, the
    machine's pid 1) carries none of it, nor does any other process there."""
    monkeypatch.setenv("FLEET_REGISTRY_AUTH", "user:agent-only-secret")
    monkeypatch.setenv("FLEET_TOKEN_SECRET", "00" * 32)
    script = (
        "import glob\nfound = []\n"
        "for path in glob.glob('/proc/[0-9]*/environ'):\n"
        "    try:\n        data = open(path, 'rb').read()\n"
        "    except OSError:\n        continue\n"
        "    if b'agent-only-secret' in data or b'FLEET_TOKEN_SECRET' in data:\n"
        "        found.append(path)\n"
        "names = sorted(v.split(b'=')[0].decode() for v in "
        "open('/proc/1/environ', 'rb').read().split(b'\\0') if v)\n"
        "print(found, ','.join(names), b'PWD=/\\0' in open('/proc/1/environ', 'rb').read())\n"
    )

    async def body(m: NamespaceMachine):  # type: ignore[no-untyped-def]
        return await m.exec(["python3", "-c", script], timeout_s=30)

    result = run(rootfs, tmp_path, body)
    assert result.exit_code == 0, result.stderr
    found, names, pwd_is_root = result.stdout.decode().split()
    assert found == "[]" and names == "PATH,PWD" and pwd_is_root == "True"


def test_files_persist_between_steps_but_not_into_the_image(rootfs: Path, tmp_path: Path) -> None:
    """A machine's writes land in its own layer: later steps see them, the image does not."""

    async def body(m: NamespaceMachine):  # type: ignore[no-untyped-def]
        await m.exec(["sh", "-c", "echo hello > /root/state.txt"], timeout_s=30)
        return await m.exec(["cat", "/root/state.txt"], timeout_s=30)

    assert run(rootfs, tmp_path, body).stdout == b"hello\n"
    assert not (rootfs / "root" / "state.txt").exists()


def test_networking_is_off_tcp_connect_fails(rootfs: Path, tmp_path: Path) -> None:
    """With networking off the only interface is loopback: a TCP connect out fails."""

    async def body(m: NamespaceMachine):  # type: ignore[no-untyped-def]
        ifaces = await m.exec(
            ["python3", "-c", "import socket; print([n for _, n in socket.if_nameindex()])"],
            timeout_s=30,
        )
        out = await m.exec(["python3", "-c", CONNECT, "127.0.0.2", "9"], timeout_s=30)
        far = await m.exec(["python3", "-c", CONNECT, "192.0.2.1", "80"], timeout_s=30)
        return ifaces, out, far

    ifaces, local, far = run(rootfs, tmp_path, body)
    assert ifaces.stdout.strip() == b"['lo']"
    assert local.exit_code == 3  # nothing listens on the machine's own loopback
    assert far.exit_code == 3 and b"unreachable" in far.stdout


def _processes_with(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                if marker.encode() in handle.read():
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def test_timeout_kills_every_process_of_the_step(rootfs: Path, tmp_path: Path) -> None:
    """A step past its timeout is killed with all its children; no process is left behind."""
    marker = f"{uuid.uuid4().int % 10_000 + 20_000}"

    async def body(m: NamespaceMachine):  # type: ignore[no-untyped-def]
        script = f"sleep {marker} & sleep {marker} & (setsid sleep {marker} &) ; sleep {marker}"
        return await m.exec(["sh", "-c", script], timeout_s=1.0)

    result = run(rootfs, tmp_path, body)
    assert result.timed_out and result.exit_code != 0
    assert _processes_with(f"sleep {marker}") == []


def test_output_is_bounded(rootfs: Path, tmp_path: Path) -> None:
    """Output beyond the cap is cut and flagged, and the step still completes."""

    async def body(m: NamespaceMachine):  # type: ignore[no-untyped-def]
        return await m.exec(
            ["python3", "-c", "print('x' * 100000)"], timeout_s=30, max_output_bytes=1000
        )

    result = run(rootfs, tmp_path, body)
    assert result.exit_code == 0 and len(result.stdout) == 1000 and result.stdout_truncated


async def test_delete_removes_the_machine_and_list_finds_by_label(
    rootfs: Path, tmp_path: Path
) -> None:
    """Machines are listed by label while they exist and leave nothing on delete."""

    runtime, spec = make(rootfs, tmp_path)
    machine = await runtime.create(spec)
    found = await runtime.list_machines({"case": tmp_path.name})
    await machine.delete()
    after = await runtime.list_machines({"case": tmp_path.name})
    exists = machine.root.exists()

    assert len(found) == 1 and after == [] and not exists


def test_isolation_namespaces_are_fresh(rootfs: Path, tmp_path: Path) -> None:
    """The step is pid 2-ish in its own pid namespace and has its own hostname."""

    async def body(m: NamespaceMachine):  # type: ignore[no-untyped-def]
        return await m.exec(
            ["sh", "-c", "echo $$; hostname; ls /proc | grep -c '^[0-9]'"], timeout_s=30
        )

    result = run(rootfs, tmp_path, body)
    pid, hostname, count = result.stdout.split()
    assert int(pid) < 10 and hostname.startswith(b"t-") and int(count) < 10


@pytest.mark.parametrize("argv", [["/nonexistent"], ["sh", "-c", "exit 7"]])
def test_nonzero_exit_is_data(rootfs: Path, tmp_path: Path, argv: list[str]) -> None:
    """A failing command is a result with its exit code, not an exception."""

    async def body(m: NamespaceMachine):  # type: ignore[no-untyped-def]
        return await m.exec(argv, timeout_s=30)

    assert run(rootfs, tmp_path, body).exit_code != 0


def test_memory_limit_kills_the_step_and_says_so(rootfs: Path, tmp_path: Path) -> None:
    """A step over the Smolfile's memory limit is killed by the kernel and reported as OOM."""

    async def body(m: NamespaceMachine):  # type: ignore[no-untyped-def]
        hog = "b = bytearray(400 * 1024 * 1024); print('survived')"
        small = await m.exec(
            ["python3", "-c", "b = bytearray(8 * 1024 * 1024); print('ok')"], timeout_s=60
        )
        big = await m.exec(["python3", "-c", hog], timeout_s=60)
        return small, big

    small, big = run(rootfs, tmp_path, body, 'image = "minimal"\nmemory = 128\n')
    assert small.exit_code == 0 and not small.oom_killed
    assert big.oom_killed and big.exit_code != 0 and b"survived" not in big.stdout


async def test_machine_processes_live_in_its_cgroup_with_its_limits(
    rootfs: Path, tmp_path: Path
) -> None:
    """While a step runs its processes are in the machine's cgroup; delete removes the group."""

    runtime, spec = make(rootfs, tmp_path, 'image = "minimal"\ncpus = 2\nmemory = 300\n')
    machine = await runtime.create(spec)
    step = asyncio.create_task(machine.exec(["sleep", "3"], timeout_s=30))
    pids: list[int] = []
    for _ in range(100):
        await asyncio.sleep(0.05)
        pids = machine.cgroup.pids()
        if len(pids) >= 2:
            break
    limits = {}
    for d in machine.cgroup.dirs.values():
        for name in (
            "memory.limit_in_bytes",
            "memory.memsw.limit_in_bytes",
            "memory.max",
            "memory.swap.max",
            "cpu.cfs_quota_us",
            "cpu.max",
            "pids.max",
        ):
            if (d / name).exists():
                limits[name] = (d / name).read_text().strip()
    step.cancel()
    await machine.delete()
    exists = machine.cgroup.exists()

    assert len(pids) >= 2  # unshare/bwrap and the sandboxed sleep
    assert limits.get("memory.limit_in_bytes", limits.get("memory.max")) == str(300 * 1024 * 1024)
    # No swap beyond it: v1 bounds memory and swap together where it accounts swap, v2 swap.
    if "memory.limit_in_bytes" in limits and "memory.memsw.limit_in_bytes" in limits:
        assert limits["memory.memsw.limit_in_bytes"] == str(300 * 1024 * 1024)
    if "memory.max" in limits and "memory.swap.max" in limits:
        assert limits["memory.swap.max"] == "0"
    assert limits.get("cpu.cfs_quota_us") == "200000" or limits.get("cpu.max") == "200000 100000"
    assert limits["pids.max"] == "4096"
    assert not exists


async def test_reaper_removes_what_a_killed_agent_left(rootfs: Path, tmp_path: Path) -> None:
    """Machines of this host left behind (no delete) are removed by reap; others are kept."""

    runtime = NamespaceRuntime(tmp_path / "machines")
    specs = [
        MachineSpec(
            name=f"orphan-{host}",
            smolfile=parse_smolfile('image = "minimal"\n').spec,
            image_digest="sha256:x",
            rootfs=rootfs,
            labels={"fleet": "1", "host": host},
        )
        for host in ("me", "other")
    ]
    mine = await runtime.create(specs[0])
    theirs = await runtime.create(specs[1])
    reaped = await NamespaceRuntime(tmp_path / "machines").reap("me")
    left = await runtime.list_machines({"fleet": "1"})
    cgroup_left = [str(d) for d in mine.cgroup.dirs.values() if d.exists()]
    await theirs.delete()

    assert reaped == 1 and len(left) == 1 and left[0].startswith("orphan-other")
    assert cgroup_left == []


async def test_a_restarted_agent_adopts_a_leased_machine_and_reaps_the_rest(
    rootfs: Path, tmp_path: Path
) -> None:
    """Left behind by a killed agent: a machine labelled with a lease is adoptable (its files
    are all there is to it); one with no lease, or a warm parent, is not. Reaping keeps the
    adopted one."""
    smolfile = parse_smolfile('image = "minimal"\n').spec

    def spec(name: str, **labels: str) -> MachineSpec:
        return MachineSpec(
            name=name, smolfile=smolfile, image_digest="sha256:x", rootfs=rootfs,
            labels={"fleet": "1", "host": "me", **labels},
        )  # fmt: skip

    before = NamespaceRuntime(tmp_path / "machines")
    leased = spec("leased", work="w-1", fence="4")
    first = await before.create(leased)
    await first.exec(["/bin/sh", "-c", "echo kept > /root/state"], timeout_s=30)
    await before.create(spec("unlabelled"))
    await before.create(spec("parent", parent="abc"))

    after = NamespaceRuntime(tmp_path / "machines")  # the restarted agent's
    found = {m.name.rsplit("-", 1)[0]: m for m in await after.leftovers("me")}
    assert set(found) == {"leased", "unlabelled", "parent"}
    assert found["leased"].adoptable and found["leased"].lease == ("w-1", 4)
    assert not found["unlabelled"].adoptable and "no lease" in found["unlabelled"].why_not
    assert not found["parent"].adoptable and "fork server" in found["parent"].why_not
    with pytest.raises(InvalidArgument, match="cannot be adopted"):
        await after.adopt(found["parent"], spec("parent"))

    adopted = await after.adopt(found["leased"], leased)
    result = await adopted.exec(["cat", "/root/state"], timeout_s=30)
    assert result.stdout == b"kept\n"
    assert await after.reap("me", keep={found["leased"].name}) == 2
    assert [m.name for m in await after.leftovers("me")] == [found["leased"].name]
    await adopted.delete()
    assert await after.leftovers("me") == []
    assert not adopted.cgroup.exists()


SYSCALLS = r"""
import ctypes, os, json
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    r = libc.syscall(nr, *args)
    return "ok" if r >= 0 else os.strerror(ctypes.get_errno())
out = {
    "mount": call(165, b"none", b"/tmp", b"tmpfs", 0, None),
    "ptrace_attach_init": call(101, 16, 1, 0, 0),
    "unshare_uts": call(272, 0x04000000),
    "keyctl": call(250, 0, 0, 0, 0),
    "bpf": call(321, 0, 0, 0),
    "init_module": call(175, 0, 0, 0),
    "getpid": call(39),
    "seccomp": [l.split()[1] for l in open("/proc/self/status") if l.startswith("Seccomp:")][0],
}
print(json.dumps(out))
"""


def test_seccomp_denies_what_a_sandbox_has_no_business_doing(rootfs: Path, tmp_path: Path) -> None:
    """mount, ptrace, unshare, keyctl, bpf and module loading fail with EPERM; getpid works."""
    import json

    async def body(m: NamespaceMachine):  # type: ignore[no-untyped-def]
        return await m.exec(["python3", "-c", SYSCALLS], timeout_s=30)

    result = run(rootfs, tmp_path, body)
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out.pop("getpid") == "ok" and out.pop("seccomp") == "2"
    assert set(out.values()) == {"Operation not permitted"}, out


# What a step may change outside its machine through /proc. Its root is the host's root user
# (in a user namespace of its own, with no capability outside it), and the kernel lets that
# user write host-wide settings under /proc/sys unless they are read-only in the machine. The
# probe writes back the value it read, so nothing changes if the write gets through.
HOST_KNOBS = r"""
import json, os
out = {}
for path in ("/proc/sys/vm/stat_interval", "/proc/sys/kernel/core_pattern"):
    try:
        value = open(path).read()
        with open(path, "w") as f:
            f.write(value)
        out[path] = "WRITTEN"
    except OSError as e:
        out[path] = e.errno
for name in ("kcore", "keys", "timer_list", "sched_debug"):
    path = "/proc/" + name
    if os.path.exists(path):
        try:
            out[path] = len(open(path, "rb").read(64))
        except OSError as e:
            out[path] = e.errno
print(json.dumps(out))
"""


def test_host_settings_under_proc_are_read_only_in_a_machine(rootfs: Path, tmp_path: Path) -> None:
    """/proc/sys (host-wide settings: core_pattern runs a program as the host's root) is
    read-only in a machine, and the kernel's memory, keys and timers read as empty."""
    import errno
    import json

    async def body(m: NamespaceMachine):  # type: ignore[no-untyped-def]
        return await m.exec(["python3", "-c", HOST_KNOBS], timeout_s=30)

    result = run(rootfs, tmp_path, body)
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out.pop("/proc/sys/vm/stat_interval") == errno.EROFS
    assert out.pop("/proc/sys/kernel/core_pattern") == errno.EROFS
    assert set(out.values()) <= {0}, out  # masked: /dev/null in their place


SETUID = r"""
import os, shutil
shutil.copy("/bin/sh", "/planted")
os.chmod("/planted", 0o4755)
print(oct(os.stat("/planted").st_mode & 0o7777))
"""


def test_a_machines_files_are_the_hosts_root_users_alone(rootfs: Path, tmp_path: Path) -> None:
    """A machine's root is the host's root user: a file it marks setuid in its layer is a
    setuid-root file on the host. No other host user can reach its directory."""
    import stat

    async def body(m: NamespaceMachine):  # type: ignore[no-untyped-def]
        result = await m.exec(["python3", "-c", SETUID], timeout_s=30)
        planted = m.layer / "upper" / "planted"
        return result, planted.stat().st_mode, stat.S_IMODE(m.root.stat().st_mode)

    result, planted, mode = run(rootfs, tmp_path, body)
    assert result.exit_code == 0 and result.stdout == b"0o4755\n", result.stderr
    assert planted & stat.S_ISUID  # there on the host, as the machine left it
    assert mode == 0o700


FILL = """
import os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY)
try:
    os.posix_fallocate(fd, 0, int(sys.argv[2]) << 20)
except OSError as exc:
    os.close(fd)  # (a failed fallocate keeps what it got until then)
    os.unlink(sys.argv[1])
    print(f"refused: {exc.strerror}")
    sys.exit(3)
print("written")
"""


WRITE_UNTIL_FULL = """
import sys
chunk = b"x" * (1 << 20)
try:
    with open("/root/big", "wb") as f:
        for _ in range(4096):
            f.write(chunk)
except OSError as exc:
    print(f"refused: {exc.strerror}")
    sys.exit(3)
"""


def _mounted(path: Path) -> bool:
    return any(
        line.split()[1] == str(path) for line in Path("/proc/mounts").read_text().splitlines()
    )


def test_a_smolfiles_overlay_bounds_what_a_machine_can_write(rootfs: Path, tmp_path: Path) -> None:
    """`overlay = 1`: 100 MiB fit, 2 GiB more do not (ENOSPC inside the machine); the layer's
    filesystem is 1 GiB as the machine sees it; delete unmounts it and leaves nothing."""

    async def body(m: NamespaceMachine):  # type: ignore[no-untyped-def]
        small = await m.exec(["python3", "-c", FILL, "/root/small", "100"], timeout_s=60)
        big = await m.exec(["python3", "-c", FILL, "/root/big", "2048"], timeout_s=60)
        size = await m.exec(
            ["python3", "-c", "import os; s = os.statvfs('/'); print(s.f_blocks * s.f_frsize)"],
            timeout_s=30,
        )
        return small, big, size, m.root, _mounted(m.root / "disk")

    small, big, size, root, mounted = run(
        rootfs, tmp_path, body, 'image = "minimal"\noverlay = 4\nstorage = 1\n'
    )
    assert small.exit_code == 0 and small.stdout == b"written\n", small.stderr
    assert big.exit_code == 3 and b"No space left on device" in big.stdout
    assert 0.9 * 2**30 < int(size.stdout) <= 2**30
    assert mounted and not _mounted(root / "disk") and not root.exists()


def test_without_overlay_or_storage_a_machine_gets_the_default_bound(
    rootfs: Path, tmp_path: Path
) -> None:
    """No Smolfile bound: the runtime's default (10 GiB) holds, and a write past it fails with
    ENOSPC inside the machine and is reported as the disk being full."""

    async def body(m: NamespaceMachine):  # type: ignore[no-untyped-def]
        size = await m.exec(
            ["python3", "-c", "import os; s = os.statvfs('/'); print(s.f_blocks * s.f_frsize)"],
            timeout_s=30,
        )
        return m.layer == m.root / "disk", _mounted(m.root / "disk"), int(size.stdout)

    layered, mounted, size = run(rootfs, tmp_path, body)
    assert layered and mounted
    assert 0.9 * 10 * 2**30 < size <= 10 * 2**30

    async def fill() -> tuple[object, object]:
        runtime, spec = make(rootfs, tmp_path)
        runtime.default_disk_gib = 1
        machine = await runtime.create(spec)
        try:
            big = await machine.exec(["python3", "-c", WRITE_UNTIL_FULL], timeout_s=120)
            ok = await machine.exec(["true"], timeout_s=30)
            return big, ok
        finally:
            await machine.delete()

    big, ok = asyncio.run(fill())
    assert big.exit_code == 3 and b"No space left" in big.stdout, big  # type: ignore[attr-defined]
    assert big.disk_full  # type: ignore[attr-defined]
    assert not ok.disk_full  # type: ignore[attr-defined]


async def test_an_agent_without_a_default_bound_keeps_layers_in_the_machine_directory(
    rootfs: Path, tmp_path: Path
) -> None:
    runtime, spec = make(rootfs, tmp_path)
    runtime.default_disk_gib = None
    m = await runtime.create(spec)
    try:
        await m.exec(["/bin/sh", "-c", "echo x > /root/f"], timeout_s=30)
        made = (m.root / "upper/root/f").is_file()
        result = m.layer == m.root, (m.root / "disk").exists(), made
    finally:
        await m.delete()

    assert result == (True, False, True)


async def test_the_reaper_unmounts_a_bounded_disk_a_killed_agent_left(
    rootfs: Path, tmp_path: Path
) -> None:
    runtime, spec = make(rootfs, tmp_path, 'image = "minimal"\noverlay = 1\n')
    spec.labels["host"] = "gone"
    machine = await runtime.create(spec)
    was = _mounted(machine.root / "disk")
    reaped = await NamespaceRuntime(tmp_path / "machines").reap("gone")
    result = reaped, was, _mounted(machine.root / "disk"), machine.root.exists()

    assert result == (1, True, False, False)


async def test_a_restarted_agent_adopts_a_machine_with_its_bounded_disk(
    rootfs: Path, tmp_path: Path
) -> None:
    """The disk stays mounted when the agent dies; the adopting agent finds it (and mounts it
    again if it is not: after an unmount here), with the machine's files and its bound."""
    labels = {"fleet": "1", "host": "me", "work": "w-1", "fence": "2"}
    spec = MachineSpec(
        name="bounded", smolfile=parse_smolfile('image = "minimal"\noverlay = 1\n').spec,
        image_digest="sha256:x", rootfs=rootfs, labels=labels,
    )  # fmt: skip

    first = await NamespaceRuntime(tmp_path / "machines").create(spec)
    await first.exec(["/bin/sh", "-c", "echo kept > /root/state"], timeout_s=30)
    unmount = await asyncio.create_subprocess_exec("umount", str(first.root / "disk"))
    assert await unmount.wait() == 0  # as after a host's restart
    after = NamespaceRuntime(tmp_path / "machines")
    (leftover,) = await after.leftovers("me")
    adopted = await after.adopt(leftover, spec)
    state = await adopted.exec(["cat", "/root/state"], timeout_s=30)
    big = await adopted.exec(["python3", "-c", FILL, "/root/big", "2048"], timeout_s=60)
    await adopted.delete()
    state, big, left = state.stdout, big.stdout, adopted.root.exists()

    assert state == b"kept\n" and b"No space left on device" in big and not left


def test_a_creation_cancelled_while_its_disk_is_made_leaves_no_mount(
    rootfs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The work stopped (its host revoked) while its machine's disk was being made: the cleanup
    waits for the disk to be mounted, then unmounts and removes it, rather than running beside
    it and leaving a disk mounted (its loop device held) for good."""
    runtime, spec = make(rootfs, tmp_path, 'image = "minimal"\noverlay = 1\n')
    started, removing = threading.Event(), threading.Event()
    make_disk, remove_disk = disk.make, disk.remove

    def slow_make(root: Path, gib: int) -> Path:
        started.set()
        removing.wait(2)  # (until the cleanup starts, if it does not wait for this first)
        return make_disk(root, gib)

    def remove(root: Path) -> None:
        removing.set()
        remove_disk(root)

    monkeypatch.setattr(disk, "make", slow_make)
    monkeypatch.setattr(disk, "remove", remove)

    async def cancelled() -> bool:
        creating = asyncio.create_task(runtime.create(spec))
        assert await asyncio.to_thread(started.wait, 30)
        creating.cancel()
        try:
            await creating
        except asyncio.CancelledError:
            return True
        return False

    assert asyncio.run(cancelled())
    machines = tmp_path / "machines"
    mounts = Path("/proc/mounts").read_text().splitlines()
    assert [line for line in mounts if str(machines) in line] == []
    assert not any(p.name.startswith(spec.name) for p in machines.rglob("*"))


def test_a_delete_cancelled_half_way_still_removes_the_machine(
    rootfs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A machine's delete is cancelled (its agent shutting down) while its cgroup is being
    removed: the delete still runs to its end, so its disk is unmounted and its files gone,
    instead of a delete marked done that never reached them."""
    runtime, spec = make(rootfs, tmp_path, 'image = "minimal"\noverlay = 1\n')
    started, cancelled = threading.Event(), threading.Event()
    remove_cgroup = MachineCgroup.remove

    def slow_remove(self: MachineCgroup) -> None:
        started.set()
        cancelled.wait(2)  # (until the delete has been cancelled)
        remove_cgroup(self)

    async def run() -> tuple[bool, NamespaceMachine]:
        machine = await runtime.create(spec)
        monkeypatch.setattr(MachineCgroup, "remove", slow_remove)
        deleting = asyncio.create_task(machine.delete())
        assert await asyncio.to_thread(started.wait, 30)
        deleting.cancel()
        cancelled.set()
        try:
            await deleting
        except asyncio.CancelledError:
            return True, machine
        return False, machine

    was_cancelled, machine = asyncio.run(run())
    mounts = Path("/proc/mounts").read_text().splitlines()
    assert was_cancelled
    assert [line for line in mounts if str(machine.root) in line] == []
    assert not machine.root.exists()
