"""A namespace machine looks like an ordinary Linux box to the code in it, and shows nothing of
the host: names resolve, root owns and gives away its files, the usual mounts are there, the
capability set is a container's, and neither the command lines nor the mount table of what runs
inside name a host directory."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest

from fleet.core.smolfile import parse_smolfile
from fleet.runtime.base import ExecResult, MachineSpec
from fleet.runtime.namespace import NamespaceRuntime
from fleet.runtime.namespace_machine import NamespaceMachine

pytestmark = pytest.mark.sandbox


def _caps_mask() -> int:
    bits = {
        "CHOWN": 0, "DAC_OVERRIDE": 1, "FOWNER": 3, "FSETID": 4, "KILL": 5, "SETGID": 6,
        "SETUID": 7, "SETPCAP": 8, "NET_BIND_SERVICE": 10, "NET_RAW": 13, "SYS_CHROOT": 18,
        "MKNOD": 27, "AUDIT_WRITE": 29, "SETFCAP": 31,
    }  # fmt: skip
    return sum(1 << b for b in bits.values())


def machine_run(
    rootfs: Path, tmp_path: Path, script: str, smolfile: str = 'image = "minimal"\n'
) -> tuple[ExecResult, Path]:
    """Runs `script` (python) in a new machine; returns its result and the machines directory."""
    machines = tmp_path / "machines"

    async def go() -> ExecResult:
        runtime = NamespaceRuntime(machines)
        spec = MachineSpec(
            name=f"box-{uuid.uuid4().hex[:6]}", smolfile=parse_smolfile(smolfile).spec,
            image_digest="sha256:x", rootfs=rootfs, labels={"fleet": "test"},
        )  # fmt: skip
        machine = await runtime.create(spec)
        try:
            return await machine.exec(["python3", "-c", script], timeout_s=60)
        finally:
            await machine.delete()

    return asyncio.run(go()), machines


BOX = r"""
import grp, json, os, pwd, socket, stat, subprocess
out = {}
out["localhost"] = socket.gethostbyname("localhost")
out["self"] = socket.gethostbyname(socket.gethostname())
out["resolv_has_nameserver"] = "nameserver" in open("/etc/resolv.conf").read()
os.chown("/root", 1000, 1000)
out["chown"] = os.stat("/root").st_uid
os.chown("/root", 2**31, 2**31)  # any id, as root in a container may
out["chown_big"] = os.stat("/root").st_uid
os.chown("/root", 0, 0)
os.setgroups([0, 4, 27])
out["groups"] = sorted(os.getgroups())
os.initgroups("root", 0)
open("/root/made", "w").close()
out["umask_mode"] = oct(stat.S_IMODE(os.stat("/root/made").st_mode))
out["shm"] = oct(stat.S_IMODE(os.stat("/dev/shm").st_mode))
out["tmp"] = oct(stat.S_IMODE(os.stat("/tmp").st_mode))
out["pts"] = os.path.isdir("/dev/pts") and os.path.exists("/dev/ptmx")
out["sys_net"] = os.path.isdir("/sys/class/net")
out["sys_cgroup"] = sorted(os.listdir("/sys/fs/cgroup"))
out["firmware"] = os.listdir("/sys/firmware") if os.path.isdir("/sys/firmware") else []
out["env"] = {k: os.environ.get(k) for k in ("PATH", "HOME", "LANG")}
master, slave = os.openpty()
out["pty"] = os.ttyname(slave).startswith("/dev/pts/")
status = [l for l in open("/proc/self/status") if l.startswith("CapEff:")][0]
out["capeff"] = int(status.split()[1], 16)
texts = [open("/proc/self/mountinfo").read()]
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            texts.append(open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace"))
            texts.append(open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace"))
        except OSError:
            pass
out["seen"] = "\n".join(texts)
print(json.dumps(out))
"""


def test_a_machine_is_an_ordinary_box(rootfs: Path, tmp_path: Path) -> None:
    result, machines = machine_run(rootfs, tmp_path, BOX)
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["localhost"] == "127.0.0.1"
    assert out["self"] == "127.0.1.1"  # its own name resolves
    assert out["resolv_has_nameserver"] is False  # no network, no resolver to wait for
    assert out["chown"] == 1000  # root owns its files and gives them away
    assert out["chown_big"] == 2**31
    assert out["groups"] == [0, 4, 27]
    assert out["umask_mode"] == "0o644"
    assert out["shm"] == "0o1777" and out["tmp"] == "0o1777"
    assert out["pts"] and out["pty"]
    assert out["sys_net"]
    assert set(out["sys_cgroup"]) >= {"memory", "pids"} or "memory.max" in out["sys_cgroup"]
    assert out["firmware"] == []
    assert out["env"] == {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root",
        "LANG": "C.UTF-8",
    }
    assert out["capeff"] == _caps_mask(), hex(out["capeff"])
    # Nothing a command can read names the host's machine directories or the image's path.
    assert str(machines) not in out["seen"]
    assert str(rootfs) not in out["seen"]
    assert "/tmp/pytest" not in out["seen"]


NFT = r"""
import ctypes, json, os, socket
out = {}
# An nf_tables "new table" request over netlink needs CAP_NET_ADMIN: refused.
try:
    # The filter refuses the socket itself now; where it did not, nf_tables refuses the table.
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)  # NETLINK_NETFILTER
    import struct
    NFNL_SUBSYS_NFTABLES, NFT_MSG_NEWTABLE = 10, 0
    def msg(kind, flags, seq, payload=b""):
        return struct.pack("=IHHII", 16 + len(payload), kind, flags, seq, 0) + payload
    nfgen = struct.pack("=BBH", 1, 0, 0)  # AF_INET, version, res_id
    name = b"probe\0"
    attr = struct.pack("=HH", 4 + len(name), 1) + name + b"\0" * ((4 - len(name) % 4) % 4)
    batch = (
        msg(0x10, 1, 1, struct.pack("=BBH", 0, 0, 10))  # NFNL_MSG_BATCH_BEGIN
        + msg((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWTABLE, 1 | 4 | 0x400, 2, nfgen + attr)
        + msg(0x11, 1, 3, struct.pack("=BBH", 0, 0, 10))  # NFNL_MSG_BATCH_END
    )
    s.sendto(batch, (0, 0))
    reply = s.recv(65536)
    errors = []
    while reply:
        length, kind = struct.unpack("=IH", reply[:6])
        if kind == 2:  # NLMSG_ERROR
            errors.append(-struct.unpack("=i", reply[16:20])[0])
        reply = reply[length:]
    out["nft"] = errors
except OSError as exc:
    out["nft"] = [exc.errno]
capeff = [line for line in open("/proc/self/status") if line.startswith("CapEff:")][0]
out["caps_admin"] = bool(int(capeff.split()[1], 16) & (1 << 21))
print(json.dumps(out))
"""


def test_a_machine_has_no_admin_capabilities(rootfs: Path, tmp_path: Path) -> None:
    """No CAP_SYS_ADMIN, no CAP_NET_ADMIN: nf_tables refuses a new table from inside."""
    import errno

    result, _ = machine_run(rootfs, tmp_path, NFT)
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["caps_admin"] is False
    assert out["nft"] and set(out["nft"]) <= {errno.EPERM, errno.EACCES}, out


WHO = r"""
import json, os
out = {"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
       "home": os.environ["HOME"]}
try:
    open("/etc/owned-by-root", "w")
    out["etc"] = "written"
except OSError as exc:
    out["etc"] = exc.errno
open("/tmp/mine", "w").close()
out["mine"] = os.stat("/tmp/mine").st_uid
out["root_file_owner"] = os.stat("/etc/passwd").st_uid
print(json.dumps(out))
"""


def test_user_nobody_runs_the_step_as_nobody(rootfs: Path, tmp_path: Path) -> None:
    import errno

    result, _ = machine_run(rootfs, tmp_path, WHO, 'image = "minimal"\nuser = "nobody"\n')
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["uid"] == 65534 and out["gid"] == 65534
    assert out["groups"] == [65534]
    assert out["home"] == "/nonexistent"
    assert out["etc"] == errno.EACCES
    assert out["mine"] == 65534
    assert out["root_file_owner"] == 0  # root's files still show as root's


def test_a_user_the_image_does_not_have_is_refused_when_the_machine_is_made(
    rootfs: Path, tmp_path: Path
) -> None:
    import pytest

    from fleet.core.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="no user 'ghost'"):
        machine_run(rootfs, tmp_path, "print(1)", 'image = "minimal"\nuser = "ghost"\n')
    with pytest.raises(InvalidArgument, match="outside the machine's ids"):
        machine_run(rootfs, tmp_path, "print(1)", 'image = "minimal"\nuser = "4294967295"\n')
    assert not any((tmp_path / "machines").glob("local/*"))  # nothing made


FORKS = r"""
import os, sys, time
children = []
try:
    for _ in range(400):
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        children.append(pid)
except OSError as exc:
    print(f"fork refused after {len(children)}: {exc.strerror}")
    sys.exit(4)
print("all forked")
"""


async def test_a_fork_bomb_is_reported_as_the_process_limit(rootfs: Path, tmp_path: Path) -> None:
    runtime = NamespaceRuntime(tmp_path / "machines")
    spec = MachineSpec(
        name="forks",
        smolfile=parse_smolfile('image = "minimal"\n').spec,
        image_digest="sha256:x",
        rootfs=rootfs,
        labels={"fleet": "test"},
    )
    machine: NamespaceMachine = await runtime.create(spec)
    try:
        pids = machine.cgroup.dirs.get("pids") or machine.cgroup.dirs["all"]
        (pids / "pids.max").write_text("64")  # a small limit, so the probe stays small
        result = await machine.exec(["python3", "-c", FORKS], timeout_s=60)
    finally:
        await machine.delete()

    assert result.exit_code == 4 and b"fork refused" in result.stdout, result
    assert result.pids_exhausted and not result.oom_killed
