"""The gateway benchmark behind scripts/bench-gateway. Prints one table, side by side.

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

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import grpc  # noqa: E402
import structlog  # noqa: E402

import gateway  # noqa: E402,F401  (its __init__ quiets torch's numpy warning in every process)
from fleet._proto.fleet.v1 import inference_pb2, inference_pb2_grpc  # noqa: E402
from fleet.connect import list_all  # noqa: E402
from fleet.core.tokens import issue  # noqa: E402
from fleet.envs.gridworld import GridWorld, argmax  # noqa: E402

SECRET = b"bench-secret-0123456789"
BENCH_MODEL = "bench-mlp"
CLIENTS = 64


def quiet() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))


def make_bench_model(directory: Path) -> Path:
    import torch

    from gateway.model import ModelSpec, build_network

    torch.manual_seed(0)
    spec = ModelSpec(
        name=BENCH_MODEL, revision="bench", file="bench-mlp.pt", sha256="", input_dim=147,
        hidden=(4096, 4096), output_dim=4,
    )  # fmt: skip
    buffer = io.BytesIO()
    torch.save(build_network(spec).state_dict(), buffer)
    (directory / spec.file).write_bytes(buffer.getvalue())
    digest = hashlib.sha256(buffer.getvalue()).hexdigest()
    manifest = directory / "models.toml"
    manifest.write_text(
        f'[model.{BENCH_MODEL}]\nrevision = "bench"\nfile = "{spec.file}"\nsha256 = "{digest}"\n'
        "input_dim = 147\nhidden = [4096, 4096]\noutput_dim = 4\n"
    )
    return manifest


def _gateway_main(settings: dict[str, Any], port: Any, fault: Any) -> None:
    quiet()
    import torch

    torch.set_num_threads(int(settings.get("threads", 1)))
    from gateway.batcher import BatchConfig
    from gateway.model import DeviceFault
    from gateway.service import Gateway, GatewayConfig, serve

    def hook() -> None:
        if fault.value:
            raise DeviceFault("device_error", "injected device error")

    async def main() -> None:
        config = GatewayConfig(
            secret=SECRET, model=settings["model"], models_toml=Path(settings["manifest"]),
            device=settings.get("device", "cpu"), capacity_mib=settings.get("capacity_mib", 0.0),
            fallback_capacity_mib=512.0, batch=BatchConfig(**settings["batch"]),
            breaker_failures=2, breaker_open_s=60.0, dtype=settings.get("dtype", ""),
            engine=settings.get("engine", "process"), engine_threads=settings.get("threads", 1),
            pack_weights=settings.get("pack_weights", True), log_level="error",
            reserve_device_memory=settings.get("reserve", True),
        )  # fmt: skip
        gw = Gateway.build(config, fault_primary=hook)
        servers: list[Any] = []  # held: a gRPC server that nothing references stops
        grpc_server, bound = await serve(gw, "127.0.0.1:0")
        servers.append(grpc_server)
        if settings.get("http"):  # where sandboxed machines reach it: this host, any address
            from gateway.http import serve_http

            http_server, http_port = await serve_http(gw, "0.0.0.0", 0)
            servers.append(http_server)
            settings["http_port"].value = http_port
        port.value = bound
        await asyncio.Event().wait()

    asyncio.run(main())


class GatewayProc:
    def __init__(self, **settings: Any) -> None:
        ctx = mp.get_context("spawn")
        self.port = ctx.Value("i", 0)
        self.fault = ctx.Value("b", False)
        self.http_port = ctx.Value("i", 0)
        settings = {**settings, "http_port": self.http_port}
        self.proc = ctx.Process(
            target=_gateway_main, args=(settings, self.port, self.fault), daemon=True
        )

    def __enter__(self) -> GatewayProc:
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
        if self.proc.pid is None:  # never started (another gateway of `together` failed first)
            return
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port.value}"

    @property
    def http_address(self) -> str:
        """Its HTTP endpoint's (only a gateway started with `http=True` has one)."""
        assert self.http_port.value, "this gateway serves no HTTP endpoint"
        return f"127.0.0.1:{self.http_port.value}"

    @staticmethod
    @contextlib.contextmanager
    def together(*procs: GatewayProc) -> Iterator[tuple[GatewayProc, ...]]:
        """Gateways started at once (each takes seconds to load torch and its model, much of
        it waiting on its engine), and all ended at the end."""
        try:
            for proc in procs:
                proc.proc.start()
            for proc in procs:
                proc.ready()
            yield procs
        finally:
            for proc in procs:
                proc.__exit__()

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None, "the gateway process was not started"
        return self.proc.pid


def _ballast_main(device: str, leave_mib: float, left: Any, release: Any) -> None:
    """Takes the CUDA device's free memory, all but about `leave_mib`, in plain allocations
    (1 GiB, then halves, down to 2 MiB), sets `left` to what the driver then reports free, and
    holds it until `release` is set."""
    import torch

    dev = torch.device(device)
    held = []
    chunk = 1 << 30
    while chunk >= 2 << 20:
        free, _total = torch.cuda.mem_get_info(dev)
        if free - chunk < leave_mib * 2**20:
            chunk //= 2
            continue
        try:
            held.append(torch.empty(chunk, dtype=torch.uint8, device=dev))
        except torch.cuda.OutOfMemoryError:
            chunk //= 2
    left.value = torch.cuda.mem_get_info(dev)[0] / 2**20
    release.wait()


@contextlib.contextmanager
def ballast(device: str, leave_mib: float) -> Iterator[float]:
    """Another process holding all of the device's free memory but about `leave_mib` while the
    block runs (what machines and models sharing the GPU do); yields the MiB left free."""
    ctx = mp.get_context("spawn")
    left, release = ctx.Value("d", -1.0), ctx.Event()
    proc = ctx.Process(target=_ballast_main, args=(device, leave_mib, left, release), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 120
        while left.value < 0:
            if time.monotonic() > deadline or not proc.is_alive():
                raise RuntimeError("the process taking the GPU's memory did not get it")
            time.sleep(0.05)
        yield float(left.value)
    finally:
        release.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def real_memory(
    common: dict[str, Any], batch: dict[str, Any], per_client: int, device: str
) -> list[dict[str, Any]]:
    """(2) again on a CUDA primary, against the device's own memory: with two gateways loaded
    (one reserving at load the memory its batches need, the default, and one not), another
    process takes the memory the GPU has free, all but 32 MiB and then all it can; at each level
    both gateways get (2)'s loads, resumable refusals retried. Answers from the GPU, from the CPU
    replica, requests lost, and out-of-memory batch failures, per gateway and level."""
    rows = []
    with GatewayProc.together(
        GatewayProc(**common, batch={**batch, "max_batch": 256}),
        GatewayProc(**common, batch={**batch, "max_batch": 256}, reserve=False),
    ) as (reserved, unreserved):  # fmt: skip
        for leave in (32.0, 0.0):
            with ballast(device, leave) as left:
                for name, gw in (("reserved", reserved), ("unreserved", unreserved)):
                    before = asyncio.run(status(gw.address))
                    runs = [
                        asyncio.run(hammer(gw.address, BENCH_MODEL, int(64 * factor), per_client,
                                           f"g{leave:g}{name}{factor}", True))
                        for factor in (0.5, 1.0, 2.0, 3.0)
                    ]  # fmt: skip
                    after = asyncio.run(status(gw.address))
                    cpu = sum(len(r["degraded_at"]) for r in runs)
                    rows.append({
                        "gateway": name, "left_mib": left,
                        "gpu": sum(r["answered"] for r in runs) - cpu, "cpu": cpu,
                        "lost": sum(r["lost"] for r in runs),
                        "oom": after.oom_faults - before.oom_faults,
                        "failovers": after.failovers - before.failovers,
                    })  # fmt: skip
    return rows


@contextlib.contextmanager
def gauge_readings(url: str, name: str, every_s: float = 0.25) -> Iterator[list[float]]:
    """Reads gauge `name` from the Prometheus text at `url` every `every_s` while the block runs,
    into the list it yields (a reading the page lacks is skipped)."""
    readings: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(every_s):
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as page:
                for line in page.read().decode().splitlines():
                    if line.startswith(name + " "):
                        readings.append(float(line.split()[1]))

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield readings
    finally:
        stop.set()
        thread.join(5)


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gateway_cpu_s(pid: int) -> float:
    """CPU seconds of a gateway process and its children (its model engine)."""
    total = process_cpu_s(pid)
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                total += process_cpu_s(int(child))
            except OSError:  # ended since it was listed
                continue
    return total


def busy_cpu_s() -> float:
    """CPU seconds this whole machine has spent busy (every core, not idle nor iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


@functools.lru_cache(maxsize=4096)
def _token(rollout: str) -> str:
    return issue(SECRET, rollout, time.time() + 3600)


def _request(model: str, rollout: str, key: str, sample: list[float]) -> Any:
    return inference_pb2.InferRequest(
        token=_token(rollout), rollout_id=rollout, request_id=key,
        idempotency_key=key, model=model,
        input=inference_pb2.Tensor(shape=[len(sample)], values=sample),
    )  # fmt: skip


def _http_request(model: str, rollout: str, key: str, sample: list[float]) -> bytes:
    """The same request for the gateway's HTTP endpoint, as a machine's step sends it."""
    body = json.dumps(
        {
            "token": _token(rollout),
            "rollout_id": rollout,
            "idempotency_key": key,
            "model": model,
            "input": sample,
        }
    ).encode()
    head = "POST /v1/infer HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
    return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


@dataclasses.dataclass
class _HttpReply:
    batch_size: int
    degraded: bool


async def _http_infer(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> tuple[_HttpReply | None, str]:
    """One request on a kept-alive connection: (the answer, "") or (None, the error's code)."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status, length = int(head.split(None, 2)[1]), 0
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-length":
            length = int(value)
    answer = json.loads(await reader.readexactly(length))
    if status != 200:
        return None, str(answer.get("code", status))
    return _HttpReply(answer["batch_size"], answer["degraded"]), ""


TRANSPORTS = ("unary", "stream", "http")


async def hammer(
    address: str, model: str, clients: int, per_client: int, tag: str,
    retry_resumable: bool = False, transport: str = "unary", seconds: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    """`clients` concurrent callers, `per_client` sequential requests each: unary Infer calls;
    with transport "stream", each caller's requests one after another on an InferStream of its
    own; with "http", on a kept-alive connection of its own to the HTTP endpoint at `address`
    (how machines call). With `seconds`, a caller sends no new request once that long has
    passed since the start (those it is waiting for are still answered and counted), so a
    fast side and a slow one are measured over the same time, not the same count."""
    assert transport in TRANSPORTS, transport
    samples = [GridWorld(seed).observation() for seed in range(16)]
    # Built before the clock starts, and their CPU left out of the load generator's: it shares
    # this machine's cores with the gateway, so it does as little per request as it can.
    building = time.process_time()
    make = _http_request if transport == "http" else _request
    requests = [
        [make(model, f"{tag}-r{c}", f"{tag}-{c}-{i}", samples[i % 16]) for i in range(per_client)]
        for c in range(clients)
    ]
    build_cpu_s = time.process_time() - building
    latencies: list[float] = []
    batch_sizes: list[int] = []
    codes: dict[str, int] = {}
    degraded_at: list[float] = []
    lost = 0
    resumable = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")
    async with contextlib.AsyncExitStack() as stack:
        if transport != "http":
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(address))
            stub = inference_pb2_grpc.InferenceServiceStub(channel)

        async def client(c: int) -> None:
            nonlocal lost
            call = stub.InferStream() if transport == "stream" else None
            conn = None
            if transport == "http":
                host, _, port = address.rpartition(":")
                conn = await asyncio.open_connection(host, int(port))
            for request in requests[c]:
                if seconds and time.perf_counter() >= until:
                    break
                for _attempt in range(20 if retry_resumable else 1):
                    started = time.perf_counter()
                    reply: Any = None
                    if conn is not None:
                        reply, code = await _http_infer(*conn, request)
                    elif call is not None:
                        await call.write(request)
                        response = await call.read()
                        if response == grpc.aio.EOF:
                            raise RuntimeError(f"the gateway ended stream {c}")
                        reply = response.answer
                        code = response.error.code if response.HasField("error") else ""
                    else:
                        try:
                            reply, code = await stub.Infer(request), ""
                        except grpc.aio.AioRpcError as exc:
                            code = exc.code().name
                    if code:
                        codes[code] = codes.get(code, 0) + 1
                        if retry_resumable and code in resumable:
                            await asyncio.sleep(0.01)
                            continue
                        if retry_resumable:
                            lost += 1
                        break
                    latencies.append(time.perf_counter() - started)
                    batch_sizes.append(reply.batch_size)
                    if reply.degraded:
                        degraded_at.append(time.monotonic())
                    break
                else:
                    lost += 1
            if conn is not None:
                conn[1].close()
                await conn[1].wait_closed()
            if call is not None:
                await call.done_writing()
                if await call.code() != grpc.StatusCode.OK:
                    raise RuntimeError(f"stream {c} ended with {await call.code()}")

        started = time.perf_counter()
        until = started + seconds
        await asyncio.gather(*(client(c) for c in range(clients)))
        elapsed = time.perf_counter() - started
    return _summary(latencies, batch_sizes, elapsed, codes=codes, lost=lost,
                    degraded_at=degraded_at, build_cpu_s=build_cpu_s)  # fmt: skip


def _summary(
    latencies: list[float], sizes: list[int], elapsed: float, **rest: Any
) -> dict[str, Any]:
    """A load's result: its answers' latencies and batch sizes over `elapsed` seconds."""
    return {
        "answered": len(latencies), "elapsed": elapsed, "rate": len(latencies) / elapsed,
        "batch_mean": statistics.fmean(sizes) if sizes else 0.0,
        "p50_ms": statistics.median(latencies) * 1000 if latencies else float("nan"),
        "latencies": latencies, "batch_sizes": sizes, **rest,
    }  # fmt: skip


def merged_runs(runs: list[dict[str, Any]], elapsed: float) -> dict[str, Any]:
    """`hammer` results as one, over `elapsed` seconds (the runs' sum when they came one after
    another, the slowest's when they ran at once)."""
    codes: dict[str, int] = {}
    for run in runs:
        for code, n in run["codes"].items():
            codes[code] = codes.get(code, 0) + n
    return _summary(
        [x for run in runs for x in run["latencies"]],
        [x for run in runs for x in run["batch_sizes"]], elapsed, codes=codes,
        lost=sum(run["lost"] for run in runs),
        degraded_at=[x for run in runs for x in run["degraded_at"]],
    )  # fmt: skip


def _hammer_in_worker(args: tuple[Any, ...]) -> tuple[dict[str, Any], float]:
    """`hammer(*args)` in a load-generating process of a `ClientPool`: its result, and the CPU
    seconds this process spent calling (building the requests left out)."""
    started = time.process_time()
    result = asyncio.run(hammer(*args))
    return result, time.process_time() - started - result["build_cpu_s"]


class ClientPool:
    """The load generator's processes: with `procs` > 1, a round's callers are shared out among
    that many processes (on a host with cores to spare, one asyncio process making all the
    calls bounds the rate it can measure: on the GPU host it spent as much CPU per sample as the
    gateway); with 1, they run in this one."""

    def __init__(self, procs: int) -> None:
        self.procs = procs
        self.pool = (
            concurrent.futures.ProcessPoolExecutor(procs, mp_context=mp.get_context("spawn"))
            if procs > 1 else None
        )  # fmt: skip
        if self.pool is not None:  # started now, not inside the first timed round
            list(self.pool.map(time.sleep, [0.2] * procs))

    def __enter__(self) -> ClientPool:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown()

    def hammer(
        self, address: str, model: str, clients: int, per_client: int, tag: str, transport: str,
        seconds: float = 0.0,
    ) -> tuple[dict[str, Any], float]:  # fmt: skip
        """One round: `hammer`'s result over all the callers (elapsed: the slowest process's),
        and the CPU seconds the load generator's processes spent on it."""
        if self.pool is None:
            started = process_cpu_s(os.getpid())
            result = asyncio.run(hammer(address, model, clients, per_client, tag,
                                        transport=transport, seconds=seconds))  # fmt: skip
            return result, process_cpu_s(os.getpid()) - started - result["build_cpu_s"]
        shares = [clients // self.procs + (k < clients % self.procs) for k in range(self.procs)]
        jobs = [(address, model, n, per_client, f"{tag}w{k}", False, transport, seconds)
                for k, n in enumerate(shares) if n]  # fmt: skip
        parts = list(self.pool.map(_hammer_in_worker, jobs))
        results = [result for result, _cpu in parts]
        merged = merged_runs(results, max(r["elapsed"] for r in results))
        return merged, sum(cpu for _result, cpu in parts)


def interleaved(
    sides: dict[str, tuple[GatewayProc, str]], model: str, round_s: float, most: int,
    tag: str, rounds: int, load: ClientPool,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Part (1)'s runs in turns: `rounds` rounds of 64 clients against each side (a gateway,
    and how its clients call: one of `TRANSPORTS`), in the order of `sides` and then reversed,
    and so on, so that a drift of this machine's speed (seen here: 30% within a few minutes)
    weighs on all alike. A round lasts `round_s` seconds whichever side it is (each caller
    sends at most `most` requests): a round of equal counts is over for the batched side in a
    fraction of the one-per-batch side's time, so opening 64 streams and the first and last
    batches, which batch little, weighed on the batched side alone (rounds of 4 requests per
    caller measured it 15-20% slower than rounds of 30-60). Returns each side's runs merged,
    with the CPU its rounds cost per sample: the load generator's (`load`'s processes), the
    gateway process's (RPC, tokens, batching) and its model engine's."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    spent = {name: [0.0, 0.0, 0.0] for name in sides}
    for i in range(rounds):
        for name in list(sides) if i % 2 == 0 else reversed(sides):
            gw, transport = sides[name]
            address = gw.http_address if transport == "http" else gw.address
            before = (process_cpu_s(gw.pid), gateway_cpu_s(gw.pid))
            result, load_cpu = load.hammer(address, model, CLIENTS, most,
                                           f"{tag}{name}{i}", transport, round_s)  # fmt: skip
            runs[name].append(result)
            after = (process_cpu_s(gw.pid), gateway_cpu_s(gw.pid))
            spent[name] = [spent[name][0] + load_cpu,
                           *(t + b - a for t, a, b in zip(spent[name][1:], before, after,
                                                          strict=True))]  # fmt: skip
    merged = {}
    for name, parts in runs.items():
        elapsed = sum(part["elapsed"] for part in parts)
        merged[name] = merged_runs(parts, elapsed) | {"rates": [part["rate"] for part in parts]}
        clients, process, with_engine = spent[name]
        merged[name]["cpu_us"] = {
            k: v * 1e6 / max(1, merged[name]["answered"])
            for k, v in (("clients", clients), ("gateway", process),
                         ("engine", with_engine - process))
        }  # fmt: skip
        merged[name]["engine_busy"] = (with_engine - process) / elapsed
    return merged


async def alternate(first: str, second: str, n: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """p50 of lone requests, sent in turn to two gateways."""
    sample = GridWorld(0).observation()
    times: tuple[list[float], list[float]] = ([], [])
    async with grpc.aio.insecure_channel(first) as a, grpc.aio.insecure_channel(second) as b:
        stubs = (inference_pb2_grpc.InferenceServiceStub(a),
                 inference_pb2_grpc.InferenceServiceStub(b))  # fmt: skip
        for i in range(n):
            for side in (0, 1):
                started = time.perf_counter()
                await stubs[side].Infer(_request(BENCH_MODEL, f"alt{side}", f"k{i}", sample))
                times[side].append(time.perf_counter() - started)
    return tuple(  # type: ignore[return-value]
        {"p50_ms": statistics.median(t) * 1000} for t in times
    )


async def status(address: str) -> Any:
    async with grpc.aio.insecure_channel(address) as channel:
        return await inference_pb2_grpc.InferenceServiceStub(channel).Status(
            inference_pb2.GatewayStatusRequest()
        )


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
                    reply = await client.infer(_request(model, f"ep{seed}", key, env.observation()))
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
    from fleet._proto.fleet.v1 import fleet_pb2, fleet_pb2_grpc, types_pb2
    from fleet.config import Paths
    from fleet.embedded import embedded_fleet
    from fleet.envs.episode import program, source, warm_step
    from fleet.runtime.cgroups import all_machines_cpu_seconds
    from fleet.server.app import ServerConfig

    paths = Paths.from_env()
    smolfile = (REPO / "smolfiles" / "minimal.smolfile").read_text()
    if warm:
        smolfile += f"\n[branch]\nenabled = true\npool_size = {slots}\n"
    env = {"FLEET_MODEL": model}

    def steps(seed: int) -> list[Any]:
        if not warm:
            return [types_pb2.Step(name="episode", argv=program(seed), env=env, timeout_s=300)]
        episode = ["python3", "-c", NOOP_STEP] if noop else warm_step(seed)
        return [types_pb2.Step(name="warm-up", argv=["python3", "-c", source()], timeout_s=60),
                types_pb2.Step(name="episode", argv=episode, env=env, timeout_s=300)]  # fmt: skip

    final = {types_pb2.ROLLOUT_STATE_SUCCEEDED, types_pb2.ROLLOUT_STATE_FAILED,
             types_pb2.ROLLOUT_STATE_CANCELLED, types_pb2.ROLLOUT_STATE_QUARANTINED}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="fleet-bench-fleet-") as tmp:
        async with (
            embedded_fleet(
                paths, Path(tmp) / "ledger.sqlite3", gpu_agents=0, cpu_agents=1,
                runtime="namespace", slots=slots, config=ServerConfig(token_secret=SECRET),
                gateway=("host", http_port),
            ) as fleet,
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
            deadline = time.monotonic() + 600
            core = fleet.server.core
            names = [f"state_{types_pb2.RolloutState.Name(s).removeprefix('ROLLOUT_STATE_')}"
                     for s in final]  # fmt: skip
            while True:  # counts by state (this ledger holds only these): a cheap query
                figures = await core.read(core.ledger.figures, time.time())
                if sum(figures.get(name, 0.0) for name in names) >= episodes:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("fleet pipeline: episodes did not finish in 600 s")
                await asyncio.sleep(0.1)
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
    return episodes / (time.perf_counter() - started), statistics.median(calls) * 1000, cpu_ms


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
    w = 58
    print(f"{'':<{w}}{'fleet':>12}{'baseline':>12}{'ratio':>9}")
    print(f"{'(1) samples/s, 64 clients on streams: batched vs one':<{w}}"
          f"{batched['rate']:>12.0f}{single['rate']:>12.0f}{out['batching_gain']:>8.1f}x")  # fmt: skip
    print(f"{'    the same, each request a unary call: batched vs one':<{w}}"
          f"{batched_unary['rate']:>12.0f}{single_unary['rate']:>12.0f}"
          f"{out['batching_gain_unary']:>8.1f}x")  # fmt: skip
    if batched_http and single_http:
        print(f"{'    the same over HTTP, as machines call: batched vs one':<{w}}"
              f"{batched_http['rate']:>12.0f}{single_http['rate']:>12.0f}"
              f"{out['batching_gain_http']:>8.1f}x")  # fmt: skip
    print(f"{'    p50 ms of a lone request: batched vs unbatched':<{w}}"
          f"{lone_batched['p50_ms']:>12.2f}{lone_single['p50_ms']:>12.2f}"
          f"{lone_batched['p50_ms'] - lone_single['p50_ms']:>+8.2f}ms")  # fmt: skip
    print(f"{'    the bare model alone: batches of 64 vs of 1 (ceiling)':<{w}}{ceiling:>12.0f}"
          f"{ceiling_one:>12.0f}{ceiling / ceiling_one:>8.1f}x")  # fmt: skip
    print(f"{'    the gateway batched, as a fraction of the bare model':<{w}}"
          f"{batched['rate'] / ceiling:>12.2f}{batched_unary['rate'] / ceiling:>12.2f}"
          "  (streams, unary)")  # fmt: skip
    by_transport = [("streams", batched), ("unary", batched_unary), ("HTTP", batched_http)]
    for label, run in [(label, run) for label, run in by_transport if run]:
        us = run["cpu_us"]
        print(f"    batched, {label}: a sample's batch held {run['batch_mean']:.1f} on average; "
              f"the model engine computed {run['engine_busy']:.0%} of the time; CPU us per "
              f"sample: the 64 clients {us['clients']:.0f}, the gateway {us['gateway']:.0f}, "
              f"its model engine {us['engine']:.0f}")  # fmt: skip
    if half:
        print(f"{'    the same, model served in bfloat16: batched vs one':<{w}}"
              f"{half['batched']['rate']:>12.0f}{half['single']['rate']:>12.0f}"
              f"{out['batching_gain_bfloat16']:>8.1f}x")  # fmt: skip
        print(f"{'    bfloat16, the bare model alone: 64 vs 1 (ceiling)':<{w}}"
              f"{half['ceiling']:>12.0f}{half['ceiling_one']:>12.0f}"
              f"{half['ceiling'] / half['ceiling_one']:>8.1f}x")  # fmt: skip
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
        print(f"{f'(2) load {factor:g}x memory capacity: answered / refused':<{w}}"
              f"{r['answered']:>12}{refused:>12}")  # fmt: skip
    print(f"{'    out-of-memory batch failures (all loads)':<{w}}{out['oom_failures']:>12}")
    print(f"{'    false refusal rate below 0.9x':<{w}}{out['false_refusal_rate']:>12.3f}")
    for row in gpu_rows:
        print(f"    GPU's memory taken by another process, {row['left_mib']:.0f} MiB left, "
              f"{row['gateway']}: answered by the GPU {row['gpu']}, by the CPU replica "
              f"{row['cpu']}; lost {row['lost']}; out-of-memory batch failures {row['oom']}; "
              f"failovers {row['failovers']}")  # fmt: skip
    print(f"{'(3) fault on the primary: s to first CPU-served answer':<{w}}{failover_s:>12.3f}")
    print(f"{'    requests lost / answered under the fault':<{w}}{fail['lost']:>12}"
          f"{fail['answered']:>12}")  # fmt: skip
    if args.skip_fleet:
        print("(4) trajectories/s: the fleet end to end: left out (--skip-fleet)")
    else:
        # First as `fleet demo` runs episodes: each a warm parent's child.
        for title, run in (("(4) trajectories/s, the fleet (warm children) vs sync", warm),
                           ("    the same, each episode a fresh machine of its own", whole)):  # fmt: skip
            base, base_cpu = run["sync_traj_s"], run["sync_cpu_ms"]
            print(f"{title:<{w}}{run['traj_s']:>12.1f}{base:>12.1f}{run['traj_s'] / base:>8.1f}x")
            cpu = run["cpu_ms"]
            print(f"{'      CPU ms per action, this whole machine':<{w}}"
                  f"{cpu['total']:>12.2f}{base_cpu:>12.2f}{cpu['total'] / base_cpu:>8.1f}x")  # fmt: skip
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
    print(f"{'    only the gateway: 64 in-process episode loops, 1 stream':<{w}}"
          f"{traj_s:>12.1f}{syncs[0][0]:>12.1f}{out['gateway_pipeline_gain']:>8.1f}x")  # fmt: skip
    for transport, label in (("http", "ms per action, shipped policy: HTTP (machines) vs bare"),
                             ("stream", "  the same on an InferStream"),
                             ("unary", "  the same as unary Infer calls")):  # fmt: skip
        print(f"{'    ' + label:<{w}}"
              f"{lone_small[transport]['p50_ms']:>12.2f}{model_p50:>12.2f}"
              f"{overhead[transport]:>+8.2f}ms")  # fmt: skip
    print(
        f"(primary {args.device}, torch {args.threads} CPU thread(s) per gateway; "
        f"model {BENCH_MODEL} "
        "147-4096-4096-4; "
        f"{actions} actions in the pipeline run)"
    )
    if args.json:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
