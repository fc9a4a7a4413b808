"""What the client hands back and takes: plain, typed values with no protobuf in them.

The sync client (`fleet.client.Fleet`) and the async one (`fleet.client.AsyncFleet`) share
these, so code written against one reads the same against the other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

from fleet.core.lifecycle import is_final
from fleet.core.smolfile import ParsedSmolfile, load_smolfile, parse_smolfile


@dataclass(frozen=True)
class Smolfile:
    """A Smolfile read and checked once, locally: its text, the name it is known by, and the
    directory an archive `image` path in it is relative to. Pass it to `submit` or `session`
    many times without reading or parsing it again."""

    parsed: ParsedSmolfile
    name: str
    base: Path
    """Where a relative archive `image` path is looked up: the Smolfile's own directory."""

    @classmethod
    def load(cls, path: str | Path, name: str | None = None) -> Smolfile:
        """The Smolfile at `path`; a malformed one is refused naming its file, line and key."""
        parsed = load_smolfile(str(path))
        return cls(parsed, name or str(path), Path(path).resolve().parent)

    @classmethod
    def from_text(cls, text: str, name: str = "<smolfile>", base: str | Path = ".") -> Smolfile:
        """A Smolfile given as text; `base` is where a relative archive `image` path is."""
        return cls(parse_smolfile(text, name), name, Path(base).resolve())

    @property
    def text(self) -> str:
        return self.parsed.text


@dataclass(frozen=True)
class Step:
    """One command of a plan. A plain argv list or a shell string stands for a Step too."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = ""
    timeout_s: float = 0.0
    """0: the server's default."""
    name: str = ""


@dataclass(frozen=True)
class InputFile:
    """A file, or a directory as one tar, uploaded and named by its content digest; placed
    read-only at `path` in the machine before the first step."""

    path: str
    digest: str
    size: int
    directory: bool = False


@dataclass(frozen=True)
class StepResult:
    """One step of a rollout, as it ended."""

    index: int
    name: str
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    duration_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False


@dataclass(frozen=True)
class Output:
    """What an attempt collected at one output path (`digest` empty: nothing was stored, and
    `error` says why)."""

    path: str
    digest: str
    size: int
    directory: bool
    error: str = ""


@dataclass(frozen=True)
class AttemptRecord:
    """One attempt at a rollout's work: who ran it, when, and how it ended."""

    attempt: int
    host_id: str
    started_at: datetime | None
    ended_at: datetime | None
    outcome: str
    """SUCCEEDED, STEP_FAILED, TRANSIENT_ERROR, ...; empty while running."""
    error: str = ""


@dataclass(frozen=True)
class Egress:
    """The egress a rollout's final machine had, as its runtime enforced it."""

    mode: str
    """off, allowlist or open."""
    allow_hosts: list[str]
    allow_cidrs: list[str]
    enforced_by: str


@dataclass(frozen=True)
class Rollout:
    """A rollout as the server last described it."""

    id: str
    state: str
    """QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED or QUARANTINED."""
    tenant: str
    attempts: int
    error: str
    labels: dict[str, str]
    results: list[StepResult] = field(default_factory=list)
    host_class: str = ""
    """gpu or cpu."""
    host_id: str = ""
    runtime: str = ""
    """The runtime that produced the final result: namespace or smol."""
    device: str = ""
    created_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    attempt_history: list[AttemptRecord] = field(default_factory=list)
    outputs: list[Output] = field(default_factory=list)
    egress: Egress | None = None
    idempotency_key: str = ""
    _wire: Callable[[], dict[str, Any]] | None = field(default=None, repr=False, compare=False)

    def wire_json(self) -> dict[str, Any]:
        """The rollout in the wire contract's JSON mapping (protobuf's canonical JSON with the
        .proto's field names, e.g. `"state": "ROLLOUT_STATE_SUCCEEDED"`, bytes in base64):
        what `fleet get --json` prints. Made when asked for, not for every rollout listed."""
        return self._wire() if self._wire is not None else {}

    @property
    def final(self) -> bool:
        """Whether the rollout has ended (succeeded, failed, cancelled or quarantined)."""
        return is_final(self.state)


@dataclass(frozen=True)
class Submission(Rollout):
    """A rollout as `submit` left it; `created` is False when its idempotency key named one
    submitted before (that one is returned)."""

    created: bool = True


@dataclass(frozen=True)
class Page:
    """One page of `list_page`; `next_page_token` goes on from there ("" : the last)."""

    rollouts: list[Rollout]
    next_page_token: str


@dataclass(frozen=True)
class Event:
    """One entry of a rollout's history (`watch`)."""

    sequence: int
    kind: str
    state: str
    """The state it moved the rollout to ("": it moved none)."""
    message: str
    from_state: str = ""
    actor: str = ""
    at: datetime | None = None
    attempt: int = 0
    rollout_id: str = ""

    @property
    def final(self) -> bool:
        """Whether the event moved the rollout to a state it ends in."""
        return is_final(self.state)


@dataclass(frozen=True)
class EgressEvent:
    """A DNS query or connection a rollout's machine was refused."""

    rollout_id: str
    attempt: int
    machine: str
    at: datetime | None
    kind: str
    """dns or connect."""
    destination: str
    decision: str
    reason: str


@dataclass(frozen=True)
class ExecResult:
    """How one command in a session ended, with its whole output."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    oom_killed: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the command exited 0 and did not time out."""
        return self.exit_code == 0 and not self.timed_out


class SessionInfo(NamedTuple):
    """A session as `sessions()` lists it (a tuple: `(id, state, host_id)`)."""

    id: str
    state: str
    """OPEN, PARKED, CLOSED or FAILED."""
    host_id: str
