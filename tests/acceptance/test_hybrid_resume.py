"""A hybrid rollout survives its worker: kill -9 mid-episode, resume from the last checkpoint."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.api.pb import fleet_pb2, types_pb2
from fleet.core.placement import HostClass
from fleet.envs.episode import program, source, warm_step
from fleet.image.store import ImageStore
from fleet.runtime.namespace import NamespaceRuntime
from fleet.runtime.netns import NetConfig
from tests.acceptance.procs import Procs
from tests.integration.harness import harness, namespace_runtime
from tests.integration.test_hybrid import gateway_on_uplink, local_episode
from tests.networld import GATEWAY, networld

SEED = 9  # an episode that runs its full 28 steps: long enough to interrupt


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.stop_all()


@pytest.mark.parametrize(
    "rescue", ["another host", "the same host restarted", "another host, as warm children"]
)
@pytest.mark.sandbox
async def test_a_killed_worker_resumes_from_its_last_checkpoint(
    tmp_path: Path, images: ImageStore, procs: Procs, rescue: str
) -> None:
    """The episode goes on from its last checkpoint: the same trajectory, no step duplicated
    or missing. On another host that is a second attempt in a new machine; an agent restarted
    under the same host id adopts the machine and its lease, and the attempt goes on. As a
    warm parent's child (gateway and relay through the agent's sockets), the child dies with
    its agent and the second attempt is a child of the rescuer's own warm parent."""

    with networld() as world:
        async with gateway_on_uplink(world) as port:
            net = NetConfig(uplink_netns=world.uplink, dns_upstream=world.dns)
            # A restarted agent adopts its machine only while the lease lasts: past 5 s (a
            # slow restart on a loaded machine) it is released, and the test sees a retry.
            ttl = 5.0 if rescue.startswith("another host") else 30.0
            async with harness(tmp_path, images, lease_ttl_s=ttl, runtime=namespace_runtime) as h:
                flags = (
                    "--egress-uplink",
                    world.uplink,
                    "--egress-dns",
                    "203.0.113.53",
                    "--gateway",
                    f"{GATEWAY[0]}:{port}",
                )
                doomed = procs.agent(
                    "doomed", h.server.address, tmp_path / "machines", 1, "cpu", *flags
                )
                ledger = h.server.core.ledger
                for _ in range(600):
                    if any(host.host_id == "doomed" for host in ledger.hosts()):
                        break
                    await asyncio.sleep(0.05)
                delay = {"FLEET_EPISODE_STEP_DELAY_S": "0.15"}
                smolfile, steps = (
                    'image = "minimal"\n',
                    [types_pb2.Step(argv=program(SEED), timeout_s=120, env=delay)],
                )
                if "warm" in rescue:
                    smolfile += "[branch]\nenabled = true\n"
                    steps = [
                        types_pb2.Step(
                            name="warm-up", argv=["python3", "-c", source()], timeout_s=60
                        ),
                        types_pb2.Step(
                            name="episode", argv=warm_step(SEED), timeout_s=120, env=delay
                        ),
                    ]
                submitted = await h.fleet.SubmitRollout(
                    fleet_pb2.SubmitRolloutRequest(
                        request_id="r",
                        idempotency_key="resume",
                        smolfile=smolfile,
                        steps=steps,
                        requirements=types_pb2.Requirements(inference=True),
                        retry=types_pb2.RetryPolicy(max_attempts=3),
                    )
                )
                rid = submitted.rollout.id
                deadline = time.monotonic() + 60
                while len(ledger.checkpoints(rid)) < 4:  # mid-episode, past a few handoffs
                    assert time.monotonic() < deadline, doomed.log.read_text()[-2000:]
                    await asyncio.sleep(0.05)
                doomed.kill9()
                saved_at_kill = len(ledger.checkpoints(rid))
                if rescue.startswith("another host"):
                    await h.start_agent(
                        "rescuer", HostClass.CPU, net=net, gateway=(GATEWAY[0], port)
                    )
                else:
                    procs.agent("doomed", h.server.address, tmp_path / "machines", 1, "cpu", *flags)
                final = await h.wait_final(rid, timeout_s=120)
                # The killed agent's machine: its reaper (same host id) removes it.
                await NamespaceRuntime(tmp_path / "machines", net).reap("doomed")
                checkpoints = ledger.checkpoints(rid)

    assert final.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, final.error
    episode = json.loads(final.results[-1].stdout)
    assert episode["actions"] == local_episode(SEED)  # no step duplicated or missing
    assert episode["resumed_at"] >= saved_at_kill >= 4
    assert [a.outcome for a in final.attempt_history][-1] == "SUCCEEDED"
    # One checkpoint per step, numbered without gaps.
    assert [seq for seq, _, _ in checkpoints] == list(range(1, len(episode["actions"]) + 1))
    assert ("warm parent's child" in final.egress.enforced_by) == ("warm" in rescue)
    if rescue.startswith("another host"):
        assert len(final.attempt_history) == 2 and final.host_id == "rescuer"
        assert {attempt for _, attempt, _ in checkpoints} == {1, 2}
    else:  # adopted: the same attempt went on, in the same machine, on the same host
        assert len(final.attempt_history) == 1 and final.host_id == "doomed"
        assert {attempt for _, attempt, _ in checkpoints} == {1}
