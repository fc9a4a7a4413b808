"""The runtime protocol every machine backend implements, and what it reports."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from fleet.core.egress import EgressEvent
from fleet.core.errors import InvalidArgument
from fleet.core.placement import Isolation, RuntimeKind
from fleet.core.rollout import MAX_OUTPUT_BYTES
from fleet.core.smolfile import Smolfile
from fleet.runtime.output import OutputSink

T = TypeVar("T")


async def to_the_end(work: Awaitable[T]) -> T:
    """`work` awaited to its end even when the caller is cancelled (the cancellation is raised
    after it): for steps that a cleanup must never run beside, or stop half way."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                continue  # (cancelled again: the work still has to end first)
        raise


async def to_thread_to_the_end(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a worker thread, waited for to its end even when the caller is cancelled
    (`to_the_end`). Cancelling `asyncio.to_thread` ends only the wait, not the thread: a
    cleanup that then runs beside it races it (a machine's disk mounted just after its removal
    ran stays mounted, its loop device held, for good)."""
    return await to_the_end(asyncio.to_thread(fn, *args))


BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
}


class MachineSpec(BaseModel):
    """Everything a runtime needs to make one machine."""

    model_config = ConfigDict(frozen=True)

    name: str
    smolfile: Smolfile
    image_digest: str
    rootfs: Path
    labels: dict[str, str] = Field(default_factory=dict)
    secrets: dict[str, str] = Field(default_factory=dict, repr=False)
    gateway: tuple[str, int] | None = None
    """The inference gateway (address, port): reachable only when the rollout uses it."""
    gateway_tls: bool = False
    """The gateway serves TLS: machines get `https://…` in FLEET_GATEWAY."""
    writable: tuple[tuple[str, str], ...] = ()
    """(host path, path in the machine): mounted writable (`fleet run`'s [dev] volumes)."""
    read_only: tuple[tuple[str, str], ...] = ()
    """(host path, path in the machine): mounted read-only in the machine (`fleet run`'s
    read-only [dev] volumes), where the runtime `mounts_read_only`."""
    inputs: tuple[tuple[str, str], ...] = ()
    """(host file or directory, path in the machine): a rollout's inputs, staged on this host,
    copied onto the machine's own disk and mounted read-only, where the runtime
    `mounts_read_only`."""


class Usage(NamedTuple):
    """What a machine used so far, where its runtime can tell (None: it cannot)."""

    cpu_seconds: float | None = None
    memory_peak_mib: float | None = None
    """The most memory it held at once."""


class ExecResult(BaseModel):
    """One command's result. A non-zero exit code is data, not an error."""

    model_config = ConfigDict(frozen=True)

    exit_code: int
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    oom_killed: bool = False
    pids_exhausted: bool = False
    """The machine's process limit refused a fork while the command ran."""
    disk_full: bool = False
    """The command failed with the machine's bounded disk full."""
    duration_s: float = 0.0


class Leftover(BaseModel):
    """A machine an earlier run of this host's agent left behind (found by its labels)."""

    model_config = ConfigDict(frozen=True)

    name: str
    labels: dict[str, str] = Field(default_factory=dict)
    adoptable: bool = False
    why_not: str = ""
    """Why it cannot be adopted (it is deleted whatever its lease says)."""
    is_source: bool = False
    """Other machines were branched from it: it is deleted after them."""

    @property
    def lease(self) -> tuple[str, int] | None:
        """(work id, fencing token) of the attempt it ran, from its labels."""
        try:
            return self.labels["work"], int(self.labels["fence"])
        except (KeyError, ValueError):
            return None


class Machine(Protocol):
    """A running sandbox made from a Smolfile."""

    @property
    def name(self) -> str: ...

    async def exec(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        timeout_s: float,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
        on_output: OutputSink | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult: ...

    async def read_file(self, path: str) -> bytes: ...

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None: ...

    async def usage(self) -> Usage:
        """CPU time and peak memory the machine used so far, read together."""
        ...

    async def egress_events(self) -> list[EgressEvent]:
        """Refused DNS queries and connections since the last call."""
        ...

    async def fork(self, spec: MachineSpec) -> Machine:
        """A new machine named and labelled by `spec` that starts as a copy of this one: its
        disk as it is now (namespace runtime; a warm parent's child gets a copy-on-write
        sibling), or a copy-on-write branch of RAM and disk (microVMs started branchable).
        Refused with FailedPrecondition where the runtime cannot."""
        ...

    async def stay_resident(self) -> None:
        """Prepares the machine for many short commands (a session's): where the runtime sets
        a sandbox up per command, it keeps one running instead. A no-op elsewhere."""
        ...

    def channel(self) -> Channel | None:
        """How the agent's own services (the checkpoint relay, a warm child's way to the
        gateway) reach this machine: sockets in a directory it sees as `/run/fleet`, a
        listener in its network namespace, or None where the runtime offers neither."""
        ...

    async def delete(self) -> None: ...


@runtime_checkable
class Parkable(Protocol):
    """A machine whose disk can be kept without it: a parked session's (see
    `fleet.runtime.layers`). Namespace machines are; microVMs and a warm parent's children
    refuse with FailedPrecondition; a machine without `pack_layer` cannot park at all."""

    async def pack_layer(self, archive: Path, scratch: Path) -> int:
        """Archives the machine's writable layer into `archive` (`scratch`: an empty or
        missing directory for the copy meanwhile); returns the archive's size."""
        ...


@dataclass(frozen=True)
class Channel:
    """Where the agent serves a machine: `unix` (sockets the agent puts in `path`, which the
    machine sees as /run/fleet: a warm child, which has no network of its own) or `netns` (a
    listener in the network namespace at `path`, reached at the relay's address)."""

    kind: Literal["unix", "netns"]
    path: Path


class Parent(Protocol):
    """A warm parent: a machine made ready once (its Smolfile's `init`, then a warm-up), and
    the copy-on-write children branched from it."""

    spec: MachineSpec
    carries_memory: bool
    """Whether a child's steps run in the interpreter the warm-up loaded (its Python state
    carried: the namespace runtime's fork server), or start from the parent's disk and
    memory image only (a microVM branch): the warm-up then runs again in each step."""

    async def branch(self, name: str) -> Machine:
        """A new child named `name`."""
        ...

    async def delete(self) -> None:
        """Its children first, then the parent."""
        ...


class Runtime(Protocol):
    """Makes machines; one per agent."""

    kind: RuntimeKind
    isolation: Isolation
    mounts_read_only: bool
    """Whether `MachineSpec.read_only`, `inputs` (and `writable`) host paths are mounted in
    machines."""

    async def create(self, spec: MachineSpec) -> Machine: ...

    async def list_machines(self, labels: Mapping[str, str]) -> list[str]: ...

    async def leftovers(self, host_id: str) -> list[Leftover]:
        """Machines an earlier run of this host's agent left behind."""
        ...

    async def adopt(self, leftover: Leftover, spec: MachineSpec) -> Machine:
        """A leftover machine, driven again by this agent (it must be `adoptable`)."""
        ...

    async def reap(self, host_id: str, keep: Collection[str] = ()) -> int:
        """Removes what an earlier run of this host left behind, but the machines in `keep`
        (adopted); returns how many machines it removed."""
        ...

    forks_children: bool
    """Whether `create_parent` makes warm parents here."""

    async def create_parent(
        self, spec: MachineSpec, warmup: str, pool_size: int,
        prepare: Callable[[Machine], Awaitable[None]],
    ) -> Parent:  # fmt: skip
        """A warm parent from `spec`: started (branchable), `prepare`d (the agent runs the
        Smolfile's `init` there), then warmed by `warmup` (Python source; "": none), with
        `pool_size` children made ahead of need where the runtime keeps a pool. Refused with
        FailedPrecondition where `forks_children` is False."""
        ...


def resolve_secrets(spec: Smolfile, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`[secrets] NAME = { from_env = "VAR" }` -> {NAME: value} from the agent's environment."""
    env = os.environ if environ is None else environ
    values = {}
    for name, ref in spec.secrets.items():
        if ref.from_env not in env:
            raise InvalidArgument(
                f"secrets.{name}: from_env = {ref.from_env!r} is not set in the agent's environment"
            )
        values[name] = env[ref.from_env]
    return values


def machine_env(spec: MachineSpec, step_env: Mapping[str, str] | None) -> dict[str, str]:
    """Environment of a command: base, then Smolfile env, secrets, then the step's own."""
    env = dict(BASE_ENV)
    env.update(spec.smolfile.env_map)
    env.update(spec.secrets)
    env.update(step_env or {})
    return env
