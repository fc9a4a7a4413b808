"""The gateway benchmark (`scripts/bench-gateway`). Prints one table, side by side.

Gateways run in their own processes and are called over gRPC on loopback by asyncio clients
in this one. Parts:

1. samples/s with 64 concurrent clients, batched vs one sample per batch, each client's
   requests one after another on an InferStream of its own (`batching_gain`) and again as unary
   Infer calls (`batching_gain_unary`), and (without --quick) each on a kept-alive connection to
   the HTTP endpoint, the way machines call (`batching_gain_http`); p50 latency of a lone request
   with and without batching (what batching adds when there is nothing to batch).
2. offered load from 0.5x to 3x of the device's memory capacity (in samples that fit at once):
   out-of-memory batch failures, and refusals at loads below 0.9x (false refusals). On CUDA,
   again against the GPU's own memory taken by another process (`real_memory`).
3. a fault injected into the primary device under load: time to the first answer served by the
   CPU replica, and requests lost (no answer even after resumable refusals were retried).
4. trajectories/s of gridworld episodes vs a synchronous loop calling the same model in-process,
   one action at a time: the whole fleet end to end (each episode a rollout in a sandboxed
   machine of an embedded fleet, `--slots` at once, every action over HTTP to this gateway and a
   checkpoint stored through the ledger after it), and the gateway alone (64 concurrent episode
   loops in this process, sharing one InferStream); the control plane's cost per action: a lone
   request's p50 through the gateway minus the bare model call's p50, with the shipped policy,
   over HTTP (`overhead_ms_per_action`: how a machine's step asks for its action), on an
   InferStream and as a unary Infer call.

The benchmark model is an MLP with the shipped policy's input and output (147 -> 4096 -> 4096 ->
4, random weights written to a temporary directory with their sha256, loaded by the same
checksum-verifying code): big enough that batching has something to amortize on a CPU. The
shipped policy is too small for that; its figures are in the last row for comparison.
"""

# ruff: noqa: T201 (a benchmark's output is what it prints)

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gateway  # noqa: F401  (its __init__ quiets torch's numpy warning in every process)
from benchmarks.gateway_episodes import fleet_pipeline, model_ceiling, pipeline, synchronous
from benchmarks.gateway_load import (
    BENCH_MODEL,
    ClientPool,
    GatewayProc,
    alternate,
    gauge_readings,
    hammer,
    interleaved,
    make_bench_model,
    real_memory,
    status,
)
from benchmarks.harness import REPO, Table, print_json, quiet


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small counts: done in under 60 s")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    parser.add_argument("--device", default="cpu", help="the primary: cpu or cuda:N")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per gateway")
    parser.add_argument(
        "--client-procs", type=int, default=1,
        help="processes part (1)'s 64 callers are shared out among (default 1: this one)",
    )  # fmt: skip
    parser.add_argument(
        "--dtypes", default=None,
        help="precisions part (1) serves the model in (float32 always; bfloat16 also if listed;"
        " default: both, or float32 alone with --quick)",
    )  # fmt: skip
    parser.add_argument(
        "--slots", type=int, default=64,
        help="episodes the fleet runs at once in part (4) (as many as part (1)'s clients)",
    )  # fmt: skip
    parser.add_argument(
        "--skip-fleet", action="store_true",
        help="leave out part (4)'s whole-fleet run (it needs namespaces and the ledger's setup)",
    )  # fmt: skip
    args = parser.parse_args()
    quiet()
    # --quick: 8 episodes per synchronous baseline, which keeps it inside its minute on a
    # slow host.
    quick, full = (8, 64, 40, 8), (40, 256, 200, 64)
    per_client, episodes, lone, sync_episodes = quick if args.quick else full
    rounds = 2 if args.quick else 4
    # Part (1)'s rounds: seconds each, and the most requests a caller sends in one (a bound
    # the fastest side, a GPU's over HTTP, does not reach within the round).
    round_s, most = (0.75, 64) if args.quick else (2.0, 256)
    # Eight waves of `slots` episodes: the first fills the fleet (the warm parent's warm-up,
    # its pool) and the last drains it, so fewer waves would measure mostly filling and draining.
    fleet_episodes = 32 if args.quick else max(128, 8 * args.slots)
    out: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="fleet-bench-gw-") as tmp,
        ClientPool(args.client_procs) as clients,
    ):
        manifest = make_bench_model(Path(tmp))
        common = {"model": BENCH_MODEL, "manifest": str(manifest), "device": args.device,
                  "threads": args.threads}  # fmt: skip
        batched_cfg = {"max_batch": 64, "max_wait_ms": 0.0, "max_queue": 4096,
                       "max_inflight_per_rollout": 64}  # fmt: skip
        with GatewayProc.together(
            GatewayProc(**common, batch={**batched_cfg, "max_batch": 1}, http=True),
            GatewayProc(**common, batch=batched_cfg, http=True),
        ) as (one, gw):
            # Lone requests alternate between the two, so both see the same machine state.
            lone_single, lone_batched = asyncio.run(alternate(one.address, gw.address, lone))
            # Each caller's requests on an InferStream of its own (the transport for callers
            # that make many), and again as unary Infer calls; one per batch and batched alike.
            # Without --quick, also over HTTP, as machines call.
            sides = {"single": (one, "stream"), "batched": (gw, "stream"),
                     "single_unary": (one, "unary"), "batched_unary": (gw, "unary")}  # fmt: skip
            if not args.quick:
                sides |= {"single_http": (one, "http"), "batched_http": (gw, "http")}
            # The GPU's utilization as the batched gateway reports it (NVML: CUDA only).
            watch: contextlib.AbstractContextManager[list[float]] = (
                gauge_readings(f"http://{gw.http_address}/metrics",
                               "fleet_gateway_gpu_utilization")
                if args.device.startswith("cuda") else contextlib.nullcontext([])
            )  # fmt: skip
            with watch as gpu_util:
                part1 = interleaved(sides, BENCH_MODEL, round_s, most, "", rounds, clients)
            single, batched = part1["single"], part1["batched"]
            single_unary, batched_unary = part1["single_unary"], part1["batched_unary"]
            single_http, batched_http = part1.get("single_http"), part1.get("batched_http")
            one.__exit__()
            # The bare model's ceiling, measured right after the runs it bounds: this machine's
            # speed drifts (measured at the end, it once came out below the gateway's rate).
            ceiling = model_ceiling(manifest, BENCH_MODEL, 64, args.device, args.threads)
            ceiling_one = model_ceiling(manifest, BENCH_MODEL, 1, args.device, args.threads)
            traj_s, actions = asyncio.run(pipeline(gw.address, BENCH_MODEL, episodes, 64))
            whole: dict[str, Any] = {}
            warm: dict[str, Any] = {}
            # The synchronous baseline runs before the fleet's runs, between them and after
            # them: this machine's speed drifts, and each run is compared with the mean of the
            # two that bracket it.
            sync_sizes = (manifest, BENCH_MODEL, sync_episodes, args.device, args.threads)
            syncs = [synchronous(*sync_sizes)]
            for result, forked in () if args.skip_fleet else ((whole, False), (warm, True)):
                result.update(
                    asyncio.run(
                        fleet_pipeline(gw.http_port.value, gw.pid, BENCH_MODEL,
                                       fleet_episodes, args.slots, warm=forked)
                    )
                )  # fmt: skip
                syncs.append(synchronous(*sync_sizes))
            noop: dict[str, Any] = {}
            if not args.skip_fleet and not args.quick:  # (--quick: its minute is spent)
                noop = asyncio.run(
                    fleet_pipeline(gw.http_port.value, gw.pid, BENCH_MODEL,
                                   fleet_episodes, args.slots, warm=True, noop=True)
                )  # fmt: skip

            # (3) failover under load: fault at t0, first CPU-served answer after it.
            async def failover() -> tuple[dict[str, Any], float]:
                # Long enough to be under way when the fault comes (a load --quick's sizes
                # make could be over within the 0.2 s before it).
                load = asyncio.create_task(
                    hammer(gw.address, BENCH_MODEL, 32, max(48, per_client * 2), "f", True)
                )
                await asyncio.sleep(0.2)
                t0 = time.monotonic()
                gw.fault.value = True
                result = await load
                after = [t for t in result["degraded_at"] if t >= t0]
                return result, (min(after) - t0) if after else float("inf")

            fail, failover_s = asyncio.run(failover())
            gw_status = asyncio.run(status(gw.address))
        sync_cpu_ms = statistics.fmean(run[2] for run in syncs)
        for i, run in enumerate((whole, warm)[: len(syncs) - 1]):
            run["sync_traj_s"] = (syncs[i][0] + syncs[i + 1][0]) / 2
            run["sync_cpu_ms"] = (syncs[i][2] + syncs[i + 1][2]) / 2
        # (1) again with the model served in bfloat16 (the CPU replica stays float32).
        half: dict[str, Any] = {}
        dtypes = args.dtypes if args.dtypes is not None else "" if args.quick else "bfloat16"
        if "bfloat16" in dtypes:
            half_common = {**common, "dtype": "bfloat16"}
            with GatewayProc.together(
                GatewayProc(**half_common, batch={**batched_cfg, "max_batch": 1}),
                GatewayProc(**half_common, batch=batched_cfg),
            ) as (one16, gw16):
                half.update(
                    interleaved(
                        {"single": (one16, "stream"), "batched": (gw16, "stream")},
                        BENCH_MODEL, round_s, most, "h", rounds, clients,
                    )
                )  # fmt: skip
            half["ceiling"] = model_ceiling(
                manifest, BENCH_MODEL, 64, args.device, args.threads, "bfloat16"
            )
            half["ceiling_one"] = model_ceiling(
                manifest, BENCH_MODEL, 1, args.device, args.threads, "bfloat16"
            )
        # The control plane's own cost: the shipped policy is so small that a lone request's
        # time through the gateway is nearly all RPC, token check and batcher.
        shipped = {"model": "gridworld-policy", "device": args.device,
                   "manifest": str(REPO / "gateway/weights/models.toml")}  # fmt: skip
        # (2) memory: capacity for 64 samples at once; offered load 0.5x .. 3x of that.
        from gateway.model import memory_model, model_specs

        mem = memory_model(model_specs(manifest)[BENCH_MODEL])
        capacity = (mem.weights_bytes + 64 * mem.activation_bytes_per_sample) / 2**20
        loads: dict[float, dict[str, Any]] = {}
        with GatewayProc.together(
            GatewayProc(**shipped, batch={**batched_cfg, "max_batch": 1}, http=True),
            # Without the engine's packed copy of the weights: whether it makes one is timed
            # at load, and the budget must mean 64 samples whatever this machine's timings were.
            GatewayProc(**common, batch={**batched_cfg, "max_batch": 256},
                        capacity_mib=capacity, pack_weights=False),
        ) as (small, mgw):  # fmt: skip
            lone_small = {
                transport: asyncio.run(
                    hammer(small.http_address if transport == "http" else small.address,
                           "gridworld-policy", 1, lone, f"sm{transport}", transport=transport)
                )
                for transport in ("http", "stream", "unary")
            }  # fmt: skip
            small.__exit__()
            for factor in (0.5, 0.75, 1.0, 1.5, 2.0, 3.0):
                loads[factor] = asyncio.run(
                    hammer(mgw.address, BENCH_MODEL, int(64 * factor), per_client, f"m{factor}")
                )
            mem_status = asyncio.run(status(mgw.address))
        _, model_p50, _ = synchronous(
            REPO / "gateway/weights/models.toml", "gridworld-policy", 16, args.device
        )
        # On CUDA, (2) once more against the device's own memory, taken by another process.
        gpu_rows = (
            real_memory(common, batched_cfg, per_client, args.device)
            if args.device.startswith("cuda") else []
        )  # fmt: skip
        below = [r for f, r in loads.items() if f < 0.9]
        refused_below = sum(sum(r["codes"].values()) for r in below)
        offered_below = sum(r["answered"] + sum(r["codes"].values()) for r in below)
    overhead = {transport: run["p50_ms"] - model_p50 for transport, run in lone_small.items()}
    out = {
        "batching_gain": batched["rate"] / single["rate"],
        "batching_gain_unary": batched_unary["rate"] / single_unary["rate"],
        "batching_gain_http": (
            batched_http["rate"] / single_http["rate"] if batched_http and single_http else None
        ),
        "batching_gain_bfloat16": (
            half["batched"]["rate"] / half["single"]["rate"] if half else None
        ),
        "oom_failures": int(mem_status.oom_faults),
        "oom_failures_gpu_full": (
            sum(row["oom"] for row in gpu_rows if row["gateway"] == "reserved")
            if gpu_rows
            else None
        ),
        "cpu_answers_gpu_full": (
            sum(row["cpu"] for row in gpu_rows if row["gateway"] == "reserved")
            if gpu_rows
            else None
        ),
        "false_refusal_rate": refused_below / max(1, offered_below),
        "failover_s": failover_s,
        "lost_requests": fail["lost"],
        # The fleet's pipeline as its evaluations run it (`fleet demo`): each episode a warm
        # parent's child; and with a fresh machine of its own per episode.
        "pipeline_gain": warm["traj_s"] / warm["sync_traj_s"] if warm else None,
        "pipeline_gain_fresh": whole["traj_s"] / whole["sync_traj_s"] if whole else None,
        "gateway_pipeline_gain": traj_s / syncs[0][0],
        "overhead_ms_per_action": overhead["http"],
        "overhead_ms_per_action_stream": overhead["stream"],
        "overhead_ms_per_action_unary": overhead["unary"],
        "fleet_cpu_ms_per_action": warm["cpu_ms"]["total"] if warm else None,
        "fresh_cpu_ms_per_action": whole["cpu_ms"]["total"] if whole else None,
        "sync_cpu_ms_per_action": sync_cpu_ms,
        "batched_cpu_us_per_sample": round(sum(batched["cpu_us"].values()), 1),
        "batched_cpu_us_per_sample_unary": round(sum(batched_unary["cpu_us"].values()), 1),
        "noop_rollouts_s": noop["traj_s"] if noop else None,
        "noop_cpu_ms_per_rollout": noop["cpu_ms"]["total"] if noop else None,
    }
    table = Table(58, (("fleet", 12), ("baseline", 12), ("ratio", 9)))
    table.print_header()
    table.print_row("(1) samples/s, 64 clients on streams: batched vs one",
                    f"{batched['rate']:.0f}", f"{single['rate']:.0f}",
                    f"{out['batching_gain']:.1f}x")  # fmt: skip
    table.print_row("    the same, each request a unary call: batched vs one",
                    f"{batched_unary['rate']:.0f}", f"{single_unary['rate']:.0f}",
                    f"{out['batching_gain_unary']:.1f}x")  # fmt: skip
    if batched_http and single_http:
        table.print_row("    the same over HTTP, as machines call: batched vs one",
                        f"{batched_http['rate']:.0f}", f"{single_http['rate']:.0f}",
                        f"{out['batching_gain_http']:.1f}x")  # fmt: skip
    table.print_row("    p50 ms of a lone request: batched vs unbatched",
                    f"{lone_batched['p50_ms']:.2f}", f"{lone_single['p50_ms']:.2f}",
                    tail=f"{lone_batched['p50_ms'] - lone_single['p50_ms']:>+8.2f}ms")  # fmt: skip
    table.print_row("    the bare model alone: batches of 64 vs of 1 (ceiling)", f"{ceiling:.0f}",
                    f"{ceiling_one:.0f}", f"{ceiling / ceiling_one:.1f}x")  # fmt: skip
    table.print_row("    the gateway batched, as a fraction of the bare model",
                    f"{batched['rate'] / ceiling:.2f}", f"{batched_unary['rate'] / ceiling:.2f}",
                    tail="  (streams, unary)")  # fmt: skip
    by_transport = [("streams", batched), ("unary", batched_unary), ("HTTP", batched_http)]
    for label, run in [(label, run) for label, run in by_transport if run]:
        us = run["cpu_us"]
        print(f"    batched, {label}: a sample's batch held {run['batch_mean']:.1f} on average; "
              f"the model engine computed {run['engine_busy']:.0%} of the time; CPU us per "
              f"sample: the 64 clients {us['clients']:.0f}, the gateway {us['gateway']:.0f}, "
              f"its model engine {us['engine']:.0f}")  # fmt: skip
    if half:
        table.print_row("    the same, model served in bfloat16: batched vs one",
                        f"{half['batched']['rate']:.0f}", f"{half['single']['rate']:.0f}",
                        f"{out['batching_gain_bfloat16']:.1f}x")  # fmt: skip
        table.print_row("    bfloat16, the bare model alone: 64 vs 1 (ceiling)",
                        f"{half['ceiling']:.0f}", f"{half['ceiling_one']:.0f}",
                        f"{half['ceiling'] / half['ceiling_one']:.1f}x")  # fmt: skip
    if gpu_util:
        print(f"    GPU utilization the batched gateway reported during (1) (NVML; both gateways"
              f" share the GPU): mean {statistics.fmean(gpu_util):.0%}, highest "
              f"{max(gpu_util):.0%}, {len(gpu_util)} readings")  # fmt: skip
    print(
        f"    p50 at 64 clients on streams: {batched['p50_ms']:.1f} ms batched, "
        f"{single['p50_ms']:.1f} ms one per batch; the gateway answered {gw_status.served} samples"
    )
    pairs = [("streams", single, batched), ("unary", single_unary, batched_unary),
             ("HTTP", single_http, batched_http)]  # fmt: skip
    for label, a, b in [(label, a, b) for label, a, b in pairs if a and b]:
        gains = [y / x for x, y in zip(a["rates"], b["rates"], strict=True)]
        print(f"    runs in turns, batched vs one per batch, {label}, round by round: "
              f"{' '.join(f'{g:.1f}x' for g in gains)}")  # fmt: skip
    for factor, r in loads.items():
        refused = sum(r["codes"].values())
        table.print_row(f"(2) load {factor:g}x memory capacity: answered / refused",
                        f"{r['answered']}", f"{refused}")  # fmt: skip
    table.print_row("    out-of-memory batch failures (all loads)", f"{out['oom_failures']}")
    table.print_row("    false refusal rate below 0.9x", f"{out['false_refusal_rate']:.3f}")
    for row in gpu_rows:
        print(f"    GPU's memory taken by another process, {row['left_mib']:.0f} MiB left, "
              f"{row['gateway']}: answered by the GPU {row['gpu']}, by the CPU replica "
              f"{row['cpu']}; lost {row['lost']}; out-of-memory batch failures {row['oom']}; "
              f"failovers {row['failovers']}")  # fmt: skip
    table.print_row("(3) fault on the primary: s to first CPU-served answer", f"{failover_s:.3f}")
    table.print_row("    requests lost / answered under the fault", f"{fail['lost']}",
                    f"{fail['answered']}")  # fmt: skip
    if args.skip_fleet:
        print("(4) trajectories/s: the fleet end to end: left out (--skip-fleet)")
    else:
        # First as `fleet demo` runs episodes: each a warm parent's child.
        runs = (("(4) trajectories/s, the fleet (warm children) vs sync", warm),
                ("    the same, each episode a fresh machine of its own", whole))  # fmt: skip
        for title, run in runs:
            base, base_cpu = run["sync_traj_s"], run["sync_cpu_ms"]
            table.print_row(title, f"{run['traj_s']:.1f}", f"{base:.1f}",
                            f"{run['traj_s'] / base:.1f}x")  # fmt: skip
            cpu = run["cpu_ms"]
            table.print_row("      CPU ms per action, this whole machine", f"{cpu['total']:.2f}",
                            f"{base_cpu:.2f}", f"{cpu['total'] / base_cpu:.1f}x")  # fmt: skip
            machines = "unread" if cpu["machines"] is None else f"{cpu['machines']:.2f}"
            print(
                f"      (of the fleet's: machines {machines}, gateway {cpu['gateway']:.2f}, "
                f"server, agent, their tools and the kernel {cpu['rest']:.2f})"
            )
            print(
                f"      ({run['ok']} of {fleet_episodes} episodes as rollouts, {args.slots} at "
                f"once, {run['actions']} actions; per action, ms asking the gateway "
                f"{run['asking_ms']:.2f}, storing the checkpoint {run['storing_ms']:.2f})"
            )
            steady = run["steady_traj_s"]
            print(
                f"      (in {run['elapsed_s']:.1f} s: the first episode done at "
                f"{run['first_done_s']:.1f} s, the last started at {run['last_start_s']:.1f} s"
                + (
                    f"; {steady:.1f} trajectories/s over the middle half of finishes)"
                    if steady is not None
                    else ")"
                )
            )
    if noop:  # its "actions" are its rollouts (none of its steps asks the gateway anything)
        cpu = noop["cpu_ms"]
        machines = "unread" if cpu["machines"] is None else f"{cpu['machines']:.1f}"
        print(f"    the fleet's own cost: {noop['ok']} warm rollouts whose step does nothing, "
              f"{noop['traj_s']:.1f} rollouts/s; CPU ms per rollout {cpu['total']:.1f} (the "
              f"machines {machines}, server, agent, their tools and the kernel "
              f"{cpu['rest'] + cpu['gateway']:.1f})")  # fmt: skip
    print(f"    (the synchronous loop, trajectories/s before, between and after the fleet's "
          f"runs: {', '.join(f'{run[0]:.1f}' for run in syncs)}; each run's baseline is the "
          "mean of the two beside it)")  # fmt: skip
    table.print_row("    only the gateway: 64 in-process episode loops, 1 stream", f"{traj_s:.1f}",
                    f"{syncs[0][0]:.1f}", f"{out['gateway_pipeline_gain']:.1f}x")  # fmt: skip
    for transport, label in (("http", "ms per action, shipped policy: HTTP (machines) vs bare"),
                             ("stream", "  the same on an InferStream"),
                             ("unary", "  the same as unary Infer calls")):  # fmt: skip
        table.print_row("    " + label, f"{lone_small[transport]['p50_ms']:.2f}",
                        f"{model_p50:.2f}", tail=f"{overhead[transport]:>+8.2f}ms")  # fmt: skip
    print(
        f"(primary {args.device}, torch {args.threads} CPU thread(s) per gateway; "
        f"model {BENCH_MODEL} "
        "147-4096-4096-4; "
        f"{actions} actions in the pipeline run)"
    )
    if args.json:
        print_json(out, 4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
