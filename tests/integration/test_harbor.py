"""A real Harbor run against fleet: Harbor's oracle agent solves a task of our own
(`tests/data/harbor-task`) in a fleet session, and Harbor's verifier scores it there.

Harbor needs Python 3.12 or newer; `scripts/setup-harbor` (run by `scripts/test`) builds one
from Debian's source package and a venv with Harbor. Harbor runs as its own process, with
this checkout on its path for `fleet.providers.harbor`, against a server and agent of ours.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from fleet.runtime.netns import NetConfig, in_netns
from tests.integration.harness import SECRET, Harness, harness, namespace_runtime, threaded_harness
from tests.networld import GATEWAY, networld

REPO = Path(__file__).resolve().parents[2]
TASK = REPO / "tests" / "data" / "harbor-task"
LLM_TASK = REPO / "tests" / "data" / "harbor-llm-task"


@pytest.fixture(scope="module")
def harbor_venv() -> Path:
    done = subprocess.run(
        [str(REPO / "scripts" / "setup-harbor")], capture_output=True, text=True, timeout=3000
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def harbor_fleet(tmp_path_factory: pytest.TempPathFactory, images: ImageStore) -> Iterator[str]:
    async def prepare(h: Harness) -> None:
        await h.start_agent("cpu-a", HostClass.CPU, slots=4)

    with threaded_harness(
        tmp_path_factory.mktemp("harbor"), images, prepare, runtime=namespace_runtime
    ) as address:
        yield address


def _harbor_env(address: str, tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "FLEET_SERVER": address,
        "FLEET_KEY": "",
        "FLEET_HOME": str(tmp_path / "home"),  # (no CA there: plain gRPC to the test server)
        "HOME": str(tmp_path / "home"),
        "NO_COLOR": "1",
        # Nothing leaves the machine: no telemetry, and LiteLLM's bundled price table instead
        # of the one it would fetch.
        "HARBOR_TELEMETRY": "0",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }


@pytest.mark.sandbox
def test_harbors_oracle_solves_a_task_in_a_fleet_session(
    harbor_venv: Path, harbor_fleet: str, tmp_path: Path
) -> None:
    from fleet.client import Fleet

    env = _harbor_env(harbor_fleet, tmp_path)
    run = subprocess.run(
        [str(harbor_venv / "bin" / "harbor"), "run", "-p", str(TASK), "-a", "oracle",
         "-e", "fleet.providers.harbor:FleetEnvironment", "-o", str(tmp_path / "jobs"), "-y"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    assert "githubusercontent" not in run.stdout + run.stderr  # (it tried to reach out)
    results = sorted((tmp_path / "jobs").rglob("result.json"))
    trial = [json.loads(p.read_text()) for p in results if (p.parent / "verifier").is_dir()]
    assert len(trial) == 1, [str(p) for p in results]
    rewards = trial[0]["verifier_result"]["rewards"]
    assert rewards == {"reward": 1.0}, trial[0]
    machine = next((tmp_path / "jobs").rglob("verifier/machine.txt")).read_text().strip()
    with Fleet(harbor_fleet, plaintext=True) as fleet:
        sessions = [r for r in fleet.list(labels={"fleet.session": "1"})
                    if r.labels.get("harbor.task")]  # fmt: skip
    # The agent's commands and the verifier's ran in fleet sessions, all closed at the end;
    # the file the solution wrote names the machine of one of them.
    assert sessions and all(r.state == "SUCCEEDED" for r in sessions)
    assert any(machine == f"fleet-{r.id}-a1" for r in sessions), (machine, sessions)


@pytest.fixture(scope="module")
def inference_fleet(tmp_path_factory: pytest.TempPathFactory, images: ImageStore) -> Iterator[str]:
    """A server and an agent whose machines reach a gateway serving the tiny language model on
    a test uplink (the gateway checks tokens by their signature: no server polls it here)."""
    from gateway.http import serve_http
    from gateway.llm.serving import ENV
    from gateway.service import Gateway, GatewayConfig
    from tests.llm_fixtures import write_tiny_model

    tmp = tmp_path_factory.mktemp("harbor-llm")
    model = write_tiny_model(tmp / "tiny-llm")
    ready = threading.Event()
    box: dict[str, Any] = {}

    def bind() -> socket.socket:
        sock = socket.socket()
        sock.bind((GATEWAY[0], 0))
        return sock

    with networld() as world:

        async def main() -> None:
            box["stop"] = (asyncio.get_running_loop(), stop := asyncio.Event())
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv(ENV, str(model))
                config = GatewayConfig(secret=SECRET, device="cpu", engine="inline",
                                       tokens_without_server=True)  # fmt: skip
                gateway = Gateway.build(config)
            gateway.batcher.start()
            sock = await asyncio.to_thread(in_netns, f"/run/netns/{world.uplink}", bind)
            http, port = await serve_http(gateway, sock=sock)
            try:
                async with harness(tmp, images, runtime=namespace_runtime) as h:
                    net = NetConfig(uplink_netns=world.uplink, dns_upstream=world.dns)
                    await h.start_agent("cpu-a", HostClass.CPU, slots=4, net=net,
                                        gateway=(GATEWAY[0], port))  # fmt: skip
                    box["address"] = h.server.address
                    ready.set()
                    await stop.wait()
            finally:
                http.close()
                await gateway.stop()

        def run() -> None:
            try:
                asyncio.run(main())
            except BaseException as exc:
                box["error"] = exc
            finally:
                ready.set()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert ready.wait(120) and "address" in box, box.get("error", "the fleet did not start")
        try:
            yield str(box["address"])
        finally:
            loop, stop = box["stop"]
            loop.call_soon_threadsafe(stop.set)
            thread.join(60)


@pytest.mark.sandbox
def test_an_agent_in_the_machine_reaches_the_gateway_with_its_rollouts_token(
    harbor_venv: Path, inference_fleet: str, tmp_path: Path
) -> None:
    """`--ek inference=true`: the trial's session is opened for inference; the agent's
    commands find OPENAI_BASE_URL and OPENAI_API_KEY pointing at the gateway with the
    rollout's token and get an answer there. The host's own OPENAI_API_KEY, which the task
    passes to every command, never reaches the machine."""
    env = {
        **_harbor_env(inference_fleet, tmp_path),
        "OPENAI_API_KEY": "sk-host-key-that-stays-on-the-host",
        "OPENAI_BASE_URL": "http://198.51.100.99:9/v1",
    }
    run = subprocess.run(
        [str(harbor_venv / "bin" / "harbor"), "run", "-p", str(LLM_TASK), "-a", "oracle",
         "-e", "fleet.providers.harbor:FleetEnvironment", "--ek", "inference=true",
         "-o", str(tmp_path / "jobs"), "-y"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    results = sorted((tmp_path / "jobs").rglob("result.json"))
    trial = [json.loads(p.read_text()) for p in results if (p.parent / "verifier").is_dir()]
    assert len(trial) == 1, [str(p) for p in results]
    found = sorted((tmp_path / "jobs").rglob("verifier/llm.json"))
    seen = json.loads(found[0].read_text()) if found else None
    assert trial[0]["verifier_result"]["rewards"] == {"reward": 1.0}, (trial[0], seen)
    assert seen is not None
    assert seen["key_is_rollout_token"] is True and seen["host_key_seen"] is False, seen
    assert seen["base"].startswith(f"http://{GATEWAY[0]}:") and seen["base"].endswith("/v1")
    assert seen["completion_tokens"] > 0 and seen["rollout"], seen
