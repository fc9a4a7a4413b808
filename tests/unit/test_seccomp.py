"""The system-call filter, loaded for real in a child process that then probes the kernel."""

from __future__ import annotations

import json
import subprocess
import sys

from fleet.runtime import seccomp

PROBE = r"""
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
prog = sys.stdin.buffer.read()

class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

assert libc.prctl(38, 1, 0, 0, 0) == 0  # no_new_privs
assert libc.prctl(22, 2, ctypes.byref(Prog(len(prog) // 8, prog)), 0, 0) == 0, ctypes.get_errno()

def call(nr, *args):
    libc.syscall.restype = ctypes.c_long
    r = libc.syscall(nr, *[ctypes.c_long(a) for a in args])
    if r == 0 and nr in (56,):  # the child of a clone that got through: leave at once
        os._exit(0)
    if r > 0 and nr == 56:
        os.waitpid(r, 0)
    return "ok" if r >= 0 else os.strerror(ctypes.get_errno())

SIGCHLD = 17
out = {
    "clone_newuser": call(56, 0x10000000 | SIGCHLD, 0, 0, 0, 0),
    "clone_newnet": call(56, 0x40000000 | SIGCHLD, 0, 0, 0, 0),
    "clone_newtime": call(56, 0x80 | SIGCHLD, 0, 0, 0, 0),
    "clone_plain": call(56, SIGCHLD, 0, 0, 0, 0),
    "clone3": call(435, 0, 0),
    "io_uring_setup": call(425, 8, 0),
    "unshare": call(272, 0x04000000),
    "mount": call(165, 0, 0, 0, 0, 0),
    "keyctl": call(250, 0, 0, 0, 0),
    "getpid": call(39),
}
pid = os.fork()  # glibc's fork: clone without namespace flags
if pid == 0:
    os._exit(7)
out["fork"] = os.waitpid(pid, 0)[1] >> 8
print(json.dumps(out))
"""


def probe(program: bytes) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], input=program, capture_output=True, timeout=60
    )
    assert done.returncode == 0, done.stderr.decode()
    return dict(json.loads(done.stdout))


def test_the_filter_refuses_namespaces_io_uring_and_clone3_and_allows_the_rest() -> None:
    out = probe(seccomp.program())
    assert out.pop("clone3") == "Function not implemented"  # so C libraries fall back to clone
    assert out.pop("getpid") == "ok"
    assert out.pop("clone_plain") == "ok"
    assert out.pop("fork") == 7
    assert set(out.values()) == {"Operation not permitted"}, out


def test_the_fork_servers_filter_keeps_what_it_needs_and_no_more() -> None:
    """unshare and mount stay open to the warm parent's fork server; clone with namespace
    flags, io_uring and keyctl do not."""
    out = probe(seccomp.program(allow=seccomp.ZYGOTE_ALLOWS))
    assert out["unshare"] != "Operation not permitted"
    assert out["mount"] != "Operation not permitted"
    assert out["clone_newuser"] == "Operation not permitted"
    assert out["io_uring_setup"] == "Operation not permitted"
    assert out["keyctl"] == "Operation not permitted"
