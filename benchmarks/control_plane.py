"""Where the CPU of a no-op warm rollout goes (`scripts/profile-control-plane`): fleet's own
cost per rollout, by part.

The embedded fleet (server and one CPU agent in this process, SQLite ledger, TLS and keys, the
namespace runtime) runs `--rollouts` warm rollouts whose step does nothing (a copy-on-write
child of a warm parent runs `print(...)`), after a first wave that makes the warm parent. The
CPU they cost (measured without the profiler) is split by who spent it:

- this process: the server, the agent and the client that submits and polls (Python);
- tools: processes the agent started and reaped (nft, ip, mount, ...), from os.times();
- machines: the warm parent and its children (the `fleet` cgroup's account);
- the rest of the machine's busy time (the kernel's own work, other processes).

The floor beside it: the same machines with no control plane, a child of the same warm parent
made, running the same step and deleted, one after another, through the runtime alone.

Then a second wave under cProfile: the event loop thread's functions by own CPU time, grouped
by module, per rollout.
"""

# ruff: noqa: T201 (a benchmark's output is what it prints)

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    busy_cpu_s,
    cpu_fleet,
    minimal_smolfile,
    print_json,
    quiet,
    stat_cpu_s,
    until_final,
)
from fleet.api.pb import fleet_pb2, fleet_pb2_grpc, types_pb2
from fleet.runtime.cgroups import all_machines_cpu_seconds

NOOP = 'print("{}")'
"""The step: nothing but its result."""


def own_cpu_s() -> tuple[float, float]:
    """(this process, its reaped children) CPU seconds."""
    t = os.times()
    return t.user + t.system, t.children_user + t.children_system


def threads_cpu_s() -> dict[str, float]:
    """CPU seconds of this process's live threads, by name: Python's name for its own threads
    (the event loop's `MainThread`, the ledger's writer `ledger`, its readers `ledger-read`,
    worker threads `asyncio`), the kernel's for the others (gRPC's `event_engine` and the
    like), numbers dropped so that a pool's threads add up."""
    out: dict[str, float] = defaultdict(float)
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    for task in Path("/proc/self/task").iterdir():
        try:
            cpu_s = stat_cpu_s(task / "stat")
            name = python_names.get(int(task.name)) or (task / "comm").read_text().strip()
        except OSError:
            continue  # (ended meanwhile)
        out[name.rstrip("0123456789_") or name] += cpu_s
    return out


async def run(rollouts: int, slots: int, profile: cProfile.Profile) -> dict[str, Any]:
    smolfile = minimal_smolfile(slots)
    finished: list[int] = []

    async def wave(stub: Any, n: int) -> dict[str, int]:
        run_id = uuid.uuid4().hex[:8]
        steps = [
            types_pb2.Step(name="warm-up", argv=["python3", "-c", "pass"], timeout_s=60),
            types_pb2.Step(name="step", argv=["python3", "-c", NOOP], timeout_s=60),
        ]
        reply = await stub.SubmitRollouts(
            fleet_pb2.SubmitRolloutsRequest(
                request_id=run_id,
                rollouts=[
                    fleet_pb2.SubmitRolloutRequest(
                        request_id=f"{run_id}-{i}", idempotency_key=f"{run_id}-{i}",
                        smolfile=smolfile, steps=steps, labels={"wave": run_id},
                    )
                    for i in range(n)
                ],
            ),
            timeout=60,
        )  # fmt: skip
        finished.append(len(reply.rollouts))
        return await until_final(core, sum(finished), poll_s=0.2)

    async with (
        cpu_fleet("fleet-profile-", slots) as fleet,
        fleet.channel() as channel,
    ):
        stub = fleet_pb2_grpc.FleetServiceStub(channel)
        core = fleet.server.core
        await wave(stub, slots)  # the warm parent is made
        before = (*own_cpu_s(), all_machines_cpu_seconds(), busy_cpu_s())
        threads_before = threads_cpu_s()
        started = time.perf_counter()
        await wave(stub, rollouts)  # measured: no profiler
        elapsed = time.perf_counter() - started
        after = (*own_cpu_s(), all_machines_cpu_seconds(), busy_cpu_s())
        threads_after = threads_cpu_s()
        floor = await machines_alone(fleet.agents[0], rollouts)
        profile.enable()
        done = await wave(stub, rollouts)  # profiled
        profile.disable()
    if done["SUCCEEDED"] != slots + 2 * rollouts:
        raise RuntimeError(f"not every rollout succeeded: {done}")
    per = 1000 / rollouts
    process = (after[0] - before[0]) * per
    tools = (after[1] - before[1]) * per
    machines = (after[2] - before[2]) * per if after[2] is not None and before[2] else None
    busy = (after[3] - before[3]) * per
    rest = busy - process - tools - (machines or 0.0)
    return {"rollouts": rollouts, "elapsed_s": elapsed, "rollouts_per_s": rollouts / elapsed,
            "cpu_ms": {"process": process, "tools": tools, "machines": machines, "rest": rest,
                       "total": busy},
            "floor_ms": floor,
            "threads_ms": {name: (threads_after[name] - threads_before.get(name, 0.0)) * per
                           for name in threads_after}}  # fmt: skip


async def machines_alone(agent: Any, n: int) -> dict[str, float]:
    """CPU ms per machine of `n` children of the agent's warm parent, each made, running the
    step and deleted through the runtime alone: (this process, machines, total busy)."""
    [parent] = agent.parents()
    before = (own_cpu_s()[0], all_machines_cpu_seconds() or 0.0, busy_cpu_s())
    for i in range(n):
        child = await parent.branch(f"floor-{uuid.uuid4().hex[:8]}-{i}")
        result = await child.exec(["python3", "-c", NOOP], timeout_s=60)
        await child.delete()
        if result.exit_code != 0:
            raise RuntimeError(f"the floor's step failed: {result.stderr[-300:]!r}")
    after = (own_cpu_s()[0], all_machines_cpu_seconds() or 0.0, busy_cpu_s())
    process, machines, busy = ((b - a) * 1000 / n for a, b in zip(before, after, strict=True))
    return {"process": process, "machines": machines, "total": busy}


def by_module(profile: cProfile.Profile, rollouts: int) -> list[tuple[str, float]]:
    """This process's own time per rollout (ms), by module (fleet's by file; the rest by
    package)."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    out: dict[str, float] = defaultdict(float)
    for (path, _line, name), (_cc, _nc, tottime, _ct, _callers) in stats.items():
        if "/fleet/" in path and "site-packages" not in path:
            key = "fleet/" + path.split("/fleet/", 1)[1]
        elif "site-packages/" in path:
            key = path.split("site-packages/", 1)[1].split("/", 1)[0]
        elif path == "~":
            key = f"builtin {name.split(' of ')[0].strip('<>{}')[:40]}"
        else:
            key = "stdlib " + Path(path).stem
        out[key] += tottime * 1000 / rollouts
    return sorted(out.items(), key=lambda kv: -kv[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rollouts", type=int, default=200)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--top", type=int, default=25, help="modules and functions shown")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args()
    quiet()
    # CPU time of the thread the event loop (server and agent) runs on, not wall time.
    profile = cProfile.Profile(time.thread_time)
    result = asyncio.run(run(args.rollouts, args.slots, profile))
    cpu = result["cpu_ms"]
    print(f"{args.rollouts} no-op warm rollouts, {args.slots} slots: "
          f"{result['rollouts_per_s']:.1f} rollouts/s")  # fmt: skip
    print("CPU ms per rollout, by who spent it:")
    for name in ("process", "tools", "machines", "rest", "total"):
        value = cpu[name]
        print(f"  {name:<10}{'n/a' if value is None else f'{value:8.2f}'}")
    floor = result["floor_ms"]
    print(f"the floor: the same machines alone (a warm child made, its step run, deleted; no "
          f"server, agent or ledger): {floor['total']:.2f} CPU ms each (machines "
          f"{floor['machines']:.2f}, this process {floor['process']:.2f}); the control plane's "
          f"own share {cpu['total'] - floor['total']:.2f} ms per rollout")  # fmt: skip
    # The machine's speed drifts between runs; this process's time over the floor's own (the
    # same runtime calls, measured minutes apart at most) compares trees run at other times.
    if floor["process"] > 0:
        print(f"this process's CPU per rollout over the floor's own: "
              f"{cpu['process'] / floor['process']:.2f}x "
              "(compare trees by this, alternating)")  # fmt: skip
    print(
        "this process's CPU ms per rollout, by thread (live threads; those that ended are missing):"
    )
    for name, ms in sorted(result["threads_ms"].items(), key=lambda kv: -kv[1]):
        if ms >= 0.05:
            print(f"  {ms:8.2f}  {name}")
    print(
        "a second wave under cProfile (CPU time of the event loop's thread; the profiler adds "
        "its own): own time per rollout (ms), by module:"
    )
    modules = by_module(profile, args.rollouts)
    for name, ms in modules[: args.top]:
        print(f"  {ms:8.3f}  {name}")
    print("functions by own time per rollout (ms):")
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[: args.top]
    for (path, line, name), (_cc, calls, tottime, _ct, _callers) in rows:
        where = path.split("site-packages/")[-1].split("/work/main/")[-1]
        print(f"  {tottime * 1000 / args.rollouts:8.3f}  {calls / args.rollouts:7.1f}/r  "
              f"{name} ({where}:{line})")  # fmt: skip
    if args.json:
        print_json({**result, "modules_ms": dict(modules[: args.top])})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
