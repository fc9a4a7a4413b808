"""The gateway's bounds on what a token buys: a connection counts against its rollout however
it is used, and tokens are refused once the fleet server stops saying which rollouts run.
Real torch, the shipped weights, a real gRPC server and HTTP endpoint on loopback."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc

from fleet.api.pb import inference_pb2, inference_pb2_grpc
from fleet.core.tokens import issue, sign_running
from fleet.envs.gridworld import GridWorld
from gateway import service
from gateway.http import serve_http
from gateway.service import Gateway, GatewayConfig, serve

SECRET = b"s" * 32
MODEL = "gridworld-policy"


@dataclass
class Client:
    stub: inference_pb2_grpc.InferenceServiceStub
    gateway: Gateway


@asynccontextmanager
async def gateway() -> AsyncIterator[Client]:
    """A gateway on the CPU with its gRPC server on loopback, and a stub that calls it."""
    gw = Gateway.build(GatewayConfig(secret=SECRET, device="cpu", tokens_without_server=True))
    server, port = await serve(gw, "127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Client(inference_pb2_grpc.InferenceServiceStub(channel), gw)
    finally:
        await channel.close()
        await gw.batcher.stop()
        await server.stop(None)


def observations(n: int) -> list[list[float]]:
    return [GridWorld(seed).observation() for seed in range(n)]


HEALTH = b"GET /healthz HTTP/1.1\r\nHost: g\r\n\r\n"


def infer_request(rollout: str, key: str, sample: list[float]) -> bytes:
    body = json.dumps({
        "token": issue(SECRET, rollout, time.time() + 600, time.time() - 30),
        "rollout_id": rollout, "idempotency_key": key, "model": MODEL, "input": sample,
    }).encode()  # fmt: skip
    head = f"POST /v1/infer HTTP/1.1\r\nHost: g\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


async def response(reader: asyncio.StreamReader) -> tuple[int, bytes, bytes]:
    """(status, head, body) of one response; (0, b"", b"") when the server closed instead."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    except (asyncio.IncompleteReadError, ConnectionResetError):
        return 0, b"", b""
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return int(head.split()[1]), head, await reader.readexactly(length)


async def test_health_checks_on_kept_alive_connections_do_not_lift_the_per_rollout_bound() -> None:
    """With the rollout's connections at their bound, connections opened with GET /healthz
    are answered and closed, so none of them carries the rollout's requests; a plain new one
    of the rollout gets a 503 to retry."""
    sample = observations(1)[0]
    async with gateway() as c:
        http, port = await serve_http(c.gateway, "127.0.0.1", 0, max_per_rollout=2)
        held = []
        try:
            first = []
            for i in range(2):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                held.append(writer)
                writer.write(infer_request("r-greedy", f"k{i}", sample))
                first.append((await response(reader))[0])
            health, smuggled = [], []
            for i in range(3):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                held.append(writer)
                writer.write(HEALTH)
                health.append(await response(reader))
                writer.write(infer_request("r-greedy", f"h{i}", sample))
                smuggled.append((await response(reader))[0])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            held.append(writer)
            writer.write(infer_request("r-greedy", "over", sample))
            over = await response(reader)
        finally:
            for w in held:
                w.close()
            http.close()

    assert first == [200, 200]
    assert [(s, b) for s, _, b in health] == [(200, b"ok")] * 3
    assert all(b"Connection: close" in head for _, head, _ in health)
    assert smuggled == [0, 0, 0]  # closed after the health check: nothing was served on it
    assert over[0] == 503 and b"2 connections of r-greedy are open here" in over[2]


async def test_tokens_are_refused_while_the_servers_list_of_running_rollouts_is_stale() -> None:
    """Once a fleet server has said which rollouts run, a gateway that stops hearing from it
    fails closed: over gRPC and HTTP, a running rollout's token is refused (Unavailable, with
    a retry hint) until a fresh list arrives, and served again after it."""
    sample = observations(1)[0]

    def request(key: str) -> inference_pb2.InferRequest:
        return inference_pb2.InferRequest(
            token=issue(SECRET, "r-live", time.time() + 600, time.time() - 30),
            rollout_id="r-live", idempotency_key=key, model=MODEL,
            input=inference_pb2.Tensor(shape=[len(sample)], values=sample),
        )  # fmt: skip

    async def poll() -> None:
        as_of = time.time()
        running = inference_pb2.RunningRollouts(
            rollout_ids=["r-live"], as_of=as_of,
            signature=sign_running(SECRET, ["r-live"], as_of),
        )  # fmt: skip
        await c.stub.Status(inference_pb2.GatewayStatusRequest(running=running))

    async def outcome(key: str) -> str:
        try:
            await c.stub.Infer(request(key))
            return "served"
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"

    async with gateway() as c:
        http, port = await serve_http(c.gateway, "127.0.0.1", 0)
        try:
            await poll()
            fresh = await outcome("a")
            c.gateway.running_received -= service.RUNNING_STALE_S + 1  # the server went quiet
            stale = await outcome("b")
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(infer_request("r-live", "c", sample))
            status, head, body = await response(reader)
            writer.close()
            await poll()  # it is back
            again = await outcome("d")
        finally:
            http.close()

    assert fresh == "served" and again == "served"
    assert stale.startswith("UNAVAILABLE: the fleet server has not said which rollouts are")
    assert "tokens are refused until it does" in stale
    assert status == 503 and b"Retry-After: 1.000" in head
    assert json.loads(body)["code"] == "UNAVAILABLE"
