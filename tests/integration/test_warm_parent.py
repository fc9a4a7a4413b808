"""Warm parents on the namespace runtime: copy-on-write children of a fork server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
from structlog.testing import capture_logs

from fleet.core.smolfile import parse_smolfile
from fleet.runtime import warm_child
from fleet.runtime.base import MachineSpec
from fleet.runtime.cgroups import MachineCgroup
from fleet.runtime.namespace import NamespaceRuntime
from fleet.runtime.warm import CHILD_ALLOWANCE_MIB, NamespaceParent
from tests.integration.test_namespace_runtime import FILL

pytestmark = pytest.mark.sandbox

T = TypeVar("T")

# The warm-up runs once: it records each run on the parent's disk, imports a module and builds
# an object the children should find in memory without running it again.
WARMUP = """
import json, time
with open("/root/warmups.log", "a") as log:
    log.write("warm-up ran\\n")
MODEL = {"weights": list(range(1000)), "name": "policy-v1"}
LOADED_AT = time.time()
"""


def with_parent(
    rootfs: Path, tmp_path: Path, body: Callable[[NamespaceParent], Awaitable[T]],
    smolfile: str = 'image = "minimal"\n', warmup: str = WARMUP, pool_size: int = 0,
) -> T:  # fmt: skip
    async def go() -> T:
        runtime = NamespaceRuntime(tmp_path / "machines")
        spec = MachineSpec(
            name=f"wp-{uuid.uuid4().hex[:6]}", smolfile=parse_smolfile(smolfile).spec,
            image_digest="sha256:x", rootfs=rootfs, labels={"host": "warm-test"},
        )  # fmt: skip
        parent = await NamespaceParent.create(
            runtime, await runtime.create(spec), warmup, pool_size=pool_size
        )
        try:
            return await body(parent)
        finally:
            await parent.delete()

    return asyncio.run(go())


def test_children_find_the_warm_state_without_running_the_warm_up(
    rootfs: Path, tmp_path: Path
) -> None:
    """Objects and modules the warm-up made are in every child; the warm-up ran once."""
    code = (
        "import sys\n"
        "print(MODEL['name'], sum(MODEL['weights']), 'json' in sys.modules, LOADED_AT > 0)\n"
        "print(open('/root/warmups.log').read().count('warm-up ran'))\n"
    )

    async def body(parent: NamespaceParent) -> list[bytes]:
        outs = []
        for i in range(3):
            child = await parent.branch(f"child-{i}")
            result = await child.exec(["python3", "-c", code], timeout_s=30)
            assert result.exit_code == 0, result.stderr
            outs.append(result.stdout)
        return outs

    outs = with_parent(rootfs, tmp_path, body)
    assert outs == [b"policy-v1 499500 True True\n1\n"] * 3


def test_each_child_has_its_own_namespaces_disk_and_cgroup(rootfs: Path, tmp_path: Path) -> None:
    """Own hostname, own writable layer (siblings and parent unaffected), own cgroup."""
    write = "import socket; open('/root/mine', 'w').write(socket.gethostname()); print('ok')"
    look = "import os; print(os.path.exists('/root/mine'))"

    async def body(parent: NamespaceParent) -> tuple[bytes, bytes, bytes, bool, str]:
        a = await parent.branch("alpha")
        b = await parent.branch("beta")
        await a.exec(["python3", "-c", write], timeout_s=30)
        again = await a.exec(["python3", "-c", "print(open('/root/mine').read())"], timeout_s=30)
        other = await b.exec(["python3", "-c", look], timeout_s=30)
        parent_view = (parent.machine.layer / "upper" / "root" / "mine").exists()
        # While a child runs, its host pid sits in its own cgroup, not the parent's.
        pid = await b.start(["python3", "-c", "import time; time.sleep(5)"])
        in_own = pid in b.cgroup.pids() and pid not in parent.machine.cgroup.pids()
        await asyncio.to_thread(b.cgroup.kill_all)
        await b.wait()
        hostname = (a.layer / "upper" / "root" / "mine").read_text()
        return again.stdout, other.stdout, b"", in_own and not parent_view, hostname

    persisted, sibling, _, isolated, hostname = with_parent(rootfs, tmp_path, body)
    assert persisted == b"alpha\n"  # the child's layer persists from step to step
    assert sibling == b"False\n" and isolated and hostname == "alpha"


LISTEN = """
import socket, time
s = socket.socket(); s.bind(("127.0.0.1", 47011)); s.listen()
c = socket.create_connection(("127.0.0.1", 47011), timeout=2)  # its own loopback works
print("listening", flush=True)
time.sleep(3)
"""
PROBE = """
import socket
try:
    socket.create_connection(("127.0.0.1", 47011), timeout=2)
    print("reached the sibling")
except OSError as exc:
    print("refused:", exc.errno)
"""


def test_children_cannot_reach_each_other_over_loopback(rootfs: Path, tmp_path: Path) -> None:
    """Each child has a network namespace of its own: a sibling's listening socket on
    127.0.0.1 is not there for it, while its own loopback works."""

    async def body(parent: NamespaceParent) -> tuple[bytes, bytes]:
        a = await parent.branch("listener")
        b = await parent.branch("prober")
        listening = asyncio.create_task(a.exec(["python3", "-c", LISTEN], timeout_s=30))
        for _ in range(100):  # until the listener is up
            if (a.layer / "stdout").exists() and (a.layer / "stdout").read_bytes():
                break
            await asyncio.sleep(0.05)
        probe = await b.exec(["python3", "-c", PROBE], timeout_s=30)
        return (await listening).stdout, probe.stdout

    listened, probed = with_parent(rootfs, tmp_path, body)
    assert listened == b"listening\n"
    assert probed.startswith(b"refused: ")


def test_children_run_under_the_full_system_call_filter(rootfs: Path, tmp_path: Path) -> None:
    """The fork server may mount (to set children up); a child's step may not."""
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "r = libc.mount(b'none', b'/mnt', b'tmpfs', 0, None)\n"
        "print(r, os.strerror(ctypes.get_errno()))\n"
        "print(libc.unshare(0x20000), os.strerror(ctypes.get_errno()))\n"
    )

    async def body(parent: NamespaceParent) -> bytes:
        child = await parent.branch("probe")
        return (await child.exec(["python3", "-c", code], timeout_s=30)).stdout

    out = with_parent(rootfs, tmp_path, body)
    assert out == b"-1 Operation not permitted\n-1 Operation not permitted\n"


def test_deleting_a_parent_removes_its_children_and_a_reaper_finds_leftovers(
    rootfs: Path, tmp_path: Path
) -> None:
    """Children go before their parent; cgroups a killed agent left are reaped by prefix."""

    async def body(parent: NamespaceParent) -> tuple[list[str], str]:
        kids = [await parent.branch(f"k{i}") for i in range(3)]
        await kids[0].start(["python3", "-c", "import time; time.sleep(60)"])
        names = [k.cgroup.name for k in kids]
        return names, parent.machine.root.name

    names, root_name = with_parent(rootfs, tmp_path, body)
    assert not any(MachineCgroup(n, "v2" if os.path.exists("/sys/fs/cgroup/cgroup.controllers")
                                 else "v1").exists() for n in names)  # fmt: skip
    assert not (tmp_path / "machines" / "warm-test" / root_name).exists()

    async def leftover() -> int:
        runtime = NamespaceRuntime(tmp_path / "machines")
        machine = await runtime.create(
            MachineSpec(
                name="orphan", smolfile=parse_smolfile('image = "minimal"\n').spec,
                image_digest="sha256:x", rootfs=rootfs, labels={"host": "warm-reap"},
            )
        )  # fmt: skip
        parent = await NamespaceParent.create(runtime, machine, "X = 1\n")
        child = await parent.branch("stray")
        await child.start(["python3", "-c", "import time; time.sleep(60)"])
        parent._kill()  # the agent dies: nothing is deleted
        assert child.cgroup.exists()
        reaped = await NamespaceRuntime(tmp_path / "machines").reap("warm-reap")
        assert not child.cgroup.exists() and not machine.cgroup.exists()
        return reaped

    assert asyncio.run(leftover()) == 1


def test_pool_children_are_forked_ahead_and_run_like_any_other(
    rootfs: Path, tmp_path: Path
) -> None:
    """With a pool, branch hands out a child already forked and placed; it behaves the same."""

    async def body(parent: NamespaceParent) -> list[bytes]:
        outs = []
        for i in range(4):  # more than the pool: refills and plain forks both serve
            child = await parent.branch(f"pooled-{i}")
            code = "import socket; print(MODEL['name'], socket.gethostname())"
            result = await child.exec(["python3", "-c", code], timeout_s=30)
            outs.append(result.stdout)
        return outs

    outs = with_parent(rootfs, tmp_path, body, pool_size=2)
    assert outs == [f"policy-v1 pooled-{i}\n".encode() for i in range(4)]


def process_state(pid: int) -> str:
    """A process's state letter ("": there is no such process)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""


def test_a_pool_child_that_died_while_it_waited_is_forked_afresh(
    rootfs: Path, tmp_path: Path
) -> None:
    """A pool child killed before its step (the fork server finds it gone when handed the
    step) is reaped, and the step runs in a fresh fork in its place."""

    async def body(parent: NamespaceParent) -> tuple[int, bytes, bool]:
        for _ in range(200):  # the pool is filled in the background
            if parent._pool and parent._pool[0].prepared_pid is not None:
                break
            await asyncio.sleep(0.05)
        dead = parent._pool[0].prepared_pid
        assert dead is not None
        with contextlib.suppress(ProcessLookupError):  # (gone already: dead all the same)
            os.kill(dead, signal.SIGKILL)
        for _ in range(200):  # until it is dead (a zombie, or reaped by the fork server)
            if await asyncio.to_thread(process_state, dead) in ("Z", ""):
                break
            await asyncio.sleep(0.05)
        child = await parent.branch("revived")
        result = await child.exec(["python3", "-c", "print(MODEL['name'])"], timeout_s=30)
        return result.exit_code, result.stdout, await asyncio.to_thread(process_state, dead) != ""

    code, out, dead_left = with_parent(rootfs, tmp_path, body, pool_size=1)
    assert (code, out) == (0, b"policy-v1\n")
    assert not dead_left  # reaped


FDS = """
import json, os, stat
kinds = {}
for name in os.listdir("/proc/self/fd"):
    try:
        mode = os.fstat(int(name)).st_mode
    except OSError:
        continue  # (the listing's own descriptor, closed by now)
    kind = "socket" if stat.S_ISSOCK(mode) else "pipe" if stat.S_ISFIFO(mode) else "file"
    kinds[kind] = kinds.get(kind, 0) + 1
KEPT.seek(0)
print(json.dumps({"kinds": kinds, "kept": KEPT.read()}, sort_keys=True))
"""


def test_a_child_holds_none_of_the_fork_servers_descriptors(rootfs: Path, tmp_path: Path) -> None:
    """The fork server's listening socket, its connections to the agent and its siblings'
    pipes stay out of every child (else a step could read another rollout's step, token
    included, or hand a pooled sibling a step of its own); what the warm-up opened stays."""
    warmup = WARMUP + "KEPT = open('/root/kept.txt', 'w+')\nKEPT.write('warm')\nKEPT.flush()\n"

    async def body(parent: NamespaceParent) -> list[bytes]:
        outs = []
        for i in range(3):  # pooled siblings wait on their pipes meanwhile
            child = await parent.branch(f"fds-{i}")
            result = await child.exec(["python3", "-c", FDS], timeout_s=30)
            assert result.exit_code == 0, result.stderr
            outs.append(result.stdout)
        return outs

    for out in with_parent(rootfs, tmp_path, body, warmup=warmup, pool_size=3):
        # stdin, stdout, stderr and the warm-up's file: no socket, no pipe.
        assert json.loads(out) == {"kinds": {"file": 4}, "kept": "warm"}, out


SIGNAL_ALL = """
import os
reached = []
for name in os.listdir("/proc"):  # every process the fork server's /proc lists
    if name.isdigit():
        try:
            os.kill(int(name), 0)
            reached.append(int(name))
        except ProcessLookupError:
            pass
print(os.getpid(), sorted(reached))
"""


def test_a_child_can_signal_no_process_but_its_own(rootfs: Path, tmp_path: Path) -> None:
    """Each step is the first process of a PID namespace of its own: the numbers of its
    siblings (other rollouts) and of the fork server name nothing it can signal."""

    async def body(parent: NamespaceParent) -> bytes:
        sibling = await parent.branch("sibling")
        running = asyncio.create_task(
            sibling.exec(["python3", "-c", "import time; time.sleep(1); print('done')"],
                         timeout_s=30)
        )  # fmt: skip
        await asyncio.sleep(0.3)
        prober = await parent.branch("prober")
        probe = await prober.exec(["python3", "-c", SIGNAL_ALL], timeout_s=30)
        assert probe.exit_code == 0, probe.stderr
        finished = await running
        assert finished.stdout == b"done\n"  # the sibling ran on, untouched
        return probe.stdout

    out = with_parent(rootfs, tmp_path, body)
    pid, reached = out.decode().split(" ", 1)
    assert pid == "1"
    assert json.loads(reached) in ([], [1])  # (1: itself, where the listing has a 1)


ESCAPE = """
import os
os.mkdir("/tmp/deeper")
top = os.open("/", os.O_RDONLY)
os.chroot("/tmp/deeper")  # a chroot is left by going above it from outside it
os.fchdir(top)
for _ in range(30):
    os.chdir("..")
os.chroot(".")
print(sorted(os.listdir("/run/fleet")), os.path.exists("/.fleet-image-digest"))
"""


def test_a_child_cannot_climb_out_of_its_root(rootfs: Path, tmp_path: Path) -> None:
    """A step is root in its user namespace and may chroot: the fork server's root (its
    socket, every sibling's directory) is detached from the child's mounts, not hidden."""

    async def body(parent: NamespaceParent) -> bytes:
        child = await parent.branch("climber")
        result = await child.exec(["python3", "-c", ESCAPE], timeout_s=30)
        assert result.exit_code == 0, result.stderr
        return result.stdout

    # Its own /run/fleet (an empty sockets directory here), in its own image's root.
    assert with_parent(rootfs, tmp_path, body) == b"[] True\n"


LEAVE = """
import os
open("/dev/shm/left", "w").write("a")
open("/dev/left", "w").write("a")
try:
    os.unlink("/dev/null")
except OSError as e:
    print("kept", e.errno)
"""
LOOK = """
import os
open("/dev/null", "w").write("x")
print(os.listdir("/dev/shm"), os.path.exists("/dev/left"), len(open("/dev/urandom", "rb").read(8)))
"""


def test_each_child_has_a_dev_of_its_own(rootfs: Path, tmp_path: Path) -> None:
    """What one step leaves in /dev or /dev/shm is not there for the next, and no step can
    put a file of its own where a device was."""

    async def body(parent: NamespaceParent) -> tuple[bytes, bytes]:
        first = await parent.branch("leaves")
        left = await first.exec(["python3", "-c", LEAVE], timeout_s=30)
        second = await parent.branch("looks")
        looked = await second.exec(["python3", "-c", LOOK], timeout_s=30)
        assert left.exit_code == 0 and looked.exit_code == 0, (left.stderr, looked.stderr)
        return left.stdout, looked.stdout

    left, looked = with_parent(rootfs, tmp_path, body)
    assert left == b"kept 16\n"  # /dev/null is a mount point: busy
    assert looked == b"[] False 8\n"


def test_a_small_parent_keeps_many_live_children(rootfs: Path, tmp_path: Path) -> None:
    """Pages the fork server writes after each fork stay charged to the parent's cgroup while
    children hold the originals: its limit grows with its live children, and shrinks back."""

    def limit_mib(parent: NamespaceParent) -> int:
        cgroup = parent.machine.cgroup
        if cgroup.version == "v2":
            return int((cgroup.dirs["all"] / "memory.max").read_text()) >> 20
        return int((cgroup.dirs["memory"] / "memory.limit_in_bytes").read_text()) >> 20

    async def body(parent: NamespaceParent) -> tuple[list[int], list[bytes], int, int]:
        children = []
        for i in range(48):  # as a pool holds them: forked, set up, waiting
            child = await parent.branch(f"kid-{i}")
            await child.prepare()
            children.append(child)
        grown = limit_mib(parent)
        results = [await c.exec(["python3", "-c", "print(len(STATE))"], timeout_s=30)
                   for c in children]  # fmt: skip
        for child in children:
            await child.delete()
        return [r.exit_code for r in results], [r.stdout for r in results], grown, limit_mib(parent)

    codes, outs, grown, after = with_parent(
        rootfs, tmp_path, body, smolfile='image = "minimal"\nmemory = 64\n',
        warmup="STATE = bytearray(24 << 20)\n",
    )  # fmt: skip
    assert codes == [0] * 48 and outs == [b"25165824\n"] * 48
    assert grown == 64 + 4 * 48 and after == 64


UNCOVER = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def result(r):
    return "ok" if r == 0 else os.strerror(ctypes.get_errno())
UNCOVERED = {
    "umount": result(libc.umount2(b"/proc/sys", 2)),
    "remount_rw": result(libc.mount(None, b"/proc/sys", None, 4096 | 32, None)),
}
"""
WRITE_BACK = """
import json
try:
    value = open("/proc/sys/vm/stat_interval").read()
    with open("/proc/sys/vm/stat_interval", "w") as f:
        f.write(value)  # the value it read: nothing changes if this gets through
    UNCOVERED["write"] = "WRITTEN"
except OSError as e:
    UNCOVERED["write"] = e.strerror
print(json.dumps(UNCOVERED))
"""


def test_neither_the_warm_up_nor_a_child_can_uncover_host_settings(
    rootfs: Path, tmp_path: Path
) -> None:
    """The warm-up runs in the fork server under the full filter: it cannot unmount or remount
    /proc/sys read-write (the fork server also locks its mounts before the warm-up), and a
    child cannot write it either."""
    import json

    async def body(parent: NamespaceParent) -> bytes:
        child = await parent.branch("uncover")
        result = await child.exec(["python3", "-c", WRITE_BACK], timeout_s=30)
        assert result.exit_code == 0, result.stderr
        return result.stdout

    out = json.loads(with_parent(rootfs, tmp_path, body, warmup=UNCOVER))
    assert out == {
        "umount": "Operation not permitted", "remount_rw": "Operation not permitted",
        "write": "Read-only file system",
    }  # fmt: skip


def swapper(name: str, target: str) -> str:
    """Warm-up code whose thread, once the agent's side makes `swap-now` in the fork server's
    control directory (after the parent's own probe child), puts a link to `target` in place
    of each child's `name` there: read or followed on the host, it names a host path."""
    return f"""
import os, threading, time
def swap():
    deadline = time.monotonic() + 60
    while not os.path.exists("/run/fleet/swap-now") and time.monotonic() < deadline:
        time.sleep(0.01)
    while time.monotonic() < deadline:
        try:
            names = os.listdir("/run/fleet/children")
        except OSError:
            names = []
        for cid in names:
            path = f"/run/fleet/children/{{cid}}/{name}"
            if os.path.exists(path) and not os.path.islink(path):
                os.rename(path, path + ".moved")
                os.symlink({target!r}, path)
        time.sleep(0.01)
threading.Thread(target=swap, daemon=True).start()
"""


def test_output_files_the_fork_server_swaps_for_links_are_refused(
    rootfs: Path, tmp_path: Path
) -> None:
    """The fork server runs the tenant's warm-up and can change its control directory, where
    a step's stdout lands. A link put in its place is not followed by the agent (which would
    read a host file as root and hand it over as the step's output): the step fails, saying so."""
    from fleet.core.errors import Internal

    async def body(parent: NamespaceParent) -> str:
        child = await parent.branch("swapped")
        (parent.ctl / "swap-now").touch()
        try:
            await child.exec(
                ["python3", "-c", "import time; print('mine'); time.sleep(1)"], timeout_s=30
            )
        except Internal as exc:
            return str(exc)
        return "read through the link"

    refused = with_parent(rootfs, tmp_path, body, warmup=swapper("stdout", "/etc/hostname"))
    assert re.fullmatch(
        r"step output children/[\w.-]+/stdout was replaced: Too many levels of symbolic links",
        refused,
    ), refused


def test_a_childs_output_is_bounded_like_any_machines(rootfs: Path, tmp_path: Path) -> None:
    """The agent reads at most max_output_bytes of a child's stdout and says it cut it."""

    async def body(parent: NamespaceParent) -> tuple[int, bool, bool]:
        child = await parent.branch("loud")
        result = await child.exec(
            ["python3", "-c", "print('x' * 5000)"], timeout_s=30, max_output_bytes=1000
        )
        return len(result.stdout), result.stdout_truncated, result.stderr_truncated

    assert with_parent(rootfs, tmp_path, body) == (1000, True, False)


def test_a_childs_output_reaches_its_reader_whole_and_in_order_as_it_is_written(
    rootfs: Path, tmp_path: Path
) -> None:
    """`on_output` is handed all a child's step writes to each stream, in order, as it
    writes it: more than one read's worth at once, a pause, then a line to each."""
    script = (
        "import sys, time\n"
        f"sys.stdout.write('a' * {warm_child.TAIL_CHUNK * 2 + 7}); sys.stdout.flush()\n"
        "sys.stderr.write('err-1\\n'); sys.stderr.flush()\n"
        f"time.sleep({warm_child.TAIL_S * 3})\n"
        "print('late'); sys.stderr.write('err-2\\n')\n"
    )

    async def body(parent: NamespaceParent) -> tuple[dict[str, bytes], bytes, int]:
        child = await parent.branch("streams")
        got: dict[str, bytes] = {"stdout": b"", "stderr": b""}
        seen_before_end = 0

        def sink(stream: str, chunk: bytes) -> None:
            nonlocal seen_before_end
            got[stream] += chunk
            if b"late" not in got["stdout"]:
                seen_before_end = len(got["stdout"])

        result = await child.exec(["python3", "-c", script], timeout_s=60, on_output=sink,
                                  max_output_bytes=1000)  # fmt: skip
        return got, result.stderr, seen_before_end

    got, stderr, seen_before_end = with_parent(rootfs, tmp_path, body)
    size = warm_child.TAIL_CHUNK * 2 + 7
    assert got["stdout"] == b"a" * size + b"late\n"
    assert got["stderr"] == stderr == b"err-1\nerr-2\n"
    assert seen_before_end == size  # handed over while the step still ran


def test_a_sockets_directory_the_fork_server_swaps_for_a_link_is_refused(
    rootfs: Path, tmp_path: Path
) -> None:
    """The agent binds a child's gateway and relay sockets in the child's directory under the
    fork server's control directory. A link the warm-up put there is refused, so the agent
    never makes its sockets in a host directory of the tenant's choosing."""
    from fleet.agent.passage import bind_unix
    from fleet.core.errors import Internal

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    async def body(parent: NamespaceParent) -> str:
        child = await parent.branch("pooled")  # forked ahead: its directories are there
        (parent.ctl / "swap-now").touch()
        swapped = parent.ctl / "children" / child.cid / "sockets"
        for _ in range(3000):  # the warm-up's thread swaps it for a link
            if swapped.is_symlink():
                break
            await asyncio.sleep(0.01)
        try:
            bind_unix(child.sockets, "probe.sock").close()
        except Internal as exc:
            return str(exc)
        return "bound"

    warmup = swapper("sockets", str(elsewhere))
    refused = with_parent(rootfs, tmp_path, body, warmup=warmup, pool_size=1)
    assert re.fullmatch(
        r"children/[\w.-]+/sockets under \S+ was replaced: Not a directory",
        refused,
    ), refused
    assert list(elsewhere.iterdir()) == []


def test_a_warm_child_over_its_memory_limit_is_reported_as_oom_once(
    rootfs: Path, tmp_path: Path
) -> None:
    """The kernel's OOM kill of a child's step is reported for that step, and not again for
    the child's next one."""
    hog = "b = bytearray(400 * 1024 * 1024); print('survived')"

    async def body(parent: NamespaceParent) -> list[tuple[int, bool, bytes]]:
        child = await parent.branch("hog")
        results = []
        for code in ("print('ok')", hog, "print('after')"):
            r = await child.exec(["python3", "-c", code], timeout_s=60)
            results.append((r.exit_code, r.oom_killed, r.stdout))
        return results

    small, big, after = with_parent(
        rootfs, tmp_path, body, smolfile='image = "minimal"\nmemory = 128\n'
    )
    assert small == (0, False, b"ok\n")
    assert big[1] and big[0] != 0 and b"survived" not in big[2]
    assert after == (0, False, b"after\n")


def _limit_bytes(cgroup: MachineCgroup) -> int:
    d = cgroup.dirs.get("all") or cgroup.dirs["memory"]
    name = "memory.max" if cgroup.version == "v2" else "memory.limit_in_bytes"
    return int((d / name).read_text())


def test_a_parent_that_holds_more_than_its_due_keeps_a_limit_above_what_it_holds(
    rootfs: Path, tmp_path: Path
) -> None:
    """Children that end lower the parent's memory limit, but never below what the parent
    holds now plus one child's allowance. Lowered to just above its usage, the parent's next
    fork found no room and the kernel killed the fork server; here it still forks."""
    grower = """
import os, threading, time
HELD = []
def grow():
    deadline = time.monotonic() + 60
    while not os.path.exists("/run/fleet/grow-now") and time.monotonic() < deadline:
        time.sleep(0.01)
    HELD.append(bytearray(b"\\x01") * (72 * 1024 * 1024))  # every page written
    open("/run/fleet/grown", "w").close()
threading.Thread(target=grow, daemon=True).start()
"""

    async def body(parent: NamespaceParent) -> tuple[int, int, int, tuple[int, bytes]]:
        children = [await parent.branch(f"c{i}") for i in range(12)]  # its limit: 64 + 12 x 4
        (parent.ctl / "grow-now").touch()
        for _ in range(3000):
            if (parent.ctl / "grown").exists():
                break
            await asyncio.sleep(0.01)
        assert (parent.ctl / "grown").exists(), "the warm-up's thread did not allocate"
        for child in children:
            await child.delete()
        held = parent.machine.cgroup.memory_usage_bytes()
        assert held is not None
        limit = _limit_bytes(parent.machine.cgroup)
        after = await parent.branch("after")
        result = await after.exec(["python3", "-c", "print('forked')"], timeout_s=30)
        return held, limit, len(parent.children), (result.exit_code, result.stdout)

    with capture_logs() as logs:
        held, limit, left, probe = with_parent(
            rootfs, tmp_path, body, smolfile='image = "minimal"\nmemory = 64\n', warmup=grower
        )
    mib = 1024 * 1024
    assert held > 72 * mib  # more than its Smolfile's 64 MiB, the scenario under test
    assert limit >= held + (CHILD_ALLOWANCE_MIB - 1) * mib, (held / mib, limit / mib)
    assert [e for e in logs if e["event"] == "warm_parent_limit_kept"] == []  # no write refused
    held_up = [e for e in logs if e["event"] == "warm_parent_limit_held_up"]
    assert len(held_up) == 1 and held_up[0]["held_mib"] > 72  # said once, for all the fits after
    assert left == 1 and probe == (0, b"forked\n")


def test_a_child_is_found_and_moved_into_its_cgroup_even_past_a_reused_pid(
    rootfs: Path, tmp_path: Path
) -> None:
    """A new child's host pid is looked for first among the processes that are not the
    parent's own; were its pid one the parent's own processes once had, it is still found."""

    async def body(parent: NamespaceParent) -> tuple[bool, bool]:
        assert parent.own_pids, "the fork server's own processes were not recorded"
        first = await parent.branch("first")
        pid = await first.start(["python3", "-c", "import time; time.sleep(5)"])
        found = pid in first.cgroup.pids() and pid not in parent.machine.cgroup.pids()
        await asyncio.to_thread(first.cgroup.kill_all)
        await first.wait()
        # As if every process in the parent's group now were one of its own (reused pids).
        parent.own_pids = frozenset(parent.machine.cgroup.members())
        second = await parent.branch("second")
        pid = await second.start(["python3", "-c", "import time; time.sleep(5)"])
        moved = pid in second.cgroup.pids() and pid not in parent.machine.cgroup.pids()
        await asyncio.to_thread(second.cgroup.kill_all)
        await second.wait()
        return found, moved

    assert with_parent(rootfs, tmp_path, body) == (True, True)


def test_removing_a_cgroup_kills_what_is_left_in_it(rootfs: Path, tmp_path: Path) -> None:
    """An empty group goes at once; one whose step still runs is emptied first."""

    async def body(parent: NamespaceParent) -> tuple[bool, bool, bool]:
        idle = await parent.branch("idle")
        busy = await parent.branch("busy")
        pid = await busy.start(["python3", "-c", "import time; time.sleep(60)"])
        await asyncio.to_thread(idle.cgroup.remove)
        await asyncio.to_thread(busy.cgroup.remove)
        code = await busy.wait()
        return idle.cgroup.exists(), busy.cgroup.exists(), code == -9 and not _alive(pid)

    assert with_parent(rootfs, tmp_path, body) == (False, False, True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# A warm-up that tries to leave a process in a pid namespace of its own (whose innermost pid
# would be 1, like a child's): it says whether the kernel let it.
NESTED_PID_NS = """
import ctypes, os, time
_libc = ctypes.CDLL(None, use_errno=True)
_ready, _tell = os.pipe()
if os.fork() == 0:
    if _libc.unshare(0x20000000) != 0:  # CLONE_NEWPID: this process's next child is its pid 1
        os.write(_tell, b"refused %d" % ctypes.get_errno())
        os._exit(3)
    if os.fork() == 0:
        os.write(_tell, b"nested")
        time.sleep(3600)
    os._exit(0)
with open("/root/nested-pid-ns", "wb") as said:
    said.write(os.read(_ready, 64))
"""


def test_the_warm_up_cannot_nest_a_pid_namespace_and_children_are_found(
    rootfs: Path, tmp_path: Path
) -> None:
    """The warm-up runs under a cold machine's filter, so it cannot make a pid namespace (a
    process there could have an innermost pid equal to a child's); a child made after it is
    found and runs."""

    async def body(parent: NamespaceParent) -> tuple[bytes, bytes]:
        child = await parent.branch("after-nesting")
        said = await child.exec(["cat", "/root/nested-pid-ns"], timeout_s=30)
        result = await child.exec(["python3", "-c", "print('ok')"], timeout_s=30)
        return said.stdout, result.stdout

    said, out = with_parent(rootfs, tmp_path, body, warmup=NESTED_PID_NS)
    assert said == b"refused 1", said  # EPERM
    assert out == b"ok\n"


def test_a_parent_and_its_children_share_its_bounded_disk(rootfs: Path, tmp_path: Path) -> None:
    """`overlay = 1` on a warm parent: a child can write 100 MiB but not 2 GiB, and what one
    child holds counts against the next (they share the parent's disk). A step that fills the
    disk and then cannot write its own output fails (its output is lost), and the parent goes
    on serving children."""
    hog = (
        "import os\n"
        "fd = os.open('/root/hog', os.O_CREAT | os.O_WRONLY)\n"
        "try:\n"
        "    os.posix_fallocate(fd, 0, 2048 << 20)\n"
        "except OSError:\n"
        "    pass\n"
        "os.unlink('/root/hog')  # still open: the disk stays full until the step ends\n"
        "print('this output has nowhere to go')\n"
    )

    async def body(parent: NamespaceParent) -> list[tuple[int, bytes]]:
        first = await parent.branch("first")
        second = await parent.branch("second")
        out = []
        for child, path, mib in ((first, "/root/a", 100), (first, "/root/b", 2048),
                                 (first, "/root/c", 700), (second, "/root/d", 700)):  # fmt: skip
            result = await child.exec(["python3", "-c", FILL, path, str(mib)], timeout_s=60)
            out.append((result.exit_code, result.stdout))
        await first.delete()
        await second.delete()
        hogger = await parent.branch("hogger")
        result = await hogger.exec(["python3", "-c", hog], timeout_s=60)
        out.append((result.exit_code, result.stdout))
        await hogger.delete()
        after = await parent.branch("after")
        result = await after.exec(["python3", "-c", FILL, "/root/e", "100"], timeout_s=60)
        out.append((result.exit_code, result.stdout))
        return out

    out = with_parent(rootfs, tmp_path, body, smolfile='image = "minimal"\noverlay = 1\n')
    refused = b"refused: No space left on device\n"
    assert out == [
        (0, b"written\n"), (3, refused), (0, b"written\n"), (3, refused),
        (1, b""), (0, b"written\n"),
    ]  # fmt: skip


def test_a_warm_up_that_raises_is_the_rollouts_fault_not_the_hosts(
    rootfs: Path, tmp_path: Path
) -> None:
    """The warm-up's exception is InvalidArgument (the attempt is malformed input, quarantined
    and not retried elsewhere), with its traceback; nothing of the parent is left."""
    from fleet.core.errors import InvalidArgument

    async def body(parent: NamespaceParent) -> None:
        raise AssertionError("the parent started")

    with pytest.raises(InvalidArgument, match="its warm-up raised") as info:
        with_parent(rootfs, tmp_path, body, warmup="import json\nraise KeyError('weights')\n")
    assert "KeyError: 'weights'" in info.value.message
    assert not any((tmp_path / "machines" / "warm-test").iterdir())


def test_a_warm_parent_refuses_a_user_it_cannot_honour(rootfs: Path, tmp_path: Path) -> None:
    from fleet.core.errors import InvalidArgument

    async def body(parent: NamespaceParent) -> None:
        raise AssertionError("the parent started")

    with pytest.raises(InvalidArgument, match="remove `user` or `\\[branch\\]`"):
        with_parent(rootfs, tmp_path, body, smolfile='image = "minimal"\nuser = "nobody"\n')
    assert not any((tmp_path / "machines" / "warm-test").iterdir())


def test_a_warm_childs_root_owns_its_files_and_gives_them_to_any_id(
    rootfs: Path, tmp_path: Path
) -> None:
    """Every id is mapped in the fork server's namespace and in each child's, as in a cold
    machine: chown to any id and setgroups work in a child, and its own name resolves."""
    code = (
        "import os; os.chown('/root', 1000, 1000); a = os.stat('/root').st_uid; "
        "os.chown('/root', 2**31, 2**31); b = os.stat('/root').st_uid; "
        "os.setgroups([0, 4, 27]); import socket; "
        "me = socket.gethostbyname(socket.gethostname()); "
        "print(a, b, sorted(os.getgroups()), me)"
    )

    async def body(parent: NamespaceParent) -> bytes:
        child = await parent.branch("ids")
        result = await child.exec(["python3", "-c", code], timeout_s=30)
        assert result.exit_code == 0, result.stderr
        return result.stdout

    assert with_parent(rootfs, tmp_path, body) == f"1000 {2**31} [0, 4, 27] 127.0.1.1\n".encode()
