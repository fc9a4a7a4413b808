"""The sessions page's actions as calls of the server's own `SessionServicer`, made as the
signed-in key.

The servicer learns who calls it from the server's current caller (a context variable the
API's authenticator sets for each gRPC call); the console sets the same variable to the key's
caller, in a context of its own for each call, so that tenancy and every other check are the
servicer's very code and nothing of one request's caller is left for the connection's next.
Each call needs the scope the API asks of it (`scope_of`), judged as the API judges a key.

A command's output reaches the page by polling: the console's HTTP loop answers whole
responses, so an exec runs as a task whose output is kept, bounded, in a `Run`, and the page
asks for the parts that came after those it shows.
"""

from __future__ import annotations

import asyncio
import codecs
import contextvars
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import structlog

from fleet.api.pb import fleet_pb2, types_pb2
from fleet.core.credentials import Scope
from fleet.core.errors import FleetError, NotFound, PermissionDenied, ResourceExhausted
from fleet.core.rollout import Rollout
from fleet.ledger.parks import Park

log = structlog.get_logger(__name__)

T = TypeVar("T")

NO_CONTEXT: Any = None
"""The gRPC context the servicer's methods are given: they read their caller from the
server's context variable, never from it, and a console request has none."""
MAX_OUTPUT_BYTES = 1 << 20
MAX_PARTS = 4096
"""What of a command's output the console keeps (past either, the rest is dropped and the
page says so: `fleet session exec` streams all of it)."""
RUNNING_PER_TENANT = 4
MAX_RUNS = 256
"""Commands running at once for one tenant through the console, and runs kept in all."""
KEEP_S = 900.0
"""How long a finished command's output stays to be read."""


class Moves(Protocol):
    async def current(self, session_id: str) -> tuple[Rollout, Rollout, Park | None]: ...


class SessionService(Protocol):
    """The parts of `fleet.server.sessions.SessionServicer` the console calls."""

    @property
    def moves(self) -> Moves: ...

    async def OpenSession(
        self, request: fleet_pb2.OpenSessionRequest, context: Any
    ) -> fleet_pb2.Session: ...

    def Exec(
        self, request: fleet_pb2.ExecRequest, context: Any
    ) -> AsyncIterator[fleet_pb2.ExecOutput]: ...

    async def CloseSession(
        self, request: fleet_pb2.CloseSessionRequest, context: Any
    ) -> fleet_pb2.Session: ...

    async def ParkSession(
        self, request: fleet_pb2.ParkSessionRequest, context: Any
    ) -> fleet_pb2.Session: ...

    async def ResumeSession(
        self, request: fleet_pb2.ResumeSessionRequest, context: Any
    ) -> fleet_pb2.Session: ...


Become = Callable[[str, frozenset[Scope], str], object]
"""(tenant, scopes, key id) -> makes that key the current caller, in the current context."""


@dataclass(frozen=True)
class SessionAccess:
    """What the server hands the console for session actions: its SessionServicer, the scope
    each SessionService method needs of a key, and how a key becomes the current caller."""

    servicer: SessionService
    scope_of: Mapping[str, Scope]
    become: Become

    def call(
        self, method: str, tenant: str, scopes: frozenset[Scope], key_id: str,
        call: Coroutine[Any, Any, T],
    ) -> asyncio.Task[T]:  # fmt: skip
        """`call` (a servicer method's coroutine, not yet started) as a task whose context
        has the key as its caller; PermissionDenied, as the API says it, when the key lacks
        the scope `method` needs."""
        need = self.scope_of.get(method)
        if need is None or (need not in scopes and Scope.ADMIN not in scopes):
            call.close()
            raise PermissionDenied(
                f"API key {key_id} lacks the scope {need or 'admin'!s} that {method} needs "
                f"(it has: {', '.join(sorted(scopes)) or 'none'})"
            )
        context = contextvars.copy_context()
        context.run(self.become, tenant, scopes, key_id)
        return asyncio.create_task(call, context=context)


def exit_words(done: types_pb2.ExecExit) -> str:
    """How a command ended, in words for the page."""
    notes = [n for n, on in (("timed out", done.timed_out), ("killed: out of memory",
             done.oom_killed)) if on]  # fmt: skip
    return f"exit {done.exit_code}" + (f" ({', '.join(notes)})" if notes else "")


@dataclass
class Run:
    """One command run from the console in a session, and the output kept of it."""

    id: str
    session_id: str
    tenant: str
    key_id: str
    command: str
    started_at: float
    parts: list[tuple[str, str]] = field(default_factory=list)
    """(stream, text) in the order they came: "stdout" or "stderr"."""
    size: int = 0
    truncated: bool = False
    exit: str = ""
    """How it ended ("exit 0"), once it has."""
    error: str = ""
    """Why it could not run or was cut off (the servicer's message)."""
    ended_at: float = 0.0
    _decoders: dict[str, codecs.IncrementalDecoder] = field(default_factory=dict, repr=False)

    @property
    def done(self) -> bool:
        return self.ended_at > 0

    def add(self, stream: str, data: bytes, final: bool = False) -> None:
        """Output as it came; UTF-8 split across chunks is decoded whole."""
        decoder = self._decoders.setdefault(
            stream, codecs.getincrementaldecoder("utf-8")(errors="replace")
        )
        text = decoder.decode(data, final)
        if not text or self.truncated:
            return
        if self.size + len(data) > MAX_OUTPUT_BYTES or len(self.parts) >= MAX_PARTS:
            self.truncated = True
            return
        self.size += len(data)
        self.parts.append((stream, text))

    def end(self, now: float) -> None:
        for stream in list(self._decoders):
            self.add(stream, b"", final=True)
        self.ended_at = now

    def after(self, index: int) -> dict[str, Any]:
        """The parts after the first `index`, and where the run stands (the poll's answer)."""
        return {
            "parts": self.parts[index:], "next": len(self.parts), "done": self.done,
            "exit": self.exit, "error": self.error, "truncated": self.truncated,
        }  # fmt: skip


class Runs:
    """The commands run from the console: started as tasks, kept until KEEP_S after they end."""

    def __init__(self) -> None:
        self._runs: dict[str, Run] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def start(
        self, access: SessionAccess, tenant: str, scopes: frozenset[Scope], key_id: str,
        request: fleet_pb2.ExecRequest,
    ) -> Run:  # fmt: skip
        """`request` run in its session as the key; its output kept as it comes."""
        now = time.time()
        for old in [r for r in self._runs.values() if r.done and now - r.ended_at > KEEP_S]:
            del self._runs[old.id]
        running = sum(1 for r in self._runs.values() if not r.done and r.tenant == tenant)
        if running >= RUNNING_PER_TENANT:
            raise ResourceExhausted(
                f"tenant {tenant} runs {running} commands from the console, the bound: "
                "wait for one to end"
            )
        if len(self._runs) >= MAX_RUNS:
            raise ResourceExhausted(
                f"the console keeps {MAX_RUNS} commands' output, its bound: try again later"
            )
        run = Run(secrets.token_urlsafe(12), request.session_id, tenant, key_id,
                  request.shell, now)  # fmt: skip
        task = access.call("Exec", tenant, scopes, key_id, self._pump(access, run, request))
        self._runs[run.id] = run
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        log.info("console_exec_started", session_id=run.session_id, run_id=run.id,
                 key_id=key_id, tenant=tenant)  # fmt: skip
        return run

    @staticmethod
    async def _pump(access: SessionAccess, run: Run, request: fleet_pb2.ExecRequest) -> None:
        try:
            async for out in access.servicer.Exec(request, NO_CONTEXT):
                kind = out.WhichOneof("kind")
                if kind in ("stdout", "stderr"):
                    run.add(kind, getattr(out, kind))
                elif kind == "exit":
                    run.exit = exit_words(out.exit)
        except FleetError as exc:
            run.error = exc.message
        except Exception:
            log.exception("console_exec_failed", session_id=run.session_id, run_id=run.id)
            run.error = "the command failed on the server: see the server's log"
        finally:
            run.end(time.time())
            log.info("console_exec_ended", session_id=run.session_id, run_id=run.id,
                     exit=run.exit, error=run.error[:200])  # fmt: skip

    def get(self, run_id: str, session_id: str, tenant: str | None) -> Run:
        """The run, if it is of that session and `tenant` (None: any) started it; else
        NotFound."""
        run = self._runs.get(run_id)
        if run is None or run.session_id != session_id or tenant not in (None, run.tenant):
            raise NotFound(f"no command {run_id[:40]!r} in session {session_id!r}")
        return run
