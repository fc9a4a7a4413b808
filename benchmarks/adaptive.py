"""The adaptive-concurrency benchmark (`scripts/bench-adaptive`). Prints one table.

A pipeline whose inference side saturates at a known rate: a gateway (its own process, the
shipped gridworld policy) whose device takes a fixed time per batch of at most `--max-batch`
samples, so it answers at most max_batch / batch time actions per second, and an embedded fleet
(SQLite ledger, one CPU agent with `--slots` machines, the namespace runtime) running gridworld
episodes as warm rollouts, each asking the gateway for every action over HTTP. All the fleet's
hosts are one pool.

1. The sweep: the pool's cap fixed at each of `--caps` in turn; after a settling time, the
   completed trajectories per second over a window, and the gateway's p95 latency over it.
2. The controller: the same pool made adaptive from a cap of 2, the server left to find the
   cap; the seconds until it first settles, then throughput and p95 over a window there.

Reported: the cap it settled at, its throughput vs the sweep's best fixed cap (target >= 90%),
its p95 gateway latency vs the largest cap's (target: lower), seconds to settle.
"""

# ruff: noqa: T201 (a benchmark's output is what it prints)

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from typing import Any

import grpc

import gateway  # noqa: F401  (its __init__ quiets torch's numpy warning in every process)
from benchmarks.harness import (
    SECRET,
    ServerProcess,
    Table,
    cpu_fleet,
    minimal_smolfile,
    print_json,
    quiet,
)
from fleet.api.pb import (
    fleet_pb2,
    fleet_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    types_pb2,
)
from fleet.core.adaptive import Adaptive
from fleet.core.placement import LOCAL_LABEL, HostClass, Pool
from fleet.envs.episode import source, warm_step
from fleet.server.settings import ServerConfig

MODEL = "gridworld-policy"
POOL = "bench"


def _gateway_main(settings: dict[str, Any], port: Any, http_port: Any) -> None:
    quiet()
    import torch

    torch.set_num_threads(1)
    from gateway.batcher import BatchConfig
    from gateway.http import serve_http
    from gateway.service import Gateway, GatewayConfig, serve

    def device_time() -> None:  # the device's fixed time per batch: the known rate
        time.sleep(settings["batch_s"])

    async def main() -> None:
        batch = BatchConfig(max_batch=settings["max_batch"], max_wait_ms=1.0, max_queue=4096,
                            latency_window_s=settings["window_s"], probe_interval_s=0)  # fmt: skip
        config = GatewayConfig(secret=SECRET, model=MODEL, device="cpu", engine="inline",
                               batch=batch, log_level="error")  # fmt: skip
        gw = Gateway.build(config, fault_primary=device_time)
        grpc_server, bound = await serve(gw, "127.0.0.1:0")
        http_server, bound_http = await serve_http(gw, "0.0.0.0", 0)
        held = (grpc_server, http_server)  # a server nothing references stops
        http_port.value = bound_http
        port.value = bound
        await asyncio.Event().wait()
        del held

    asyncio.run(main())


class RateLimitedGateway(ServerProcess):
    """The gateway whose device takes `batch_s` per batch of at most `max_batch`, in a process of
    its own."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(_gateway_main, settings)


async def gateway_p95_ms(address: str) -> float:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        status = await stub.Status(inference_pb2.GatewayStatusRequest(), timeout=5)
        return float(status.p95_latency_ms)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rate = args.max_batch / args.batch_s
    smolfile = minimal_smolfile(min(args.slots, 16))
    env = {"FLEET_MODEL": MODEL}
    run_id = uuid.uuid4().hex[:8]
    out: dict[str, Any] = {"gateway_actions_per_s": rate, "slots": args.slots}
    with RateLimitedGateway(batch_s=args.batch_s, max_batch=args.max_batch,
                            window_s=args.window_s) as gw:  # fmt: skip
        address = gw.address
        config = ServerConfig(token_secret=SECRET, gateway_address=address, gateway_poll_s=0.25,
                              govern_interval_s=0.5)  # fmt: skip
        async with cpu_fleet(
            "fleet-bench-adaptive-", args.slots, config, ("host", gw.http_port.value)
        ) as fleet:
            core = fleet.server.core
            ledger = core.ledger
            fixed = Pool(name=POOL, host_class=HostClass.CPU, labels={LOCAL_LABEL: "1"},
                         max_running=args.caps[0])  # fmt: skip
            await core.db(ledger.set_pool, fixed, time.time())
            async with fleet.channel() as channel:
                stub = fleet_pb2_grpc.FleetServiceStub(channel)
                submitted = 0

                async def feed() -> None:  # keeps work waiting for the pool, all run long
                    nonlocal submitted
                    while True:
                        figures = await core.read(ledger.figures, time.time())
                        queued = int(figures.get("state_QUEUED", 0))
                        for _ in range(max(0, 2 * args.slots - queued)):
                            seed = submitted
                            submitted += 1
                            await stub.SubmitRollout(fleet_pb2.SubmitRolloutRequest(
                                request_id=f"{run_id}-{seed}", idempotency_key=f"{run_id}-{seed}",
                                smolfile=smolfile, smolfile_name="smolfiles/minimal.smolfile",
                                steps=[
                                    types_pb2.Step(name="warm-up", argv=["python3", "-c",
                                                   source()], timeout_s=60),
                                    types_pb2.Step(name="episode", argv=warm_step(seed % 997),
                                                   env=env, timeout_s=120),
                                ],
                                requirements=types_pb2.Requirements(inference=True),
                            ), timeout=30)  # fmt: skip
                        await asyncio.sleep(0.25)

                async def measure(window_s: float) -> tuple[float, float]:
                    await asyncio.sleep(window_s)
                    figures = await core.read(ledger.figures, time.time(), window_s)
                    return figures["trajectories_per_second"], await gateway_p95_ms(address)

                feeder = asyncio.create_task(feed())
                try:
                    await asyncio.sleep(args.settle_s)  # the warm parent and its pool start
                    sweep = []
                    for cap in args.caps:
                        pool = fixed.model_copy(update={"max_running": cap})
                        await core.db(ledger.set_pool, pool, time.time())
                        await asyncio.sleep(args.settle_s)
                        traj, p95 = await measure(args.window_s)
                        sweep.append({"cap": cap, "traj_s": traj, "p95_ms": p95})
                        print(f"  fixed cap {cap:>3}: {traj:6.2f} traj/s, p95 {p95:7.1f} ms",
                              file=sys.stderr, flush=True)  # fmt: skip
                    adaptive = Adaptive(start=2, step=2, interval_s=args.interval_s,
                                        probe_every=6)  # fmt: skip
                    started = time.time()
                    await core.db(ledger.set_pool, fixed.model_copy(update={
                        "max_running": 0, "adaptive": adaptive}), started)  # fmt: skip
                    settled_at = None
                    while time.time() - started < args.max_settle_s:
                        await asyncio.sleep(0.5)
                        events = await core.db(ledger.pool_events, started, POOL)
                        done = [e for e in events if e.kind in ("lowered", "settled")]
                        if done:
                            settled_at = done[0].at
                            break
                    views = await core.db(ledger.pools)
                    settled_cap = views[0].pool.max_running
                    traj, p95 = await measure(args.window_s)
                    events = await core.db(ledger.pool_events, started, POOL)
                finally:
                    feeder.cancel()
    best = max(sweep, key=lambda s: s["traj_s"])
    largest = max(sweep, key=lambda s: s["cap"])
    out.update(
        sweep=sweep, best_fixed_cap=best["cap"], best_fixed_traj_s=best["traj_s"],
        largest_cap=largest["cap"], largest_cap_p95_ms=largest["p95_ms"],
        settled_cap=settled_cap, settled_traj_s=traj, settled_p95_ms=p95,
        settle_s=None if settled_at is None else settled_at - started,
        throughput_vs_best=traj / best["traj_s"] if best["traj_s"] else 0.0,
        p95_vs_largest=p95 / largest["p95_ms"] if largest["p95_ms"] else 0.0,
        decisions=[(round(e.at - started, 1), e.kind, e.cap, e.figures.get("rate_per_s"))
                   for e in events],
        submitted=submitted,
    )  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    parser.add_argument("--slots", type=int, default=24, help="the CPU host's slots (24)")
    parser.add_argument("--caps", default="2,4,6,8,12,16,24",
                        help="the sweep's fixed caps (2,4,6,8,12,16,24)")  # fmt: skip
    parser.add_argument("--batch-s", type=float, default=0.05, help="device time per batch")
    parser.add_argument("--max-batch", type=int, default=4, help="samples per batch, at most")
    parser.add_argument("--window-s", type=float, default=40.0, help="each measurement's window")
    parser.add_argument("--settle-s", type=float, default=4.0, help="wait after a cap change")
    parser.add_argument("--interval-s", type=float, default=15.0, help="the controller's")
    parser.add_argument("--max-settle-s", type=float, default=300.0)
    args = parser.parse_args()
    args.caps = [int(c) for c in args.caps.split(",")]
    quiet()
    out = asyncio.run(run(args))
    rows = [
        ("gateway ceiling (actions/s)", f"{out['gateway_actions_per_s']:.0f}", ""),
        *((f"fixed cap {s['cap']}", f"{s['traj_s']:.2f} traj/s", f"p95 {s['p95_ms']:.1f} ms")
          for s in out["sweep"]),
        ("controller settled at cap", str(out["settled_cap"]),
         f"after {out['settle_s']:.1f} s" if out["settle_s"] is not None else "did not settle"),
    ]  # fmt: skip
    cells = Table(34, (("", 16), ("", 16)), sep=" ")
    cells.print_header()
    for name, a, b in rows:
        cells.print_row(name, a, b)
    print()
    versus = Table(34, (("adaptive", 10), ("baseline", 10), ("ratio", 8)), sep=" ")
    versus.print_header()
    versus.print_row(
        "throughput vs best fixed (traj/s)",
        f"{out['settled_traj_s']:.2f}",
        f"{out['best_fixed_traj_s']:.2f}",
        f"{out['throughput_vs_best']:.2f}",
    )
    versus.print_row(
        "p95 gateway ms vs largest cap",
        f"{out['settled_p95_ms']:.1f}",
        f"{out['largest_cap_p95_ms']:.1f}",
        f"{out['p95_vs_largest']:.2f}",
    )
    print(f"targets: throughput >= 90% of the best fixed cap ({out['best_fixed_cap']}); p95 "
          f"lower than at the largest cap ({out['largest_cap']})")  # fmt: skip
    print("decisions (s, kind, cap, traj/s):", out["decisions"])
    if args.json:
        print_json(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
