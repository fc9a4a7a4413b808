"""The capabilities a machine's root keeps, as the kernel numbers them, and the small static
program (`capbound.c`) that takes every other one out of a cold machine's bounding set.

bwrap keeps `view.CAPABILITIES` in a command's effective, permitted, inheritable and ambient
sets, but leaves its bounding set whole; the bounding set is what a later `execve` of a
privileged file could draw on, so it is cut to the same set before the command runs. A warm
parent's fork server and its children, which enter user namespaces of their own (where the
kernel gives every capability back), drop to the same sets themselves (`zygote.py`, from the
mask written by `fleet.runtime.warm`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from fleet.runtime import users
from fleet.runtime.view import CAPABILITIES

NUMBERS: dict[str, int] = {
    "CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_FOWNER": 3,
    "CAP_FSETID": 4, "CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8,
    "CAP_LINUX_IMMUTABLE": 9, "CAP_NET_BIND_SERVICE": 10, "CAP_NET_BROADCAST": 11,
    "CAP_NET_ADMIN": 12, "CAP_NET_RAW": 13, "CAP_IPC_LOCK": 14, "CAP_IPC_OWNER": 15,
    "CAP_SYS_MODULE": 16, "CAP_SYS_RAWIO": 17, "CAP_SYS_CHROOT": 18, "CAP_SYS_PTRACE": 19,
    "CAP_SYS_PACCT": 20, "CAP_SYS_ADMIN": 21, "CAP_SYS_BOOT": 22, "CAP_SYS_NICE": 23,
    "CAP_SYS_RESOURCE": 24, "CAP_SYS_TIME": 25, "CAP_SYS_TTY_CONFIG": 26, "CAP_MKNOD": 27,
    "CAP_LEASE": 28, "CAP_AUDIT_WRITE": 29, "CAP_AUDIT_CONTROL": 30, "CAP_SETFCAP": 31,
    "CAP_MAC_OVERRIDE": 32, "CAP_MAC_ADMIN": 33, "CAP_SYSLOG": 34, "CAP_WAKE_ALARM": 35,
    "CAP_BLOCK_SUSPEND": 36, "CAP_AUDIT_READ": 37, "CAP_PERFMON": 38, "CAP_BPF": 39,
    "CAP_CHECKPOINT_RESTORE": 40,
}  # fmt: skip
"""<linux/capability.h>'s numbers."""

SOURCE = Path(__file__).with_name("capbound.c")


def mask(names: Iterable[str] = CAPABILITIES) -> int:
    """The capabilities `names` as the kernel's bit mask (as /proc/PID/status shows it)."""
    bits = 0
    for name in names:
        bits |= 1 << NUMBERS[name]
    return bits


def bounder(cache: Path) -> Path:
    """The compiled bounding-set helper in `cache` (built by `fleet.runtime.helpers` when the
    host is prepared or the runtime is made; `users.tool`)."""
    return users.tool(cache, SOURCE, "the namespace runtime", "capability-bounding helper")


def bounder_argv(helper_fd: int, keep: int) -> list[str]:
    """What runs first in a machine's sandbox: the helper, through its inherited descriptor,
    keeping `keep` (a mask) in the bounding set."""
    return [f"/proc/self/fd/{helper_fd}", str(helper_fd), f"{keep:x}", "--"]
