"""The system-call filter's `socket` rules, loaded for real in a child process that then opens
sockets through the raw system call (so that high bits of an `int` argument reach the filter
as a caller could set them)."""

from __future__ import annotations

import json
import subprocess
import sys

from fleet.runtime import seccomp

PROBE = r"""
import ctypes, errno, json, os, platform, socket, sys
SYS_SOCKET = {"x86_64": 41, "aarch64": 198}[platform.machine()]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
prog = sys.stdin.buffer.read()

class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

assert libc.prctl(38, 1, 0, 0, 0) == 0  # no_new_privs
assert libc.prctl(22, 2, ctypes.byref(Prog(len(prog) // 8, prog)), 0, 0) == 0, ctypes.get_errno()
HIGH = 1 << 32  # ignored by the kernel, which reads the arguments as ints

def sock(family, kind, proto=0):
    fd = libc.syscall(SYS_SOCKET, ctypes.c_long(family), ctypes.c_long(kind), ctypes.c_long(proto))
    if fd >= 0:
        os.close(fd)
        return "ok"
    return errno.errorcode[ctypes.get_errno()]

NONBLOCK_CLOEXEC = 0o4000 | 0o2000000
out = {
    "vsock": sock(40, socket.SOCK_STREAM),
    "vsock_high": sock(40 | HIGH, socket.SOCK_STREAM),
    "packet": sock(17, socket.SOCK_RAW, 0x0300),
    "packet_high": sock(17 | HIGH, socket.SOCK_DGRAM, 0x0300),
    "inet_sock_packet": sock(2, 10 | NONBLOCK_CLOEXEC, 0x0300),
    "netfilter": sock(16, socket.SOCK_RAW, 12),
    "netfilter_high": sock(16 | HIGH, socket.SOCK_RAW | NONBLOCK_CLOEXEC, 12 | HIGH),
    "netlink_route": sock(16, socket.SOCK_RAW, 0),
    "tcp": sock(2, socket.SOCK_STREAM),
    "udp": sock(2, socket.SOCK_DGRAM),
    "icmp_dgram": sock(2, socket.SOCK_DGRAM, 1),
    "tcp6": sock(10, socket.SOCK_STREAM),
    "unix": sock(1, socket.SOCK_STREAM),
}
print(json.dumps(out))
"""


def probe(program: bytes) -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], input=program, capture_output=True, timeout=60
    )
    assert done.returncode == 0, done.stderr.decode()
    return dict(json.loads(done.stdout))


def test_vsock_packet_and_netfilter_sockets_are_refused_whatever_the_high_bits() -> None:
    """AF_VSOCK and AF_PACKET (also as AF_INET's SOCK_PACKET) fail with EAFNOSUPPORT and
    NETLINK_NETFILTER with EPERM, also when the caller sets bits the kernel ignores; the
    sockets machines use (TCP, UDP, ICMP for ping, Unix, netlink's routing) still open (where
    this host lets an unprivileged ICMP socket be made at all)."""
    for program in (seccomp.program(), seccomp.program(allow=seccomp.ZYGOTE_ALLOWS)):
        out = probe(program)
        assert out.pop("icmp_dgram") in ("ok", "EACCES")  # (net.ipv4.ping_group_range)
        assert out == {
            "vsock": "EAFNOSUPPORT", "vsock_high": "EAFNOSUPPORT",
            "packet": "EAFNOSUPPORT", "packet_high": "EAFNOSUPPORT",
            "inet_sock_packet": "EAFNOSUPPORT",
            "netfilter": "EPERM", "netfilter_high": "EPERM",
            "netlink_route": "ok", "tcp": "ok", "udp": "ok", "tcp6": "ok", "unix": "ok",
        }  # fmt: skip
