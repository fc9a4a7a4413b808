"""The namespace runtime's system-call filter, built with libseccomp and loaded by bwrap
(`--seccomp FD`) or by a warm parent's fork server.

A deny list, like container runtimes use: everything a sandboxed workload has no business doing
(mounting, tracing other processes, loading kernel modules, keyrings, BPF, namespaces, the clock,
rebooting, io_uring, whose requests bypass this filter) fails with EPERM; every other call is
allowed. The filter is argument-aware where a call is dangerous only with some arguments:
`clone` is refused when it asks for a new namespace, and `clone3`, whose flags live in memory a
filter cannot read, fails with ENOSYS, so C libraries fall back to `clone` (as Docker's profile
does). `socket` is refused for the families a machine has no use for and whose kernel code is
a known way in: AF_VSOCK (the hypervisor's sockets) and AF_PACKET (raw frames, also reached as
AF_INET's obsolete SOCK_PACKET) fail with EAFNOSUPPORT, and netlink's NETLINK_NETFILTER (nf_tables,
the firewall's own interface) with EPERM. Integer arguments are compared on their low 32 bits
only, as the kernel reads them: high bits set by the caller change nothing. libseccomp knows every
architecture's numbers; calls of another ABI than the host's (32-bit or x32 on a 64-bit host) are
refused outright, since their numbers would slip past the list.
"""

from __future__ import annotations

import errno
import os
import platform
from collections.abc import Iterable
from typing import Any

from fleet.core.errors import Unavailable

DENIED: tuple[str, ...] = (
    "ptrace", "syslog", "uselib", "pivot_root", "adjtimex", "acct", "settimeofday", "mount",
    "umount2", "swapon", "swapoff", "reboot", "iopl", "ioperm", "create_module", "init_module",
    "delete_module", "get_kernel_syms", "query_module", "quotactl", "nfsservctl",
    "lookup_dcookie", "clock_settime", "kexec_load", "add_key", "request_key", "keyctl",
    "unshare", "perf_event_open", "name_to_handle_at", "open_by_handle_at", "clock_adjtime",
    "setns", "process_vm_readv", "process_vm_writev", "finit_module", "kexec_file_load", "bpf",
    "userfaultfd", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick",
    "mount_setattr", "io_uring_setup", "io_uring_enter", "io_uring_register",
)  # fmt: skip
"""Refused with EPERM whatever their arguments."""

NAMESPACE_FLAGS: dict[str, int] = {
    "CLONE_NEWTIME": 0x00000080, "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000, "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000, "CLONE_NEWNET": 0x40000000,
}  # fmt: skip
"""`clone` with any of these fails with EPERM: a step makes no namespaces (as `unshare`)."""

AF_INET, AF_NETLINK, AF_PACKET, AF_VSOCK = 2, 16, 17, 40
SOCK_PACKET, SOCK_TYPE_MASK = 10, 0xF
NETLINK_NETFILTER = 12
INT_MASK = 0xFFFF_FFFF
"""An `int` argument's bits: the kernel ignores the rest of the register."""
REFUSED_FAMILIES: tuple[int, ...] = (AF_VSOCK, AF_PACKET)
"""`socket` with these families fails with EAFNOSUPPORT."""

ZYGOTE_ALLOWS = frozenset({"unshare", "mount", "umount2", "pivot_root"})
"""What a warm parent's fork server may still call, to put each child into its own namespaces
and make its overlay the root; every child installs the full filter on top before its step
runs."""


def _clone_flags_arg() -> int:
    """Which argument of `clone` holds its flags (the second on s390, the first elsewhere)."""
    return 1 if platform.machine().startswith("s390") else 0


def _filter(allow: Iterable[str]) -> Any:
    allowed = frozenset(allow)
    try:
        import pyseccomp as sc  # loads libseccomp.so.2

        f = sc.SyscallFilter(sc.ALLOW)
    except (ImportError, OSError, AttributeError) as exc:  # libseccomp missing or too old
        raise Unavailable(
            f"the namespace runtime's system-call filter needs libseccomp (libseccomp2): {exc}"
        ) from exc
    f.set_attr(sc.Attr.ACT_BADARCH, sc.ERRNO(errno.EPERM))
    for name in DENIED:
        if name in allowed:
            continue
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except (OSError, ValueError):  # a call this architecture does not have: nothing to deny
            continue
    flags = _clone_flags_arg()
    for bit in NAMESPACE_FLAGS.values():
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(flags, sc.MASKED_EQ, bit, bit))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    _socket_rules(f, sc)
    return f


def _socket_rules(f: Any, sc: Any) -> None:
    """The families and protocols `socket` refuses (see the module's text)."""
    no_family = sc.ERRNO(errno.EAFNOSUPPORT)
    for family in REFUSED_FAMILIES:
        f.add_rule(no_family, "socket", sc.Arg(0, sc.MASKED_EQ, INT_MASK, family))
    # The kernel hands socket(AF_INET, SOCK_PACKET, ...) to AF_PACKET.
    f.add_rule(
        no_family, "socket",
        sc.Arg(0, sc.MASKED_EQ, INT_MASK, AF_INET),
        sc.Arg(1, sc.MASKED_EQ, SOCK_TYPE_MASK, SOCK_PACKET),
    )  # fmt: skip
    f.add_rule(
        sc.ERRNO(errno.EPERM), "socket",
        sc.Arg(0, sc.MASKED_EQ, INT_MASK, AF_NETLINK),
        sc.Arg(2, sc.MASKED_EQ, INT_MASK, NETLINK_NETFILTER),
    )  # fmt: skip


def program(allow: Iterable[str] = ()) -> bytes:
    """The filter as raw `struct sock_filter` instructions for this host's architecture, with
    the calls in `allow` left out of the deny list."""
    f = _filter(allow)
    fd = os.memfd_create("fleet-seccomp", os.MFD_CLOEXEC)
    try:
        with os.fdopen(os.dup(fd), "rb+", buffering=0) as out:
            f.export_bpf(out)
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
