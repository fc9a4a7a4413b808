"""The sessions pages: the list with a form to open one, and a session's page with its exec
box and its close, park and resume buttons.

Every action and every read of one session is a call of the server's SessionServicer made as
the signed-in key (`fleet.console.session_calls`): another tenant's session answers as an
unknown one, exactly as over gRPC. The list reads the ledger directly (one indexed query),
scoped to the viewer's tenant like the rollouts list.
"""

from __future__ import annotations

import json
import secrets
import urllib.parse
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from fleet.api.pb import fleet_pb2
from fleet.console import operate
from fleet.console.http import Request, redirect, response
from fleet.console.session_calls import NO_CONTEXT, Runs, SessionAccess, SessionService
from fleet.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from fleet.core.rollout import Rollout
from fleet.ledger.parks import session_state
from fleet.ledger.store import Ledger

if TYPE_CHECKING:
    from fleet.console.session import Viewer

log = structlog.get_logger(__name__)

T = TypeVar("T")
Page = Callable[..., bytes]
Read = Callable[..., Awaitable[Any]]

READY_WAIT_S = 60.0
"""How long opening or resuming a session from the console waits for its machine (past it
the session stays open, and its page says so)."""
MAX_COMMAND = 16 << 10
MAX_TIMEOUT_S = 3600.0
DEFAULT_SMOLFILE = 'image = "minimal"\n'


@dataclass(frozen=True)
class SessionView:
    first: Rollout
    """The rollout that opened it (its id is the session's)."""
    current: Rollout
    """The rollout holding it now (another after a resume)."""
    state: str
    host_id: str


def _number(form: dict[str, str], name: str, high: float) -> float:
    """A form's optional number of seconds in (0, high]; "" is 0 (the servicer's default)."""
    text = form.get(name, "").strip()
    if not text:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= high:
        raise InvalidArgument(f"{name} {text[:20]!r}: seconds, more than 0 and at most {high:g}")
    return value


class SessionPages:
    """The `/sessions` pages of one console."""

    def __init__(self, access: SessionAccess | None, ledger: Ledger, read: Read,
                 page: Page) -> None:  # fmt: skip
        self.access = access
        self.ledger = ledger
        self.read = read
        self.page = page
        self.runs = Runs()

    @property
    def _servicer(self) -> SessionService:
        if self.access is None:
            raise Unavailable("this console was started without the server's session service")
        return self.access.servicer

    def _call(self, viewer: Viewer, method: str, call: Coroutine[Any, Any, T]) -> Awaitable[T]:
        assert self.access is not None  # (`call` came from `_servicer`, which checked)
        return self.access.call(method, viewer.tenant, viewer.scopes, viewer.key_id, call)

    async def route(self, request: Request, viewer: Viewer, rest: list[str]) -> bytes | None:
        """The answer to /sessions/... (None: no such page)."""
        method = request.method
        match (method, rest):
            case ("GET", []):
                return await self._list(viewer, {}, "")
            case ("POST", []):
                return await self._open(request, viewer)
            case ("GET", [session_id]):
                return await self._session(request, viewer, session_id)
            case ("POST", [session_id, "exec"]):
                return await self._exec(request, viewer, session_id)
            case ("GET", [session_id, "runs", run_id]):
                return self._poll(request, viewer, session_id, run_id)
            case ("GET", [session_id, "close"]):
                view = await self._describe(viewer, session_id)
                return self.page(200, "session_close.html", viewer, s=view)
            case ("POST", [session_id, ("close" | "park" | "resume") as action]):
                return await self._act(request, viewer, session_id, action)
        return None

    async def _list(self, viewer: Viewer, form: dict[str, str], error: str,
                    status: int = 200) -> bytes:  # fmt: skip
        found = await self.read(operate.sessions, self.ledger, viewer.scope)
        shown = {"smolfile": DEFAULT_SMOLFILE, "on_idle": "park", "idle_timeout_s": "", **form,
                 "idem": secrets.token_urlsafe(12)}  # fmt: skip
        return self.page(status, "sessions.html", viewer, sessions=found, form=shown,
                         error=error)  # fmt: skip

    async def _open(self, request: Request, viewer: Viewer) -> bytes:
        """A session from the form's Smolfile; a Smolfile the servicer refuses is shown again
        with its reason. The form's one-off key makes a repeated POST the same session."""
        form = request.form
        on_idle = form.get("on_idle", "park")
        if on_idle not in ("park", "close"):
            raise InvalidArgument(f"on_idle {on_idle[:20]!r}: park or close")
        idem = form.get("idem", "")
        if len(idem) > 64:
            raise InvalidArgument("idem: a form's key of at most 64 characters")
        try:
            opening = fleet_pb2.OpenSessionRequest(
                smolfile=form.get("smolfile", ""), smolfile_name="console", idempotency_key=idem,
                idle_timeout_s=_number(form, "idle_timeout_s", 7 * 86400.0), on_idle=on_idle,
                ready_timeout_s=READY_WAIT_S,
            )  # fmt: skip
            opened = await self._call(viewer, "OpenSession",
                                      self._servicer.OpenSession(opening, NO_CONTEXT))  # fmt: skip
        except (InvalidArgument, FailedPrecondition) as exc:
            return await self._list(viewer, dict(form), exc.message, 400)
        log.info("console_session_opened", session_id=opened.id, key_id=viewer.key_id)
        return redirect(f"/sessions/{urllib.parse.quote(opened.id, safe='')}")

    async def _describe(self, viewer: Viewer, session_id: str) -> SessionView:
        """The session as its caller sees it (NotFound for another tenant's)."""
        first, current, park = await self._call(
            viewer, "ListSessions", self._servicer.moves.current(session_id)
        )
        lease = None if current.state.final else await self.read(
            self.ledger.rollout_lease, current.id
        )  # fmt: skip
        return SessionView(first, current, session_state(current, park), lease[1] if lease else "")

    async def _session(self, request: Request, viewer: Viewer, session_id: str) -> bytes:
        view = await self._describe(viewer, session_id)
        run_id = request.query.get("run", "")
        run = self.runs.get(run_id, session_id, viewer.scope) if run_id else None
        return self.page(200, "session.html", viewer, s=view, run=run)

    async def _exec(self, request: Request, viewer: Viewer, session_id: str) -> bytes:
        """The form's command started in the session (`/bin/sh -c`); the answer is the
        session's page, whose exec box follows its output."""
        command = request.form.get("command", "")
        if not command.strip():
            raise InvalidArgument("command: empty (a shell command line, run with /bin/sh -c)")
        if len(command) > MAX_COMMAND:
            raise InvalidArgument(f"command: {len(command)} characters, over {MAX_COMMAND}")
        timeout_s = _number(request.form, "timeout_s", MAX_TIMEOUT_S)
        await self._describe(viewer, session_id)  # (another tenant's: NotFound here, not later)
        assert self.access is not None  # (_describe reached the servicer)
        run = self.runs.start(
            self.access, viewer.tenant, viewer.scopes, viewer.key_id,
            fleet_pb2.ExecRequest(session_id=session_id, shell=command, timeout_s=timeout_s),
        )  # fmt: skip
        quoted = urllib.parse.quote(session_id, safe="")
        return redirect(f"/sessions/{quoted}?run={urllib.parse.quote(run.id, safe='')}#exec")

    def _poll(self, request: Request, viewer: Viewer, session_id: str, run_id: str) -> bytes:
        """A command's output after the parts the page has (`after`), as JSON: the page
        adds it as text."""
        after = request.query.get("after", "0")
        if not after.isdigit() or len(after) > 9:
            raise InvalidArgument(f"after {after[:20]!r}: a count of output parts")
        run = self.runs.get(run_id, session_id, viewer.scope)
        body = json.dumps(run.after(int(after))).encode()
        return response(200, body, "application/json")

    async def _act(self, request: Request, viewer: Viewer, session_id: str, action: str) -> bytes:
        if action == "close" and request.form.get("confirm") != "yes":
            raise InvalidArgument(f"close {session_id}: not confirmed (the form's confirm=yes)")
        servicer = self._servicer
        call: Coroutine[Any, Any, fleet_pb2.Session]
        if action == "close":
            method = "CloseSession"
            call = servicer.CloseSession(
                fleet_pb2.CloseSessionRequest(session_id=session_id), NO_CONTEXT
            )
        elif action == "park":
            method = "ParkSession"
            call = servicer.ParkSession(
                fleet_pb2.ParkSessionRequest(session_id=session_id), NO_CONTEXT
            )
        else:
            method = "ResumeSession"
            call = servicer.ResumeSession(
                fleet_pb2.ResumeSessionRequest(
                    session_id=session_id, ready_timeout_s=READY_WAIT_S
                ), NO_CONTEXT,
            )  # fmt: skip
        done = await self._call(viewer, method, call)
        log.info("console_session_action", action=action, session_id=session_id,
                 state=done.state, key_id=viewer.key_id)  # fmt: skip
        return redirect(f"/sessions/{urllib.parse.quote(session_id, safe='')}")
