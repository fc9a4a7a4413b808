"""The spawn benchmark (`scripts/bench-spawn`): cold machines vs copy-on-write children.

On the namespace runtime, in one run: (1) cold start of a machine from the image, and (2) a
child of a warm parent holding 1 GiB of state in memory (anonymous memory the warm-up wrote,
transparent huge pages where the kernel offers them). Spawn latency is measured from the
request to the first line of the step's own code. Then 100 live children each write 1% of the
parent's memory: their memory (PSS, and the private bytes each adds) against the naive cost of
100 full copies. Then density: idle children are added until the p99 spawn latency of the
last 50 passes 100 ms, memory use passes 80%, or the cap is reached.
"""

# ruff: noqa: T201 (a benchmark's output is what it prints)

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from pathlib import Path

from benchmarks.harness import Table, minimal_image, percentile, print_json, quiet
from fleet.core.smolfile import parse_smolfile
from fleet.runtime.base import MachineSpec
from fleet.runtime.namespace import NamespaceRuntime
from fleet.runtime.warm import NamespaceParent
from fleet.runtime.warm_child import WarmChild

GIB = 1 << 30
PAGE = 4096
WARMUP = f"""
import mmap, time
STATE = mmap.mmap(-1, {GIB}, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
if hasattr(mmap, "MADV_HUGEPAGE"):
    STATE.madvise(mmap.MADV_HUGEPAGE)
for offset in range(0, {GIB}, {PAGE}):
    STATE[offset] = 1
"""
STAMP = "import time; print(repr(time.time()), flush=True)"
DIRTY = (
    STAMP
    + f"""
for offset in range(0, {GIB} // 100, {PAGE}):
    STATE[offset] = 2
print("dirty", flush=True)
time.sleep(600)
"""
)
IDLE = STAMP + "\ntime.sleep(600)\n"


def smaps(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0]) * 1024
    return out


def mem_used_fraction() -> float:
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        info[key] = int(value.split()[0])
    return 1 - info["MemAvailable"] / info["MemTotal"]


async def started_at(child: WarmChild, timeout_s: float = 60) -> float:
    """When the child's step began: the timestamp it printed first."""
    path = child.layer / "stdout"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            first = path.read_text().split("\n", 1)[0]
            if first:
                return float(first)
        await asyncio.sleep(0.0002)
    raise TimeoutError(f"{child.name} did not start")


async def spawn(parent: NamespaceParent, code: str) -> tuple[WarmChild, float, int]:
    child = await parent.branch(f"c-{uuid.uuid4().hex[:6]}")
    asked = time.time()
    pid = await child.start(["python3", "-c", code])
    return child, (await started_at(child)) - asked, pid


async def run(args: argparse.Namespace) -> dict[str, float]:
    images, record = minimal_image()
    rootfs = images.rootfs(record.digest)
    runtime = NamespaceRuntime(Path(args.dir) / "machines")

    def spec(name: str) -> MachineSpec:
        return MachineSpec(
            name=name, smolfile=parse_smolfile('image = "minimal"\nmemory = 65536\n').spec,
            image_digest=record.digest, rootfs=rootfs, labels={"host": "bench-spawn"},
        )  # fmt: skip

    cold: list[float] = []
    for i in range(args.cold):
        asked = time.time()
        machine = await runtime.create(spec(f"cold-{i}"))
        result = await machine.exec(["python3", "-c", STAMP], timeout_s=60)
        cold.append(float(result.stdout.split(b"\n", 1)[0]) - asked)
        await machine.delete()

    parent = await NamespaceParent.create(
        runtime, await runtime.create(spec("warm")), WARMUP, pool_size=args.pool
    )
    try:
        zygote_pids = await asyncio.to_thread(parent.machine.cgroup.pids)
        parent_rss = max(smaps(p).get("Rss", 0) for p in zygote_pids)
        forks: list[float] = []
        for _ in range(args.forks):
            child, latency, _pid = await spawn(parent, STAMP)
            forks.append(latency)
            await child.wait()
            await child.delete()
        # 100 live children, each writing 1% of the parent's memory.
        live: list[tuple[WarmChild, int]] = []
        for _ in range(args.live):
            child, _, pid = await spawn(parent, DIRTY)
            live.append((child, pid))
        for child, _ in live:
            # (a file another process writes: nothing to wait on but the file)
            while "dirty" not in (child.layer / "stdout").read_text():  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        # A child is every process in its cgroup: the step, and the one that waits for it
        # outside the step's PID namespace.
        rollups = []
        for child, _ in live:
            procs = [smaps(pid) for pid in await asyncio.to_thread(child.cgroup.pids)]
            rollups.append({key: sum(r.get(key, 0) for r in procs) for key in procs[0]})
        pss = statistics.fmean(r["Pss"] for r in rollups)
        private = statistics.fmean(r["Private_Dirty"] + r["Private_Clean"] for r in rollups)
        for child, _ in live:
            await child.delete()
        # Density: idle children until spawns slow down or memory runs short.
        density, recent = 0, list[float]()
        idle: list[WarmChild] = []
        while density < args.density_cap:
            child, latency, _ = await spawn(parent, IDLE)
            idle.append(child)
            recent = [*recent[-49:], latency]
            density += 1
            if len(recent) >= 20 and percentile(recent, 0.99) > 0.1:
                break
            if mem_used_fraction() > 0.8:
                break
        for child in idle:
            await child.delete()
    finally:
        await parent.delete()
    return {
        "cold_p50_ms": percentile(cold, 0.5) * 1000,
        "cold_p99_ms": percentile(cold, 0.99) * 1000,
        "fork_p50_ms": percentile(forks, 0.5) * 1000,
        "fork_p99_ms": percentile(forks, 0.99) * 1000,
        "child_pss_mib": pss / 2**20,
        "child_private_mib": private / 2**20,
        "dirtied_mib": GIB / 100 / 2**20,
        "naive_child_mib": parent_rss / 2**20,
        "density": float(density),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small counts: under 60 s")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    parser.add_argument("--dir", default="/tmp/fleet-bench-spawn")
    parser.add_argument(
        "--pool", type=int, default=8,
        help="children forked ahead of need ([branch] pool_size; 0: fork on request)",
    )  # fmt: skip
    args = parser.parse_args()
    args.cold, args.forks, args.live, args.density_cap = (
        (10, 30, 100, 150) if args.quick else (30, 200, 100, 600)
    )
    quiet()
    r = asyncio.run(run(args))
    table = Table(52, (("CoW child", 12), ("cold start", 12), ("ratio", 9)))
    table.print_header()
    table.print_row("spawn latency p50 (ms)", f"{r['fork_p50_ms']:.2f}", f"{r['cold_p50_ms']:.2f}",
                    f"{r['cold_p50_ms'] / r['fork_p50_ms']:.1f}x")  # fmt: skip
    table.print_row("spawn latency p99 (ms)", f"{r['fork_p99_ms']:.2f}", f"{r['cold_p99_ms']:.2f}",
                    f"{r['cold_p99_ms'] / r['fork_p99_ms']:.1f}x")  # fmt: skip
    table.print_row("memory per child, 100 live, 1% dirtied: PSS (MiB)",
                    f"{r['child_pss_mib']:.1f}", f"{r['naive_child_mib']:.1f}",
                    f"{r['naive_child_mib'] / r['child_pss_mib']:.1f}x")  # fmt: skip
    table.print_row("   private bytes each adds (MiB); it dirtied", f"{r['child_private_mib']:.1f}",
                    f"{r['dirtied_mib']:.1f}",
                    f"{r['child_private_mib'] / r['dirtied_mib']:.2f}x")  # fmt: skip
    table.print_row("density: live children before p99 > 100 ms or 80% memory",
                    f"{r['density']:.0f}")  # fmt: skip
    print(
        f"(parent: 1 GiB written by its warm-up; pool of {args.pool} children forked ahead; "
        f"naive = a full copy of the parent per child; the cap on density was {args.density_cap})"
    )
    if args.json:
        keys = ("cold_p50_ms", "fork_p50_ms", "fork_p99_ms", "child_pss_mib",
                "naive_child_mib", "density")  # fmt: skip
        print_json({k: r[k] for k in keys}, 3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
