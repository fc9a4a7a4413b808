"""The gateway benchmark's gateways and load: its gateways in processes of their own, the
model they serve, the callers that load them (on streams, as unary calls, over HTTP; in this
process or shared out among several) and the readings taken meanwhile. `benchmarks.gateway`
runs them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import multiprocessing as mp
import os
import statistics
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

import gateway  # noqa: F401  (its __init__ quiets torch's numpy warning in every process)
from benchmarks.harness import SECRET, ServerProcess, percentile, process_cpu_s, quiet
from fleet.api.pb import inference_pb2, inference_pb2_grpc
from fleet.core.tokens import issue
from fleet.envs.gridworld import GridWorld

BENCH_MODEL = "bench-mlp"
CLIENTS = 64


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


def _gateway_main(settings: dict[str, Any], fault: Any, port: Any, http_port: Any) -> None:
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
            tokens_without_server=True,  # (no fleet server polls a benchmark's gateway)
        )  # fmt: skip
        gw = Gateway.build(config, fault_primary=hook)
        servers: list[Any] = []  # held: a gRPC server that nothing references stops
        grpc_server, bound = await serve(gw, "127.0.0.1:0")
        servers.append(grpc_server)
        if settings.get("http"):  # where sandboxed machines reach it: this host, any address
            from gateway.http import serve_http

            http_server, bound_http = await serve_http(gw, "0.0.0.0", 0)
            servers.append(http_server)
            http_port.value = bound_http
        port.value = bound
        await asyncio.Event().wait()

    asyncio.run(main())


class GatewayProc(ServerProcess):
    """A gateway serving `settings` in a process of its own; setting `fault` makes its primary
    device fail every batch from then on."""

    def __init__(self, **settings: Any) -> None:
        self.fault = mp.get_context("spawn").Value("b", False)
        super().__init__(_gateway_main, settings, self.fault)


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


@functools.lru_cache(maxsize=4096)
def _token(rollout: str) -> str:
    return issue(SECRET, rollout, time.time() + 3600)


def infer_request(model: str, rollout: str, key: str, sample: list[float]) -> Any:
    """An InferRequest for `sample`, with a token for `rollout` (made once per rollout)."""
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
    make = _http_request if transport == "http" else infer_request
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
        "p50_ms": percentile(latencies, 0.5) * 1000 if latencies else float("nan"),
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
                await stubs[side].Infer(infer_request(BENCH_MODEL, f"alt{side}", f"k{i}", sample))
                times[side].append(time.perf_counter() - started)
    return tuple(  # type: ignore[return-value]
        {"p50_ms": percentile(t, 0.5) * 1000} for t in times
    )


async def status(address: str) -> Any:
    async with grpc.aio.insecure_channel(address) as channel:
        return await inference_pb2_grpc.InferenceServiceStub(channel).Status(
            inference_pb2.GatewayStatusRequest()
        )
