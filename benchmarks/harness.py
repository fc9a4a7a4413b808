"""What the benchmarks share: one percentile definition, the side-by-side table, the closing
JSON line, CPU readings from /proc, and the set-ups several of them repeat (a gateway in a
process of its own, the embedded fleet with one CPU agent, the minimal image).

Every figure a benchmark reports goes through these, so that two benchmarks' p99s, or one
benchmark's p50 from one run to the next, mean the same thing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypeVar

import structlog

from fleet.config import Paths
from fleet.core.lifecycle import FINAL_STATES
from fleet.image.store import ImageRecord, ImageStore

if TYPE_CHECKING:  # (imported where used: a gateway's process imports this module too)
    from fleet.embedded import Fleet
    from fleet.server.core import Core
    from fleet.server.settings import ServerConfig

REPO = Path(__file__).resolve().parent.parent
SECRET = b"bench-secret-0123456789"
"""The inference token secret the benchmarks' gateways and the fleets that call them share."""


def quiet() -> None:
    """Only errors from fleet's logs: a benchmark's output is its table."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))


def percentile(values: Sequence[float], q: float) -> float:
    """The `q` quantile (0 <= q <= 1) of `values`, interpolated linearly between the two closest
    ranks: Hyndman and Fan's type 7, numpy's default and `statistics.quantiles(...,
    method="inclusive")`. At q = 0.5 it is `statistics.median`, bit for bit, which the gateway,
    spawn and image benchmarks always reported as their p50; a p99 of few samples lies between
    the two largest instead of being the largest."""
    if not values:
        raise ValueError("percentile of no values: the run produced no samples")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"percentile: q must be within [0, 1], got {q!r}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    frac = rank - low
    if frac == 0.0:
        return float(ordered[low])
    # (as a weighted sum: at frac 0.5 this rounds exactly as (a + b) / 2 does)
    return ordered[low] * (1.0 - frac) + ordered[high] * frac


@dataclasses.dataclass(frozen=True)
class Table:
    """A side-by-side table: a label column `label_width` wide, then figure columns, each right
    aligned to its width (a cell wider than its column is printed whole). Cells are strings,
    formatted by the caller; `tail`, after the last cell, is printed as it is."""

    label_width: int
    columns: tuple[tuple[str, int], ...]
    """(header, width) of each figure column."""
    sep: str = ""

    def header(self) -> str:
        return self.line("", *(name for name, _ in self.columns))

    def line(self, label: str, *cells: str, tail: str = "") -> str:
        if len(cells) > len(self.columns):
            raise ValueError(f"table row {label!r}: {len(cells)} cells for "
                             f"{len(self.columns)} columns")  # fmt: skip
        parts = [label.ljust(self.label_width)]
        parts += [cell.rjust(width) for cell, (_, width) in zip(cells, self.columns, strict=False)]
        return self.sep.join(parts) + tail

    def print_header(self) -> None:
        print(self.header())  # noqa: T201 (a benchmark's output is its table)

    def print_row(self, label: str, *cells: str, tail: str = "") -> None:
        print(self.line(label, *cells, tail=tail))  # noqa: T201


def json_line(results: Mapping[str, Any], digits: int | None = None) -> str:
    """The closing JSON object of a benchmark's `--json` run, its floats rounded to `digits`
    (those at the top level; None: as they are)."""
    if digits is None:
        return json.dumps(dict(results))
    return json.dumps(
        {k: round(v, digits) if isinstance(v, float) else v for k, v in results.items()}
    )


def print_json(results: Mapping[str, Any], digits: int | None = None) -> None:
    """Prints `json_line(results, digits)`: the last line of a `--json` run."""
    print(json_line(results, digits))  # noqa: T201


def stat_cpu_s(stat: Path) -> float:
    """CPU seconds (user + system) in a /proc `stat` file: a process's (every thread's) or, under
    /proc/PID/task, one thread's."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) a process has used so far."""
    return stat_cpu_s(Path(f"/proc/{pid}/stat"))


def busy_cpu_s() -> float:
    """CPU seconds this whole machine has spent busy (every core, not idle nor iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


_P = TypeVar("_P", bound="ServerProcess")


class ServerProcess:
    """A server in a spawned process of its own (a gateway: torch and its model load there, and
    its CPU is read apart from the load generator's). `target(*args, port, http_port)` sets
    `port` once it listens, and `http_port` once its HTTP endpoint does, if it serves one."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.port = ctx.Value("i", 0)
        self.http_port = ctx.Value("i", 0)
        self.proc = ctx.Process(target=target, args=(*args, self.port, self.http_port), daemon=True)

    def __enter__(self) -> Self:
        self.proc.start()
        self.ready()
        return self

    def ready(self) -> None:
        deadline = time.monotonic() + 120
        while self.port.value == 0:
            if time.monotonic() > deadline or not self.proc.is_alive():
                raise RuntimeError("benchmark gateway did not start")
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        if self.proc.pid is None:  # never started (another server of `together` failed first)
            return
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port.value}"

    @property
    def http_address(self) -> str:
        """Its HTTP endpoint's (only a server that set `http_port` has one)."""
        assert self.http_port.value, "this gateway serves no HTTP endpoint"
        return f"127.0.0.1:{self.http_port.value}"

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None, "the gateway process was not started"
        return self.proc.pid

    @staticmethod
    @contextlib.contextmanager
    def together(*procs: _P) -> Iterator[tuple[_P, ...]]:
        """Servers started at once (a gateway takes seconds to load torch and its model, much
        of it waiting on its engine), and all ended at the end."""
        try:
            for proc in procs:
                proc.proc.start()
            for proc in procs:
                proc.ready()
            yield procs
        finally:
            for proc in procs:
                proc.__exit__()


def minimal_image() -> tuple[ImageStore, ImageRecord]:
    """This host's image store and its `minimal` image, which every sandboxed benchmark runs."""
    paths = Paths.from_env()
    images = ImageStore(paths.images, paths.recipes)
    record = images.record("minimal")
    if record is None:
        raise SystemExit("the minimal image is not built: run scripts/setup")
    return images, record


def minimal_smolfile(pool_size: int | None = None) -> str:
    """The shipped `smolfiles/minimal.smolfile`; with `pool_size`, as a warm parent whose pool
    keeps that many children forked ahead (`[branch]`)."""
    smolfile = (REPO / "smolfiles" / "minimal.smolfile").read_text()
    if pool_size is not None:
        smolfile += f"\n[branch]\nenabled = true\npool_size = {pool_size}\n"
    return smolfile


@contextlib.asynccontextmanager
async def cpu_fleet(
    prefix: str, slots: int, config: ServerConfig | None = None,
    gateway: tuple[str, int] | None = None,
) -> AsyncIterator[Fleet]:  # fmt: skip
    """The embedded fleet the benchmarks run rollouts on: its server and one CPU agent with
    `slots` machines in this process, a SQLite ledger in a temporary directory named after
    `prefix`, the namespace runtime, TLS and keys; `gateway`: where its machines reach one."""
    from fleet.embedded import embedded_fleet

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        async with embedded_fleet(
            Paths.from_env(), Path(tmp) / "ledger.sqlite3", gpu_agents=0, cpu_agents=1,
            runtime="namespace", slots=slots, config=config, gateway=gateway,
        ) as fleet:  # fmt: skip
            yield fleet


async def until_final(
    core: Core, n: int, poll_s: float, timeout_s: float = 600.0
) -> dict[str, int]:
    """Until `n` rollouts of `core`'s ledger (it holds only the benchmark's) are final: their
    counts by final state. Read from the ledger's figures, a cheap query; polling over the API
    would count as the fleet's own work."""
    deadline = time.monotonic() + timeout_s
    while True:
        figures = await core.read(core.ledger.figures, time.time())
        counts = {s.value: int(figures.get(f"state_{s.value}", 0)) for s in FINAL_STATES}
        if sum(counts.values()) >= n:
            return counts
        if time.monotonic() > deadline:
            raise RuntimeError(f"rollouts did not finish in {timeout_s:.0f} s")
        await asyncio.sleep(poll_s)
