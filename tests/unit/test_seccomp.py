"""The seccomp filter program: its table matches the kernel headers, its jumps land right."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from fleet.core.errors import Unavailable
from fleet.runtime import seccomp

HEADER = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")


def run_filter(prog: bytes, arch: int, nr: int) -> int:
    """A tiny interpreter for the instructions the filter uses."""
    insns = [struct.unpack("=HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    data = {0: nr, 4: arch}
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:
            acc, pc = data[k], pc + 1
        elif code == 0x15:
            pc = pc + 1 + (jt if acc == k else jf)
        elif code == 0x35:
            pc = pc + 1 + (jt if acc >= k else jf)
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unknown opcode {code:#x}")


def test_numbers_match_the_kernel_headers() -> None:
    """Every denied call's number is the one <asm/unistd_64.h> gives."""
    if not HEADER.exists():
        pytest.skip(f"{HEADER} is not installed here")
    table = dict(re.findall(r"#define __NR_(\w+) (\d+)", HEADER.read_text()))
    for name, nr in seccomp.DENIED_X86_64.items():
        assert int(table[name]) == nr, name


def test_filter_denies_the_list_and_allows_the_rest() -> None:
    """Listed calls get EPERM, others are allowed, other ABIs are refused."""
    prog = seccomp.program("x86_64")
    deny = 0x00050000 | 1
    for nr in seccomp.DENIED_X86_64.values():
        assert run_filter(prog, seccomp.AUDIT_ARCH_X86_64, nr) == deny
    for allowed in (0, 1, 2, 57, 59, 60, 231):  # read, write, open, fork, execve, exit, exit_group
        assert run_filter(prog, seccomp.AUDIT_ARCH_X86_64, allowed) == 0x7FFF0000
    assert run_filter(prog, 0x40000003, 1) == deny  # i386
    assert run_filter(prog, seccomp.AUDIT_ARCH_X86_64, 0x40000000 | 1) == deny  # x32


def test_unknown_architecture_is_refused() -> None:
    """No table for the architecture: the runtime refuses instead of running unfiltered."""
    with pytest.raises(Unavailable, match="no system-call table"):
        seccomp.program("riscv64")
