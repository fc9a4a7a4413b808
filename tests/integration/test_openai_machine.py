"""An inference rollout's machine finds the gateway's OpenAI-compatible API in its environment
(OPENAI_BASE_URL, OPENAI_API_KEY) and streams a chat completion from inside its namespace.

Real parts: the fleet server and an agent (in process), a namespace machine on a test uplink,
and the gateway serving a tiny language model on the uplink's address. The first step speaks
the API with the image's standard library (the image has no `openai` package); what it sends is
what that client sends: `Authorization: Bearer`, JSON, and server-sent events back. The last
test runs the official client itself in the machine, uploaded as an input, against the
shipped model.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest

from fleet.api.pb import types_pb2
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from fleet.runtime.netns import NetConfig, in_netns
from gateway.http import serve_http
from gateway.llm.serving import ENV
from gateway.service import Gateway, GatewayConfig
from tests.integration.harness import SECRET, harness, namespace_runtime, request
from tests.llm_fixtures import write_tiny_model
from tests.networld import GATEWAY, networld

STEP = r"""
import json, os, urllib.error, urllib.request
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]

def call(path, body=None, token=key):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={
        "Authorization": "Bearer " + token, "Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=30)

models = json.load(call("/models"))["data"]
ask = {"model": models[0]["id"], "messages": [{"role": "user", "content": "hello"}],
       "max_tokens": 12, "temperature": 0}
whole = json.load(call("/chat/completions", ask))
chunks = []
with call("/chat/completions", {**ask, "stream": True}) as reply:
    kind = reply.headers["Content-Type"]
    for line in reply:
        line = line.decode().strip()
        if line.startswith("data: "):
            chunks.append(line[6:])
try:
    call("/models", token="v1.not.a-token")
    refused = None
except urllib.error.HTTPError as exc:
    refused = exc.code
deltas = [json.loads(c)["choices"][0]["delta"].get("content") or "" for c in chunks[:-1]]
print(json.dumps({
    "base": base, "key_is_token": key == os.environ["FLEET_INFERENCE_TOKEN"],
    "models": [(m["id"], m["context_length"]) for m in models], "kind": kind,
    "whole": whole["choices"][0]["message"]["content"], "streamed": "".join(deltas),
    "last": chunks[-1], "chunks": len(chunks), "refused": refused,
    "served_by": whole["fleet"]["device"],
}))
"""


@pytest.mark.sandbox
async def test_a_machine_streams_a_chat_completion_with_its_environment(
    tmp_path: Path, images: ImageStore
) -> None:
    model = write_tiny_model(tmp_path / "tiny-llm")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV, str(model))
        gateway = Gateway.build(
            GatewayConfig(secret=SECRET, device="cpu", engine="inline", tokens_without_server=True)
        )
    gateway.batcher.start()

    def bind() -> socket.socket:
        sock = socket.socket()
        sock.bind((GATEWAY[0], 0))
        return sock

    with networld() as world:
        sock = await asyncio.to_thread(in_netns, f"/run/netns/{world.uplink}", bind)
        http, port = await serve_http(gateway, sock=sock)
        try:
            async with harness(tmp_path, images, runtime=namespace_runtime) as h:
                net = NetConfig(uplink_netns=world.uplink, dns_upstream=world.dns)
                await h.start_agent("cpu-a", HostClass.CPU, net=net, gateway=(GATEWAY[0], port))
                inference = types_pb2.Requirements(inference=True)
                submitted = await h.fleet.SubmitRollout(
                    request('image = "minimal"\n', ["python3", "-c", STEP], requirements=inference)
                )
                done = await h.wait_final(submitted.rollout.id)
        finally:
            http.close()
            await gateway.stop()

    assert done.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, [r.stderr[-800:] for r in done.results]
    seen = json.loads(done.results[0].stdout)
    assert seen["base"] == f"http://{GATEWAY[0]}:{port}/v1"
    assert seen["key_is_token"] is True
    assert seen["models"] == [["tiny-test-r1", 192]]
    assert seen["kind"] == "text/event-stream"
    assert seen["streamed"] == seen["whole"] and seen["chunks"] > 2
    assert seen["last"] == "[DONE]"
    assert seen["refused"] == 401
    assert seen["served_by"] == "cpu"


OFFICIAL = r"""
import json, os, sys, time
from openai import APIStatusError, OpenAI

shell = {"type": "function", "function": {"name": "shell", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
model = client.models.list().data[0].id
stream = client.chat.completions.create(
    model=model, temperature=0, max_tokens=48, tools=[shell], stream=True,
    messages=[{"role": "user", "content": "How many words are in 'red fox jumps'?"}])
calls, reasons, chunks = [], [], 0
for chunk in stream:
    chunks += 1
    for choice in chunk.choices:
        calls += [c.function.name for c in choice.delta.tool_calls or []]
        if choice.finish_reason:
            reasons.append(choice.finish_reason)
refused = {}
for name, key in (("expired", os.environ["EXPIRED_TOKEN"]), ("other", os.environ["OTHER_TOKEN"])):
    try:
        OpenAI(api_key=key, max_retries=0, default_headers={
            "x-fleet-rollout": os.environ["FLEET_ROLLOUT_ID"]}).models.list()
        refused[name] = None
    except APIStatusError as exc:
        refused[name] = [exc.status_code, exc.message]
import openai
print(json.dumps({"openai": openai.__version__, "model": model, "calls": calls,
                  "reasons": reasons, "chunks": chunks, "refused": refused}))
"""

FIND_PACKAGES = r"""
import json, sys, openai
openai.OpenAI(api_key="k", base_url="http://127.0.0.1:9/v1").chat.completions
site = next(p for p in sys.path if p.endswith("site-packages"))
tops = sorted({m.split(".")[0] for m, mod in list(sys.modules.items())
               if (getattr(mod, "__file__", None) or "").startswith(site)})
import importlib.metadata as md
dists = md.packages_distributions()
infos = sorted({str(md.distribution(d)._path) for t in tops for d in dists.get(t, [])
                if str(md.distribution(d)._path).startswith(site)})
print(json.dumps({"site": site, "tops": tops, "infos": infos}))
"""


def official_client_tree(into: Path) -> Path:
    """The official `openai` package and what it imports, copied from this test's own
    environment (the machine's Python is the same minor version): uploaded as an input, since
    the image has no `openai` and the machine no package index."""
    import shutil
    import subprocess
    import sys

    found = json.loads(subprocess.run([sys.executable, "-c", FIND_PACKAGES], check=True,
                                      capture_output=True, text=True).stdout)  # fmt: skip
    site = Path(found["site"])
    into.mkdir(parents=True)
    for top in found["tops"]:
        if top.startswith("__editable__") or top == "_virtualenv":
            continue
        if (site / top).is_dir():
            shutil.copytree(site / top, into / top,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))  # fmt: skip
        elif (site / f"{top}.py").is_file():
            shutil.copy2(site / f"{top}.py", into / f"{top}.py")
        else:  # a compiled module beside the packages (name.cpython-311-...so)
            for f in site.glob(f"{top}.*.so"):
                shutil.copy2(f, into / f.name)
    for info in found["infos"]:  # (their metadata: `openai` reads its dependencies' versions)
        shutil.copytree(info, into / Path(info).name)
    return into


@pytest.mark.sandbox
async def test_the_official_client_in_a_machine_streams_a_tool_call_from_the_shipped_model(
    tmp_path: Path, images: ImageStore
) -> None:
    """The official `openai` client, inside a machine of an --inference rollout, lists the
    models and streams a chat completion with a tool call from the shipped model; an expired
    token and another rollout's token are refused there (403, saying why)."""
    from fleet.api.pb import fleet_pb2_grpc
    from fleet.cli import client
    from fleet.core.tokens import issue

    library = official_client_tree(tmp_path / "pylib")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV, "auto")  # the shipped fleet-tiny-chat-v1
        gateway = Gateway.build(
            GatewayConfig(secret=SECRET, device="cpu", engine="inline", tokens_without_server=True)
        )
    gateway.batcher.start()

    def bind() -> socket.socket:
        sock = socket.socket()
        sock.bind((GATEWAY[0], 0))
        return sock

    with networld() as world:
        sock = await asyncio.to_thread(in_netns, f"/run/netns/{world.uplink}", bind)
        http, port = await serve_http(gateway, sock=sock)
        try:
            async with harness(tmp_path, images, secure=True, runtime=namespace_runtime) as h:
                net = NetConfig(uplink_netns=world.uplink, dns_upstream=world.dns)
                await h.start_agent("cpu-a", HostClass.CPU, net=net, gateway=(GATEWAY[0], port))
                async with h.connect(h.key("team-a")) as channel:
                    stub = fleet_pb2_grpc.FleetServiceStub(channel)
                    tree = await client.upload(stub, library, "/opt/pylib", True)
                    step = ["sh", "-c", 'PYTHONPATH=/opt/pylib exec python3 -c "$STEP"']
                    req = request('image = "minimal"\n', step,
                                  requirements=types_pb2.Requirements(inference=True))  # fmt: skip
                    req.inputs.append(tree)
                    env = req.steps[0].env
                    env["STEP"] = OFFICIAL
                    env["EXPIRED_TOKEN"] = issue(SECRET, "r-any", 1.0)
                    env["OTHER_TOKEN"] = issue(SECRET, "r-another-tenants", 4e9)
                    req.steps[0].timeout_s = 120
                    rid = (await stub.SubmitRollout(req)).rollout.id
                    done = await h.wait_final(rid, timeout_s=120)
        finally:
            http.close()
            await gateway.stop()

    assert done.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, [r.stderr[-1500:] for r in done.results]
    seen = json.loads(done.results[0].stdout)
    assert seen["model"] == "fleet-tiny-chat-v1"
    assert seen["calls"] == ["shell"] and seen["reasons"] == ["tool_calls"]
    assert seen["chunks"] >= 2
    assert seen["refused"]["expired"][0] == 403 and "expired" in seen["refused"]["expired"][1]
    assert seen["refused"]["other"][0] == 403 and "rollout" in seen["refused"]["other"][1]
