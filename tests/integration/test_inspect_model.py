"""A real `inspect eval` with `--model fleet/<model>` and `sandbox="fleet"`: each sample's model
calls go to the inference gateway with the token of the sample's own fleet session, and the
ledger charges each sample's tokens to that sample's rollout.

Real parts: the `inspect` command line in a process of its own (fleet's provider found through
its entry point), the fleet server polling a real gateway over gRPC, its SQLite ledger, an agent
running namespace machines on a test uplink, and the gateway serving a tiny language model:
over HTTP on loopback for the host's `inspect`, and on the uplink for machines.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import sys
from pathlib import Path

import pytest

from fleet.api.pb import fleet_pb2, types_pb2
from fleet.core.cost import AttemptCost
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from fleet.ledger.store import Ledger
from fleet.runtime.netns import NetConfig, in_netns
from fleet.server.settings import ServerConfig
from gateway.http import serve_http
from gateway.llm.serving import ENV
from gateway.service import Gateway, GatewayConfig, serve
from tests.conftest import SMOLFILES
from tests.integration.harness import SECRET, harness, namespace_runtime
from tests.llm_fixtures import write_tiny_model
from tests.networld import GATEWAY, networld

MODEL = "tiny-test-r1"

TASK = r"""
from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.scorer import CORRECT, INCORRECT, Score, accuracy, scorer
from inspect_ai.solver import generate
from inspect_ai.util import sandbox


@scorer(metrics=[accuracy()])
def answered_in_its_rollout():
    async def score(state, target):
        # (the rollout the sample's machine belongs to, as the machine itself says)
        rollout = await sandbox().exec(["/bin/sh", "-c", 'printf %s "$FLEET_ROLLOUT_ID"'])
        usage = state.output.usage
        ok = usage is not None and usage.output_tokens > 0
        return Score(value=CORRECT if ok else INCORRECT, answer=state.output.completion,
                     explanation=rollout.stdout)
    return score


@task
def tiny():
    return Task(
        dataset=[Sample(input="hello", id="a"), Sample(input="the agent runs", id="b")],
        solver=generate(), scorer=answered_in_its_rollout(), sandbox=("fleet", "SMOLFILE"),
    )
"""


async def _charged(ledger: Ledger, want: dict[str, tuple[int, int]]) -> dict[str, AttemptCost]:
    """Each rollout's attempt once the ledger holds the tokens `want` says (10 s at most)."""
    seen: dict[str, AttemptCost] = {}
    for _ in range(200):
        seen = {a.rollout_id: a for a in await asyncio.to_thread(ledger.cost_attempts, 0.0)
                if a.rollout_id in want}  # fmt: skip
        if {rid: (a.prompt_tokens, a.completion_tokens) for rid, a in seen.items()} == want:
            return seen
        await asyncio.sleep(0.05)
    got = {rid: (a.prompt_tokens, a.completion_tokens) for rid, a in seen.items()}
    raise AssertionError(f"the ledger holds {got}, not {want}")


@pytest.mark.sandbox
async def test_inspect_eval_with_a_fleet_model_charges_each_samples_tokens_to_its_rollout(
    tmp_path: Path, images: ImageStore
) -> None:
    model = write_tiny_model(tmp_path / "tiny-llm")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV, str(model))
        gateway = await asyncio.to_thread(
            Gateway.build, GatewayConfig(secret=SECRET, device="cpu", engine="inline")
        )
    grpc_server, grpc_port = await serve(gateway, "127.0.0.1:0")
    config = ServerConfig(
        lease_ttl_s=5.0, heartbeat_interval_s=0.5, token_secret=SECRET,
        gateway_address=f"127.0.0.1:{grpc_port}", gateway_poll_s=0.1,
    )  # fmt: skip
    task_file = tmp_path / "tiny_task.py"
    task_file.write_text(TASK.replace("SMOLFILE", str(SMOLFILES / "minimal.smolfile")))

    def bind() -> socket.socket:
        sock = socket.socket()
        sock.bind((GATEWAY[0], 0))
        return sock

    try:
        with networld() as world:
            async with harness(tmp_path, images, config, runtime=namespace_runtime) as h:
                sock = await asyncio.to_thread(in_netns, f"/run/netns/{world.uplink}", bind)
                machines_http, port = await serve_http(gateway, sock=sock)
                host_http, host_port = await serve_http(gateway, "127.0.0.1", 0)
                try:
                    net = NetConfig(uplink_netns=world.uplink, dns_upstream=world.dns)
                    await h.start_agent("cpu-a", HostClass.CPU, net=net,
                                        gateway=(GATEWAY[0], port))  # fmt: skip
                    env = {
                        **os.environ,
                        "FLEET_SERVER": h.server.address,
                        "FLEET_KEY": "",
                        "FLEET_HOME": str(tmp_path / "home"),  # (no CA there: plain gRPC)
                        "FLEET_GATEWAY_URL": f"http://127.0.0.1:{host_port}",
                        "INSPECT_LOG_DIR": str(tmp_path / "logs"),
                        "NO_COLOR": "1",
                    }
                    env.pop("FLEET_INFERENCE_TOKEN", None)
                    proc = await asyncio.create_subprocess_exec(
                        str(Path(sys.executable).parent / "inspect"), "eval", task_file.name,
                        "--model", f"fleet/{MODEL}", "--max-tokens", "8", "--temperature", "0",
                        "--log-format", "json", "--display", "none",
                        env=env, cwd=tmp_path, stdout=asyncio.subprocess.PIPE,
                        stderr=asyncio.subprocess.STDOUT,
                    )  # fmt: skip
                    out, _ = await asyncio.wait_for(proc.communicate(), 300)
                    assert proc.returncode == 0, out.decode(errors="replace")[-4000:]

                    from inspect_ai.log import read_eval_log

                    [log_file] = (tmp_path / "logs").glob("*.json")
                    log = await asyncio.to_thread(read_eval_log, str(log_file))
                    assert log.status == "success", (log.error, out.decode()[-2000:])
                    assert log.samples is not None and len(log.samples) == 2
                    per_rollout: dict[str, tuple[int, int]] = {}
                    for sample in log.samples:
                        usage = sample.model_usage[f"fleet/{MODEL}"]
                        [score] = (sample.scores or {}).values()
                        assert score.value == "C", (sample.id, score, sample.error)
                        per_rollout[str(score.explanation)] = (
                            usage.input_tokens,
                            usage.output_tokens,
                        )
                    # Two samples, two machines of two rollouts: each sample's tokens are
                    # charged to its own rollout's attempt, exactly.
                    assert len(per_rollout) == 2, per_rollout
                    attempts = await _charged(h.server.core.ledger, per_rollout)
                    rollouts = [
                        await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=rid))
                        for rid in per_rollout
                    ]
                finally:
                    machines_http.close()
                    host_http.close()
    finally:
        await grpc_server.stop(None)
        await gateway.stop()

    assert all(dict(a.tokens) == {MODEL: per_rollout[rid]} for rid, a in attempts.items())
    # Each is a session of the eval's task, opened for inference and closed at its end.
    assert all(r.labels.get("inspect.task") == "tiny" for r in rollouts), rollouts
    assert all(r.manifest.requirements.inference for r in rollouts), rollouts
    assert all(r.state == types_pb2.ROLLOUT_STATE_SUCCEEDED for r in rollouts), rollouts
    # The tokens were sent, never written down: the eval's log has none of them.
    text = log_file.read_text()
    assert not re.search(r"v1\.[A-Za-z0-9_-]{20,}\.[A-Za-z0-9_-]{20,}", text)
    assert "Bearer" not in text
