"""The pieces `benchmarks.scale` runs: two `fleet serve` replicas in processes of their own, the
processes of simulated hosts (`benchmarks.scale_hosts`) driven over pipes, the counters the
hosts hand over, and a submitter that moves to the other replica when its own is gone."""

# ruff: noqa: T201 (a benchmark's output is what it prints)

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc

from benchmarks.harness import REPO, process_cpu_s
from benchmarks.scale_hosts import GIVE_UP_S, MOVE_ON, Counters, Plan, worker_main
from fleet.api.pb import fleet_pb2, fleet_pb2_grpc, types_pb2
from fleet.config import Paths
from fleet.image.store import ImageStore
from fleet.server.settings import ServerConfig

STEP = types_pb2.Step(name="step", argv=["true"], timeout_s=60)
"""The rollouts' one step (the simulated hosts report it succeeded without running it)."""
SUBMIT_BATCH = 500
"""Rollouts per SubmitRollouts call when a batch is queued at once."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the replicas ---------------------------------------------------------------------------


@dataclasses.dataclass
class Replica:
    """A `fleet serve` process of its own (ended by its pid)."""

    name: str
    api: str
    host_endpoint: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def cpu_s(self) -> float:
        return process_cpu_s(self.popen.pid) if self.alive else 0.0

    def kill(self) -> None:
        if self.alive:
            os.kill(self.popen.pid, signal.SIGKILL)
        self.popen.wait(30)

    def stop(self) -> None:
        if self.alive:
            os.kill(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def start_replica(name: str, home: Path, db: str, config: ServerConfig) -> Replica:
    api, host_endpoint = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    log = home / f"{name}.log"
    argv = [sys.executable, "-m", "fleet.cli.main", "--log-level", "warning", "serve",
            "--listen", api, "--tls", "--host-listen", host_endpoint, "--db", db,
            "--lease-ttl-s", str(config.lease_ttl_s),
            "--heartbeat-s", str(config.heartbeat_interval_s),
            "--max-heartbeats-per-s", str(config.max_heartbeats_per_s)]  # fmt: skip
    with log.open("wb") as out:  # (the child keeps its own copy of the descriptor)
        popen = subprocess.Popen(
            argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "FLEET_HOME": str(home), "FLEET_SERVER": ""},
        )  # fmt: skip
    replica = Replica(name, api, host_endpoint, popen, log)
    deadline = time.monotonic() + 60
    while "listening on" not in log.read_text(errors="replace"):
        if not replica.alive or time.monotonic() > deadline:
            replica.kill()
            raise RuntimeError(f"replica {name} did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    return replica


def placeholder_image(paths: Paths) -> str:
    """A digest the replicas' image store holds an archive for. The no-op hosts never fetch
    it: a submission only needs the server to hold the image it names."""
    body = b"fleet scale benchmark: a no-op workload runs no image\n"
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    blob = ImageStore(paths.images, paths.recipes).blob_path(digest)
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(body)
    return digest


# -- the simulated hosts' processes -----------------------------------------------------------


class Workers:
    """The processes that run the simulated hosts, asked in turn over their pipes."""

    def __init__(self, plans: list[Plan]) -> None:
        ctx = mp.get_context("spawn")
        self.plans = plans
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for plan in plans:
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(plan, theirs), daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)
        self._lock = asyncio.Lock()

    def _answer(self, conn: Connection, timeout_s: float) -> Any:
        if not conn.poll(timeout_s):
            raise RuntimeError(f"a hosts' process did not answer in {timeout_s:.0f} s")
        name, value = conn.recv()
        if name == "failed":
            raise RuntimeError(f"a hosts' process failed: {value}")
        return value

    def ready(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        return sum(self._answer(c, max(deadline - time.monotonic(), 0.1)) for c in self.conns)

    def _ask(self, commands: list[tuple[Any, ...]], timeout_s: float) -> list[Any]:
        for conn, command in zip(self.conns, commands, strict=True):
            conn.send(command)
        return [self._answer(conn, timeout_s) for conn in self.conns]

    async def ask(self, *command: Any, timeout_s: float = 30.0) -> list[Any]:
        async with self._lock:
            return await asyncio.to_thread(self._ask, [command] * len(self.conns), timeout_s)

    async def claim(self, hosts: int) -> None:
        """The first `hosts` hosts (by number) claim work from now on."""
        commands: list[tuple[Any, ...]] = []
        for plan in self.plans:
            commands.append(("claim", max(0, min(plan.count, hosts - plan.first))))
        async with self._lock:
            await asyncio.to_thread(self._ask, commands, 30.0)

    async def pause(self) -> None:
        await self.ask("pause", timeout_s=self.plans[0].claim_wait_s + 30)

    def stop(self) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            with contextlib.suppress(OSError):
                conn.send(("stop",))
                conn.poll(30)
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(10)


@dataclasses.dataclass
class Tally:
    """The hosts' counters, added up as they are handed over."""

    heartbeats: int = 0
    heartbeat_errors: int = 0
    lost_leases: int = 0
    completed: int = 0
    not_final: int = 0
    refused: int = 0
    last_completed_at: float = 0.0
    claims: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    moves: list[tuple[str, float, float]] = dataclasses.field(default_factory=list)

    async def update(self, workers: Workers) -> Tally:
        answers: list[Counters] = await workers.ask("stats")
        for name in ("heartbeats", "heartbeat_errors", "lost_leases", "completed", "not_final",
                     "refused"):  # fmt: skip
            setattr(self, name, sum(getattr(a, name) for a in answers))
        self.last_completed_at = max(a.last_completed_at for a in answers)
        for answer in answers:
            for rollout_id, at in answer.claims:
                self.claims.setdefault(rollout_id, []).append(at)
            self.moves += answer.moves
        return self


# -- submitting -------------------------------------------------------------------------------


class Submitter:
    """Submits no-op rollouts over TLS with a tenant key, to one replica and, when it is gone,
    the other, resending the same request (its idempotency keys make a resend harmless)."""

    def __init__(self, apis: list[str], ca_pem: bytes, key: str, image: str) -> None:
        credentials = grpc.ssl_channel_credentials(root_certificates=ca_pem)
        self.channels = [grpc.aio.secure_channel(a, credentials) for a in apis]
        self.stubs = [fleet_pb2_grpc.FleetServiceStub(c) for c in self.channels]
        self.metadata = (("authorization", f"Bearer {key}"),)
        self.smolfile = f'image = "{image}"\n'
        self.replica = 0
        self.submitted: dict[str, float] = {}
        """Rollout id -> when its submission was sent."""
        self.failed = 0
        """Rollouts whose submission no replica took within GIVE_UP_S."""

    async def submit(self, n: int, phase: str) -> list[str]:
        batch = uuid.uuid4().hex[:12]
        request = fleet_pb2.SubmitRolloutsRequest(
            request_id=batch,
            rollouts=[
                fleet_pb2.SubmitRolloutRequest(
                    request_id=f"{batch}-{i}", idempotency_key=f"{batch}-{i}",
                    smolfile=self.smolfile, smolfile_name="scale.smolfile", steps=[STEP],
                    labels={"phase": phase},
                )
                for i in range(n)
            ],
        )  # fmt: skip
        sent = time.time()
        give_up = time.monotonic() + GIVE_UP_S
        delay = 0.05
        while True:
            replica = self.replica
            try:
                reply = await self.stubs[replica].SubmitRollouts(
                    request, timeout=30, metadata=self.metadata
                )
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in MOVE_ON or time.monotonic() > give_up:
                    self.failed += n
                    print(f"submission of {n} refused: {exc.code().name} {exc.details()}",
                          file=sys.stderr)  # fmt: skip
                    return []
                if replica == self.replica:
                    self.replica = (replica + 1) % len(self.stubs)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        ids = [r.id for r in reply.rollouts]
        for rollout_id in ids:
            self.submitted.setdefault(rollout_id, sent)
        return ids

    async def queue(self, n: int, phase: str) -> None:
        """`n` rollouts at once, in batches."""
        sizes = [min(SUBMIT_BATCH, n - i) for i in range(0, n, SUBMIT_BATCH)]
        await asyncio.gather(*(self.submit(size, phase) for size in sizes))

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
