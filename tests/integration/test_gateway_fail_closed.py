"""A gateway that no fleet server has polled yet fails closed: it refuses every token until the
server's first signed list of running rollouts arrives, unless it runs standalone."""

from __future__ import annotations

import argparse
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import httpx
import pytest

from fleet.api.pb import inference_pb2, inference_pb2_grpc
from fleet.core.tokens import issue, sign_running
from fleet.envs.gridworld import GridWorld
from gateway.http import serve_http
from gateway.service import STALE_RETRY_S, Gateway, GatewayConfig, serve
from gateway.settings import GatewaySettings

SECRET = b"f" * 32
MODEL = "gridworld-policy"
SAMPLE = GridWorld(0).observation()


@dataclass
class Endpoints:
    gateway: Gateway
    stub: inference_pb2_grpc.InferenceServiceStub
    http_url: str


@asynccontextmanager
async def gateway(**overrides: object) -> AsyncIterator[Endpoints]:
    """A gateway on the CPU with both endpoints on loopback; nothing polls it but the test."""
    config = GatewayConfig(secret=SECRET, device="cpu", engine="inline").model_copy(
        update=overrides
    )
    gw = Gateway.build(config)
    server, port = await serve(gw, "127.0.0.1:0")
    http, http_port = await serve_http(gw, "127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        yield Endpoints(gw, stub, f"http://127.0.0.1:{http_port}")
    finally:
        http.close()
        await channel.close()
        await gw.stop()
        await server.stop(None)


def token() -> str:
    """A token of r-live issued well before any list is read, so only the list (not a new
    token's grace) decides; made when asked (a module-level one would expire in a long run)."""
    return issue(SECRET, "r-live", time.time() + 600, time.time() - 30)


async def ask_grpc(e: Endpoints, key: str) -> str:
    request = inference_pb2.InferRequest(
        token=token(), rollout_id="r-live", idempotency_key=key, model=MODEL,
        input=inference_pb2.Tensor(shape=[len(SAMPLE)], values=SAMPLE),
    )  # fmt: skip
    try:
        reply = await e.stub.Infer(request, timeout=60)
    except grpc.aio.AioRpcError as exc:
        return f"{exc.code().name}: {exc.details()}"
    assert len(reply.output.values) > 0
    return "served"


async def ask_http(e: Endpoints, key: str) -> httpx.Response:
    body = {"token": token(), "rollout_id": "r-live", "idempotency_key": key, "model": MODEL,
            "input": SAMPLE}  # fmt: skip
    async with httpx.AsyncClient(timeout=60) as client:
        return await client.post(e.http_url + "/v1/infer", json=body)


async def send_list(e: Endpoints, ids: list[str]) -> None:
    """What the fleet server's poll sends: the running rollouts, signed with the secret."""
    as_of = time.time()
    running = inference_pb2.RunningRollouts(
        rollout_ids=ids, as_of=as_of, signature=sign_running(SECRET, ids, as_of)
    )
    await e.stub.Status(inference_pb2.GatewayStatusRequest(running=running), timeout=30)


async def test_a_gateway_no_server_has_polled_refuses_tokens_until_the_first_list() -> None:
    async with gateway() as e:
        before_grpc = await ask_grpc(e, "g-before")
        before_http = await ask_http(e, "h-before")
        bare_status = await e.stub.Status(inference_pb2.GatewayStatusRequest(), timeout=30)
        still_grpc = await ask_grpc(e, "g-still")  # (a poll without a list changes nothing)
        await send_list(e, ["r-live"])
        after_grpc = await ask_grpc(e, "g-after")
        after_http = await ask_http(e, "h-after")

    assert before_grpc.startswith("UNAVAILABLE: no fleet server has said yet which rollouts")
    assert "--tokens-without-server" in before_grpc
    assert before_http.status_code == 503
    assert float(before_http.headers["Retry-After"]) == STALE_RETRY_S
    assert before_http.json()["code"] == "UNAVAILABLE"
    assert bare_status.queue_depth == 0
    assert still_grpc.startswith("UNAVAILABLE")
    assert after_grpc == "served"
    assert after_http.status_code == 200, after_http.text


async def test_a_standalone_gateway_serves_tokens_before_any_list() -> None:
    """Run without a server (`tokens_without_server`), tokens are checked on their own; once a
    server does send a list, it decides as it would for any gateway."""
    async with gateway(tokens_without_server=True) as e:
        at_once_grpc = await ask_grpc(e, "g-now")
        at_once_http = await ask_http(e, "h-now")
        await send_list(e, [])  # r-live has ended
        ended = await ask_grpc(e, "g-ended")

    assert at_once_grpc == "served"
    assert at_once_http.status_code == 200, at_once_http.text
    assert ended.startswith("PERMISSION_DENIED: rollout r-live is not running")


def test_standalone_is_off_by_default_and_a_flag_and_a_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parser = argparse.ArgumentParser(prog="fleet gateway")
    GatewaySettings.add_flags(parser)
    default = GatewaySettings.from_args(parser.parse_args([])).gateway_config(b"k", "info")
    flagged = GatewaySettings.from_args(parser.parse_args(["--tokens-without-server"]))
    monkeypatch.setenv("FLEET_GATEWAY_TOKENS_WITHOUT_SERVER", "true")
    from_env = GatewaySettings.from_args(parser.parse_args([]))

    assert GatewayConfig().tokens_without_server is False
    assert default.tokens_without_server is False
    assert flagged.gateway_config(b"k", "info").tokens_without_server is True
    assert from_env.gateway_config(b"k", "info").tokens_without_server is True
