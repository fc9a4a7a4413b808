"""Hybrid rollouts: a CPU machine steps the environment and asks the gateway for each action.

Real parts throughout: the fleet server and an agent (in process), a namespace machine with its
own network namespace hanging off a test uplink, and the gateway with the shipped policy,
listening on the uplink's address. Nothing leaves the namespaces the test creates.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch

from fleet.api.pb import fleet_pb2, types_pb2
from fleet.core.placement import HostClass
from fleet.envs.episode import program, source, warm_step
from fleet.envs.gridworld import GridWorld, argmax
from fleet.image.store import ImageStore
from fleet.runtime.netns import NetConfig, in_netns
from gateway.http import HTTP_STATUS, serve_http
from gateway.model import load_network, model_specs
from gateway.service import Gateway, GatewayConfig
from tests.integration.harness import SECRET, harness, namespace_runtime, request
from tests.networld import GATEWAY, NetWorld, networld


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


@asynccontextmanager
async def gateway_on_uplink(
    world: NetWorld, tls: ssl.SSLContext | None = None
) -> AsyncIterator[int]:
    """The shipped policy's gateway, its HTTP endpoint on the uplink's own address (over TLS
    with `tls`); yields the port machines reach it on."""
    gateway = Gateway.build(GatewayConfig(secret=SECRET, device="cpu", tokens_without_server=True))
    gateway.batcher.start()

    def bind() -> socket.socket:
        sock = socket.socket()
        sock.bind((GATEWAY[0], 0))
        return sock

    sock = await asyncio.to_thread(in_netns, f"/run/netns/{world.uplink}", bind)
    http, port = await serve_http(gateway, sock=sock, tls=tls)
    try:
        yield port
    finally:
        http.close()
        await gateway.batcher.stop()


def test_every_error_code_has_an_http_status() -> None:
    from fleet.core.errors import ErrorCode

    assert set(HTTP_STATUS) == set(ErrorCode)


@pytest.mark.sandbox
async def test_a_machine_gets_each_action_from_the_gateway(
    tmp_path: Path, images: ImageStore
) -> None:
    """The episode runs in the machine, actions come from the gateway, the trajectory matches."""

    with networld() as world:
        async with (
            gateway_on_uplink(world) as port,
            harness(tmp_path, images, runtime=namespace_runtime) as h,
        ):
            net = NetConfig(uplink_netns=world.uplink, dns_upstream=world.dns)
            await h.start_agent("cpu-a", HostClass.CPU, net=net, gateway=(GATEWAY[0], port))
            hybrid = await h.fleet.SubmitRollout(
                request(
                    'image = "minimal"\n',
                    program(7),
                    requirements=types_pb2.Requirements(inference=True),
                )
            )
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
            )
            done = await h.wait_final(hybrid.rollout.id)
            blocked = await h.wait_final(plain.rollout.id)
            events = await h.fleet.ListEgressEvents(
                fleet_pb2.ListEgressEventsRequest(rollout_id=plain.rollout.id)
            )
            events = list(events.events)

    assert done.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, done.results[0].stderr[-800:]
    episode = json.loads(done.results[0].stdout)
    assert episode["actions"] == local_episode(7)
    assert episode["devices"] == ["cpu"]
    assert "plus the inference gateway" in done.egress.enforced_by
    assert blocked.state == types_pb2.ROLLOUT_STATE_FAILED
    assert b"refused" in blocked.results[0].stderr
    assert [e.kind for e in events] == ["connect"]
    assert "host's own address" in events[0].reason


# Run in a warm child after the episode: nothing but the agent's sockets is reachable.
CONFINED = """
import os, socket, sys
sys.stdout.write(" ".join(sorted(os.listdir("/run/fleet"))) + "\\n")
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
    print("reached the gateway directly")
except OSError as exc:
    print("no route:", type(exc).__name__)
try:
    open("/run/fleet/mine", "w")
    print("wrote into /run/fleet")
except OSError as exc:
    print("read-only:", exc.errno)
"""


@pytest.mark.sandbox
async def test_a_warm_child_gets_actions_and_stores_checkpoints_through_the_agents_sockets(
    tmp_path: Path, images: ImageStore
) -> None:
    """A [branch] rollout that uses the gateway runs as a warm parent's child: its actions
    come through gateway.sock, its checkpoints go through checkpoints.sock, and nothing else
    (not even the gateway's own address) is reachable from it."""

    with networld() as world:
        async with (
            gateway_on_uplink(world) as port,
            harness(tmp_path, images, runtime=namespace_runtime) as h,
        ):
            net = NetConfig(uplink_netns=world.uplink, dns_upstream=world.dns)
            await h.start_agent("cpu-a", HostClass.CPU, net=net, gateway=(GATEWAY[0], port))
            submitted = await h.fleet.SubmitRollout(
                fleet_pb2.SubmitRolloutRequest(
                    request_id="warm-hybrid",
                    idempotency_key="warm-hybrid",
                    smolfile='image = "minimal"\n[branch]\nenabled = true\n',
                    smolfile_name="test.smolfile",
                    steps=[
                        types_pb2.Step(
                            name="warm-up", argv=["python3", "-c", source()], timeout_s=60
                        ),
                        types_pb2.Step(name="episode", argv=warm_step(7), timeout_s=60),
                        types_pb2.Step(
                            name="confined",
                            timeout_s=30,
                            argv=["python3", "-c", CONFINED, GATEWAY[0], str(port)],
                        ),
                    ],
                    requirements=types_pb2.Requirements(inference=True),
                )
            )
            rid = submitted.rollout.id
            done = await h.wait_final(rid)
            saved = h.server.core.ledger.checkpoints(rid)

    assert done.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, [r.stderr[-800:] for r in done.results]
    episode = json.loads(done.results[0].stdout)
    assert episode["actions"] == local_episode(7)
    assert episode["devices"] == ["cpu"]
    # One checkpoint per action, through the relay's socket, under attempt 1, the last whole.
    assert [seq for seq, _, _ in saved] == list(range(1, len(episode["actions"]) + 1))
    assert {attempt for _, attempt, _ in saved} == {1}
    assert json.loads(saved[-1][2])["actions"] == episode["actions"]
    assert done.results[1].stdout.decode().splitlines() == [
        "checkpoints.sock gateway.sock", "no route: OSError", "read-only: 30",
    ]  # fmt: skip
    assert "warm parent's child" in done.egress.enforced_by
    assert "gateway.sock" in done.egress.enforced_by


async def test_a_deep_gateway_queue_holds_inference_rollouts_while_cpu_work_goes_on(
    tmp_path: Path, images: ImageStore
) -> None:
    """Over the threshold: only CPU-only work is handed out; drained: inference work again."""
    import time

    import grpc

    from fleet.api.pb import host_pb2, inference_pb2, inference_pb2_grpc
    from fleet.core.tokens import issue
    from fleet.server.app import ServerConfig
    from gateway.batcher import BatchConfig
    from gateway.service import serve

    def slow() -> None:
        time.sleep(0.15)

    gateway = Gateway.build(
        GatewayConfig(
            secret=SECRET,
            device="cpu",
            engine="inline",  # (a blocking hook)
            batch=BatchConfig(max_batch=1, max_wait_ms=0.5),
            tokens_without_server=True,  # (its flood may come before the server's first poll)
        ),
        fault_primary=slow,
    )
    grpc_server, port = await serve(gateway, "127.0.0.1:0")
    config = ServerConfig(
        lease_ttl_s=30,
        heartbeat_interval_s=0.5,
        token_secret=SECRET,
        gateway_address=f"127.0.0.1:{port}",
        backpressure_queue_depth=4,
        backpressure_resume_depth=1,
        gateway_poll_s=0.05,
    )
    try:
        async with (
            harness(tmp_path, images, config) as h,
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            sample = GridWorld(0).observation()
            load = [
                stub.Infer(
                    inference_pb2.InferRequest(
                        # (issued now: the server's list of running rollouts,
                        # read before, could not hold these yet)
                        token=issue(SECRET, f"load-{i}", time.time() + 60, time.time()),
                        rollout_id=f"load-{i}",
                        idempotency_key="k",
                        model="gridworld-policy",
                        input=inference_pb2.Tensor(shape=[147], values=sample),
                    )
                )
                for i in range(12)
            ]
            flood = asyncio.gather(*load)
            for _ in range(100):  # until the server has seen the deep queue
                if h.server.core.hold_inference:
                    break
                await asyncio.sleep(0.02)
            held = h.server.core.hold_inference
            await h.register_host("h1", gateway=True)
            model = await h.fleet.SubmitRollout(
                request(requirements=types_pb2.Requirements(inference=True))
            )
            plain = await h.fleet.SubmitRollout(request())
            first = await h.hosts.ClaimWork(
                host_pb2.ClaimWorkRequest(request_id="c1", host_id="h1", max_items=5, wait_s=0)
            )
            await flood  # the queue drains
            second = await h.hosts.ClaimWork(
                host_pb2.ClaimWorkRequest(request_id="c2", host_id="h1", max_items=5, wait_s=5)
            )
            first = [i.rollout_id for i in first.items]
            second = [i.rollout_id for i in second.items]
            plain, model = plain.rollout.id, model.rollout.id
    finally:
        await gateway.batcher.stop()
        await grpc_server.stop(None)

    assert held
    assert first == [plain]
    assert second == [model]


@pytest.mark.sandbox
async def test_server_and_gateway_metrics_and_fleet_top(tmp_path: Path, images: ImageStore) -> None:
    """Prometheus text from both; `fleet top --once` shows rollouts, throughput and the gateway."""
    import time
    import urllib.request

    from fleet.core.tokens import issue
    from fleet.server.app import ServerConfig
    from tests.acceptance.procs import FLEET

    def get(url: str) -> str:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return str(reply.read().decode())

    gateway = Gateway.build(GatewayConfig(secret=SECRET, device="cpu", tokens_without_server=True))
    gateway.batcher.start()
    http, port = await serve_http(gateway, "127.0.0.1", 0)
    config = ServerConfig(
        lease_ttl_s=5,
        heartbeat_interval_s=0.5,
        token_secret=SECRET,
        metrics_listen="127.0.0.1:0",
    )
    try:
        await gateway.infer(
            via="grpc", token=issue(SECRET, "r-m", time.time() + 60),
            rollout_id="r-m", idempotency_key="k", model="gridworld-policy", revision="",
            shape=[147], values=GridWorld(1).observation(), deadline=None,
        )  # fmt: skip
        async with harness(tmp_path, images, config, runtime=namespace_runtime) as h:
            await h.start_agent("cpu-a", HostClass.CPU)
            busy = ["python3", "-c", "sum(i * i for i in range(3_000_000))"]
            reply = await h.fleet.SubmitRollout(request('image = "minimal"\n', busy))
            await h.wait_final(reply.rollout.id)
            server_url = f"http://127.0.0.1:{h.server.metrics_port}/metrics"
            server_text = await asyncio.to_thread(get, server_url)
            gateway_text = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/metrics")
            top = await asyncio.create_subprocess_exec(
                *FLEET, "top", "--once", "--metrics", server_url,
                "--gateway-metrics", f"http://127.0.0.1:{port}/metrics",
                stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            out, _ = await top.communicate()
            top = out.decode()
    finally:
        http.close()
        await gateway.batcher.stop()

    from fleet.cli.top import parse

    server, gateway = parse(server_text), parse(gateway_text)
    assert server['fleet_rollouts{state="SUCCEEDED"}'] == 1
    assert server["fleet_trajectories_completed_total"] == 1
    assert server["fleet_cpu_seconds_per_trajectory"] > 0.05  # the step's own CPU time
    assert server["fleet_backpressure_holding"] == 0
    assert server["fleet_server_insecure"] == 1 and "WITHOUT TLS" in top
    assert gateway["fleet_gateway_served_total"] == 1
    assert gateway['fleet_gateway_requests_total{via="grpc"}'] == 1
    assert gateway["fleet_gateway_streams_open"] == 0
    assert gateway['fleet_gateway_batch_size_bucket{le="1"}'] == 1
    assert "trajectories/s" in top and "succeeded 1" in top and "gateway         queue 0" in top
    assert "model           gridworld-policy v1 on cpu in float32" in top
    assert gateway["fleet_gateway_engine_restarts_total"] == 0 and "engine restarts 0" in top
    assert "grpc 1   grpc_stream 0   http 0   streams open 0" in top


@pytest.mark.sandbox
async def test_the_gateway_over_tls_serves_machines_and_warm_children(
    tmp_path: Path, images: ImageStore
) -> None:
    """The gateway's endpoint beyond loopback speaks TLS with a certificate from the fleet's
    CA: a machine verifies it (FLEET_GATEWAY is https://…), a warm child's socket is joined to
    it over TLS by the agent, and a client that does not trust the CA gets nothing."""
    from fleet.identity.ca import CertificateAuthority
    from fleet.identity.tls import ServerTls, server_ssl_context

    ca = CertificateAuthority.init(tmp_path / "ca")
    tls = server_ssl_context(ServerTls.issue(ca, [GATEWAY[0]]))
    warm = 'image = "minimal"\n[branch]\nenabled = true\n'
    untrusted = (
        "import os, socket, ssl, sys\n"
        "host, port = os.environ['FLEET_GATEWAY'].removeprefix('https://').rsplit(':', 1)\n"
        "s = socket.create_connection((host, int(port)), timeout=5)\n"
        "try:\n"
        "    ssl.create_default_context().wrap_socket(s, server_hostname=host)\n"
        "    print('trusted a stranger')\n"
        "except ssl.SSLError as exc:\n"
        "    print('refused:', exc.reason)\n"
    )

    with networld() as world:
        async with (
            gateway_on_uplink(world, tls) as port,
            harness(tmp_path, images, runtime=namespace_runtime) as h,
        ):
            net = NetConfig(uplink_netns=world.uplink, dns_upstream=world.dns)
            await h.start_agent(
                "cpu-a", HostClass.CPU, net=net, gateway=(GATEWAY[0], port), gateway_ca=ca.pem
            )
            inference = types_pb2.Requirements(inference=True)
            plain = await h.fleet.SubmitRollout(
                request(
                    'image = "minimal"\n',
                    program(7),
                    ["python3", "-c", untrusted],
                    requirements=inference,
                )
            )
            child = await h.fleet.SubmitRollout(
                fleet_pb2.SubmitRolloutRequest(
                    request_id="warm-tls",
                    idempotency_key="warm-tls",
                    smolfile=warm,
                    smolfile_name="test.smolfile",
                    requirements=inference,
                    steps=[
                        types_pb2.Step(
                            name="warm-up", argv=["python3", "-c", source()], timeout_s=60
                        ),
                        types_pb2.Step(name="episode", argv=warm_step(7), timeout_s=60),
                    ],
                )
            )
            plain, child = (
                await h.wait_final(plain.rollout.id),
                await h.wait_final(child.rollout.id),
            )

    for done in (plain, child):
        assert done.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, [
            r.stderr[-800:] for r in done.results
        ]
        assert json.loads(done.results[0].stdout)["actions"] == local_episode(7)
    assert plain.results[1].stdout.startswith(b"refused: CERTIFICATE_VERIFY_FAILED")


async def test_a_finished_rollouts_token_is_refused_by_the_gateway(
    tmp_path: Path, images: ImageStore
) -> None:
    """The server tells the gateway which rollouts run (every poll, signed): a rollout's token
    is served while it runs and refused once it has finished, although its deadline is far."""
    import time

    import grpc

    from fleet.api.pb import host_pb2, inference_pb2, inference_pb2_grpc
    from fleet.server.app import ServerConfig
    from gateway.service import serve

    gateway = Gateway.build(GatewayConfig(secret=SECRET, device="cpu"))
    grpc_server, port = await serve(gateway, "127.0.0.1:0")
    config = ServerConfig(
        lease_ttl_s=30,
        heartbeat_interval_s=0.5,
        token_secret=SECRET,
        gateway_address=f"127.0.0.1:{port}",
        gateway_poll_s=0.05,
    )
    try:
        async with (
            harness(tmp_path, images, config) as h,
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            sample = GridWorld(0).observation()
            await h.register_host("h1", gateway=True)
            submitted = await h.fleet.SubmitRollout(
                request(requirements=types_pb2.Requirements(inference=True))
            )
            claim = await h.hosts.ClaimWork(
                host_pb2.ClaimWorkRequest(request_id="c", host_id="h1", max_items=1, wait_s=5)
            )
            item = claim.items[0]
            claimed = time.time()

            async def ask(key: str) -> str:
                try:
                    await stub.Infer(
                        inference_pb2.InferRequest(
                            token=item.inference_token,
                            rollout_id=item.rollout_id,
                            idempotency_key=key,
                            model="gridworld-policy",
                            input=inference_pb2.Tensor(shape=[147], values=sample),
                        )
                    )
                    return "served"
                except grpc.aio.AioRpcError as exc:
                    return f"{exc.code().name}: {exc.details()}"

            # Past the grace of a new token: from here only the list decides.
            await asyncio.sleep(max(0.0, claimed + 1.5 - time.time()))
            running = [await ask("while-running")]
            await h.hosts.CompleteWork(
                host_pb2.CompleteWorkRequest(
                    request_id="done",
                    host_id="h1",
                    work_id=item.work_id,
                    fencing_token=item.fencing_token,
                    outcome=types_pb2.OUTCOME_SUCCEEDED,
                )
            )
            finished = time.time()
            for _ in range(100):  # until a poll read after the rollout ended
                if gateway.running_as_of > finished:
                    break
                await asyncio.sleep(0.02)
            after = await ask("after-the-end")
            assert submitted.rollout.id == item.rollout_id
            # The device time of the answered request reached the attempt, through the
            # server's poll of the gateway.
            ledger = h.server.core.ledger
            for _ in range(100):
                [cost] = await asyncio.to_thread(ledger.cost_attempts, 0.0)
                if cost.device_s > 0:
                    break
                await asyncio.sleep(0.02)
            assert 0 < cost.device_s < 5, cost
    finally:
        await gateway.batcher.stop()
        await grpc_server.stop(None)

    assert running == ["served"]
    assert after.startswith("PERMISSION_DENIED: rollout r-") and "is not running" in after
