"""What a machine's root may do, seen from inside each kind of namespace machine: a cold
machine's command, its session's resident command server, a warm parent's warm-up and a warm
child's step all hold the same capabilities and run under the same system-call filter."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from fleet.core.smolfile import parse_smolfile
from fleet.runtime.base import MachineSpec
from fleet.runtime.capabilities import mask
from fleet.runtime.namespace import NamespaceRuntime
from fleet.runtime.warm import NamespaceParent

pytestmark = pytest.mark.sandbox

# Reads this thread's capability sets, filter mode and no-new-privs, and tries what a machine
# must not do. unshare runs in a fork, so that a namespace it makes (where the filter lets it)
# leaves the prober as it was; every other refused call changes nothing when it gets through.
# io_uring_setup (425) and clone3 (435) have the same numbers on every architecture.
PROBE = r"""
import ctypes, errno, json, os, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {}
with open("/proc/thread-self/status") as status:
    for line in status:
        key, _, value = line.partition(":")
        if key.startswith("Cap") or key in ("Seccomp", "NoNewPrivs"):
            out[key] = value.strip()
def result(code):
    return "ok" if code >= 0 else errno.errorcode[ctypes.get_errno()]
pid = os.fork()
if pid == 0:
    os._exit(0 if libc.unshare(0x10000000) == 0 else ctypes.get_errno())  # CLONE_NEWUSER
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
out["unshare_user"] = "ok" if code == 0 else errno.errorcode[code]
out["io_uring_setup"] = result(libc.syscall(425, 1, None))
out["clone3"] = result(libc.syscall(435, None, 0))
out["mount"] = result(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None))
def sock(family, kind, proto=0):
    try:
        socket.socket(family, kind, proto).close()
        return "ok"
    except OSError as exc:
        return errno.errorcode[exc.errno]
out["vsock"] = sock(40, socket.SOCK_STREAM)
out["packet"] = sock(17, socket.SOCK_RAW, 0x0300)
out["inet_sock_packet"] = sock(socket.AF_INET, 10, 0x0300)
out["netlink_netfilter"] = sock(socket.AF_NETLINK, socket.SOCK_RAW, 12)
out["netlink_route"] = sock(socket.AF_NETLINK, socket.SOCK_RAW, 0)
out["tcp"] = sock(socket.AF_INET, socket.SOCK_STREAM)
out["udp6"] = sock(socket.AF_INET6, socket.SOCK_DGRAM)
if os.path.exists("/proc/config.gz"):
    with open("/proc/config.gz", "rb") as f:
        out["config_gz_bytes"] = len(f.read(64))
"""
SHOW = "\nprint(json.dumps(out, sort_keys=True))\n"
KEEP = f"{mask():016x}"


def spec(rootfs: Path, smolfile: str = 'image = "minimal"\n') -> MachineSpec:
    return MachineSpec(
        name=f"pv-{uuid.uuid4().hex[:6]}", smolfile=parse_smolfile(smolfile).spec,
        image_digest="sha256:x", rootfs=rootfs, labels={"host": "privileges-test"},
    )  # fmt: skip


def seen(stdout: bytes, stderr: bytes, code: int) -> dict[str, Any]:
    assert code == 0, stderr.decode(errors="replace")
    found: dict[str, Any] = json.loads(stdout)
    return found


async def cold(runtime: NamespaceRuntime, rootfs: Path) -> dict[str, Any]:
    machine = await runtime.create(spec(rootfs))
    try:
        done = await machine.exec(["python3", "-c", PROBE + SHOW], timeout_s=60)
        return seen(done.stdout, done.stderr, done.exit_code)
    finally:
        await machine.delete()


def test_a_cold_machine_keeps_its_capabilities_in_every_set_and_refuses_odd_sockets(
    rootfs: Path, tmp_path: Path
) -> None:
    """A command's bounding set holds only the capabilities it keeps (bwrap leaves it whole);
    AF_VSOCK, AF_PACKET (also as AF_INET's SOCK_PACKET) and NETLINK_NETFILTER sockets are
    refused while ordinary ones open; /proc/config.gz reads as empty. The same holds for a
    session's resident command server and, for the bounding set, for a Smolfile `user`."""

    async def go() -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
        runtime = NamespaceRuntime(tmp_path / "machines")
        command = await cold(runtime, rootfs)
        session = await runtime.create(spec(rootfs))
        try:
            await session.stay_resident()
            done = await session.exec(["python3", "-c", PROBE + SHOW], timeout_s=60)
            resident = seen(done.stdout, done.stderr, done.exit_code)
        finally:
            await session.delete()
        user = await runtime.create(spec(rootfs, 'image = "minimal"\nuser = "nobody"\n'))
        try:
            script = "grep -E '^Cap(Bnd|Eff)' /proc/self/status"
            done = await user.exec(["/bin/sh", "-c", script], timeout_s=60)
            assert done.exit_code == 0, done.stderr
            nobody = dict(line.split(":\t") for line in done.stdout.decode().splitlines())
        finally:
            await user.delete()
        return command, resident, nobody

    command, resident, nobody = asyncio.run(go())
    assert resident == command
    assert {command.pop(k) for k in ("CapEff", "CapPrm", "CapBnd", "CapInh", "CapAmb")} == {KEEP}
    assert nobody == {"CapBnd": KEEP, "CapEff": "0" * 16}
    config = command.pop("config_gz_bytes", 0)
    assert config == 0  # (/dev/null in its place, where the host's kernel has one)
    assert command == {
        "Seccomp": "2", "NoNewPrivs": "1",
        "unshare_user": "EPERM", "io_uring_setup": "EPERM", "clone3": "ENOSYS", "mount": "EPERM",
        "vsock": "EAFNOSUPPORT", "packet": "EAFNOSUPPORT", "inet_sock_packet": "EAFNOSUPPORT",
        "netlink_netfilter": "EPERM",
        "netlink_route": "ok", "tcp": "ok", "udp6": "ok",
    }  # fmt: skip


# The warm-up probes the fork server's thread that runs it and leaves what it found in the
# parent's layer (the host reads it there).
WARMUP = PROBE + "\nwith open('/root/warm-up.json', 'w') as f:\n    json.dump(out, f)\n"


def test_a_warm_parent_and_its_children_hold_what_a_cold_machine_holds(
    rootfs: Path, tmp_path: Path
) -> None:
    """The warm-up and a child's step (a `python3 -c` step in the warm interpreter, and an
    exec'd command) hold a cold machine's capabilities, bounding set included, under its
    filter with no-new-privs: neither can make a user namespace (where nf_tables would take
    a table), mount, or set up io_uring."""

    async def go() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
        runtime = NamespaceRuntime(tmp_path / "machines")
        reference = await cold(runtime, rootfs)
        parent = await NamespaceParent.create(runtime, await runtime.create(spec(rootfs)), WARMUP)
        try:
            warm_up = json.loads((parent.machine.layer / "upper/root/warm-up.json").read_text())
            child = await parent.branch("probe")
            done = await child.exec(["python3", "-c", PROBE + SHOW], timeout_s=60)
            step = seen(done.stdout, done.stderr, done.exit_code)
            script = "import sys\nexec(sys.stdin.read())"  # a fresh interpreter, exec'd
            done = await child.exec(
                ["/usr/bin/env", "python3", "-c", script], stdin=(PROBE + SHOW).encode(),
                timeout_s=60,
            )  # fmt: skip
            execd = seen(done.stdout, done.stderr, done.exit_code)
        finally:
            await parent.delete()
        return reference, warm_up, step, execd

    reference, warm_up, step, execd = asyncio.run(go())
    # bwrap keeps the capabilities by name, the warm machines by number: equal sets show that
    # the numbers are right.
    assert reference["CapBnd"] == reference["CapEff"] == KEEP
    assert warm_up == reference
    assert step == reference
    assert execd == reference
