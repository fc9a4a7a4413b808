"""The console's pages and actions: sign-in, rollouts, a rollout, sessions, hosts, pools, cost,
policy.

Each request is parsed (`fleet.console.http`), its session checked (`fleet.console.session`,
then its key's ledger row: `fleet.console.keys`), and answered by one page function. Reads run
on the server's reader threads; host actions on its writer, as the admin API's do. Anything a
tenant may not see answers as if it did not exist.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
import tomllib
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import Any

import jinja2
import structlog
from pydantic import ValidationError

from fleet.console import operate, reads
from fleet.console.http import (
    BadRequest,
    Request,
    attachment,
    parse,
    redirect,
    response,
    same_origin,
)
from fleet.console.keys import Keys
from fleet.console.session import COOKIE, PRE_COOKIE, Session, Sessions, Viewer, cookie_header
from fleet.console.session_calls import SessionAccess
from fleet.console.session_pages import SessionPages
from fleet.core import policy
from fleet.core.credentials import Scope
from fleet.core.errors import (
    FleetError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from fleet.httpd import connection_handler
from fleet.ledger.store import Ledger

log = structlog.get_logger(__name__)

Runner = Callable[..., Awaitable[Any]]
Chunks = Callable[[str], AsyncIterator[tuple[int, bytes, int]]]
MAX_DOWNLOAD_BYTES = 64 << 20
"""An output larger than this is not sent through the console (`fleet get --download`)."""
STATUS_OF = {
    "INVALID_ARGUMENT": 400, "NOT_FOUND": 404, "PERMISSION_DENIED": 403,
    "UNAUTHENTICATED": 401, "RESOURCE_EXHAUSTED": 413, "FAILED_PRECONDITION": 409,
    "UNAVAILABLE": 503,
}  # fmt: skip
HOST_ACTIONS = {
    "cordon": "cordoned", "uncordon": "ready", "drain": "draining", "revoke": "revoked",
}  # fmt: skip
DRAIN_S = 600.0
"""The drain deadline a drain from the console sets (as `fleet host drain` without one)."""
MAX_OWNERS = 100_000
"""Rollouts whose tenant the console keeps in memory for live pages' polls."""
STATIC = {"console.css": "text/css; charset=utf-8",
          "console.js": "text/javascript; charset=utf-8"}  # fmt: skip


@dataclass(frozen=True)
class Backend:
    """What the server hands the console: its ledger, its reader and writer threads, its
    artifact store's reads, its wake-up for claims waiting on a host's state, and its
    session service (None: the sessions pages list, and act on nothing)."""

    ledger: Ledger
    read: Runner
    write: Runner
    chunks: Chunks
    changed: Callable[[], None]
    sessions: SessionAccess | None = None


def _when(value: float | datetime | None) -> str:
    if value is None or value == 0:
        return "-"
    if isinstance(value, datetime):
        value = value.timestamp()
    return datetime.fromtimestamp(float(value), UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def templates() -> jinja2.Environment:
    """The console's templates, autoescaped (HTML and everything they include)."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("fleet.console", "templates"),
        autoescape=jinja2.select_autoescape(default=True, default_for_string=True),
        undefined=jinja2.StrictUndefined,
    )
    env.filters["when"] = _when
    env.filters["text"] = _text
    env.filters["q"] = lambda value: urllib.parse.quote(str(value), safe="")
    return env


class Console:
    """The console's request handler (`handle`, for `fleet.httpd.connection_handler`)."""

    def __init__(self, backend: Backend, secret: bytes = b"", *, tls: bool = False) -> None:
        self.backend = backend
        self.sessions = Sessions(secret)
        self.keys = Keys(backend.read, backend.ledger.identities.key_row)
        self.env = templates()
        self.tls = tls
        self.session_pages = SessionPages(backend.sessions, backend.ledger, backend.read, self.page)
        self._owners: dict[str, str] = {}
        self._static = {
            name: resources.files("fleet.console").joinpath("static", name).read_bytes()
            for name in STATIC
        }

    # -- plumbing ---------------------------------------------------------------------------

    def page(self, code: int, name: str, viewer: Viewer | None, **values: Any) -> bytes:
        body = self.env.get_template(name).render(viewer=viewer, **values)
        return response(code, body.encode())

    def error(self, code: int, viewer: Viewer | None, message: str) -> bytes:
        return self.page(code, "error.html", viewer, status=code, message=message)

    async def handle(self, method: str, target: str, headers: dict[str, str],
                     body: bytes) -> bytes:  # fmt: skip
        try:
            request = parse(method, target, headers, body)
        except BadRequest as exc:
            return self.error(400, None, str(exc))
        viewer: Viewer | None = None
        try:
            viewer = await self._viewer(request)
            return await self._route(request, viewer)
        except FleetError as exc:
            status = STATUS_OF.get(str(exc.code), 500)
            live = request.path[-1:] == ["live"] or request.query.get("fragment") == "1"
            if status == 401 and method == "GET" and not live:
                return redirect("/login")
            log.info("console_refused", method=method, path="/".join(request.path)[:200],
                     status=status, reason=exc.message, peer=request.peer,
                     key_id=viewer.key_id if viewer else "-")  # fmt: skip
            return self.error(status, viewer, exc.message)
        except Exception:
            log.exception("console_failed", method=method, path="/".join(request.path)[:200])
            return self.error(500, viewer, "the console failed to answer: see the server's log")

    async def _viewer(self, request: Request) -> Viewer | None:
        """The signed-in person, if the cookie verifies, has not expired and its key is still
        good (not revoked, not expired); else None."""
        cookie = request.cookies.get(COOKIE, "")
        session: Session | None = self.sessions.check(cookie, time.time()) if cookie else None
        if session is None:
            return None
        key = await self.keys.still_good(session.key_id)
        if key is None or key.tenant != session.tenant:
            return None
        return Viewer(key.id, key.tenant, Scope.ADMIN in key.scopes,
                      self.sessions.csrf(session.nonce), frozenset(key.scopes))  # fmt: skip

    def _check_post(self, request: Request, nonce_or_csrf: str, *, login: bool = False) -> None:
        """Every action: from this console's own pages (Origin), with the CSRF token of the
        session it is made in (or, for sign-in, of the sign-in form's cookie)."""
        if not same_origin(request.headers):
            raise PermissionDenied("this action came from another site's page: refused")
        token = request.form.get("csrf", "")
        good = (self.sessions.csrf_ok(nonce_or_csrf, token) if login
                else bool(nonce_or_csrf) and hmac.compare_digest(token, nonce_or_csrf))  # fmt: skip
        if not good:
            raise PermissionDenied("missing or stale CSRF token: reload the page and try again")

    async def _route(self, request: Request, viewer: Viewer | None) -> bytes:
        method, path = request.method, request.path
        if path[:1] == ["static"] and len(path) == 2 and path[1] in STATIC and method == "GET":
            return response(200, self._static[path[1]], STATIC[path[1]],
                            headers={"Cache-Control": "max-age=300"})  # fmt: skip
        if path == ["login"]:
            if method == "POST":
                return await self._sign_in(request)
            return self._login_form(request, "")
        if method not in ("GET", "POST"):
            return self.error(405, viewer, f"{method[:20]} is not served here")
        if viewer is None:
            if method == "GET" and path[-1:] != ["live"] and request.query.get("fragment") != "1":
                return redirect("/login")
            raise Unauthenticated("not signed in (or the session expired): sign in again")
        if method == "POST":
            self._check_post(request, viewer.csrf)
        match (method, path):
            case ("GET", []):
                return redirect("/rollouts")
            case ("POST", ["logout"]):
                return redirect("/login", {"Set-Cookie": cookie_header(COOKIE, "", 0)})
            case ("GET", ["rollouts"]):
                return await self._rollouts(request, viewer)
            case ("GET", ["rollouts", rollout_id]):
                return await self._rollout(request, viewer, rollout_id)
            case ("GET", ["rollouts", rollout_id, "live"]):
                return await self._live(request, viewer, rollout_id)
            case ("GET", ["rollouts", rollout_id, "outputs", index]):
                return await self._output(viewer, rollout_id, index)
            case ("GET", ["hosts"]):
                return await self._hosts(viewer)
            case ("GET", ["hosts", host_id, action]):
                return self._confirm(viewer, host_id, action)
            case ("POST", ["hosts", host_id, action]):
                return await self._host_action(request, viewer, host_id, action)
            case (_, ["sessions", *rest]):
                answer = await self.session_pages.route(request, viewer, rest)
                if answer is not None:
                    return answer
            case ("GET", ["pools"]):
                self._admin(viewer, "the pools page")
                hours = operate.window_hours(request.query.get("window", ""))
                rows = await self.backend.read(operate.pools, self.backend.ledger, hours)
                return self.page(200, "pools.html", viewer, pools=rows, hours=hours,
                                 windows=operate.WINDOWS_H)  # fmt: skip
            case ("GET", ["cost"]):
                self._admin(viewer, "the cost report")
                hours = operate.window_hours(request.query.get("window", ""))
                by = request.query.get("by", "").strip()
                got = await self.backend.read(operate.cost, self.backend.ledger, hours, by)
                return self.page(200, "cost.html", viewer, c=got, hours=hours, by=by,
                                 windows=operate.WINDOWS_H)  # fmt: skip
            case ("GET", ["policy"]):
                return self.page(200, "policy.html", viewer, form={}, result=None)
            case ("POST", ["policy"]):
                return self._policy(request, viewer)
        raise NotFound("no such page")

    # -- sign-in ----------------------------------------------------------------------------

    def _login_form(self, request: Request, error: str, status: int = 200) -> bytes:
        # The browser's own value is kept: a second load (another tab, a favicon's redirect)
        # must not make the first form's token stale.
        nonce = request.cookies.get(PRE_COOKIE, "")
        if not (16 <= len(nonce) <= 64 and nonce.replace("-", "").replace("_", "").isalnum()):
            nonce = secrets.token_urlsafe(16)
        body = self.env.get_template("login.html").render(
            viewer=None, csrf=self.sessions.csrf(nonce), error=error
        )
        return response(status, body.encode(),
                        headers={"Set-Cookie": cookie_header(PRE_COOKIE, nonce, 600)})  # fmt: skip

    async def _sign_in(self, request: Request) -> bytes:
        self._check_post(request, request.cookies.get(PRE_COOKIE, ""), login=True)
        try:
            key = await self.keys.sign_in(request.form.get("key", ""))
        except (Unauthenticated, PermissionDenied) as exc:
            log.info("console_sign_in_refused", reason=exc.message, peer=request.peer)
            return self._login_form(request, exc.message, 401)
        value = self.sessions.issue(key.id, key.tenant, tuple(sorted(key.scopes)), time.time())
        log.info("console_signed_in", key_id=key.id, tenant=key.tenant, peer=request.peer)
        cookie = cookie_header(COOKIE, value, int(self.sessions.ttl_s))
        return redirect("/rollouts", {"Set-Cookie": cookie})

    # -- rollouts ---------------------------------------------------------------------------

    async def _rollouts(self, request: Request, viewer: Viewer) -> bytes:
        q = request.query
        shown = {k: q.get(k, "") for k in ("state", "label", "tenant", "since", "until")}
        wanted = reads.Filters(
            tenant=viewer.scope if not viewer.admin else (shown["tenant"] or None),
            state=shown["state"], labels=reads.parse_label(shown["label"]),
            since=reads.parse_time("since", shown["since"]),
            until=reads.parse_time("until", shown["until"]),
        )  # fmt: skip
        after = q.get("after", "")
        found = await self.backend.read(reads.rollouts, self.backend.ledger, wanted, after)
        filters = {k: v for k, v in shown.items() if v}
        name = "rollouts_table.html" if q.get("fragment") == "1" else "rollouts.html"
        return self.page(200, name, viewer, page=found, filters=filters, states=reads.STATES,
                         after=after, query=urllib.parse.urlencode(filters))  # fmt: skip

    async def _rollout(self, request: Request, viewer: Viewer, rollout_id: str,
                       live: bool = False) -> bytes:  # fmt: skip
        detail = await self.backend.read(reads.rollout, self.backend.ledger, rollout_id,
                                         viewer.scope)  # fmt: skip
        self._remember_owner(rollout_id, detail.rollout.tenant)
        timeline = reads.attempts_timeline(detail.attempts, time.time())
        if live:
            return self.page(200, "rollout_live.html", viewer, d=detail, r=detail.rollout,
                             timeline=timeline)  # fmt: skip
        # (Checkpoints only on the whole page: a live poll need not read them.)
        saved = await self.backend.read(reads.checkpoints, self.backend.ledger, rollout_id,
                                        viewer.scope)  # fmt: skip
        return self.page(200, "rollout.html", viewer, d=detail, r=detail.rollout,
                         timeline=timeline, checkpoints=saved)  # fmt: skip

    async def _live(self, request: Request, viewer: Viewer, rollout_id: str) -> bytes:
        """A rollout's live fragment; with `after` (the last event sequence the page shows),
        an empty 204 when no event came since: a page left open costs one indexed read per
        poll, not the whole page's reads and its rendering. Every change the page shows
        that matters (a claim, a step's results, the end) comes with an event."""
        after = request.query.get("after", "")
        if not after:
            return await self._rollout(request, viewer, rollout_id, live=True)
        if not after.isdigit() or len(after) > 19:
            raise InvalidArgument(f"after {after[:40]!r}: expected an event sequence number")
        owner = self._owners.get(rollout_id)
        if owner is None:
            found = await self.backend.read(reads.owned, self.backend.ledger, rollout_id, None)
            owner = self._remember_owner(rollout_id, found.tenant)
        if viewer.scope is not None and owner != viewer.scope:
            raise NotFound(f"no rollout {rollout_id!r}")  # (as reads.owned says it)
        if not await self.backend.read(reads.changed_since, self.backend.ledger, rollout_id,
                                       int(after)):  # fmt: skip
            return response(204)
        return await self._rollout(request, viewer, rollout_id, live=True)

    def _remember_owner(self, rollout_id: str, tenant: str) -> str:
        """A rollout's tenant never changes: kept so that a live page's poll need not read it
        (bounded; forgotten all at once when full)."""
        if len(self._owners) >= MAX_OWNERS:
            self._owners.clear()
        self._owners[rollout_id] = tenant
        return tenant

    async def _output(self, viewer: Viewer, rollout_id: str, index: str) -> bytes:
        found = await self.backend.read(reads.owned, self.backend.ledger, rollout_id,
                                        viewer.scope)  # fmt: skip
        if not index.isdigit() or int(index) >= len(found.outputs):
            raise NotFound(f"rollout {rollout_id} has no output {index[:20]!r}")
        output = found.outputs[int(index)]
        if not output.digest:
            raise NotFound(f"output {output.path!r} was not collected: {output.error}")
        if output.size > MAX_DOWNLOAD_BYTES:
            raise ResourceExhausted(
                f"output {output.path!r} is {output.size} bytes, over the console's "
                f"{MAX_DOWNLOAD_BYTES}: use `fleet get {rollout_id} --download DIR`"
            )
        data = bytearray()
        async for _, chunk, _ in self.backend.chunks(output.digest):
            data += chunk
            if len(data) > MAX_DOWNLOAD_BYTES:
                raise ResourceExhausted(f"output {output.path!r} is over the console's limit")
        name = output.path.rstrip("/").rsplit("/", 1)[-1] + (".tar" if output.directory else "")
        log.info("console_download", key_id=viewer.key_id, rollout_id=rollout_id,
                 digest=output.digest)  # fmt: skip
        return response(200, bytes(data), "application/octet-stream",
                        headers={"Content-Disposition": attachment(name)})  # fmt: skip

    # -- hosts ------------------------------------------------------------------------------

    @staticmethod
    def _admin(viewer: Viewer, what: str) -> None:
        if not viewer.admin:
            raise PermissionDenied(f"{what} needs an admin key; this is tenant "
                                   f"{viewer.tenant!r}'s key {viewer.key_id}")  # fmt: skip

    async def _hosts(self, viewer: Viewer) -> bytes:
        self._admin(viewer, "the hosts page")
        rows = await self.backend.read(reads.hosts, self.backend.ledger)
        return self.page(200, "hosts.html", viewer, hosts=rows, now=time.time())

    def _confirm(self, viewer: Viewer, host_id: str, action: str) -> bytes:
        self._admin(viewer, f"{action} a host")
        if action not in HOST_ACTIONS:
            raise NotFound(f"no host action {action[:20]!r}")
        return self.page(200, "confirm.html", viewer, host_id=host_id, action=action)

    async def _host_action(self, request: Request, viewer: Viewer, host_id: str,
                           action: str) -> bytes:  # fmt: skip
        self._admin(viewer, f"{action} a host")
        if action not in HOST_ACTIONS:
            raise NotFound(f"no host action {action[:20]!r}")
        if request.form.get("confirm") != "yes":
            raise InvalidArgument(f"{action} {host_id}: not confirmed (the form's confirm=yes)")
        ledger = self.backend.ledger
        if host_id not in {h.host_id for h in await self.backend.read(ledger.hosts)}:
            raise NotFound(f"no host {host_id!r}")
        if action == "revoke":
            await self.backend.write(ledger.identities.revoke_host, host_id, time.time())
        else:
            deadline = time.time() + DRAIN_S if action == "drain" else None
            await self.backend.write(
                lambda: ledger.set_host_state(host_id, HOST_ACTIONS[action],
                                              drain_deadline=deadline)
            )  # fmt: skip
        self.backend.changed()
        log.info("console_host_action", action=action, host_id=host_id, key_id=viewer.key_id)
        return redirect("/hosts")

    # -- policy -----------------------------------------------------------------------------

    def _policy(self, request: Request, viewer: Viewer) -> bytes:
        """The audit of a pasted or uploaded Smolfile (with an org policy, when one is given
        too), its egress in plain words, and its diff from a previous version: `fleet
        policy`'s engine."""
        form = dict(request.form)
        # An uploaded file stands in for its pasted field (a browser sends an empty one when
        # no file was chosen), and is shown in that field for the next edit.
        for field in ("smolfile", "old", "org"):
            if form.get(f"{field}_file", "").strip():
                form[field] = form[f"{field}_file"]
        text, old, org_text = form.get("smolfile", ""), form.get("old", ""), form.get("org", "")
        if not text.strip():
            raise InvalidArgument("no Smolfile: paste one or choose a file to upload")
        org = None
        if org_text.strip():
            try:
                data = tomllib.loads(org_text)
                org = policy.OrgPolicy.model_validate(
                    data.get("egress", {}) | data.get("files", {})
                )
            except (tomllib.TOMLDecodeError, ValidationError) as exc:
                raise InvalidArgument(f"org policy: {exc}") from None
        findings = policy.audit_text(text, "Smolfile", org)
        try:
            explained = policy.explain(text, "Smolfile")
        except FleetError as exc:
            explained = [exc.message]
        changes: list[str] = []
        if old.strip():
            try:
                changes = policy.diff(old, "before", text, "after")
            except FleetError as exc:
                changes = [exc.message]
        result = {"findings": findings, "explained": explained, "diff": changes}
        return self.page(200, "policy.html", viewer, form=form, result=result)


async def serve(console: Console, host: str, port: int,
                ssl: Any = None) -> tuple[asyncio.Server, int]:  # fmt: skip
    """The console on host:port (port 0: any free one), over TLS with `ssl` (an
    ssl.SSLContext); returns the listening server and its port."""
    handler = connection_handler(console.handle, max_body_bytes=1 << 20, max_connections=256)
    server = await asyncio.start_server(handler, host, port, ssl=ssl, limit=1 << 16)
    bound = int(server.sockets[0].getsockname()[1])
    log.info("console_listening", host=host, port=bound, tls=ssl is not None)
    return server, bound


def console_address(listen: str) -> tuple[str, int]:
    """host, port of `--console-listen`: `HOST:PORT`, or `PORT` / `:PORT` on loopback."""
    text = listen.strip()
    host, colon, port = text.rpartition(":")
    if not colon:
        host, port = "", text
    if not port.isdigit() or int(port) > 65535:
        raise InvalidArgument(f"--console-listen {listen[:80]!r}: expected HOST:PORT or PORT")
    return host.strip("[]") or "127.0.0.1", int(port)
