"""The agent drives whatever implements the runtime protocol: a real server and agent on the
in-memory runtime of `fleet.testing`, no sandbox. A `[branch]` rollout gets a warm parent
made through `create_parent` (once per tenant and warm-up) and children through `branch`; a
parent that carries no interpreter has the warm-up run again in each step; scripted exits and
hangs come back as the rollout's results."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fleet.api.pb import types_pb2
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from fleet.runtime.base import ExecResult
from fleet.testing import FakeRuntime, default_script
from tests.integration.harness import harness, request

WARM = 'image = "minimal"\n[branch]\nenabled = true\n'


def test_warm_rollouts_on_a_runtime_known_only_by_its_protocol(
    tmp_path: Path, images: ImageStore
) -> None:
    async def script(argv: list[str], env: Any) -> ExecResult:
        if argv[:2] == ["python3", "-c"] and "hang" in argv[2]:
            await asyncio.sleep(60)
        return await default_script(argv, env)

    runtime = FakeRuntime(script)

    async def body() -> list[types_pb2.Rollout]:
        async with harness(tmp_path, images) as h:
            await h.start_agent("fake-1", HostClass.CPU, slots=4, runtime=runtime)
            warm = [["python3", "-c", "X = 41"], ["python3", "-c", "print(X + 1)"]]
            ids = []
            for _ in range(3):
                req = request(WARM, *warm)
                req.steps[0].name = "warm-up"
                ids.append((await h.fleet.SubmitRollout(req)).rollout.id)
            hung = request(WARM, ["python3", "-c", "X = 41"], ["python3", "-c", "hang"])
            hung.steps[0].name, hung.steps[1].timeout_s = "warm-up", 0.5
            ids.append((await h.fleet.SubmitRollout(hung)).rollout.id)
            ids.append((await h.fleet.SubmitRollout(request(WARM, ["exit", "3"]))).rollout.id)
            return [await h.wait_final(rid) for rid in ids]

    done = asyncio.run(body())
    assert [r.state for r in done[:3]] == [types_pb2.ROLLOUT_STATE_SUCCEEDED] * 3
    assert done[3].state == types_pb2.ROLLOUT_STATE_FAILED and "hit its" in done[3].error
    assert done[4].state == types_pb2.ROLLOUT_STATE_FAILED and "exited 3" in done[4].error
    parents = [c for c in runtime.calls if c[0] == "create_parent"]
    assert [c[2] for c in parents] == [("X = 41",)]  # one parent for the tenant and warm-up
    branches = [c for c in runtime.calls if c[0] == "branch"]
    assert len(branches) == 4
    # The fake's parent carries no interpreter: each step ran the warm-up first.
    steps = [c[2] for c in runtime.calls if c[0] == "exec" and c[1] != parents[0][1]]
    assert steps.count(("python3", "-c", "X = 41\nprint(X + 1)")) == 3
    # The step's output is the rollout's result.
    assert [r.results[-1].stdout for r in done[:3]] == [b"print(X + 1)"] * 3
    # Every child is gone; the parent lives until its agent stops (then it went too).
    assert not runtime.machines
