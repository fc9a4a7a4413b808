"""Hybrid rollouts: a CPU machine steps the environment and asks the gateway for each action.

Real parts throughout: the fleet server and an agent (in process), a namespace machine with its
own network namespace hanging off a test uplink, and the gateway with the shipped policy,
listening on the uplink's address. Nothing leaves the namespaces the test creates.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import torch

from fleet._proto.fleet.v1 import fleet_pb2, types_pb2
from fleet.core.placement import HostClass
from fleet.envs.episode import program
from fleet.envs.gridworld import GridWorld, argmax
from fleet.image.store import ImageStore
from fleet.runtime.netns import NetConfig, in_netns
from gateway.http import HTTP_STATUS, serve_http
from gateway.model import load_network, model_specs
from gateway.service import Gateway, GatewayConfig
from tests.integration.harness import SECRET, harness, request
from tests.networld import GATEWAY, networld


def local_episode(seed: int) -> list[int]:
    """The same policy run in-process: the trajectory the gateway must reproduce."""
    net = load_network(model_specs()["gridworld-policy"])
    env, done, actions = GridWorld(seed), False, []
    while not done:
        with torch.inference_mode():
            action = argmax(net(torch.tensor([env.observation()]))[0].tolist())
        _, done = env.step(action)
        actions.append(action)
    return actions


def test_every_error_code_has_an_http_status() -> None:
    from fleet.core.errors import ErrorCode

    assert set(HTTP_STATUS) == set(ErrorCode)


def test_a_machine_gets_each_action_from_the_gateway(tmp_path: Path, images: ImageStore) -> None:
    """The episode runs in the machine, actions come from the gateway, the trajectory matches."""

    async def body() -> tuple[Any, Any, list[Any]]:
        with networld() as world:
            gateway = Gateway.build(GatewayConfig(secret=SECRET, device="cpu"))
            gateway.batcher.start()

            def bind() -> socket.socket:
                sock = socket.socket()
                sock.bind((GATEWAY[0], 0))
                return sock

            sock = await asyncio.to_thread(in_netns, f"/run/netns/{world.uplink}", bind)
            http, port = await serve_http(gateway, sock=sock)
            try:
                async with harness(tmp_path, images) as h:
                    net = NetConfig(uplink_netns=world.uplink, dns_upstream=world.dns)
                    await h.start_agent("cpu-a", HostClass.CPU, net=net, gateway=(GATEWAY[0], port))
                    hybrid = await h.fleet.SubmitRollout(
                        request(
                            'image = "minimal"\n', program(7),
                            requirements=types_pb2.Requirements(inference=True),
                        )
                    )  # fmt: skip
                    # A rollout that does not use inference cannot reach the gateway, even
                    # with egress of its own.
                    probe = (
                        "import socket, sys\ns = socket.socket(); s.settimeout(3)\n"
                        f"try: s.connect(('{GATEWAY[0]}', {port}))\n"
                        "except OSError as exc: sys.exit(f'refused: {exc}')\n"
                    )
                    plain = await h.fleet.SubmitRollout(
                        request(
                            'image = "minimal"\n[network]\nallow_hosts = ["svc.fleet.test"]\n',
                            ["python3", "-c", probe],
                        )
                    )  # fmt: skip
                    done = await h.wait_final(hybrid.rollout.id)
                    blocked = await h.wait_final(plain.rollout.id)
                    events = await h.fleet.ListEgressEvents(
                        fleet_pb2.ListEgressEventsRequest(rollout_id=plain.rollout.id)
                    )
                    return done, blocked, list(events.events)
            finally:
                http.close()
                await gateway.batcher.stop()

    done, blocked, events = asyncio.run(body())
    assert done.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, done.results[0].stderr[-800:]
    episode = json.loads(done.results[0].stdout)
    assert episode["actions"] == local_episode(7)
    assert episode["devices"] == ["cpu"]
    assert blocked.state == types_pb2.ROLLOUT_STATE_FAILED
    assert b"refused" in blocked.results[0].stderr
    assert [e.kind for e in events] == ["connect"]
    assert "host's own address" in events[0].reason
