"""Fakes of fleet's own ports, for tests that need no root, image or sandbox.

`FakeRuntime` implements the runtime protocol (`fleet.runtime.base.Runtime`) in memory: its
machines hold files in a dict and answer commands from a script (`Script`), and it makes warm
parents whose children start from the parent's files (like a microVM branch: no interpreter
carried). Everything it was asked is kept in `calls`, in order, for a test to read.
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field

from fleet.core.egress import EgressEvent
from fleet.core.errors import FailedPrecondition, NotFound
from fleet.core.placement import Isolation, RuntimeKind
from fleet.core.rollout import MAX_OUTPUT_BYTES
from fleet.runtime.base import Channel, ExecResult, Leftover, Machine, MachineSpec, Usage
from fleet.runtime.output import OutputSink

Script = Callable[[list[str], Mapping[str, str]], Awaitable[ExecResult] | ExecResult]
"""What a fake machine answers to a command (argv, its environment)."""


async def default_script(argv: list[str], env: Mapping[str, str]) -> ExecResult:
    """`true` and `false`; `echo WORDS`; `exit N`; `sleep S` (really waits, so that a
    timeout or a cancel can meet it); `python3 -c CODE` prints CODE's last line; anything else
    exits 0."""
    shell = len(argv) >= 3 and argv[0] in ("sh", "/bin/sh") and argv[1] == "-c"
    words = shlex.split(argv[2]) if shell else argv
    if not words:
        return ExecResult(exit_code=0)
    head = words[0]
    if head == "false":
        return ExecResult(exit_code=1)
    if head == "exit":
        return ExecResult(exit_code=int(words[1]))
    if head == "echo":
        return ExecResult(exit_code=0, stdout=(" ".join(words[1:]) + "\n").encode())
    if head == "sleep":
        await asyncio.sleep(float(words[1]))
        return ExecResult(exit_code=0)
    if head == "python3" and words[1:2] == ["-c"]:
        return ExecResult(exit_code=0, stdout=(words[2].splitlines() or [""])[-1].encode())
    return ExecResult(exit_code=0)


class FakeMachine:
    def __init__(self, runtime: FakeRuntime, spec: MachineSpec, files: dict[str, bytes]) -> None:
        self.runtime = runtime
        self.spec = spec
        self.files = files
        self.deleted = False

    @property
    def name(self) -> str:
        return self.spec.name

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
    ) -> ExecResult:
        if self.deleted:
            raise NotFound(f"machine {self.name} was deleted")
        self.runtime.calls.append(("exec", self.name, tuple(argv)))
        answer = self.runtime.script(list(argv), dict(env or {}))
        try:
            result = await asyncio.wait_for(_awaited(answer), timeout_s)
        except TimeoutError:
            return ExecResult(exit_code=-9, timed_out=True, duration_s=timeout_s)
        if on_output is not None:
            on_output("stdout", result.stdout)
            on_output("stderr", result.stderr)
        return result

    async def read_file(self, path: str) -> bytes:
        if path not in self.files:
            raise NotFound(f"{path}: no such file in machine {self.name}")
        return self.files[path]

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.files[path] = bytes(data)

    async def usage(self) -> Usage:
        return Usage()

    async def egress_events(self) -> list[EgressEvent]:
        return []

    async def fork(self, spec: MachineSpec) -> Machine:
        self.runtime.calls.append(("fork", self.name, (spec.name,)))
        return self.runtime._machine(spec, dict(self.files))

    async def stay_resident(self) -> None:
        return None

    def channel(self) -> Channel | None:
        return None

    async def delete(self) -> None:
        if not self.deleted:
            self.deleted = True
            self.runtime.calls.append(("delete", self.name, ()))
            self.runtime.machines.pop(self.name, None)


async def _awaited(answer: Awaitable[ExecResult] | ExecResult) -> ExecResult:
    return await answer if isinstance(answer, Awaitable) else answer


@dataclass
class FakeParent:
    runtime: FakeRuntime
    machine: FakeMachine
    spec: MachineSpec
    carries_memory: bool = False
    children: list[FakeMachine] = field(default_factory=list)

    async def branch(self, name: str) -> Machine:
        self.runtime.calls.append(("branch", self.machine.name, (name,)))
        child = self.runtime._machine(
            self.spec.model_copy(update={"name": name}), dict(self.machine.files)
        )
        self.children.append(child)
        return child

    async def delete(self) -> None:
        for child in self.children:
            await child.delete()
        await self.machine.delete()


class FakeRuntime:
    """The runtime protocol in memory (see the module docstring)."""

    kind = RuntimeKind.NAMESPACE
    isolation = Isolation.NAMESPACE
    mounts_read_only = False
    forks_children = True

    def __init__(self, script: Script = default_script) -> None:
        self.script = script
        self.machines: dict[str, FakeMachine] = {}
        self.parents: list[FakeParent] = []
        self.calls: list[tuple[str, str, tuple[str, ...]]] = []

    def _machine(self, spec: MachineSpec, files: dict[str, bytes]) -> FakeMachine:
        machine = FakeMachine(self, spec, files)
        self.machines[spec.name] = machine
        return machine

    async def create(self, spec: MachineSpec) -> Machine:
        self.calls.append(("create", spec.name, ()))
        return self._machine(spec, {})

    async def create_parent(
        self, spec: MachineSpec, warmup: str, pool_size: int,
        prepare: Callable[[Machine], Awaitable[None]],
    ) -> FakeParent:  # fmt: skip
        self.calls.append(("create_parent", spec.name, (warmup,)))
        machine = self._machine(spec, {})
        await prepare(machine)
        parent = FakeParent(self, machine, spec)
        self.parents.append(parent)
        return parent

    async def list_machines(self, labels: Mapping[str, str]) -> list[str]:
        return sorted(
            name for name, m in self.machines.items()
            if all(m.spec.labels.get(k) == v for k, v in labels.items())
        )  # fmt: skip

    async def leftovers(self, host_id: str) -> list[Leftover]:
        return []

    async def adopt(self, leftover: Leftover, spec: MachineSpec) -> Machine:
        raise FailedPrecondition("a fake runtime leaves nothing to adopt")

    async def reap(self, host_id: str, keep: Collection[str] = ()) -> int:
        return 0
