"""The warm parent's fork server. Runs inside the sandbox with the image's python3 (stdlib only).

At start it locks the sandbox's mounts (a user and mount namespace of its own: what the sandbox
made read-only, /proc/sys among it, stays so although this process may mount), drops to a cold
machine's capabilities (`/run/fleet/caps`; its new user namespace gave it every one), then runs
the warm-up (`/run/fleet/warmup.py`) into its own globals: imports, weights, whatever the
children should find already in memory. The warm-up runs on the main thread under the full
system-call filter, as a cold machine's command would; the threads that fork children were
started before it was installed and keep the looser one their children need to set up (a
filter belongs to a thread). Then it serves JSON lines on `/run/fleet/zygote.sock`:

    {"op": "spawn", "id": ID, "argv": [...], "env": {...}, "workdir": DIR}
        -> {"id": ID, "pid": PID}   the child is forked and waits: the agent moves it into its
                                    cgroup, then sends "settle" or "go"
    {"op": "settle", "id": ID}      -> {"ok": true}   a pool child (spawned without a step,
                                    ahead of need) sets up now and waits for "go"
    {"op": "go", "id": ID, "step": {...}}  -> {"ok": true}   sets up if it has not, then runs
                                    the spawn's step, or this one
    {"op": "wait", "id": ID}        -> {"id": ID, "status": waitpid status}
    {"op": "copy", "from": SRC, "id": ID}  -> {"ok": true}   child SRC's writable layer
                                    copied to ID's, before ID first runs (a session's fork)

Each child also finds `/run/fleet` in its root: its directory `children/ID/sockets`, bound
read-only, where the agent puts the Unix sockets of what the child may reach beyond its
loopback (the inference gateway, the checkpoint relay), if its rollout uses any.

A child is a copy-on-write fork() of this process. First it closes every descriptor this
process opened after the warm-up (its listening socket, its connections to the agent, its other
children's pipes): a step must not read another rollout's step off the agent's connection, nor
hand a pooled sibling a step of its own. What the warm-up opened stays open, as warm state.
Before its step runs it enters new user, mount, UTS, IPC, network and PID namespaces (its
network: a loopback of its own, so children of one parent cannot reach each other's sockets),
mounts its own overlay (its writable layer over the parent's layer and the image) and a /dev
of its own, makes the overlay the root with pivot_root (the fork server's root, and all in it,
detached), forks the first process of its PID namespace and exits (this process, a subreaper,
adopts that fork and reaps it: the step can signal no sibling and not this process), and
installs the full system-call filter (the forking threads run under a looser one that still
allows the namespace and mount calls it needs); last, once it has named itself, it drops to a
cold machine's capabilities, bounding set included. Then `["python3", "-c", CODE]` runs CODE
in the child's copy of the warm interpreter, so everything the warm-up loaded is there; any
other argv is exec'd.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import gc
import json
import os
import socket
import stat
import struct
import sys
import threading
import time
import traceback
from typing import Any

CTL = "/run/fleet"
NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET = (
    0x20000,
    0x04000000,
    0x08000000,
    0x10000000,
    0x20000000,
    0x40000000,
)
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC = 1, 32, 4096, 16384
# statvfs flag -> mount flag: nosuid, nodev, noexec, noatime, nodiratime, relatime
STATVFS_TO_MS = ((2, 2), (4, 4), (8, 8), (1024, 1024), (2048, 2048), (4096, 1 << 21))
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
PR_SET_CHILD_SUBREAPER = 36
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE = 24, 47, 2
CAPABILITY_VERSION_3 = 0x20080522
SYS_PIVOT_ROOT, MNT_DETACH, MS_PRIVATE = 155, 2, 1 << 18
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
DEV_LINKS = (
    ("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx"),
)  # fmt: skip

libc = ctypes.CDLL(None, use_errno=True)
WARM: dict[str, Any] = {"__name__": "__warm__"}
# id -> [pid, go pipe's write end, status or None, Event, step, report pipe's read end or None,
#        its ids mapped]
children: dict[str, list[Any]] = {}
STEP_KEYS = ("argv", "env", "workdir", "hostname", "stdin")
lock = threading.Lock()
spawned = threading.Semaphore(0)
WARM_FDS: set[int] = set()  # descriptors the warm-up left open (children keep them)
KEEP = 0  # the capabilities a machine keeps, as a mask (CTL/caps, written by the agent)


def check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, what + ": " + os.strerror(err))


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]  # fmt: skip


def keep_capabilities(keep: int) -> None:
    """This thread's capabilities become a cold machine's: `keep` (a mask) in its effective,
    permitted, inheritable, ambient and bounding sets, as bwrap and `capbound` leave them, and
    nothing else. A user namespace of its own gave it every one; dropped here, nothing this
    thread or a process it starts runs can take them back (the bounding set limits what an
    `execve` grants, and the filter refuses new user namespaces)."""
    for cap in range(64):  # the bounding set first: dropping needs CAP_SETPCAP, which is kept
        if not keep & (1 << cap) and libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            if ctypes.get_errno() == errno.EINVAL:
                break  # past the last capability this kernel has
            check(-1, f"drop capability {cap} from the bounding set")
    header = CapHeader(CAPABILITY_VERSION_3, 0)
    data = (CapData * 2)()
    for word in range(2):
        bits = (keep >> (32 * word)) & 0xFFFFFFFF
        data[word].effective = data[word].permitted = data[word].inheritable = bits
    check(libc.capset(ctypes.byref(header), data), "capset")
    for cap in range(64):
        if keep & (1 << cap):
            check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0), "ambient")


def install_filter(program: bytes) -> None:
    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    prog = SockFprog(len(program) // 8, program)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")


ALL_IDS = "0 0 4294967295\n"
"""Every user and group id is the parent namespace's same id (a machine's root owns its files
and can give them to any id, as in a container)."""
MAP_WAIT_S = 10.0


def await_ids() -> None:
    """Just after unshare(NEWUSER): waits until this namespace's ids are mapped from outside
    (a process can map no more than its own id from inside)."""
    give_up = time.monotonic() + MAP_WAIT_S
    while True:
        with open("/proc/self/uid_map") as f:
            if f.read().strip():
                return
        if time.monotonic() > give_up:
            raise OSError(errno.ETIMEDOUT, "this machine's user ids were never mapped")
        time.sleep(0.0002)


def map_child(pid: int) -> None:
    """Maps every id for a child that has unshared its user namespace (or is about to)."""
    own = os.readlink("/proc/self/ns/user")
    give_up = time.monotonic() + MAP_WAIT_S
    while os.readlink(f"/proc/{pid}/ns/user") == own:
        if time.monotonic() > give_up:
            raise OSError(errno.ETIMEDOUT, f"child {pid} did not enter its user namespace")
        time.sleep(0.0002)
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(ALL_IDS)


def become_machine(cid: str, report: int) -> None:
    """New namespaces, the child's overlay as its root (the fork server's gone), its loopback up.

    The process that called this only forks: what returns from here is its fork, the first
    process of a PID namespace of its own, while the caller writes that fork's pid to `report`
    and exits, leaving it to the fork server (a subreaper) to wait for. So a step can signal no
    process but its own: not its siblings (other rollouts), not the fork server. (Its /proc is
    still the fork server's: a fresh one cannot be mounted under the sandbox's, whose covered
    paths the kernel locks; there, other processes' environments stay unreadable, and their
    numbers name nothing in the step's namespace.)
    """
    check(libc.unshare(NEWUSER | NEWNS | NEWUTS | NEWIPC | NEWNET | NEWPID), "unshare")
    await_ids()  # the fork server maps every id for this namespace (map_child)
    # Nothing mounted from here on propagates anywhere, nor anything from elsewhere here.
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "private")
    base = f"{CTL}/children/{cid}"
    lower = CTL + "/parent-upper:" + CTL + "/lower"
    opts = f"lowerdir={lower},upperdir={base}/upper,workdir={base}/work,userxattr"
    merged = base + "/merged"
    # The child's last step may still be letting go of this layer (its namespace's mounts are
    # torn down after its last process exited): the kernel refuses a second overlay on an
    # upper directory in use until then.
    for _ in range(400):
        if libc.mount(b"overlay", merged.encode(), b"overlay", 0, opts.encode()) == 0:
            break
        if ctypes.get_errno() not in (errno.EACCES, errno.EBUSY):
            check(-1, "overlay")
        time.sleep(0.005)
    else:
        check(-1, "overlay (its layer stayed in use by its last step)")
    check(libc.mount(b"/proc", (merged + "/proc").encode(), None, MS_BIND | MS_REC, None), "proc")
    own_dev(merged + "/dev")
    check(libc.mount(b"tmpfs", (merged + "/tmp").encode(), b"tmpfs", 0, None), "tmp")
    run = (merged + CTL).encode()
    os.makedirs(run, exist_ok=True)
    check(libc.mount((base + "/sockets").encode(), run, None, MS_BIND, None), "sockets")
    # A remount in a user namespace must keep the flags it inherited (they are locked).
    kept = os.statvfs(run).f_flag
    locked = sum(ms for st, ms in STATVFS_TO_MS if kept & st)
    check(libc.mount(None, run, None, MS_BIND | MS_REMOUNT | MS_RDONLY | locked, None), "ro")
    loopback_up()
    # The overlay becomes the root and the fork server's is detached: a chroot could be left
    # (a step is root in its user namespace), and that root holds the fork server's socket and
    # every sibling's directory. What was mounted under it stays in the new root.
    os.chdir(merged)
    check(libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "detach the fork server's root")
    os.chdir("/")
    first = os.fork()
    if first:
        os.write(report, b"%d\n" % first)
        os._exit(0)
    os.close(report)


def own_dev(dev: str) -> None:
    """A /dev of the child's own: a fresh tmpfs with the fork server's harmless devices bound
    in, its own /dev/shm and its own pseudo-terminals. (Bound whole, the fork server's /dev was
    one writable tmpfs for every child: one step could leave files in /dev/shm for the next,
    or put a file of its own where a sibling's /dev/null or /dev/urandom was.)"""
    check(libc.mount(b"tmpfs", dev.encode(), b"tmpfs", MS_NOSUID | MS_NOEXEC, b"mode=755"), "dev")
    for name in DEVICES:
        node = f"{dev}/{name}"
        os.close(os.open(node, os.O_CREAT | os.O_WRONLY, 0o666))  # where the device is bound
        check(libc.mount(f"/dev/{name}".encode(), node.encode(), None, MS_BIND, None), name)
    for name in ("shm", "pts"):
        os.mkdir(f"{dev}/{name}")
    shm = MS_NOSUID | MS_NODEV
    check(libc.mount(b"tmpfs", f"{dev}/shm".encode(), b"tmpfs", shm, b"mode=1777"), "shm")
    pts = b"newinstance,ptmxmode=0666,mode=620"
    check(
        libc.mount(b"devpts", f"{dev}/pts".encode(), b"devpts", MS_NOSUID | MS_NOEXEC, pts), "pts"
    )
    for name, target in DEV_LINKS:
        os.symlink(target, f"{dev}/{name}")


def loopback_up() -> None:
    """The child's own network namespace starts with its loopback down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        name, flags = struct.unpack(
            "16sH", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH", b"lo", 0))[:18]
        )
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", name, flags | IFF_UP))


def run_child(cid: str, request: dict[str, Any], go_read: int, report: int, program: bytes) -> int:
    base = f"{CTL}/children/{cid}"
    out = os.open(base + "/stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(base + "/stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    # Nothing happens until the agent has moved this process into its own cgroup: what setting
    # up allocates (namespaces, mounts) is charged there, not to the parent's (whose limit
    # would otherwise shrink with every child of the pool). Then "settle" (a pool child: set
    # up, wait for the step) or "go" (set up, run the step) arrives on the pipe.
    with os.fdopen(go_read, "rb") as pipe:
        line = pipe.readline()
        if not line:
            return 0  # a pool child that was never used
        become_machine(cid, report)
        install_filter(program)
        if json.loads(line).get("settle"):
            line = pipe.readline()
            if not line:
                return 0
    request = json.loads(line)
    if request.get("stdin"):  # the agent's file, in the child's read-only /run/fleet
        fd = os.open(f"{CTL}/stdin", os.O_RDONLY | os.O_NOFOLLOW)
        os.dup2(fd, 0)
        os.close(fd)
    name = (request.get("hostname") or cid).encode()[:63]
    check(libc.sethostname(name, len(name)), "hostname")
    own_name(name.decode(errors="replace"))
    keep_capabilities(KEEP)  # (naming itself was the last thing that needed more)
    os.chdir(request.get("workdir") or "/")
    os.environ.clear()
    os.environ.update(request.get("env") or {})
    argv = request["argv"]
    if len(argv) >= 3 and argv[0] in ("python3", "python") and argv[1] == "-c":
        sys.argv = ["-c", *argv[3:]]
        scope = dict(WARM)
        scope["__name__"] = "__main__"
        exec(compile(argv[2], "<step>", "exec"), scope)
        return 0
    os.execvpe(argv[0], argv, os.environ)
    return 127


def own_name(name: str) -> None:
    """The child's own name in its /etc/hosts and /etc/hostname (its layer's copies), so that
    it resolves as a cold machine's does."""
    hosts = f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{name}\n"
    for path, text in (("/etc/hosts", hosts), ("/etc/hostname", name + "\n")):
        try:
            with open(path, "w") as f:
                f.write(text)
        except OSError:
            pass  # (an image without /etc: nothing resolves there anyway)


def open_fds() -> set[int]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(name))  # (the listing's own descriptor is closed by now)
        except OSError:
            continue
        fds.add(int(name))
    return fds


def close_inherited(keep: set[int]) -> None:
    """Closes every descriptor but `keep` (one close_range per gap between kept ones)."""
    low = 0
    for fd in sorted(keep):
        if fd > low:
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


def child_main(
    cid: str, request: dict[str, Any], go_read: int, report: int, program: bytes
) -> None:
    """The forked child's whole life: it ends here, with os._exit, whatever happens (an error
    that escaped would carry on in the fork server's code, as a second fork server)."""
    code = 1
    try:
        try:
            close_inherited(WARM_FDS | {1, 2, go_read, report})  # 1, 2: replaced in run_child
            null = os.open("/dev/null", os.O_RDONLY)  # stdin: nothing to read (fd 0 was closed)
            if null != 0:
                os.dup2(null, 0)
                os.close(null)
            code = run_child(cid, request, go_read, report, program)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            code = 1
            traceback.print_exc()  # (may fail too: a full disk under stderr)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # (its disk is full): the output is lost, and the step failed
                code = code or 1
    finally:
        os._exit(code)


def reaper() -> None:
    """Waits for every child: first the process forked here, then, if that one forked its
    step's process (and reported its pid) before it exited, that process, which comes to this
    one as a subreaper. The step's process may be reaped first: its status waits in `early`."""
    early: dict[int, int] = {}
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            spawned.acquire()  # no child at all: until the next spawn (no polling)
            continue
        with lock:
            entry = next((e for e in children.values() if e[0] == pid), None)
            if entry is None:
                early[pid] = status
                continue
            step_pid = read_report(entry[5]) if entry[5] is not None else None
            entry[5] = None
            if step_pid is None:  # the step's process itself, or a first one that failed
                entry[2] = status
                entry[3].set()
                continue
            entry[0] = step_pid
            if step_pid in early:
                entry[2] = early.pop(step_pid)
                entry[3].set()


def read_report(fd: int) -> int | None:
    """The pid a child's first process wrote before it exited (None: it wrote none). Never
    waits: a step's process that outlived a first process killed before it wrote still holds
    the write end for a moment, and the reaper must not wait on it."""
    try:
        data = os.read(fd, 64)
    except BlockingIOError:
        data = b""
    finally:
        os.close(fd)
    return int(data) if data.strip() else None


def serve(conn: socket.socket, program: bytes) -> None:
    reader = conn.makefile("r")
    for line in reader:
        try:
            reply = handle(json.loads(line), program)
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        conn.sendall((json.dumps(reply) + "\n").encode())


def handle(request: dict[str, Any], program: bytes) -> dict[str, Any]:
    op, cid = request.get("op"), str(request.get("id", ""))
    if op == "spawn":
        for sub in ("upper", "work", "merged", "sockets"):
            os.makedirs(f"{CTL}/children/{cid}/{sub}", exist_ok=True)
        with lock:  # the reaper must see the entry before the child can exit
            go_read, go_write = os.pipe()  # (under the lock: no other fork holds its read end)
            report_read, report_write = os.pipe()
            os.set_blocking(report_read, False)
            pid = os.fork()
            if pid == 0:
                child_main(cid, request, go_read, report_write, program)
            os.close(go_read)
            os.close(report_write)
            step = {k: request[k] for k in STEP_KEYS if k in request}
            children[cid] = [pid, go_write, None, threading.Event(), step, report_read, False]
        spawned.release()
        return {"id": cid, "pid": pid}
    if op == "settle":
        entry = children[cid]
        try:
            os.write(entry[1], b'{"settle": true}\n')
            map_child(entry[0])
            entry[6] = True
        except (BrokenPipeError, FileNotFoundError, ProcessLookupError):
            return {"error": f"child {cid} is gone"}
        return {"ok": True}
    if op == "go":  # the step: from this request (a pool child) or from its spawn
        entry = children[cid]
        try:
            os.write(entry[1], (json.dumps(request.get("step") or entry[4]) + "\n").encode())
            if not entry[6]:
                map_child(entry[0])
                entry[6] = True
        except (BrokenPipeError, FileNotFoundError, ProcessLookupError):
            return {"error": f"child {cid} is gone"}
        finally:
            os.close(entry[1])
        return {"ok": True}
    if op == "wait":
        entry = children[cid]
        entry[3].wait()
        with lock:
            children.pop(cid, None)
        return {"id": cid, "status": entry[2]}
    if op == "copy":
        source = str(request.get("from", ""))
        if not source or "/" in source or "/" in cid or source in (".", "..") or not cid:
            return {"error": "copy: give the ids of two children"}
        for sub in ("upper", "work", "merged", "sockets"):
            os.makedirs(f"{CTL}/children/{cid}/{sub}", exist_ok=True)
        copy_layer(f"{CTL}/children/{source}/upper", f"{CTL}/children/{cid}/upper")
        return {"ok": True}
    return {"error": f"unknown op {op!r}"}


def copy_layer(src: str, dst: str) -> None:
    """A child's writable layer copied into another's: files, links, whiteouts (device 0/0),
    owners, modes, times and extended attributes (the overlay's own among them). Nothing is
    followed: a link is copied as a link."""
    dirs: list[tuple[str, os.stat_result, str]] = []

    def attrs(path: str, st: os.stat_result, target: str) -> None:
        os.chown(target, st.st_uid, st.st_gid, follow_symlinks=False)
        if not stat.S_ISLNK(st.st_mode):
            os.chmod(target, stat.S_IMODE(st.st_mode))
            for name in os.listxattr(path, follow_symlinks=False):
                try:
                    value = os.getxattr(path, name, follow_symlinks=False)
                    os.setxattr(target, name, value, follow_symlinks=False)
                except OSError:
                    if name.startswith("user.overlay."):
                        raise  # (without it the copy is not the same tree)
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)

    def walk(path: str, target: str) -> None:
        with os.scandir(path) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                into = os.path.join(target, entry.name)
                if stat.S_ISDIR(st.st_mode):
                    os.mkdir(into, 0o700)
                    walk(entry.path, into)
                    dirs.append((entry.path, st, into))
                    continue
                if stat.S_ISLNK(st.st_mode):
                    os.symlink(os.readlink(entry.path), into)
                elif stat.S_ISREG(st.st_mode):
                    with open(entry.path, "rb") as f, open(into, "xb") as g:
                        while chunk := f.read(1 << 20):
                            g.write(chunk)
                else:  # a whiteout, a fifo, a device node
                    os.mknod(into, st.st_mode, st.st_rdev)
                attrs(entry.path, st, into)

    walk(src, dst)
    for path, st, target in dirs:  # deepest first: setting a directory's time ends its writes
        attrs(path, st, target)
    attrs(src, os.stat(src, follow_symlinks=False), dst)


def lock_mounts() -> None:
    """Enters a user and mount namespace of its own, so that every mount the sandbox made is
    copied in locked: this process's filter allows mount and umount (its children need them)
    and the warm-up runs here, yet nothing the sandbox covers (/proc/sys, read-only) can be
    unmounted or made writable again. Children are made from here as before, one level down."""
    check(libc.unshare(NEWUSER | NEWNS), "lock mounts")
    sys.stdout.write("map-ids\n")  # the agent maps every id, from the machine's namespace
    sys.stdout.flush()
    if not sys.stdin.buffer.read(1):
        raise OSError(errno.EPIPE, "the agent went away before mapping this process's ids")
    await_ids()


def main() -> None:
    """Runs the warm-up on this thread, then serves forks from another.

    Both drop to a cold machine's capabilities first, but the fork server's threads keep the
    looser filter its children need (they unshare and mount, then install the full one), while
    this thread installs the full filter before the warm-up runs: the warm-up, and every thread
    and process it starts, can make no namespace, mount nothing and open no io_uring, as in a
    cold machine. (Seccomp filters, capabilities and no-new-privs belong to each thread.)

    The threads share this process's memory, so a warm-up written to rewrite the fork server's
    code can still reach the looser filter through it; what it reaches there is no more than
    a child gets while it sets up (new namespaces, mounts in them), and never nf_tables,
    AF_PACKET or AF_VSOCK, which both filters refuse.
    """
    global KEEP
    with open(CTL + "/child.bpf", "rb") as f:
        program = f.read()
    with open(CTL + "/caps") as f:
        KEEP = int(f.read().strip(), 16)
    lock_mounts()  # (while this process has one thread: a user namespace needs that)
    keep_capabilities(KEEP)  # the fork server's threads, started next, inherit the drop
    warmed = threading.Event()
    forks = threading.Thread(target=serve_forks, args=(program, warmed), daemon=True)
    forks.start()
    install_filter(program)
    try:
        with open(CTL + "/warmup.py") as f:
            exec(compile(f.read(), "<warm-up>", "exec"), WARM)
    except BaseException:  # the rollout's code failed, not this host: said as such
        sys.stdout.write("warm-up-failed\n")
        sys.stdout.flush()
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)
    # Everything the warm-up made is left alone by the collector from now on: a collection
    # writes to every object it visits, and each page this process writes after a fork is a
    # copy, while the children go on holding the original, charged to the parent's cgroup.
    # Unfrozen, a pool of 48 children held over 200 MiB of the parent's 256 MiB that way.
    gc.collect()
    gc.freeze()
    WARM_FDS.update(open_fds() - {0, 1, 2})
    warmed.set()
    forks.join()  # (it serves for as long as the parent lives)
    os._exit(1)


def serve_forks(program: bytes, warmed: threading.Event) -> None:
    """The fork server, once the warm-up has run: children are forked from its threads."""
    warmed.wait()
    # A child's step runs in a fork of the child's first process, which exits at once: this
    # process adopts and waits for it.
    check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "subreaper")
    threading.Thread(target=reaper, daemon=True).start()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = CTL + "/zygote.sock"
    if os.path.exists(path):
        os.unlink(path)
    server.bind(path)
    server.listen(64)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve, args=(conn, program), daemon=True).start()


if __name__ == "__main__":
    main()
