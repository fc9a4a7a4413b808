"""The namespace runtime's system-call filter: a seccomp BPF program bwrap loads (--seccomp FD).

A deny list, like container runtimes use: everything a sandboxed workload has no business doing
(mounting, tracing other processes, loading kernel modules, keyrings, BPF, namespaces, the clock,
rebooting) fails with EPERM; every other call is allowed. Calls from another ABI (32-bit or x32)
are refused outright, since their numbers differ and would slip past the list.
"""

from __future__ import annotations

import platform
import struct

from fleet.core.errors import Unavailable

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
EPERM = 1

_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_RET_K = 0x06
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000

# x86_64 numbers, checked against <asm/unistd_64.h> by a test where the header is installed.
DENIED_X86_64: dict[str, int] = {
    "ptrace": 101, "syslog": 103, "uselib": 134, "pivot_root": 155, "adjtimex": 159,
    "acct": 163, "settimeofday": 164, "mount": 165, "umount2": 166, "swapon": 167,
    "swapoff": 168, "reboot": 169, "iopl": 172, "ioperm": 173, "create_module": 174,
    "init_module": 175, "delete_module": 176, "get_kernel_syms": 177, "query_module": 178,
    "quotactl": 179, "nfsservctl": 180, "lookup_dcookie": 212, "clock_settime": 227,
    "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272,
    "perf_event_open": 298, "name_to_handle_at": 303, "open_by_handle_at": 304,
    "clock_adjtime": 305, "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311,
    "finit_module": 313, "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "mount_setattr": 442,
}  # fmt: skip


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


ZYGOTE_ALLOWS = frozenset({"unshare", "mount", "umount2", "pivot_root"})
"""What a warm parent's fork server may still call, to put each child into its own namespaces
and make its overlay the root; every child installs the full filter on top before its step
runs."""


def program(machine: str | None = None, allow: frozenset[str] = frozenset()) -> bytes:
    """The filter as raw `struct sock_filter` instructions for this host's architecture."""
    arch = machine or platform.machine()
    if arch != "x86_64":
        raise Unavailable(
            f"the namespace runtime's seccomp filter has no system-call table for {arch}; "
            "it refuses to run sandboxes without one"
        )
    numbers = sorted({nr for name, nr in DENIED_X86_64.items() if name not in allow})
    deny = 4 + len(numbers) + 1  # index of the deny instruction
    out = [
        _insn(_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        _insn(_JEQ_K, 0, deny - 2, AUDIT_ARCH_X86_64),
        _insn(_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        _insn(_JGE_K, deny - 4, 0, X32_SYSCALL_BIT),
    ]
    for i, nr in enumerate(numbers):
        index = 4 + i
        out.append(_insn(_JEQ_K, deny - (index + 1), 0, nr))
    out.append(_insn(_RET_K, 0, 0, _RET_ALLOW))
    out.append(_insn(_RET_K, 0, 0, _RET_ERRNO | EPERM))
    return b"".join(out)
