"""The web console over plain HTTP: sign-in and its cookie, tenancy, CSRF, escaping of
attacker-controlled text, host actions, the policy page. A real server with a real agent and a
SQLite ledger; requests through httpx (the browser's own run is test_console_browser.py).

The server has TLS, so the console serves HTTPS with the API's certificate (checked against
the fleet CA here). The tests carry the session cookie by hand, which lets them tamper with
it: the client's own cookie jar is emptied before each request."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shlex
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text as sql_text

from fleet.api.pb import fleet_pb2, fleet_pb2_grpc, types_pb2
from fleet.console import reads
from fleet.console.http import attachment
from fleet.console.session import COOKIE, PRE_COOKIE, Sessions
from fleet.core.adaptive import Adaptive
from fleet.core.credentials import parse_api_key
from fleet.core.gates import Gates
from fleet.core.placement import HostClass, Pool
from fleet.image.store import ImageStore
from tests.integration.harness import (
    SECRET,
    Harness,
    RuntimeFactory,
    fake_runtime,
    harness,
    namespace_runtime,
    request,
)

HOSTILE = '<script>alert("x")</script>\'q'
ESCAPED = "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;&#39;q"
STEP = [
    "sh",
    "-c",
    # (HOSTILE holds a slash, in "</script>": the file lies in a directory of that name.)
    f'x={shlex.quote(HOSTILE)}; mkdir -p "$(dirname "/out/$x.txt")"; '
    'printf %s "$x" > "/out/$x.txt" && printf %s "$x"',
]


@dataclass
class Console:
    h: Harness
    base: str
    http: httpx.AsyncClient

    def bare(self) -> httpx.AsyncClient:
        """The client with no cookie of its own (only those a request names are sent)."""
        self.http.cookies.clear()
        return self.http

    async def sign_in(self, key: str) -> httpx.Response:
        """POST /login with the sign-in form's CSRF token and its cookie, as a browser would."""
        form = await self.bare().get(f"{self.base}/login")
        csrf = _csrf(form.text)
        pre = form.cookies[PRE_COOKIE]
        return await self.bare().post(
            f"{self.base}/login", data={"key": key, "csrf": csrf},
            headers={"Cookie": f"{PRE_COOKIE}={pre}"},
        )  # fmt: skip

    async def session(self, key: str) -> tuple[str, str]:
        """(cookie header, CSRF token) of a fresh session of `key`."""
        reply = await self.sign_in(key)
        assert reply.status_code == 303, reply.text
        value = _cookie_value(reply.headers["set-cookie"], COOKIE)
        cookie = f"{COOKIE}={value}"
        page = await self.bare().get(f"{self.base}/policy", headers={"Cookie": cookie})
        return cookie, _csrf(page.text)

    async def get(self, path: str, cookie: str) -> httpx.Response:
        return await self.bare().get(f"{self.base}{path}", headers={"Cookie": cookie})

    async def post(self, path: str, cookie: str, data: dict[str, str]) -> httpx.Response:
        return await self.bare().post(f"{self.base}{path}", data=data, headers={"Cookie": cookie})


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, html[:2000]
    return found.group(1)


def _cookie_value(set_cookie: str, name: str) -> str:
    found = re.match(rf"{name}=([^;]*)", set_cookie)
    assert found, set_cookie
    return found.group(1)


@contextlib.asynccontextmanager
async def _console(
    tmp: Path, images: ImageStore, runtime: RuntimeFactory
) -> AsyncIterator[Console]:
    async with harness(tmp, images, secure=True, runtime=runtime) as h:
        port = await h.server.start_console("127.0.0.1:0")
        assert h.ca is not None
        trust = ssl.create_default_context(cadata=h.ca.pem.decode())
        async with httpx.AsyncClient(follow_redirects=False, timeout=30, verify=trust) as http:
            yield Console(h, f"https://127.0.0.1:{port}", http)


@pytest.fixture
async def console(tmp_path: Path, images: ImageStore) -> AsyncIterator[Console]:
    """The console of a server whose agents run the in-memory runtime."""
    async with _console(tmp_path, images, fake_runtime) as c:
        yield c


@pytest.fixture
async def sandboxed(tmp_path: Path, images: ImageStore) -> AsyncIterator[Console]:
    """The console of a server whose agents run real namespace sandboxes (tests marked
    `sandbox`): step output and output files are what real processes wrote."""
    async with _console(tmp_path, images, namespace_runtime) as c:
        yield c


async def _run_hostile(c: Console, key: str) -> str:
    """A rollout whose label, step output and output file name are HOSTILE; its id."""
    await c.h.start_agent("cpu-a", HostClass.CPU)
    async with c.h.connect(key) as channel:
        stub = fleet_pb2_grpc.FleetServiceStub(channel)
        req = request('image = "minimal"\n', STEP)
        req.labels["run"] = HOSTILE
        req.outputs.append(f"/out/{HOSTILE}.txt")
        rid = (await stub.SubmitRollout(req)).rollout.id
    final = await c.h.wait_final(rid)
    assert final.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, final.error
    return str(rid)


async def test_sign_in_sets_a_signed_strict_session_without_the_key(console: Console) -> None:
    """The answer to a good key is a redirect with an HttpOnly, Secure, SameSite=Strict
    session cookie that holds the key's id but not its secret; every page carries the CSP."""
    key = console.h.key("team-a")
    reply = await console.sign_in(key)
    assert reply.status_code == 303 and reply.headers["location"] == "/rollouts"
    set_cookie = reply.headers["set-cookie"]
    flags = {part.strip().lower() for part in set_cookie.split(";")[1:]}
    assert {"httponly", "secure", "samesite=strict"} <= flags
    value = _cookie_value(set_cookie, COOKIE)
    secret = parse_api_key(key).secret
    assert secret not in value and key not in value
    page = await console.get("/rollouts", f"{COOKIE}={value}")
    assert page.status_code == 200 and "team-a" in page.text
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
    assert '<script src="/static/console.js"' in page.text
    assert re.search(r"<script>", page.text) is None  # no inline script anywhere


async def test_a_bad_key_is_refused_and_says_why(console: Console) -> None:
    wrong = await console.sign_in(console.h.key("team-a")[:-4] + "AAAA")
    assert wrong.status_code == 401 and "wrong secret" in wrong.text
    malformed = await console.sign_in("not a key")
    assert malformed.status_code == 401 and "malformed API key" in malformed.text
    assert "set-cookie" not in wrong.headers or COOKIE + "=" not in wrong.headers["set-cookie"]


async def test_sign_in_without_the_forms_token_is_refused(console: Console) -> None:
    """Login CSRF: a POST without the token bound to the form's cookie signs no one in."""
    key = console.h.key("team-a")
    reply = await console.bare().post(f"{console.base}/login", data={"key": key})
    assert reply.status_code == 403 and "CSRF" in reply.text
    assert "set-cookie" not in reply.headers


async def test_a_tampered_an_expired_and_a_revoked_session_are_refused(
    console: Console,
) -> None:
    key = console.h.key("team-a")
    cookie, _ = await console.session(key)
    assert (await console.get("/rollouts", cookie)).status_code == 200
    payload, signature = cookie.split("=", 1)[1].split(".")
    # A payload changed under its old signature.
    tampered = f"{COOKIE}={payload[:-2]}xx.{signature}"
    refused = await console.get("/rollouts", tampered)
    assert refused.status_code == 303 and refused.headers["location"] == "/login"
    key_id = parse_api_key(key).id
    expired = Sessions(SECRET, ttl_s=-1.0).issue(key_id, "team-a", ("rollouts:read",),
                                                 time.time())  # fmt: skip
    refused = await console.get("/rollouts", f"{COOKIE}={expired}")
    assert refused.status_code == 303 and refused.headers["location"] == "/login"
    # The same secret, in date: accepted (so the two refusals above were for what they say).
    good = Sessions(SECRET).issue(key_id, "team-a", ("rollouts:read",), time.time())
    assert (await console.get("/rollouts", f"{COOKIE}={good}")).status_code == 200
    # Revoking the key signs its sessions out (within the key cache's second).
    console.h.server.core.ledger.identities.revoke_key(key_id, time.time())
    for _ in range(40):
        refused = await console.get("/rollouts", cookie)
        if refused.status_code == 303:
            break
        await asyncio.sleep(0.05)
    assert refused.status_code == 303


@pytest.mark.sandbox
async def test_attacker_controlled_text_renders_as_text(sandboxed: Console) -> None:
    """A label, a step's output and an output file name holding a script tag and quotes are
    shown escaped on the list and the rollout's page; the download's name cannot break its
    header."""
    key = sandboxed.h.key("team-a")
    rid = await _run_hostile(sandboxed, key)
    cookie, _ = await sandboxed.session(key)
    listing = await sandboxed.get("/rollouts", cookie)
    page = await sandboxed.get(f"/rollouts/{rid}", cookie)
    for html in (listing.text, page.text):
        assert HOSTILE not in html and "<script>alert" not in html
    assert f"run={ESCAPED}" in listing.text
    assert f"run={ESCAPED}</span>" in page.text
    assert f'id="stdout-0">{ESCAPED}</pre>' in page.text
    link = re.search(r'<a class="output" href="([^"]+)">/out/([^<]*)\.txt</a>', page.text)
    assert link and link.group(2) == ESCAPED, page.text
    got = await sandboxed.get(link.group(1), cookie)
    assert got.status_code == 200 and got.content == HOSTILE.encode()
    disposition = got.headers["content-disposition"]
    assert disposition == attachment("script>'q.txt") and "<" not in disposition.split(";")[1]


def test_a_download_name_cannot_break_its_header() -> None:
    disposition = attachment(f"{HOSTILE}\r\nSet-Cookie: x=1;.txt")
    assert disposition.startswith('attachment; filename="') and "filename*=UTF-8''" in disposition
    assert not set('<>"\r\n;') & set(disposition.split('filename="')[1].split('"')[0])
    assert "\r" not in disposition and "\n" not in disposition
    assert disposition.count(";") == 2 and disposition.count('"') == 2


async def test_another_tenants_rollout_is_the_same_404_as_an_unknown_one(
    console: Console,
) -> None:
    rid = await _run_hostile(console, console.h.key("team-a"))
    cookie, _ = await console.session(console.h.key("team-b"))
    theirs = await console.get(f"/rollouts/{rid}", cookie)
    unknown_id = "r_" + "0" * (len(rid) - 2)
    unknown = await console.get(f"/rollouts/{unknown_id}", cookie)
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.text.replace(rid, "ID") == unknown.text.replace(unknown_id, "ID")
    assert (await console.get(f"/rollouts/{rid}/outputs/0", cookie)).status_code == 404
    assert (await console.get(f"/rollouts/{rid}/live", cookie)).status_code == 404
    listing = await console.get("/rollouts", cookie)
    assert rid not in listing.text
    admin, _ = await console.session(console.h.admin_key)
    assert (await console.get(f"/rollouts/{rid}", admin)).status_code == 200


async def test_host_actions_need_an_admin_the_csrf_token_and_confirmation(
    console: Console,
) -> None:
    await console.h.start_agent("cpu-a", HostClass.CPU)
    ledger = console.h.server.core.ledger
    admin, admin_csrf = await console.session(console.h.admin_key)
    tenant, tenant_csrf = await console.session(console.h.key("team-a"))
    confirm = {"confirm": "yes"}

    no_token = await console.post("/hosts/cpu-a/cordon", admin, confirm)
    wrong_token = await console.post("/hosts/cpu-a/cordon", admin,
                                     {**confirm, "csrf": tenant_csrf})  # fmt: skip
    as_tenant = await console.post("/hosts/cpu-a/cordon", tenant, {**confirm, "csrf": tenant_csrf})
    tenant_page = await console.get("/hosts", tenant)
    unconfirmed = await console.post("/hosts/cpu-a/cordon", admin, {"csrf": admin_csrf})
    cross_site = await console.bare().post(
        f"{console.base}/hosts/cpu-a/cordon", data={**confirm, "csrf": admin_csrf},
        headers={"Cookie": admin, "Origin": "https://evil.example"},
    )  # fmt: skip
    assert ledger.host_states()["cpu-a"] == "ready"  # none of those did anything
    assert no_token.status_code == wrong_token.status_code == 403 and "CSRF" in no_token.text
    assert as_tenant.status_code == tenant_page.status_code == 403
    assert "admin key" in as_tenant.text
    assert unconfirmed.status_code == 400 and "not confirmed" in unconfirmed.text
    assert cross_site.status_code == 403

    done = await console.post("/hosts/cpu-a/cordon", admin, {**confirm, "csrf": admin_csrf})
    assert done.status_code == 303 and done.headers["location"] == "/hosts"
    assert ledger.host_states()["cpu-a"] == "cordoned"
    hosts = await console.get("/hosts", admin)
    assert re.search(r'id="host-cpu-a">.*?class="host-state">cordoned<', hosts.text, re.S)


async def test_the_policy_page_shows_the_audits_findings(console: Console) -> None:
    cookie, csrf = await console.session(console.h.key("team-a"))
    bad = 'image = "minimal"\n[network]\nallow_cidrs = ["169.254.169.254/32"]\n'
    page = await console.post("/policy", cookie, {"smolfile": bad, "csrf": csrf,
                                                  "old": 'image = "minimal"\n'})  # fmt: skip
    assert page.status_code == 200
    assert re.search(r'<tr class="finding"><td>3</td><td>\w+</td><td class="rule">FLEET005<',
                     page.text)  # fmt: skip
    assert 'id="diff"' in page.text
    refused = await console.post("/policy", cookie, {"smolfile": bad})
    assert refused.status_code == 403


@pytest.mark.sandbox
async def test_the_rollouts_list_filters_and_pages(sandboxed: Console) -> None:
    """By state, by label and in keyset pages; a bad filter is a 400 that names it."""
    await sandboxed.h.start_agent("cpu-a", HostClass.CPU)
    ids = []
    async with sandboxed.h.connect(sandboxed.h.key("team-a")) as channel:
        stub = fleet_pb2_grpc.FleetServiceStub(channel)
        for i in range(3):
            req = request('image = "minimal"\n', ["sh", "-c", f"exit {i % 2}"])
            req.labels["n"] = str(i)
            ids.append((await stub.SubmitRollout(req)).rollout.id)
    for rid in ids:
        await sandboxed.h.wait_final(rid)
    cookie, _ = await sandboxed.session(sandboxed.h.key("team-a"))
    failed = await sandboxed.get("/rollouts?state=FAILED", cookie)
    assert ids[1] in failed.text and ids[0] not in failed.text and ids[2] not in failed.text
    labelled = await sandboxed.get("/rollouts?label=n%3D2", cookie)
    assert ids[2] in labelled.text and ids[0] not in labelled.text
    bad = await sandboxed.get("/rollouts?state=NOPE", cookie)
    assert bad.status_code == 400 and "state &#39;NOPE&#39;: not one of" in bad.text
    ledger = sandboxed.h.server.core.ledger
    mine = reads.Filters(tenant="team-a")
    first = reads.rollouts(ledger, mine, after="", size=2)
    rest = reads.rollouts(ledger, mine, after=first.next_token, size=2)
    assert [r.id for r in first.rollouts + rest.rollouts] == ids[::-1] and not rest.next_token
    page = await sandboxed.get(f"/rollouts?after={first.next_token}", cookie)
    assert ids[0] in page.text and ids[2] not in page.text
    none = reads.rollouts(ledger, reads.Filters(tenant="team-b"), after="")
    assert none.rollouts == []
    # By creation time (a browser's datetime-local value, UTC): all of them, then none.
    since = datetime.fromtimestamp(time.time() - 3600, UTC).strftime("%Y-%m-%dT%H:%M")
    until = datetime.fromtimestamp(time.time() - 1800, UTC).strftime("%Y-%m-%dT%H:%M")
    recent = await sandboxed.get(f"/rollouts?since={since}", cookie)
    assert all(rid in recent.text for rid in ids)
    older = await sandboxed.get(f"/rollouts?since={since}&until={until}", cookie)
    assert older.status_code == 200 and not any(rid in older.text for rid in ids)
    bad_time = await sandboxed.get("/rollouts?since=yesterday", cookie)
    assert bad_time.status_code == 400 and "since &#39;yesterday&#39;" in bad_time.text


async def test_a_rollouts_page_shows_its_tokens_by_model(console: Console) -> None:
    key = console.h.key("team-a")
    await console.h.start_agent("cpu-a", HostClass.CPU)
    async with console.h.connect(key) as channel:
        stub = fleet_pb2_grpc.FleetServiceStub(channel)
        rid = (await stub.SubmitRollout(request('image = "minimal"\n', ["true"]))).rollout.id
    await console.h.wait_final(rid)
    cookie, _ = await console.session(key)
    before = await console.get(f"/rollouts/{rid}", cookie)
    assert "no language-model call was charged" in before.text
    console.h.server.core.ledger.add_usage({}, {rid: {"tiny-<b>": (120, 7), "big": (3, 1)}})
    page = await console.get(f"/rollouts/{rid}", cookie)
    rows = re.findall(r"<tr><td>([^<]*)</td><td>(\d+)</td><td>(\d+)</td></tr>", page.text)
    assert rows == [("big", "3", "1"), ("tiny-&lt;b&gt;", "120", "7")]


async def test_a_live_page_is_answered_empty_until_an_event_comes(console: Console) -> None:
    """The live fragment asked for with the last event sequence the page shows: 204 while
    nothing happened, the fragment once something did; tenancy and bad input as elsewhere."""
    key = console.h.key("team-a")
    await console.h.start_agent("cpu-a", HostClass.CPU)
    ledger = console.h.server.core.ledger
    ledger.set_host_state("cpu-a", "cordoned")  # (the rollout waits, with no event, until...)
    async with console.h.connect(key) as channel:
        stub = fleet_pb2_grpc.FleetServiceStub(channel)
        rid = (await stub.SubmitRollout(request('image = "minimal"\n', ["true"]))).rollout.id
    cookie, _ = await console.session(key)
    page = await console.get(f"/rollouts/{rid}", cookie)
    found = re.search(r'data-seq="(\d+)"', page.text)
    assert found and int(found.group(1)) > 0, page.text[:2000]
    seq = found.group(1)
    quiet = await console.get(f"/rollouts/{rid}/live?after={seq}", cookie)
    assert quiet.status_code == 204 and quiet.content == b""
    whole = await console.get(f"/rollouts/{rid}/live?after=0", cookie)
    assert whole.status_code == 200 and 'id="rollout-state"' in whole.text
    other, _ = await console.session(console.h.key("team-b"))
    theirs = await console.get(f"/rollouts/{rid}/live?after={seq}", other)
    unknown = await console.get(f"/rollouts/r_{'0' * 20}/live?after={seq}", other)
    assert theirs.status_code == unknown.status_code == 404
    bad = await console.get(f"/rollouts/{rid}/live?after=-1", cookie)
    assert bad.status_code == 400 and "event sequence" in bad.text
    ledger.set_host_state("cpu-a", "ready")  # (...its host takes work again)
    console.h.server.core.changed()
    await console.h.wait_final(rid)
    moved = await console.get(f"/rollouts/{rid}/live?after={seq}", cookie)
    assert moved.status_code == 200 and "SUCCEEDED" in moved.text and 'data-final="1"' in moved.text


async def test_the_pools_page_shows_caps_gates_pauses_and_the_controllers_chart(
    console: Console,
) -> None:
    """An admin's page: each pool's cap, its gates with the figures of its last judgement,
    its pauses, and its cap over the window as an SVG drawn on the server. A tenant's key is
    refused; a bad window is a 400 that names it."""
    await console.h.start_agent("cpu-a", HostClass.CPU)
    ledger = console.h.server.core.ledger
    now = time.time()
    ledger.set_pool(Pool(name="gpu<b>", host_class=HostClass.CPU, max_running=4,
                         gates=Gates(retry_rate=0.5), adaptive=Adaptive()), now - 600)  # fmt: skip
    rows = [
        (now - 500, "raised", 4, "throughput paid", '{"attempts": 3}'),
        (now - 300, "paused", 4, "<script>x</script> retry_rate 0.9", '{"retry_rate": 0.9}'),
        (now - 200, "resumed", 4, "back under", '{"retry_rate": 0.1}'),
        (now - 100, "lowered", 3, "backed off", '{"attempts": 12, "retry_rate": 0.25}'),
    ]
    with ledger.engine.begin() as db:
        for at, kind, cap, message, figures in rows:
            db.execute(
                sql_text(
                    "INSERT INTO pool_events (pool, at, kind, cap, message, figures_json) "
                    "VALUES ('gpu<b>', :at, :kind, :cap, :message, :figures)"
                ),
                {"at": at, "kind": kind, "cap": cap, "message": message, "figures": figures},
            )
    admin, _ = await console.session(console.h.admin_key)
    page = await console.get("/pools?window=1", admin)
    assert page.status_code == 200, page.text
    html = page.text
    assert 'id="pool-gpu&lt;b&gt;"' in html and "<script>x" not in html
    assert re.search(r"<tr><td>retry_rate</td><td>0.5</td><td>0.25</td></tr>", html)
    assert re.search(r"<td>paused</td><td>&lt;script&gt;x&lt;/script&gt; retry_rate 0.9</td>",
                     html)  # fmt: skip
    line = re.search(r'<polyline class="line" points="([^"]+)"', html)
    assert line, html
    heights = [float(p.split(",")[1]) for p in line.group(1).split()]
    assert len(set(heights)) == 2  # (cap 4, then 3: two levels)
    assert html.count('<line class="mark"') == 2  # (the pause and the resume)
    tenant, _ = await console.session(console.h.key("team-a"))
    assert (await console.get("/pools", tenant)).status_code == 403
    bad = await console.get("/pools?window=5", admin)
    assert bad.status_code == 400 and "window &#39;5&#39;" in bad.text


async def test_the_cost_page_reports_by_pool_and_label_with_its_chart(console: Console) -> None:
    key = console.h.key("team-a")
    await console.h.start_agent("cpu-a", HostClass.CPU)
    async with console.h.connect(key) as channel:
        stub = fleet_pb2_grpc.FleetServiceStub(channel)
        req = request('image = "minimal"\n', ["true"])
        req.labels["suite"] = "<i>s1"
        rid = (await stub.SubmitRollout(req)).rollout.id
    await console.h.wait_final(rid)
    admin, _ = await console.session(console.h.admin_key)
    by_pool = await console.get("/cost", admin)
    assert by_pool.status_code == 200, by_pool.text
    assert re.search(r'<tr class="group"><td>-</td><td>1</td><td>1</td>', by_pool.text)
    assert '<rect class="bar"' in by_pool.text
    by_label = await console.get("/cost?by=suite&window=6", admin)
    assert re.search(r'<tr class="group"><td>&lt;i&gt;s1</td><td>1</td>', by_label.text)
    tenant, _ = await console.session(key)
    assert (await console.get("/cost", tenant)).status_code == 403


async def test_the_sessions_page_lists_a_tenants_own_sessions(console: Console) -> None:
    await console.h.start_agent("cpu-a", HostClass.CPU)
    async with console.h.connect(console.h.key("team-a")) as channel:
        stub = fleet_pb2_grpc.SessionServiceStub(channel)
        opened = await stub.OpenSession(fleet_pb2.OpenSessionRequest(
            smolfile='image = "minimal"\n', ready_timeout_s=30,
        ))  # fmt: skip
    mine, _ = await console.session(console.h.key("team-a"))
    theirs, _ = await console.session(console.h.key("team-b"))
    listed = await console.get("/sessions", mine)
    assert listed.status_code == 200
    assert re.search(rf'<a href="/sessions/{opened.id}">{opened.id}</a></td><td class="state '
                     r'\w+">open</td><td>team-a</td>', listed.text)  # fmt: skip
    other = await console.get("/sessions", theirs)
    assert other.status_code == 200 and opened.id not in other.text


async def _open_from_console(c: Console, cookie: str, csrf: str) -> str:
    """A session opened through the sessions page's form; its id (from the redirect)."""
    page = await c.get("/sessions", cookie)
    idem = re.search(r'name="idem" value="([^"]+)"', page.text)
    assert page.status_code == 200 and idem, page.text[:2000]
    form = {"csrf": csrf, "idem": idem.group(1), "smolfile": 'image = "minimal"\n',
            "on_idle": "park"}  # fmt: skip
    opened = await c.post("/sessions", cookie, form)
    assert opened.status_code == 303, opened.text
    found = re.fullmatch(r"/sessions/([\w-]+)", opened.headers["location"])
    assert found, opened.headers["location"]
    again = await c.post("/sessions", cookie, form)  # (the same form twice: the same session)
    assert again.headers["location"] == opened.headers["location"]
    return found.group(1)


async def _run_in_console(c: Console, cookie: str, csrf: str, session_id: str,
                          command: str) -> tuple[str, dict[str, object]]:  # fmt: skip
    """A command run from the session's exec box, followed as its page follows it: the run's
    id and the poll's last answer (the command ended), with every part it sent."""
    started = await c.post(f"/sessions/{session_id}/exec", cookie,
                           {"csrf": csrf, "command": command})  # fmt: skip
    assert started.status_code == 303, started.text
    found = re.fullmatch(rf"/sessions/{session_id}\?run=([\w-]+)#exec", started.headers["location"])
    assert found, started.headers["location"]
    run_id, after = found.group(1), 0
    parts: list[list[str]] = []
    for _ in range(600):
        got = await c.get(f"/sessions/{session_id}/runs/{run_id}?after={after}", cookie)
        assert got.status_code == 200 and got.headers["content-type"] == "application/json"
        answer = got.json()
        parts += answer["parts"]
        after = answer["next"]
        if answer["done"]:
            return run_id, {**answer, "parts": parts}
        await asyncio.sleep(0.05)
    raise AssertionError(f"the command {command!r} did not end within the poll's bound")


@pytest.mark.sandbox
async def test_a_tenant_opens_a_session_runs_a_command_and_closes_it(sandboxed: Console) -> None:
    """The sessions page's actions on a real machine: open from a Smolfile, a command's output
    followed in the exec box (script tags and quotes shown as text), park and resume, close
    after confirming."""
    await sandboxed.h.start_agent("cpu-a", HostClass.CPU)
    cookie, csrf = await sandboxed.session(sandboxed.h.key("team-a"))
    sid = await _open_from_console(sandboxed, cookie, csrf)
    page = await sandboxed.get(f"/sessions/{sid}", cookie)
    assert page.status_code == 200
    assert re.search(r'id="session-state" class="state open">OPEN<', page.text)
    assert re.search(r'id="session-host">cpu-a<', page.text)
    listed = await sandboxed.get("/sessions", cookie)
    assert f'<a href="/sessions/{sid}">{sid}</a>' in listed.text

    command = f"echo hello from the session; printf %s {shlex.quote(HOSTILE)} >&2; exit 3"
    run_id, ended = await _run_in_console(sandboxed, cookie, csrf, sid, command)
    assert ended["exit"] == "exit 3" and ended["error"] == ""
    assert ended["parts"] == [["stdout", "hello from the session\n"], ["stderr", HOSTILE]]
    shown = await sandboxed.get(f"/sessions/{sid}?run={run_id}", cookie)
    assert '<span class="stdout">hello from the session\n</span>' in shown.text
    assert f'<span class="stderr">{ESCAPED}</span>' in shown.text
    assert HOSTILE not in shown.text and "<script>alert" not in shown.text
    assert re.search(r'id="exec-status">exit 3<', shown.text)

    # Parked, it is listed as parked (the list reads each session's state now); resumed, it
    # is open again, on a machine made from its layer.
    parked = await sandboxed.post(f"/sessions/{sid}/park", cookie, {"csrf": csrf})
    assert parked.status_code == 303, parked.text
    listed = await sandboxed.get("/sessions", cookie)
    assert re.search(rf'<a href="/sessions/{sid}">{sid}</a></td><td class="state parked">parked<',
                     listed.text), listed.text  # fmt: skip
    resumed = await sandboxed.post(f"/sessions/{sid}/resume", cookie, {"csrf": csrf})
    assert resumed.status_code == 303, resumed.text
    listed = await sandboxed.get("/sessions", cookie)
    assert re.search(rf'<a href="/sessions/{sid}">{sid}</a></td><td class="state open">open<',
                     listed.text), listed.text  # fmt: skip

    confirm = await sandboxed.get(f"/sessions/{sid}/close", cookie)
    assert confirm.status_code == 200 and 'name="confirm" value="yes"' in confirm.text
    unconfirmed = await sandboxed.post(f"/sessions/{sid}/close", cookie, {"csrf": csrf})
    assert unconfirmed.status_code == 400 and "not confirmed" in unconfirmed.text
    closed = await sandboxed.post(f"/sessions/{sid}/close", cookie,
                                  {"csrf": csrf, "confirm": "yes"})  # fmt: skip
    assert closed.status_code == 303 and closed.headers["location"] == f"/sessions/{sid}"
    after = await sandboxed.get(f"/sessions/{sid}", cookie)
    assert re.search(r'id="session-state" class="state closed">CLOSED<', after.text)
    assert 'id="exec-form"' not in after.text
    assert sandboxed.h.server.core.ledger.get(sid).state.final


async def test_session_actions_are_the_tenants_own_and_need_the_csrf_token(
    console: Console,
) -> None:
    """Another tenant's session is the same 404 as an unknown id, for every page and action;
    an action without the CSRF token does nothing; a read-only key opens nothing; an admin
    sees any tenant's session. A Smolfile the servicer refuses is shown again with why."""
    await console.h.start_agent("cpu-a", HostClass.CPU)
    ledger = console.h.server.core.ledger
    mine, csrf = await console.session(console.h.key("team-a"))
    sid = await _open_from_console(console, mine, csrf)
    run_id, _ = await _run_in_console(console, mine, csrf, sid, "echo hi")

    theirs, their_csrf = await console.session(console.h.key("team-b"))
    unknown_id = "r_" + "0" * (len(sid) - 2)
    refused = await console.get(f"/sessions/{sid}", theirs)
    unknown = await console.get(f"/sessions/{unknown_id}", theirs)
    assert refused.status_code == unknown.status_code == 404
    assert refused.text.replace(sid, "ID") == unknown.text.replace(unknown_id, "ID")
    for path, form in ((f"/sessions/{sid}/exec", {"command": "echo no"}),
                       (f"/sessions/{sid}/close", {"confirm": "yes"})):  # fmt: skip
        answer = await console.post(path, theirs, {**form, "csrf": their_csrf})
        assert answer.status_code == 404, (path, answer.text)
    for action in ("park", "resume"):
        answer = await console.post(f"/sessions/{sid}/{action}", theirs, {"csrf": their_csrf})
        assert answer.status_code == 404, (action, answer.text)
    for path in (f"/sessions/{sid}/close", f"/sessions/{sid}/runs/{run_id}?after=0",
                 f"/sessions/{sid}?run={run_id}"):  # fmt: skip
        assert (await console.get(path, theirs)).status_code == 404, path

    before = len(reads.rollouts(ledger, reads.Filters(), after="").rollouts)
    no_token = [
        await console.post("/sessions", mine, {"smolfile": 'image = "minimal"\n'}),
        await console.post(f"/sessions/{sid}/exec", mine, {"command": "echo no"}),
        await console.post(f"/sessions/{sid}/close", mine, {"confirm": "yes"}),
        await console.post(f"/sessions/{sid}/close", mine, {"confirm": "yes", "csrf": their_csrf}),
    ]
    assert [a.status_code for a in no_token] == [403] * 4
    assert all("CSRF" in a.text for a in no_token)
    assert len(reads.rollouts(ledger, reads.Filters(), after="").rollouts) == before
    assert not ledger.get(sid).state.final

    reader, reader_csrf = await console.session(console.h.key("team-a", "rollouts:read"))
    assert (await console.get(f"/sessions/{sid}", reader)).status_code == 200
    read_only = await console.post(f"/sessions/{sid}/exec", reader,
                                   {"csrf": reader_csrf, "command": "echo no"})  # fmt: skip
    assert read_only.status_code == 403 and "lacks the scope rollouts:write" in read_only.text

    bad = await console.post("/sessions", mine, {"csrf": csrf, "smolfile": 'image = "<b>\n'})
    assert bad.status_code == 400 and 'id="error"' in bad.text
    assert "image = &#34;&lt;b&gt;" in bad.text  # (the Smolfile is kept in the form, escaped)
    admin, _ = await console.session(console.h.admin_key)
    seen = await console.get(f"/sessions/{sid}", admin)
    assert seen.status_code == 200 and "team-a" in seen.text


async def test_a_rollouts_page_lists_its_checkpoints_and_draws_its_attempts(
    console: Console,
) -> None:
    """Checkpoints with their attempt, host, size and time (their data is neither read nor sent);
    the attempts as a timeline of one labelled bar each, their hosts' names escaped; another
    tenant gets the same 404 as for an unknown rollout."""
    key = console.h.key("team-a")
    await console.h.start_agent("cpu-a", HostClass.CPU)
    async with console.h.connect(key) as channel:
        stub = fleet_pb2_grpc.FleetServiceStub(channel)
        rid = (await stub.SubmitRollout(request('image = "minimal"\n', ["true"]))).rollout.id
    await console.h.wait_final(rid)
    ledger = console.h.server.core.ledger
    [first] = ledger.attempts(rid)
    with ledger.engine.begin() as db:
        # A second attempt on a host with a hostile name, and two checkpoints, one from each.
        db.execute(
            sql_text(
                "INSERT INTO attempts (work_id, attempt, host_id, fencing_token, started_at, "
                "ended_at, outcome, error) VALUES (:w, 2, :h, 7, :s, :e, 'FAILED', :h)"
            ),
            {"w": first.work_id, "h": HOSTILE, "s": first.started_at + 1,
             "e": first.started_at + 3},
        )  # fmt: skip
        for seq, attempt, data in ((1, 1, b"a" * 10), (2, 2, b"<b>" * 100)):
            db.execute(
                sql_text(
                    "INSERT INTO checkpoints (rollout_id, seq, attempt, data, created_at) "
                    "VALUES (:r, :seq, :attempt, :data, :at)"
                ),
                {"r": rid, "seq": seq, "attempt": attempt, "data": data, "at": time.time()},
            )
    cookie, _ = await console.session(key)
    page = await console.get(f"/rollouts/{rid}", cookie)
    assert page.status_code == 200, page.text
    html = page.text
    rows = re.findall(
        r'<tr class="checkpoint"><td>(\d+)</td><td>(\d+)</td><td>([^<]*)</td><td>(\d+)</td>'
        r"<td>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC</td></tr>",
        html,
    )
    assert rows == [("1", "1", "cpu-a", "10"), ("2", "2", ESCAPED, "300")]
    svg = re.search(r'<svg class="chart timeline" id="attempts-timeline".*?</svg>', html, re.S)
    assert svg, html[-4000:]
    labels = re.findall(r'<text class="bar-label"[^>]*>([^<]*)</text>', svg.group(0))
    assert labels == ["#1 cpu-a · SUCCEEDED", f"#2 {ESCAPED} · FAILED"]
    assert svg.group(0).count('<rect class="bar"') == 2
    assert HOSTILE not in html and "<b><b>" not in html
    live = await console.get(f"/rollouts/{rid}/live", cookie)
    assert live.text.count('<rect class="bar"') == 2
    other, _ = await console.session(console.h.key("team-b"))
    theirs = await console.get(f"/rollouts/{rid}", other)
    unknown = await console.get("/rollouts/r_unknown", other)
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.text.replace(rid, "r_unknown") == unknown.text


async def _upload(c: Console, cookie: str, fields: dict[str, str],
                  files: dict[str, tuple[str, str]]) -> httpx.Response:  # fmt: skip
    """POST /policy as multipart/form-data, as a browser sends a form with a file input:
    `fields`, and `files` as field -> (file name, text)."""
    return await c.bare().post(
        f"{c.base}/policy", headers={"Cookie": cookie}, data=fields,
        files={k: (name, text.encode(), "text/plain") for k, (name, text) in files.items()},
    )  # fmt: skip


async def test_an_uploaded_smolfile_is_audited_and_needs_the_csrf_token(console: Console) -> None:
    """The policy form as a browser sends it with a file chosen (multipart/form-data): the
    file's findings are shown and its text, escaped, is put back in the form; without the
    CSRF token the upload is refused; a pasted Smolfile still works through the same form."""
    cookie, csrf = await console.session(console.h.key("team-a"))
    bad = 'image = "minimal"\n[network]\nallow_cidrs = ["169.254.169.254/32"]\n# <script>\n'
    page = await _upload(console, cookie, {"csrf": csrf, "smolfile": ""},
                         {"smolfile_file": ("Smol<b>", bad)})  # fmt: skip
    assert page.status_code == 200, page.text
    assert re.search(r'<tr class="finding"><td>3</td><td>\w+</td><td class="rule">FLEET005<',
                     page.text)  # fmt: skip
    assert "# &lt;script&gt;" in page.text and "<script>" not in page.text
    pasted = await _upload(console, cookie, {"csrf": csrf, "smolfile": bad},
                           {"smolfile_file": ("", "")})  # fmt: skip
    assert pasted.status_code == 200 and 'class="rule">FLEET005<' in pasted.text
    refused = await _upload(console, cookie, {}, {"smolfile_file": ("Smolfile", bad)})
    assert refused.status_code == 403 and "CSRF" in refused.text
    empty = await _upload(console, cookie, {"csrf": csrf}, {"smolfile_file": ("Smolfile", "")})
    assert empty.status_code == 400 and "no Smolfile" in empty.text


async def test_a_malformed_multipart_form_is_a_400_that_says_what_is_wrong(
    console: Console,
) -> None:
    cookie, csrf = await console.session(console.h.key("team-a"))
    field = f'Content-Disposition: form-data; name="csrf"\r\n\r\n{csrf}\r\n'
    cases = {
        # (content type, body): what the answer must name
        ("multipart/form-data", f"--B\r\n{field}--B--\r\n"): "names no boundary",
        ("multipart/form-data; boundary=B", f"--B\r\n{field}"): "CloseBoundaryNotFound",
        ("multipart/form-data; boundary=B", "no parts at all"): "StartBoundaryNotFound",
        ("multipart/form-data; boundary=B",
         "--B\r\nContent-Type: text/plain\r\n\r\nx\r\n--B--\r\n"): "not a named form-data",
        ("multipart/form-data; boundary=B",
         f'--B\r\n{field}--B\r\nContent-Disposition: form-data; name="smolfile"\r\n\r\n'
         "\udcff\r\n--B--\r\n"): "not UTF-8",
        ("text/plain", "smolfile=x"): "multipart/form-data",
    }  # fmt: skip
    for (kind, body), says in cases.items():
        answer = await console.bare().post(
            f"{console.base}/policy", content=body.encode("utf-8", "surrogateescape"),
            headers={"Cookie": cookie, "Content-Type": kind},
        )  # fmt: skip
        assert answer.status_code == 400, (kind, body, answer.text)
        assert says in answer.text, (says, answer.text)
    # (the connection was closed after each refusal; the console still answers)
    assert (await console.get("/policy", cookie)).status_code == 200
