"""The session benchmark (`scripts/bench-sessions`).

fleet side: an in-process server (SQLite ledger, loopback, no TLS) and one agent on the
namespace runtime with 64 slots, driven through the typed client over gRPC. Baseline: the
same commands with `bwrap` directly on the host over the same image (a read-only bind of its
root filesystem, fresh namespaces per command), which is what a harness calling a sandbox
tool itself would pay. Measured: (1) open-to-first-exec of a cold session, p50/p99; (2) the
round trip of `true` in an open session, p50/p99, against one bwrap run of `true`; (3) 64
sessions at once running 20 `true` each: wall time and commands per second, against 64
threads running 20 bwrap `true` each; (4) the time to fork an open session. Each for a cold
session (a machine of its own) and a warm one (a warm parent's copy-on-write child).
"""

# ruff: noqa: T201 (a benchmark's output is what it prints)

from __future__ import annotations

import argparse
import asyncio
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.harness import Table, minimal_image, percentile, print_json, quiet
from fleet.agent.agent import Agent
from fleet.agent.capabilities import RuntimeChoice
from fleet.agent.config import AgentConfig
from fleet.client import Fleet
from fleet.core.placement import HostClass, RuntimeKind
from fleet.embedded import until_registered
from fleet.image.store import ImageStore
from fleet.ledger.store import Ledger
from fleet.server.app import FleetServer, ServerConfig

SMOLFILE = 'image = "minimal"\n'
WARM_SMOLFILE = 'image = "minimal"\n\n[branch]\nenabled = true\npool_size = 4\n'


def bwrap_true(rootfs: Path) -> float:
    started = time.perf_counter()
    subprocess.run(
        ["bwrap", "--ro-bind", str(rootfs), "/", "--proc", "/proc", "--dev", "/dev",
         "--tmpfs", "/tmp", "--unshare-all", "--die-with-parent", "--", "true"],
        check=True, capture_output=True,
    )  # fmt: skip
    return (time.perf_counter() - started) * 1000


class Fleetlet:
    """A server and one agent on a thread of their own."""

    def __init__(self, tmp: Path, images: ImageStore, slots: int) -> None:
        self.tmp, self.images, self.slots = tmp, images, slots
        self.ready = threading.Event()
        self.address = ""
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        ledger = Ledger.open(str(self.tmp / "ledger.sqlite3"))
        server = FleetServer(ledger, self.images, "127.0.0.1:0", ServerConfig())
        await server.start()
        agent = Agent(AgentConfig(
            server=server.address, host_id="bench", host_class=HostClass.CPU,
            runtime=RuntimeChoice(RuntimeKind.NAMESPACE, "bench"),
            machines_dir=self.tmp / "machines", images=self.images, slots=self.slots,
            claim_wait_s=1.0,
        ))  # fmt: skip
        task = asyncio.create_task(agent.run(self._stop))
        await until_registered(server, [agent], [task])
        self.address = server.address
        self.ready.set()
        await self._stop.wait()
        await task
        await server.stop()

    def __enter__(self) -> Fleetlet:
        self._thread.start()
        assert self.ready.wait(60)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    quiet()
    images, record = minimal_image()
    rootfs = images.rootfs(record.digest)
    opens, rounds, sessions, per = (10, 100, 16, 10) if args.quick else (30, 300, 64, 20)
    r: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cold_file, warm_file = Path(tmp) / "cold.smolfile", Path(tmp) / "warm.smolfile"
        cold_file.write_text(SMOLFILE)
        warm_file.write_text(WARM_SMOLFILE)
        with (
            Fleetlet(Path(tmp), images, sessions + 2) as fl,
            Fleet(fl.address, plaintext=True) as f,
        ):
            f.session(warm_file).close()  # the warm parent is made once, before the timing
            for kind, smolfile in (("cold", cold_file), ("warm", warm_file)):
                first = []
                for _ in range(opens):
                    started = time.perf_counter()
                    box = f.session(smolfile)
                    box.exec(["true"])
                    first.append((time.perf_counter() - started) * 1000)
                    box.close()
                box = f.session(smolfile)
                box.exec(["true"])  # (first-call costs out of the way)
                trips = []
                for _ in range(rounds):
                    started = time.perf_counter()
                    box.exec(["true"])
                    trips.append((time.perf_counter() - started) * 1000)
                forks = []
                for _ in range(max(3, opens // 3)):
                    started = time.perf_counter()
                    [copy] = box.fork()
                    forks.append((time.perf_counter() - started) * 1000)
                    copy.close()
                box.close()
                r[f"{kind}_open_first_exec_p50_ms"] = percentile(first, 0.5)
                r[f"{kind}_open_first_exec_p99_ms"] = percentile(first, 0.99)
                r[f"{kind}_exec_p50_ms"] = percentile(trips, 0.5)
                r[f"{kind}_exec_p99_ms"] = percentile(trips, 0.99)
                r[f"{kind}_fork_p50_ms"] = percentile(forks, 0.5)
            bw = [bwrap_true(rootfs) for _ in range(rounds)]
            r.update(bwrap_p50_ms=percentile(bw, 0.5), bwrap_p99_ms=percentile(bw, 0.99))
            for kind, smolfile in (("cold", cold_file), ("warm", warm_file)):
                boxes = [f.session(smolfile) for _ in range(sessions)]

                def burst(b: object, kind: str = kind) -> None:
                    for _ in range(per):
                        done = b.exec(["true"])  # type: ignore[attr-defined]
                        assert done.ok, (kind, done)

                started = time.perf_counter()
                with ThreadPoolExecutor(sessions) as pool:
                    list(pool.map(burst, boxes))
                r[f"{kind}_concurrent_s"] = time.perf_counter() - started
                for b in boxes:
                    b.close()
        started = time.perf_counter()
        with ThreadPoolExecutor(sessions) as pool:
            list(pool.map(lambda _: [bwrap_true(rootfs) for _ in range(per)], range(sessions)))
        r["bwrap_concurrent_s"] = time.perf_counter() - started
    n = sessions * per
    for kind in ("cold", "warm", "bwrap"):
        r[f"{kind}_concurrent_per_s"] = n / r[f"{kind}_concurrent_s"]
    for kind in ("cold", "warm"):
        r[f"{kind}_added_p50_ms"] = r[f"{kind}_exec_p50_ms"] - r["bwrap_p50_ms"]
    table = Table(54, (("cold", 9), ("warm", 9), ("bwrap", 9), ("cold/bw", 9), ("warm/bw", 9)))
    table.print_header()
    for q in ("p50", "p99"):
        table.print_row(f"open a session + first exec {q} (ms)",
                        f"{r[f'cold_open_first_exec_{q}_ms']:.1f}",
                        f"{r[f'warm_open_first_exec_{q}_ms']:.1f}")  # fmt: skip
    table.print_row("fork an open session, copy ready (p50, ms)", f"{r['cold_fork_p50_ms']:.1f}",
                    f"{r['warm_fork_p50_ms']:.1f}")  # fmt: skip
    for q in ("p50", "p99"):
        cold, warm, base = r[f"cold_exec_{q}_ms"], r[f"warm_exec_{q}_ms"], r[f"bwrap_{q}_ms"]
        table.print_row(f"exec `true` round trip {q} (ms)", f"{cold:.2f}", f"{warm:.2f}",
                        f"{base:.2f}", f"{cold / base:.2f}", f"{warm / base:.2f}")  # fmt: skip
    cold, warm, base = (r[f"{k}_concurrent_per_s"] for k in ("cold", "warm", "bwrap"))
    table.print_row(f"{sessions} sessions x {per} commands at once (cmd/s)", f"{cold:.1f}",
                    f"{warm:.1f}", f"{base:.1f}", f"{cold / base:.2f}",
                    f"{warm / base:.2f}")  # fmt: skip
    print(f"targets: warm open + first exec p50 {r['warm_open_first_exec_p50_ms']:.1f} ms "
          f"(<= 50); fleet adds {r['cold_added_p50_ms']:.2f} ms (cold) and "
          f"{r['warm_added_p50_ms']:.2f} ms (warm) p50 per exec over bwrap (<= 3)")  # fmt: skip
    if args.json:
        print_json(r, 3)


if __name__ == "__main__":
    main()
