"""What a host may claim to be, and names that may not fool a reader.

A join token bounds its hosts (`HostBound`): the class and labels an operator gave it, and the
runtimes it allows. By default that is the namespace runtime only: a microVM runtime claims VM
isolation, which rollouts that require it trust, so no host may claim it on its own word. The
bound is kept with the enrolled host and checked at enrollment and at every registration.

Host ids and tenants are checked against their whole text: `re.match` with a `$` pattern also
accepts the name with a newline after it, which then reads as another name in logs and lists.
Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.core.credentials import HOST_ID_RE, TENANT_RE, check_host_id, check_tenant
from fleet.core.errors import InvalidArgument, PermissionDenied
from fleet.core.placement import HostCapabilities, HostClass, Isolation, RuntimeKind

DEFAULT_RUNTIMES = frozenset({RuntimeKind.NAMESPACE})
"""What a join token made without `--runtime` allows."""
ISOLATION_OF = {RuntimeKind.SMOL: Isolation.VM, RuntimeKind.NAMESPACE: Isolation.NAMESPACE}
"""The isolation each runtime gives: a host may claim only its allowed runtimes'."""


def no_control(value: str, what: str) -> str:
    """`value`, refused if it holds a control character (a newline, a NUL, an escape): a name
    that ends in a newline looks like another in every log line and listing."""
    bad = next((c for c in value if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0), None)
    if bad is not None:
        raise InvalidArgument(f"{what} {value[:80]!r} holds a control character ({bad!r})")
    return value


def strict_host_id(host_id: str) -> str:
    """A host id as `check_host_id` has it, and nothing after it: a pattern's `$` also matches
    before a final newline, so an id with one appended passes a match that is not full."""
    check_host_id(host_id)
    if HOST_ID_RE.fullmatch(host_id) is None:
        raise InvalidArgument(f"host id {host_id[:80]!r} holds a control character")
    return host_id


def strict_tenant(tenant: str) -> str:
    """A tenant as `check_tenant` has it, and nothing after it (see `strict_host_id`)."""
    check_tenant(tenant)
    if TENANT_RE.fullmatch(tenant) is None:
        raise InvalidArgument(f"tenant {tenant[:80]!r} holds a control character")
    return tenant


def runtimes_text(runtimes: frozenset[RuntimeKind]) -> str:
    return ",".join(sorted(r.value for r in runtimes))


def parse_runtimes(text: str) -> frozenset[RuntimeKind]:
    """`smol,namespace` -> runtimes; an unknown one is refused by name."""
    out: set[RuntimeKind] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            out.add(RuntimeKind(part))
        except ValueError:
            known = ", ".join(r.value for r in RuntimeKind)
            raise InvalidArgument(f"unknown runtime {part!r} (known: {known})") from None
    if not out:
        raise InvalidArgument("a join token allows at least one runtime")
    return frozenset(out)


def _labels_text(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "none"


@dataclass(frozen=True)
class HostBound:
    """What a host may claim to be: its join token's class, labels and runtimes."""

    host_class: HostClass
    labels: dict[str, str]
    runtimes: frozenset[RuntimeKind]
    source: str
    """Whose bound it is, for the refusal ("join token 3fa2c1")."""

    def check(self, caps: HostCapabilities) -> None:
        """Refuses (PERMISSION_DENIED, naming each part and the bound) capabilities beyond it."""
        problems = []
        if caps.host_class != self.host_class:
            problems.append(f"class {caps.host_class} (allowed: {self.host_class})")
        extra = {k: v for k, v in caps.labels.items() if self.labels.get(k) != v}
        if extra:
            problems.append(f"labels {_labels_text(extra)} (allowed: {_labels_text(self.labels)})")
        allowed = runtimes_text(self.runtimes)
        if caps.runtime not in self.runtimes:
            problems.append(f"runtime {caps.runtime} (allowed: {allowed})")
        isolations = {ISOLATION_OF[r] for r in self.runtimes}
        if caps.isolation not in isolations:
            problems.append(f"isolation {caps.isolation} (allowed: "
                            f"{','.join(sorted(isolations))}, by runtime {allowed})")  # fmt: skip
        if self.host_class == HostClass.CPU and caps.cuda_devices:
            problems.append(f"{caps.cuda_devices} CUDA devices (allowed: none, as a cpu-class "
                            "host)")  # fmt: skip
        if problems:
            raise PermissionDenied(
                f"host {caps.host_id!r} claims more than {self.source} allows: "
                + "; ".join(problems)
                + ". Make a join token that allows it (fleet host token create --class, "
                "--label, --runtime) and enroll under a new host id"
            )
