"""Tokens per rollout, end to end: a machine of an inference rollout calls the gateway's
language model (non-streamed, streamed, a completion, retries with an Idempotency-Key); the
gateway hands each rollout's tokens to the fleet server's poll, which charges them to the
rollout's attempt in the ledger, and `fleet report` prices them per completed trajectory.
A retry with the same key gets the same answer and adds no token; another body with the same
key is refused. And a poll whose charge fails loses nothing: the gateway hands it again.

Real parts: the fleet server polling a real gateway over gRPC, its SQLite ledger, an agent
running a namespace machine on a test uplink where the gateway's HTTP endpoint listens, and a
tiny language model in the shipped layout.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from fleet.api.pb import types_pb2
from fleet.core.cost import AttemptCost
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from fleet.ledger.store import Ledger
from fleet.runtime.netns import NetConfig, in_netns
from fleet.server.settings import ServerConfig
from gateway.llm.serving import ENV
from gateway.service import Gateway, GatewayConfig, serve
from tests.integration.harness import (
    SECRET,
    Harness,
    RuntimeFactory,
    fake_runtime,
    harness,
    namespace_runtime,
    request,
)
from tests.llm_fixtures import write_tiny_model
from tests.networld import GATEWAY, networld

MODEL = "tiny-test-r1"

STEP = r"""
import json, os, urllib.error, urllib.request
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]

def call(path, body, idem=None):
    headers = {"Authorization": "Bearer " + key, "Content-Type": "application/json"}
    if idem:
        headers["Idempotency-Key"] = idem
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers=headers)
    return urllib.request.urlopen(req, timeout=60)

def whole(path, body, idem=None):
    with call(path, body, idem) as reply:
        return reply.headers.get("x-fleet-replayed"), json.load(reply)

def stream(path, body, idem):
    with call(path, body, idem) as reply:
        lines = [line.decode().strip() for line in reply]
        data = [line[6:] for line in lines if line.startswith("data: ")]
        return reply.headers.get("x-fleet-replayed"), data

ask = {"model": "MODEL", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 12,
       "temperature": 0}
first = whole("/chat/completions", ask, "k-chat")
again = whole("/chat/completions", ask, "k-chat")
try:
    call("/chat/completions", {**ask, "max_tokens": 5}, "k-chat")
    conflict = None
except urllib.error.HTTPError as exc:
    conflict = [exc.code, json.load(exc)["error"]["param"]]
streamed_ask = {**ask, "stream": True, "stream_options": {"include_usage": True}}
streamed = stream("/chat/completions", streamed_ask, "k-stream")
restreamed = stream("/chat/completions", streamed_ask, "k-stream")
completion = whole("/completions", {"model": "MODEL", "prompt": "The agent runs", "max_tokens": 6,
                                    "temperature": 0})
print(json.dumps({"first": first, "again": again, "conflict": conflict, "streamed": streamed,
                  "restreamed": restreamed, "completion": completion}))
""".replace("MODEL", MODEL)


@asynccontextmanager
async def _fleet(
    tmp_path: Path, images: ImageStore, http: Callable[[Gateway], Any] | None = None,
    runtime: RuntimeFactory = fake_runtime,
) -> AsyncIterator[tuple[Gateway, Harness]]:  # fmt: skip
    """A gateway serving the tiny model (gRPC on loopback, for the server's polls), and a
    fleet server that polls it every 0.1 s (its agents on `runtime`)."""
    model = write_tiny_model(tmp_path / "tiny-llm")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV, str(model))
        gateway = await asyncio.to_thread(
            Gateway.build, GatewayConfig(secret=SECRET, device="cpu", engine="inline")
        )
    grpc_server, port = await serve(gateway, "127.0.0.1:0")
    config = ServerConfig(
        lease_ttl_s=5.0, heartbeat_interval_s=0.5, token_secret=SECRET,
        gateway_address=f"127.0.0.1:{port}", gateway_poll_s=0.1,
    )  # fmt: skip
    try:
        async with harness(tmp_path, images, config, runtime=runtime) as h:
            yield gateway, h
    finally:
        await grpc_server.stop(None)
        await gateway.stop()


async def _charged(
    ledger: Ledger, rollout_id: str, want: dict[str, tuple[int, int]]
) -> list[AttemptCost]:
    """The rollout's attempts once the ledger holds `want` tokens for them (10 s at most)."""
    seen: list[AttemptCost] = []
    for _ in range(200):
        seen = [a for a in await asyncio.to_thread(ledger.cost_attempts, 0.0)
                if a.rollout_id == rollout_id]  # fmt: skip
        if seen and dict(seen[-1].tokens) == want:
            return seen
        await asyncio.sleep(0.05)
    raise AssertionError(f"the ledger holds {[dict(a.tokens) for a in seen]}, not {want}")


def _usage(answer: dict[str, Any]) -> tuple[int, int]:
    return answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]


def _unmarked(events: list[str]) -> list[Any]:
    """The events as the first request got them: the replay's marks taken out."""
    out = []
    for event in events:
        if event.startswith("{"):
            payload = json.loads(event)
            payload.get("fleet", {}).pop("replayed", None)
            out.append(payload)
        else:
            out.append(event)
    return out


@pytest.mark.sandbox
async def test_a_rollouts_tokens_reach_its_attempt_and_the_report_once(
    tmp_path: Path, images: ImageStore
) -> None:
    def bind() -> socket.socket:
        sock = socket.socket()
        sock.bind((GATEWAY[0], 0))
        return sock

    from gateway.http import serve_http

    with networld() as world:
        async with _fleet(tmp_path, images, runtime=namespace_runtime) as (gateway, h):
            sock = await asyncio.to_thread(in_netns, f"/run/netns/{world.uplink}", bind)
            http, port = await serve_http(gateway, sock=sock)
            try:
                net = NetConfig(uplink_netns=world.uplink, dns_upstream=world.dns)
                await h.start_agent("cpu-a", HostClass.CPU, net=net, gateway=(GATEWAY[0], port))
                inference = types_pb2.Requirements(inference=True)
                submitted = await h.fleet.SubmitRollout(
                    request('image = "minimal"\n', ["python3", "-c", STEP], requirements=inference)
                )
                rid = submitted.rollout.id
                done = await h.wait_final(rid)
                assert done.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, [
                    r.stderr[-800:] for r in done.results
                ]
                seen = json.loads(done.results[0].stdout)
                answers = [seen["first"][1], seen["completion"][1],
                           json.loads(seen["streamed"][1][-2])]  # (the usage chunk)  # fmt: skip
                prompt = sum(_usage(a)[0] for a in answers)
                completion = sum(_usage(a)[1] for a in answers)
                [attempt] = await _charged(h.server.core.ledger, rid, {MODEL: (prompt, completion)})
                metrics = gateway.metrics_text()
            finally:
                http.close()
        db = tmp_path / "ledger.sqlite3"

    # The retry got the stored answer, marked; it was not generated again.
    (replayed_first, first), (replayed_again, again) = seen["first"], seen["again"]
    assert replayed_first is None and replayed_again == "1"
    assert again["id"] == first["id"] and again["choices"] == first["choices"]
    assert again["fleet"]["replayed"] is True and "replayed" not in first["fleet"]
    assert seen["conflict"] == [409, "Idempotency-Key"]
    (_, events), (replayed_stream, events_again) = seen["streamed"], seen["restreamed"]
    assert replayed_stream == "1" and events[-1] == "[DONE]"
    assert _unmarked(events_again) == _unmarked(events)
    assert all(json.loads(e)["fleet"]["replayed"] for e in events_again[:-1])
    # Tokens: every answer's (non-streamed, streamed, completion), replays none, once.
    assert completion > 0 and attempt.prompt_tokens == prompt
    assert attempt.completion_tokens == completion
    assert f'fleet_gateway_llm_tokens_total{{kind="completion"}} {float(completion)}' in metrics
    assert "fleet_gateway_llm_replayed_total 2.0" in metrics

    report = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "fleet.cli.main", "report", "--since", "1h", "--db", str(db),
         "--price", f"prompt:{MODEL}=2/Mtok,completion:{MODEL}=8/Mtok", "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr
    [group] = json.loads(report.stdout.splitlines()[-1])["groups"]
    assert group["completed"] == 1
    assert group["prompt_tokens_per_completed"] == prompt
    assert group["completion_tokens_per_completed"] == completion
    cost = (prompt * 2 + completion * 8) / 1e6
    assert group["token_cost_per_completed"] == pytest.approx(cost)
    assert group["cost_per_completed"] == pytest.approx(cost)  # (no host price set)
    table = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "fleet.cli.main", "report", "--since", "1h", "--db", str(db),
         "--price", f"tokens:{MODEL}=1/Mtok", "--chart", ""],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    [row] = [line.split() for line in table.stdout.splitlines() if line.startswith("-")]
    assert [float(x) for x in row[9:12]] == pytest.approx(
        [prompt, completion, (prompt + completion) / 1e6], abs=1e-6
    )
    assert f"prompt:{MODEL} 1/Mtok" in table.stdout


async def test_a_poll_whose_charge_failed_is_handed_again_and_charged_once(
    tmp_path: Path, images: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _fleet(tmp_path, images) as (gateway, h):
        await h.start_agent("cpu-a", HostClass.CPU)
        rid = (await h.fleet.SubmitRollout(request('image = "minimal"\n', ["true"]))).rollout.id
        assert (await h.wait_final(rid)).state == types_pb2.ROLLOUT_STATE_SUCCEEDED
        ledger = h.server.core.ledger
        real = ledger.add_usage
        calls: list[dict[str, Any]] = []

        def flaky(seconds: Any, tokens: Any) -> int:
            calls.append(dict(tokens))
            if len(calls) == 1:
                raise RuntimeError("the ledger is unreachable")
            return real(seconds, tokens)

        monkeypatch.setattr(ledger, "add_usage", flaky)
        gateway.usage.add_tokens(rid, "m", 100, 10)
        await _charged(ledger, rid, {"m": (100, 10)})
        gateway.usage.add_tokens(rid, "m", 1, 1)
        await _charged(ledger, rid, {"m": (101, 11)})
        await asyncio.sleep(0.5)  # (polls go on: nothing more may be charged)
        [attempt] = await _charged(ledger, rid, {"m": (101, 11)})

    want = {rid: {"m": (100, 10)}}
    assert calls[:2] == [want, want]  # refused, then handed again whole
    assert calls[2:] == [{rid: {"m": (1, 1)}}]  # confirmed: never handed again
    assert (attempt.prompt_tokens, attempt.completion_tokens) == (101, 11)
