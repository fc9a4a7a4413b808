"""The gateway benchmark's episodes: gridworld trajectories through the gateway alone (episode
loops in this process on one InferStream) and through the whole fleet (each episode a rollout
in a sandboxed machine), against the synchronous loop calling the model in-process; and the
bare model's own rate. `benchmarks.gateway` runs them."""

from __future__ import annotations

import asyncio
import functools
import json
import statistics
import time
import uuid
from array import array
from pathlib import Path
from typing import Any

import grpc

from benchmarks.gateway_load import gateway_cpu_s, infer_request
from benchmarks.harness import (
    SECRET,
    busy_cpu_s,
    cpu_fleet,
    minimal_smolfile,
    percentile,
    until_final,
)
from fleet.api.pb import fleet_pb2, fleet_pb2_grpc, inference_pb2_grpc, types_pb2
from fleet.connect import list_all
from fleet.envs.episode import program, source, warm_step
from fleet.envs.gridworld import GridWorld, argmax
from fleet.runtime.cgroups import all_machines_cpu_seconds
from fleet.server.settings import ServerConfig


async def pipeline(address: str, model: str, episodes: int, concurrency: int) -> tuple[float, int]:
    """Trajectories/s with `concurrency` episodes in flight, each action from the gateway, all
    of them calling over one InferStream (`gateway.client.InferStreamClient`)."""
    from gateway.client import InferStreamClient

    actions = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        todo = list(range(episodes))

        async def worker(client: InferStreamClient) -> None:
            nonlocal actions
            while todo:
                seed = todo.pop()
                env, done, step = GridWorld(seed), False, 0
                while not done:
                    key = f"ep{seed}-{step}"
                    reply = await client.infer(
                        infer_request(model, f"ep{seed}", key, env.observation())
                    )
                    _, done = env.step(argmax(list(reply.output.values)))
                    step += 1
                    actions += 1

        async with InferStreamClient(stub) as client:
            started = time.perf_counter()
            await asyncio.gather(*(worker(client) for _ in range(concurrency)))
            return episodes / (time.perf_counter() - started), actions


NOOP_STEP = 'print(json.dumps({"actions": [], "action_ms": 0, "checkpoint_ms": 0}))'
"""A warm child's step that does nothing: what is left is the fleet's own cost per rollout."""


async def fleet_pipeline(
    http_port: int, gateway_pid: int, model: str, episodes: int, slots: int, warm: bool = False,
    noop: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Trajectories/s of the whole fleet: each episode a rollout on the embedded fleet (SQLite
    ledger, one CPU agent with `slots` machines at once, the namespace runtime, firewall and
    DNS per machine), stepping gridworld inside its sandbox and asking the gateway over HTTP
    for every action, with a checkpoint stored through the ledger after each one. With `warm`,
    each episode is a copy-on-write child of a warm parent that loaded the environment and the
    client (`[branch]`), reaching the gateway and the relay through the agent's sockets.

    Also where this machine's CPU went, per action: the machines (their cgroups), the gateway
    process, and the rest of the machine's busy time (server, agent, the tools they run, this
    process's polling, the kernel). With `noop` (and `warm`), each episode's step does nothing
    but print its result: rollouts/s and CPU per rollout are then the fleet's own."""
    smolfile = minimal_smolfile(slots if warm else None)
    env = {"FLEET_MODEL": model}

    def steps(seed: int) -> list[Any]:
        if not warm:
            return [types_pb2.Step(name="episode", argv=program(seed), env=env, timeout_s=300)]
        episode = ["python3", "-c", NOOP_STEP] if noop else warm_step(seed)
        return [types_pb2.Step(name="warm-up", argv=["python3", "-c", source()], timeout_s=60),
                types_pb2.Step(name="episode", argv=episode, env=env, timeout_s=300)]  # fmt: skip

    async with (
        cpu_fleet("fleet-bench-fleet-", slots, ServerConfig(token_secret=SECRET),
                  ("host", http_port)) as fleet,
        fleet.channel() as channel,
    ):  # fmt: skip
        stub = fleet_pb2_grpc.FleetServiceStub(channel)
        run = uuid.uuid4().hex[:8]
        cpu_before = (all_machines_cpu_seconds(), gateway_cpu_s(gateway_pid), busy_cpu_s())
        started = time.perf_counter()
        for seed in range(episodes):
            await stub.SubmitRollout(
                fleet_pb2.SubmitRolloutRequest(
                    request_id=f"{run}-{seed}", idempotency_key=f"{run}-{seed}",
                    smolfile=smolfile, smolfile_name="smolfiles/minimal.smolfile",
                    steps=steps(seed),
                    labels={"bench": run},
                    requirements=types_pb2.Requirements(inference=True),
                ),
                timeout=30,
            )  # fmt: skip
        await until_final(fleet.server.core, episodes, poll_s=0.1)
        elapsed = time.perf_counter() - started
        cpu_after = (all_machines_cpu_seconds(), gateway_cpu_s(gateway_pid), busy_cpu_s())
        rollouts = await list_all(stub, {"bench": run})
    ok = [r for r in rollouts if r.state == types_pb2.ROLLOUT_STATE_SUCCEEDED]
    episodes_out = [json.loads(r.results[-1].stdout) for r in ok if r.results]
    # Per action; with `noop`, per rollout (its steps ask for no action).
    actions = max(1, len(ok) if noop else sum(len(e["actions"]) for e in episodes_out))
    first = min((r.created_at.ToNanoseconds() for r in rollouts), default=0) / 1e9
    ends = sorted(r.finished_at.ToNanoseconds() / 1e9 - first for r in ok)
    starts = sorted(r.started_at.ToNanoseconds() / 1e9 - first for r in ok)
    # Trajectories/s while the fleet was full: over the middle half of the finishes (only
    # where there were waves of episodes: with one wave, they all finish in a burst).
    q1, q3 = len(ends) // 4, 3 * len(ends) // 4
    waves = len(ends) >= 4 * slots and ends[q3] > ends[q1]
    steady = (q3 - q1) / (ends[q3] - ends[q1]) if waves else None
    machines = None
    if cpu_before[0] is not None and cpu_after[0] is not None:
        machines = (cpu_after[0] - cpu_before[0]) * 1000 / actions
    gateway_ms = (cpu_after[1] - cpu_before[1]) * 1000 / actions
    total = (cpu_after[2] - cpu_before[2]) * 1000 / actions
    return {
        "traj_s": len(ok) / elapsed, "ok": len(ok), "actions": actions, "elapsed_s": elapsed,
        "first_done_s": ends[0] if ends else 0.0, "last_start_s": starts[-1] if starts else 0.0,
        "steady_traj_s": steady,
        "asking_ms": statistics.fmean(e["action_ms"] for e in episodes_out) if ok else 0.0,
        "storing_ms": statistics.fmean(e["checkpoint_ms"] for e in episodes_out) if ok else 0.0,
        "cpu_ms": {"machines": machines, "gateway": gateway_ms, "total": total,
                   "rest": total - gateway_ms - (machines or 0.0)},
    }  # fmt: skip


def synchronous(
    manifest: Path, model: str, episodes: int, device: str = "cpu", threads: int = 1
) -> tuple[float, float, float]:
    """Trajectories/s of the plain loop (step, call the model in-process, repeat), the p50 of
    one model call in ms, and the CPU ms it spent per action."""
    runner = _runner(manifest, model, device, threads)
    started, cpu_started = time.perf_counter(), time.process_time()
    calls = []
    for seed in range(episodes):
        env, done = GridWorld(seed), False
        while not done:
            t = time.perf_counter()
            logits = runner.run_flat(array("f", env.observation()), 1, 147).tolist()
            calls.append(time.perf_counter() - t)
            _, done = env.step(argmax(logits))
    cpu_ms = (time.process_time() - cpu_started) * 1000 / len(calls)
    return episodes / (time.perf_counter() - started), percentile(calls, 0.5) * 1000, cpu_ms


def model_ceiling(
    manifest: Path, model: str, batch: int, device: str = "cpu", threads: int = 1,
    dtype: str = "float32",
) -> float:  # fmt: skip
    """Samples/s of the bare model at `batch` (what the device alone allows), through the runner
    the gateway's engine uses (its packed weights where they are faster), with no gateway."""
    import torch

    runner = _runner(manifest, model, device, threads, dtype)
    x = array("f", torch.randn(batch * 147).tolist())
    runs = 5 if batch > 1 else 40
    runner.run_flat(x, batch, 147)
    started = time.perf_counter()
    for _ in range(runs):
        runner.run_flat(x, batch, 147)
    return runs * batch / (time.perf_counter() - started)


@functools.lru_cache(maxsize=4)
def _runner(manifest: Path, model: str, device: str, threads: int, dtype: str = "float32") -> Any:
    """The model as the gateway's engine holds it, in this process (made once: packing times
    the model at load)."""
    from dataclasses import replace

    import torch

    from gateway.model import TorchRunner, load_network, model_specs

    torch.set_num_threads(threads)
    spec = replace(model_specs(manifest)[model], dtype=dtype)
    return TorchRunner(spec, load_network(spec), device, 1 << 40, pack=True)
