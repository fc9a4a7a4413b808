"""Soak: 200 rollouts as copy-on-write children of a warm parent, some killed mid-step.

Afterwards nothing of them is left: no process, cgroup, mount or network namespace.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from pathlib import Path

import pytest

from fleet.api.pb import fleet_pb2, types_pb2
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from tests.integration.harness import harness, namespace_runtime

SMOLFILE = 'image = "minimal"\n[branch]\nenabled = true\npool_size = 8\n'
WARM_UP = "import json\nSTATE = bytearray(16 << 20)\nSTATE[-1] = 9\n"
WORK = "import random, time\ntime.sleep(random.uniform(0.05, 0.4))\nprint(STATE[-1])\n"
ROLLOUTS = 200


def cgroup_dirs() -> set[str]:
    found = set()
    for controller in Path("/sys/fs/cgroup").iterdir():
        fleet = controller / "fleet"
        if fleet.is_dir():
            found |= {f"{controller.name}/{d.name}" for d in fleet.iterdir() if d.is_dir()}
    return found


def child_pids() -> list[int]:
    """Host pids of warm children now running (their cgroups are named parent.child)."""
    pids: list[int] = []
    for controller in ("pids", ""):
        fleet = Path("/sys/fs/cgroup") / controller / "fleet"
        for d in fleet.glob("fleet-parent-*.*") if fleet.is_dir() else []:
            try:
                pids += [int(p) for p in (d / "cgroup.procs").read_text().split()]
            except OSError:
                continue
    return pids


def mounts_under(path: Path) -> list[str]:
    return [line for line in Path("/proc/mounts").read_text().splitlines() if str(path) in line]


def netns() -> set[str]:
    return set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()


@pytest.mark.sandbox
async def test_warm_children_soak_leaves_nothing_behind(tmp_path: Path, images: ImageStore) -> None:
    before_cgroups, before_netns = cgroup_dirs(), netns()
    rng = random.Random(7)

    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await h.start_agent("warm-soak", HostClass.CPU, slots=8)
        ids = []
        for i in range(ROLLOUTS):
            reply = await h.fleet.SubmitRollout(
                fleet_pb2.SubmitRolloutRequest(
                    request_id=f"s{i}",
                    idempotency_key=f"soak-{i}",
                    smolfile=SMOLFILE,
                    steps=[
                        types_pb2.Step(name="warm-up", argv=["python3", "-c", WARM_UP]),
                        types_pb2.Step(name="work", argv=["python3", "-c", WORK], timeout_s=30),
                    ],
                    retry=types_pb2.RetryPolicy(max_attempts=1),
                )
            )
            ids.append(reply.rollout.id)
        kills = 0
        for _ in range(400):  # kill some children mid-step while the rest run
            pids = child_pids()
            if pids and kills < 20 and rng.random() < 0.5:
                try:
                    os.kill(rng.choice(pids), signal.SIGKILL)
                    kills += 1
                except ProcessLookupError:  # it ended between the listing and the kill
                    pass
            states = [
                (await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=i))).state
                for i in ids[-5:]
            ]
            if (
                all(
                    s == types_pb2.ROLLOUT_STATE_SUCCEEDED or s == types_pb2.ROLLOUT_STATE_FAILED
                    for s in states
                )
                and kills >= 10
            ):
                break
            await asyncio.sleep(0.1)
        final = [await h.wait_final(i, timeout_s=120) for i in ids]

    succeeded = [r for r in final if r.state == types_pb2.ROLLOUT_STATE_SUCCEEDED]
    failed = [r for r in final if r.state == types_pb2.ROLLOUT_STATE_FAILED]
    assert kills >= 10
    assert len(succeeded) + len(failed) == ROLLOUTS
    assert 0 < len(failed) <= kills  # each kill fails at most the one rollout it hit
    assert all(r.results[-1].stdout == b"9\n" for r in succeeded)  # the warm state, in each
    assert {r.error for r in failed} == {"step 1 (work) exited -9"}  # killed, reported as such
    # Nothing left: processes, cgroups, mounts, network namespaces.
    assert child_pids() == []
    assert cgroup_dirs() == before_cgroups
    assert mounts_under(tmp_path) == []
    assert netns() == before_netns
    leftover = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = await asyncio.to_thread(Path(f"/proc/{pid}/cmdline").read_bytes)
                if str(tmp_path).encode() in cmdline:
                    leftover.append(pid)
            except OSError:
                continue
    assert leftover == []
