"""Upstream models behind the gateway: a real upstream (`tests.openai_upstream`, a process of
its own that checks the gateway's key), a real gateway forwarding to it with the key it holds,
and callers with rollout tokens: a client on loopback, and the machine of an --inference
rollout on a real fleet, which also searches everything it can read for the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleet.api.pb import types_pb2
from fleet.client import AsyncFleet
from fleet.core.placement import HostClass
from fleet.core.tokens import issue, sign_running, verify
from fleet.image.store import ImageStore
from fleet.runtime.netns import NetConfig, in_netns
from gateway.http import serve_http
from gateway.llm.upstream import Upstreams
from gateway.llm.upstream_config import load_upstreams
from gateway.service import Gateway, GatewayConfig
from tests.integration.harness import SECRET, harness, namespace_runtime
from tests.networld import GATEWAY, networld

REPO = Path(__file__).resolve().parents[2]
ALLOWED = ("up/echo-model", "up/die-before", "up/die-after", "up/leaky", "down/echo-model")


@dataclass
class Upstream:
    key: str
    log: Path
    port: int

    def seen(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines()]


def _closed_port() -> int:
    """A loopback port nothing listens on (connections to it are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def upstream_process(tmp: Path) -> AsyncIterator[Upstream]:
    """`tests.openai_upstream` in a process of its own, expecting a new random key."""
    key = "sk-" + secrets.token_hex(24)
    key_file = tmp / "upstream.key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    port_file, log = tmp / "upstream.port", tmp / "upstream.log"
    log.touch()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.openai_upstream",
        "--key-file",
        str(key_file),
        "--port-file",
        str(port_file),
        "--log",
        str(log),
        cwd=REPO,
    )
    try:
        for _ in range(200):
            if port_file.exists():
                break
            assert proc.returncode is None, "the upstream exited at start"
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the upstream did not start in 10 s")
        yield Upstream(key, log, int(port_file.read_text()))
    finally:
        proc.kill()
        await proc.wait()


def _upstreams(tmp: Path, up: Upstream) -> Upstreams:
    """The gateway's upstreams as `fleet gateway` reads them: `up` with its key from a file,
    `down` refusing connections, and fallback chains onto `up`'s echo model."""
    config = load_upstreams(
        [f"up=http://127.0.0.1:{up.port}/v1", f"down=http://127.0.0.1:{_closed_port()}/v1"],
        [f"up=@{tmp / 'upstream.key'}"],
        ["up/die-before=up/echo-model", "down/echo-model=up/echo-model"],
    )
    return Upstreams(config)


@contextlib.asynccontextmanager
async def serving(
    ups: Upstreams, sock: socket.socket | None = None
) -> AsyncIterator[tuple[Gateway, int, int]]:
    """A gateway (no language model of its own) whose OpenAI-compatible endpoint forwards to
    `ups`: (the gateway, the port of its endpoint on `sock`, its port on loopback)."""
    gw = Gateway.build(GatewayConfig(secret=SECRET, device="cpu", engine="inline", llm="none",
                                     tokens_without_server=True))  # fmt: skip
    gw.upstreams = ups
    gw.batcher.start()
    local, local_port = await serve_http(gw, "127.0.0.1", 0)
    http, port = (await serve_http(gw, sock=sock)) if sock is not None else (local, local_port)
    try:
        yield gw, port, local_port
    finally:
        http.close()
        local.close()
        await ups.aclose()
        await gw.stop()


def _ask(model: str, stream: bool = False) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "what is it?"}],
        "stream": stream,
    }


async def _sse(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, list[str]]:
    async with client.stream("POST", "/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            await reply.aread()
            return reply.status_code, [reply.text]
        return 200, [line[6:] async for line in reply.aiter_lines() if line.startswith("data: ")]


def _text(events: list[str]) -> str:
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")
    )


async def test_the_gateway_forwards_with_its_key_and_falls_back_before_the_first_token(
    tmp_path: Path,
) -> None:
    async with (
        upstream_process(tmp_path) as up,
        serving(_upstreams(tmp_path, up)) as (_gw, port, _),
    ):
        token = issue(SECRET, "r-a", time.time() + 600, models=ALLOWED)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}/v1",
            timeout=30,
            headers={"authorization": f"Bearer {token}"},
        ) as client:
            listed = (await client.get("/models")).json()["data"]
            whole = await client.post("/chat/completions", json=_ask("up/echo-model"))
            status, streamed = await _sse(client, _ask("up/echo-model", stream=True))
            _, saved = await _sse(client, _ask("up/die-before", stream=True))
            refused_whole = await client.post("/chat/completions", json=_ask("down/echo-model"))
            _, broken = await _sse(client, _ask("up/die-after", stream=True))
            leaky = await client.post("/chat/completions", json=_ask("up/leaky"))
            outside = await client.post("/chat/completions", json=_ask("up/tired"))
        seen = up.seen()

    assert {m["id"] for m in listed} == {
        "up/echo-model",
        "up/die-before",
        "up/die-after",
        "up/leaky",
    }
    assert whole.status_code == 200, whole.text
    answer = whole.json()
    assert answer["choices"][0]["message"]["content"] == "the answer is 42"
    assert answer["model"] == "up/echo-model"
    assert answer["fleet"]["upstream"] == "up" and answer["fleet"]["fallbacks_tried"] == []
    assert whole.headers["x-fleet-served-by"].startswith("upstream; upstream=up")

    assert status == 200 and streamed[-1] == "[DONE]"
    assert _text(streamed) == "the answer is 42"
    assert all(json.loads(e)["fleet"]["upstream"] == "up" for e in streamed[:-1])

    # Died before its first token: completed on the chain's next model, and says so.
    assert saved[-1] == "[DONE]" and _text(saved) == "the answer is 42"
    said = json.loads(saved[0])["fleet"]
    assert said["model"] == "up/echo-model" and said["requested"] == "up/die-before"
    assert [t["model"] for t in said["fallbacks_tried"]] == ["up/die-before"]
    # Refused connections: the same, whole.
    assert refused_whole.status_code == 200, refused_whole.text
    tried = refused_whole.json()["fleet"]["fallbacks_tried"]
    assert tried[0]["model"] == "down/echo-model" and "refused" in tried[0]["error"]
    assert refused_whole.headers["x-fleet-degraded"] == "1"

    # Died after tokens were sent: not continued elsewhere; a resumable error names the last.
    assert _text(broken[:-1]) == "the answer is"
    end = json.loads(broken[-1])
    assert end["error"]["code"] == "resumable"
    assert end["fleet"]["tokens_sent"] == 3 and end["fleet"]["last_token"] == " is"
    assert end["fleet"]["model"] == "up/die-after"

    # The upstream's refusal comes back with the key it quoted scrubbed.
    assert leaky.status_code == 400 and up.key not in leaky.text and "[redacted]" in leaky.text
    # A model the token does not list: 403 in OpenAI's shape, naming it; never forwarded.
    assert outside.status_code == 403
    assert (
        outside.json()["error"]["param"] == "model"
        and "up/tired" in outside.json()["error"]["message"]
    )
    assert not any(s["model"] == "tired" for s in seen)
    # The upstream saw the gateway's key on every request, never the rollout's token.
    assert seen and all(s["key_ok"] for s in seen)


STEP = r"""
import hashlib, json, os, signal, stat, sys, time, urllib.error, urllib.request
base, token = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
wire = []

def call(path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={
        "Authorization": "Bearer " + token, "Content-Type": "application/json"})
    try:
        reply = urllib.request.urlopen(req, timeout=30)
        status = reply.status
    except urllib.error.HTTPError as exc:
        reply, status = exc, exc.code
    raw = reply.read()
    wire.append(("%d\n%s\n" % (status, reply.headers)).encode() + raw)
    return status, raw.decode()

def ask(model, stream=False):
    return call("/chat/completions", {"model": model, "stream": stream,
                                      "messages": [{"role": "user", "content": "what is it?"}]})

out = {"token": token, "models": [], "calls": {}}
if sys.argv[1] == "search":
    out["models"] = [m["id"] for m in json.loads(call("/models")[1])["data"]]
    status, raw = ask("up/echo-model")
    out["calls"]["whole"] = [status, json.loads(raw)["choices"][0]["message"]["content"]]
    for model in ("up/echo-model", "up/die-before", "up/die-after"):
        status, raw = ask(model, stream=True)
        events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        text = "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in chunks if c.get("choices"))
        out["calls"][model] = [status, text, events[-1]]
status, raw = ask("up/tired")
out["calls"]["up/tired"] = [status, raw[:400]]
if sys.argv[1] != "search":
    print(json.dumps(out))
    raise SystemExit(0)

# What the machine received on the wire, kept where the search below reads it.
with open("/tmp/wire.bin", "wb") as f:
    f.write(b"\n".join(wire))
# A decoy of the key's shape, planted here: the search must find it (or it proves nothing).
decoy = "sk-" + os.urandom(24).hex()
with open("/tmp/decoy.txt", "w") as f:
    f.write("x" * 1000 + decoy + "\n")
targets = {
    "key": (sys.argv[2].encode(), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]),
    "decoy": (decoy[3:11].encode(), 3, len(decoy), hashlib.sha256(decoy.encode()).hexdigest()),
}

def alarm(*_):
    raise TimeoutError
signal.signal(signal.SIGALRM, alarm)

def read(path):
    chunks, size = [], 0
    signal.alarm(2)  # (a file that blocks its reader, as /proc/kmsg can, is given up on)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            while size < (8 << 20):
                piece = os.read(fd, 1 << 20)
                if not piece:
                    break
                chunks.append(piece)
                size += len(piece)
        finally:
            os.close(fd)
    finally:
        signal.alarm(0)
    return b"".join(chunks)

def hits(data, marker, offset, length, digest):
    at = data.find(marker)
    while at != -1:
        start = at - offset
        if start >= 0 and hashlib.sha256(data[start:start + length]).hexdigest() == digest:
            return True
        at = data.find(marker, at + 1)
    return False

found = {name: [] for name in targets}
files = readable = 0
complete = True
give_up = time.monotonic() + 150
environ = "\n".join(f"{k}={v}" for k, v in os.environ.items()).encode()
for name, target in targets.items():
    if hits(environ, *target):
        found[name].append("<environment>")
for root, dirs, names in os.walk("/"):
    if time.monotonic() > give_up:
        complete = False
        break
    for name in names:
        path = os.path.join(root, name)
        files += 1
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            data = read(path)
        except (OSError, TimeoutError):
            continue
        readable += 1
        for what, target in targets.items():
            if hits(data, *target):
                found[what].append(path)
out.update(found=found, files=files, readable=readable, complete=complete,
           proc_self=os.path.realpath("/proc/self"))
print(json.dumps(out))
"""


def _step(*argv: str) -> list[str]:
    return ["python3", "-c", STEP, *argv]


@pytest.mark.sandbox
async def test_a_machine_calls_upstream_models_and_cannot_find_the_key(
    tmp_path: Path, images: ImageStore
) -> None:
    def bind() -> socket.socket:
        sock = socket.socket()
        sock.bind((GATEWAY[0], 0))
        return sock

    with networld() as world:
        async with upstream_process(tmp_path) as up:
            # The machine gets only a fragment of the key and the key's digest: a window of
            # the key's length at each place the fragment occurs is hashed and compared.
            marker, digest = up.key[3:11], hashlib.sha256(up.key.encode()).hexdigest()
            sock = await asyncio.to_thread(in_netns, f"/run/netns/{world.uplink}", bind)
            async with (
                serving(_upstreams(tmp_path, up), sock) as (gw, port, local_port),
                harness(tmp_path, images, runtime=namespace_runtime) as h,
            ):
                net = NetConfig(uplink_netns=world.uplink, dns_upstream=world.dns)
                await h.start_agent("cpu-a", HostClass.CPU, net=net, gateway=(GATEWAY[0], port))
                smolfile = tmp_path / "minimal.smolfile"
                smolfile.write_text('image = "minimal"\n')
                async with AsyncFleet(h.server.address, plaintext=True) as fleet:
                    mine = await fleet.submit(
                        smolfile, [_step("search", marker, "3", str(len(up.key)), digest)],
                        inference=True, models=ALLOWED, timeout_s=240,
                    )  # fmt: skip
                    theirs = await fleet.submit(
                        smolfile, [_step("other")], inference=True, tenant="other"
                    )
                    # A session names its models the same way; its machine's token says them.
                    async with await fleet.session(
                        smolfile, inference=True, models=["up/echo-model"]
                    ) as box:
                        said = await box.exec(["sh", "-c", "echo $OPENAI_API_KEY"], timeout_s=30)
                a, b = mine.id, theirs.id
                done_a = await h.wait_final(a, 300)
                done_b = await h.wait_final(b, 120)
                assert done_a.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, [
                    r.stderr[-1500:] for r in done_a.results
                ]
                assert done_b.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, [
                    r.stderr[-1500:] for r in done_b.results
                ]
                seen_a = json.loads(done_a.results[0].stdout)
                seen_b = json.loads(done_b.results[0].stdout)
                async with httpx.AsyncClient(
                    base_url=f"http://127.0.0.1:{local_port}/v1", timeout=30
                ) as client:
                    # Another tenant's token, used for this rollout: refused.
                    crossed = await client.post(
                        "/chat/completions",
                        json=_ask("up/echo-model"),
                        headers={
                            "authorization": f"Bearer {seen_b['token']}",
                            "x-fleet-rollout": a,
                        },
                    )
                    # Both rollouts ended: the server's list (as the server signs it) says
                    # neither runs, and their tokens are refused from then on.
                    as_of = time.time() + 2.0
                    gw.note_running([], as_of, sign_running(SECRET, [], as_of))
                    ended = await client.post(
                        "/chat/completions",
                        json=_ask("up/echo-model"),
                        headers={"authorization": f"Bearer {seen_a['token']}"},
                    )
            stored = up.seen()

    session_token = said.stdout.decode().strip()
    assert verify(SECRET, session_token, time.time()).models == ("up/echo-model",)
    assert done_a.manifest.models == list(ALLOWED)
    assert verify(SECRET, seen_a["token"], 0.0).models == ALLOWED
    assert verify(SECRET, seen_b["token"], 0.0).models == ()
    # The machine got its answers from the upstream, through the gateway.
    assert seen_a["models"] == ["up/echo-model", "up/die-before", "up/die-after", "up/leaky"]
    calls = seen_a["calls"]
    assert calls["whole"] == [200, "the answer is 42"]
    assert calls["up/echo-model"][:2] == [200, "the answer is 42"]
    assert calls["up/die-before"][:2] == [200, "the answer is 42"]  # on the fallback
    assert calls["up/die-after"][1] == "the answer is"
    assert json.loads(calls["up/die-after"][2])["error"]["code"] == "resumable"
    assert calls["up/tired"][0] == 403 and "up/tired" in calls["up/tired"][1]
    # Another tenant's rollout, which named no upstream model, is refused them.
    assert seen_b["calls"]["up/tired"][0] == 403
    # The upstream saw the gateway's key on each request.
    assert stored and all(s["key_ok"] for s in stored)
    # The machine's search: everything it could read, the environment and what it received;
    # the decoy it planted was found (so the search works), the key nowhere.
    assert seen_a["complete"] is True and seen_a["readable"] > 1000, seen_a
    assert "/tmp/decoy.txt" in seen_a["found"]["decoy"], seen_a["found"]
    assert seen_a["found"]["key"] == [], seen_a["found"]["key"]
    # Ended rollouts' tokens, and a token used for another rollout, are refused.
    assert ended.status_code == 403 and "not running" in ended.json()["error"]["message"]
    assert crossed.status_code == 403 and f"not to {a}" in crossed.json()["error"]["message"]


def test_fleet_gateway_refuses_a_key_given_on_its_command_line(tmp_path: Path) -> None:
    """The operator's mistake (the key itself where the variable's name goes) stops the start,
    and the key appears in nothing the gateway says."""
    key = "sk-" + secrets.token_hex(24)
    env = {**os.environ, "FLEET_HOME": str(tmp_path / "home")}
    argv = [sys.executable, "-m", "fleet.cli.main", "gateway", "--listen", "127.0.0.1:0",
            "--http-listen", "127.0.0.1:0", "--device", "cpu", "--engine", "inline",
            "--upstream", "a=http://127.0.0.1:9/v1", "--upstream-key", f"a={key}"]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, cwd=tmp_path, timeout=120)
    said = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode != 0, said[-2000:]
    assert "the key itself is never taken on the command line" in said, said[-2000:]
    assert key not in said
