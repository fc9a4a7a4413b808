"""An inference rollout's machine finds the gateway's OpenAI-compatible API in its environment
(OPENAI_BASE_URL, OPENAI_API_KEY) and streams a chat completion from inside its namespace.

Real parts: the fleet server and an agent (in process), a namespace machine on a test uplink,
and the gateway serving a tiny language model on the uplink's address. The step speaks the
API with the image's standard library (the image has no `openai` package); what it sends is
what that client sends: `Authorization: Bearer`, JSON, and server-sent events back.
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
from tests.integration.harness import SECRET, harness, request
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
            async with harness(tmp_path, images) as h:
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
