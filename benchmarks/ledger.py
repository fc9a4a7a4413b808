"""The ledger benchmark (`scripts/bench-ledger`, which installs procrastinate first): fleet on
SQLite and PostgreSQL against procrastinate on the same PostgreSQL. Prints one table, side by
side, then where one worker's time goes and what TLS and keys cost through the gRPC API."""

# ruff: noqa: T201 (a benchmark's output is what it prints)

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import fcntl
import json
import multiprocessing as mp
import os
import pstats
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from datetime import UTC, datetime
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Barrier as BarrierType
from pathlib import Path
from typing import Any

import grpc

from benchmarks.harness import REPO, Table, print_json, quiet
from fleet import __version__
from fleet.api import convert
from fleet.api.pb import fleet_pb2, fleet_pb2_grpc, host_pb2, host_pb2_grpc, types_pb2
from fleet.config import Paths
from fleet.connect import ClientAuth
from fleet.core.credentials import Scope, format_api_key
from fleet.core.lifecycle import Outcome
from fleet.core.manifest import (
    Manifest,
    Step,
    SubmitRequest,
    build_manifest,
    validate_request,
)
from fleet.core.placement import HostCapabilities, HostClass, Isolation, RuntimeKind
from fleet.core.rollout import Assignment, Completion, StepResult
from fleet.identity.ca import CertificateAuthority
from fleet.identity.local import local_host_identity
from fleet.image.store import ImageStore
from fleet.ledger import queries as Q
from fleet.ledger.base import new_id
from fleet.ledger.engines import sqlite_connect
from fleet.ledger.leases import Claim
from fleet.ledger.raw import dialect
from fleet.ledger.store import Ledger
from fleet.server.app import FleetServer
from fleet.server.auth import Security
from fleet.server.core import ClaimBatcher, CompletionBatcher, Core, SubmitBatcher
from fleet.server.settings import ServerConfig
from tests.pgserver import create_database, postgres_server

WORKERS = 4
CLAIM_BATCH = 32
CALLERS = 32
"""Submitters each sending one rollout at a time, in the server-shaped enqueue rows."""

BASELINE = r"""
import asyncio, sys, time
import procrastinate
url, n, CALLERS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))

@app.task(name="noop")
def noop() -> None:
    pass

async def main() -> None:
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        t = time.perf_counter()
        for _ in range(n):
            await noop.defer_async()
        one = n / (time.perf_counter() - t)
        gate = asyncio.Semaphore(CALLERS)

        async def defer() -> None:
            async with gate:
                await noop.defer_async()

        t = time.perf_counter()
        await asyncio.gather(*(defer() for _ in range(n)))
        callers = n / (time.perf_counter() - t)
        t = time.perf_counter()
        await noop.batch_defer_async(*[{} for _ in range(n)])
        batch = n / (time.perf_counter() - t)
        t = time.perf_counter()
        await app.run_worker_async(concurrency=4, wait=False, listen_notify=False,
                                   install_signal_handlers=False, delete_jobs="never")
        jobs = 3 * n / (time.perf_counter() - t)
        print(f"{one} {callers} {batch} {jobs}")

asyncio.run(main())
"""


def request(i: int, prefix: str) -> tuple[SubmitRequest, Manifest]:
    now = datetime.now(UTC)
    req = SubmitRequest(
        idempotency_key=f"{prefix}-{i}",
        smolfile='image = "minimal"\n',
        steps=(Step(argv=("true",)),),
    )
    return req, build_manifest(req, validate_request(req, now), "sha256:bench", now)


def enqueue(target: str, n: int, prefix: str, batch: int) -> float:
    """Rollouts stored per second: one transaction each (batch=1) or `batch` per transaction."""
    ledger = Ledger.open(target)
    items = [request(i, prefix) for i in range(n)]
    t = time.perf_counter()
    if batch == 1:
        for req, manifest in items:
            ledger.submit(req, manifest, time.time())
    else:
        for start in range(0, n, batch):
            ledger.submit_many(items[start : start + batch], time.time())
    rate = n / (time.perf_counter() - t)
    ledger.engine.dispose()
    return rate


class _FloorDb:
    """A floor worker's connection: sqlite3 under the ledger's pragmas and file lock, or
    psycopg, each running the ledger's statements in its own dialect (no fleet code)."""

    def __init__(self, target: str) -> None:
        self.postgres = target.startswith("postgresql")
        if self.postgres:
            import psycopg  # (the postgres extra; only the PostgreSQL floor needs it)

            self.pg = psycopg.connect(target.replace("postgresql+psycopg://", "postgresql://"))
            self.cursor: Any = self.pg.cursor()
        else:
            self.lite = sqlite_connect(target)  # (the ledger's own: its pragmas, autocommit)
            self.cursor = self.lite.cursor()
            self.lock = open(f"{target}.lock", "a")  # noqa: SIM115 (closed in close())

    def sql(self, name: str, n: int = 0) -> str:
        return dialect(getattr(Q, name), self.postgres, n)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Any]:
        """One durable transaction, as the ledger takes it (SQLite: the file lock and BEGIN
        IMMEDIATE; PostgreSQL: its implicit BEGIN)."""
        if self.postgres:
            yield self.cursor
            self.pg.commit()
            return
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        try:
            self.cursor.execute("BEGIN IMMEDIATE")
            yield self.cursor
            self.cursor.execute("COMMIT")
        finally:
            fcntl.flock(self.lock, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def writes(self) -> Iterator[None]:
        """Row writes sent as the ledger sends them (`Raw.pipeline`: one psycopg pipeline on
        PostgreSQL, answered at its end)."""
        if not self.postgres:
            yield
            return
        with self.pg.pipeline():
            yield

    def close(self) -> None:
        if self.postgres:
            self.pg.close()
        else:
            self.lite.close()
            self.lock.close()


def enqueue_floor(target: str, n: int, batch: int) -> float:
    """The database's own cost of what an enqueue writes: the statements the ledger runs for
    `batch` submissions (the keys looked up, each one's manifest, rollout, work item and event,
    the tenant's count), with rows built before the clock starts, `batch` per durable
    commit, on the ledger's schema, pragmas and lock. No fleet code runs: this bounds what any
    fleet code can reach."""
    Ledger.open(target).engine.dispose()  # the schema
    db = _FloorDb(target)
    now = time.time()
    # The same submissions as `enqueue` stores, each with its own manifest (its deadline makes
    # it one of a kind, as every real submission's is), ids made as fleet makes them.
    submissions = [request(i, "floor") for i in range(n)]
    keys = [req.idempotency_key for req, _ in submissions]
    ids = [(new_id("r-"), new_id("w-")) for _ in range(n)]
    manifests = [(m.digest, m.model_dump_json(), now) for _, m in submissions]
    rollouts = [(r, req.idempotency_key, req.fingerprint(), m.digest, "default", "{}", "QUEUED",
                 0, now, now)
                for (req, m), (r, _) in zip(submissions, ids, strict=True)]  # fmt: skip
    items = [(w, r, "default", "QUEUED", "cpu", False, False, False, False, 0, 3, now,
              m.deadline.timestamp(), False, "")
             for (_, m), (r, w) in zip(submissions, ids, strict=True)]  # fmt: skip
    events = [(r, "submitted", "", "QUEUED", "tenant:default", now,
               f"manifest {m.digest[:19]}, 1 steps, cpu-class", 0)
              for (_, m), (r, _) in zip(submissions, ids, strict=True)]  # fmt: skip
    sql = {name: db.sql(name) for name in (
        "INSERT_MANIFEST", "INSERT_ROLLOUT", "INSERT_WORK_ITEM", "INSERT_EVENT", "COUNT_ACTIVE",
    )}  # fmt: skip
    t = time.perf_counter()
    for start in range(0, n, batch):
        end = min(n, start + batch)
        with db.transaction() as cursor:
            cursor.execute(db.sql("ROLLOUTS_BY_KEY", end - start), keys[start:end]).fetchall()
            with db.writes():
                cursor.executemany(sql["INSERT_MANIFEST"], sorted(manifests[start:end]))
                cursor.executemany(sql["INSERT_ROLLOUT"], rollouts[start:end])
                cursor.executemany(sql["INSERT_WORK_ITEM"], items[start:end])
                cursor.executemany(sql["INSERT_EVENT"], events[start:end])
                cursor.executemany(sql["COUNT_ACTIVE"], [("default", end - start)])
    rate = n / (time.perf_counter() - t)
    db.close()
    return rate


def succeeded(a: Assignment) -> Completion:
    """A no-op step's report of `a`: succeeded."""
    return Completion(
        work_id=a.work_id,
        fencing_token=a.fencing_token,
        outcome=Outcome.SUCCEEDED,
        results=(StepResult(index=0, exit_code=0),),
    )


def register(ledger: Ledger, host_id: str) -> None:
    ledger.register_host(
        HostCapabilities(
            host_id=host_id, host_class=HostClass.CPU, runtime=RuntimeKind.NAMESPACE,
            isolation=Isolation.NAMESPACE, cpus=1, memory_mib=1, cuda_devices=0,
        ),
        time.time(),
    )  # fmt: skip


def fill(target: str, n: int, prefix: str) -> Ledger:
    """A ledger with `n` rollouts queued."""
    ledger = Ledger.open(target)
    for start in range(0, n, 500):
        ledger.submit_many(
            [request(i, prefix) for i in range(start, min(n, start + 500))], time.time()
        )
    return ledger


def in_server(ledger: Ledger, run: Callable[[Core], Coroutine[Any, Any, float]]) -> float:
    """`run`'s figure, run against a server's core (its ledger thread, an empty image store);
    the ledger is closed after."""
    with tempfile.TemporaryDirectory(prefix="fleet-bench-images-") as images:
        core = Core(ledger, ImageStore(Path(images), Path(images)), ServerConfig())
        try:
            return asyncio.run(run(core))
        finally:
            core.close()
            ledger.engine.dispose()


def served(target: str, n: int) -> float:
    """Durable claim+complete jobs/s as a server takes them: one process, the server's ledger
    thread and its group commits (`ClaimBatcher`, `CompletionBatcher`), WORKERS hosts each
    claiming CLAIM_BATCH and reporting every item on its own, as agents do (no gRPC: the
    ledger's share of a server's work)."""
    ledger = fill(target, n, "served")
    hosts = [f"bench-{i}" for i in range(WORKERS)]
    for host in hosts:
        register(ledger, host)

    async def run(core: Core) -> float:
        claims, completions = ClaimBatcher(core), CompletionBatcher(core)

        async def host(host_id: str) -> int:
            done = 0
            while batch := await claims.claim(Claim(host_id, CLAIM_BATCH, 60.0)):
                await asyncio.gather(*(
                    completions.complete(host_id, succeeded(a)) for a in batch
                ))  # fmt: skip
                done += len(batch)
            return done

        t = time.perf_counter()
        counts = await asyncio.gather(*(host(h) for h in hosts))
        elapsed = time.perf_counter() - t
        assert sum(counts) == n, f"drained {sum(counts)} of {n}"
        return n / elapsed

    return in_server(ledger, run)


def served_enqueue(target: str, n: int, prefix: str) -> float:
    """Rollouts stored per second as a server takes submissions: CALLERS submitters each
    sending one at a time, into the server's ledger thread and its group commit
    (`SubmitBatcher`; no gRPC)."""
    ledger = Ledger.open(target)
    items = [request(i, prefix) for i in range(n)]

    async def run(core: Core) -> float:
        submits = SubmitBatcher(core)
        gate = asyncio.Semaphore(CALLERS)

        async def submit(req: SubmitRequest, manifest: Manifest) -> bool:
            async with gate:
                _, created = await submits.store(req, manifest)
                return created

        t = time.perf_counter()
        created = await asyncio.gather(*(submit(req, m) for req, m in items))
        elapsed = time.perf_counter() - t
        assert all(created), "a submission was not stored"
        return n / elapsed

    return in_server(ledger, run)


def worker(target: str, host_id: str, counter: Synchronized[int], ready: BarrierType) -> None:
    quiet()
    ledger = Ledger.open(target)
    register(ledger, host_id)
    done = 0
    ready.wait()  # the clock starts when every worker is up
    while True:
        batch = ledger.claim(host_id, CLAIM_BATCH, time.time(), 60.0)
        if not batch:
            break
        # The batch's completions are group-committed: one durable commit for all of them.
        answers = ledger.complete_many(host_id, [succeeded(a) for a in batch], time.time())
        assert all(not isinstance(x, Exception) for x in answers), answers
        done += len(batch)
    with counter.get_lock():
        counter.value += done
    ledger.engine.dispose()


def drain(target: str, n: int, work: Callable[..., None] | None = None) -> float:
    """Durable claim+complete jobs/s with WORKERS processes over `n` queued rollouts (each
    process runs `work`: fleet's `worker` unless told)."""
    fill(target, n, "drain").engine.dispose()
    ctx = mp.get_context("spawn")
    counter = ctx.Value("i", 0)
    ready = ctx.Barrier(WORKERS + 1)
    procs = [
        ctx.Process(target=work or worker, args=(target, f"bench-{i}", counter, ready))
        for i in range(WORKERS)
    ]
    for p in procs:
        p.start()
    ready.wait()
    t = time.perf_counter()
    for p in procs:
        p.join()
    elapsed = time.perf_counter() - t
    assert counter.value == n, f"drained {counter.value} of {n}"
    return n / elapsed


def floor_worker(target: str, host_id: str, counter: Synchronized[int], ready: BarrierType) -> None:
    """The floor's worker: a claim+complete loop of the ledger's own statements, straight on
    sqlite3 or psycopg, with rows built from what the claim read and nothing else."""
    quiet()
    db = _FloorDb(target)
    sql = {name: db.sql(name, n) for name, n in (
        ("CLAIMABLE", 1), ("LEASE_ITEM", 0), ("INSERT_ATTEMPT", 0), ("RUN_ROLLOUT", 0),
        ("INSERT_EVENT", 0), ("REPORT_ATTEMPT", 0), ("REPORT_ITEM", 0), ("REPORT_ROLLOUT", 0),
    )}  # fmt: skip
    results = json.dumps([{"index": 0, "exit_code": 0}])
    done = 0
    ready.wait()
    while True:
        now = time.time()
        with db.transaction() as cursor:
            if db.postgres:
                cursor.execute(Q.CLAIM_IN_LEASE_ORDER)
            items = cursor.execute(sql["CLAIMABLE"], (
                "QUEUED", "cpu", "cpu", now, now, host_id, host_id, now, host_id, now,
                False, True, False, True, "", CLAIM_BATCH)).fetchall()  # fmt: skip
            ids = sorted(i[0] for i in items)
            rids = sorted(i[1] for i in items)
            if items:
                cursor.execute(db.sql("CLAIMED_ROLLOUTS", len(rids)), rids).fetchall()
                with db.writes():
                    cursor.executemany(
                        sql["LEASE_ITEM"],
                        [(i[9] + 1, i[14] + 1, host_id, now + 60, "", i[0]) for i in items],
                    )
                    cursor.executemany(
                        sql["INSERT_ATTEMPT"],
                        [(i[0], i[9] + 1, host_id, i[14] + 1, now) for i in items],
                    )
                    cursor.executemany(
                        sql["RUN_ROLLOUT"], [(i[9] + 1, now, now, i[1]) for i in items]
                    )
                    cursor.executemany(sql["INSERT_EVENT"], [
                        (i[1], "leased", "QUEUED", "RUNNING", host_id, now, "attempt 1", 1)
                        for i in items])  # fmt: skip
        if not items:
            break
        with db.transaction() as cursor:
            cursor.execute(db.sql("ITEMS_FOR_UPDATE", len(ids)), ids).fetchall()
            cursor.execute(db.sql("REPORTED_ROLLOUTS", len(rids)), rids).fetchall()
            with db.writes():
                cursor.executemany(
                    sql["REPORT_ATTEMPT"],
                    [(now, "SUCCEEDED", "", 0.0, 0.0, False, i[0], i[9] + 1) for i in items],
                )
                cursor.executemany(
                    sql["REPORT_ITEM"],
                    [("DONE", host_id, i[11], "sha256:floor", "", i[0]) for i in items],
                )
                cursor.executemany(sql["REPORT_ROLLOUT"], [
                    ("SUCCEEDED", "", host_id, "namespace", "", results, "", now, now, 0.0, "[]",
                     i[1])
                    for i in items])  # fmt: skip
                cursor.executemany(sql["INSERT_EVENT"], [
                    (i[1], "succeeded", "RUNNING", "SUCCEEDED", host_id, now, "", 1)
                    for i in items])  # fmt: skip
        done += len(items)
    with counter.get_lock():
        counter.value += done
    db.close()


def drain_floor(target: str, n: int) -> float:
    """The database's own cost of what claim+complete writes: WORKERS processes running the
    ledger's statements for a claim and a completion of CLAIM_BATCH (the same reads, the same
    rows written, under the same lock) with no fleet code around them. It bounds what any
    fleet code can reach with this schema and this durability."""
    return drain(target, n, floor_worker)


def fsync_rate(directory: str, n: int = 300) -> float:
    """Bare write+fsync per second on the ledger's disk: the ceiling for durable one-by-one."""
    fd = os.open(os.path.join(directory, "fsync.probe"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        t = time.perf_counter()
        for _ in range(n):
            os.write(fd, b"x" * 128)
            os.fsync(fd)
        return n / (time.perf_counter() - t)
    finally:
        os.close(fd)


def where_time_goes(target: str, n: int) -> dict[str, float]:
    """One worker's claim+complete loop under cProfile: microseconds per job, by who spent them.

    "driver" is time inside the database driver (sqlite3's C calls, or psycopg waiting on the
    server), "commit" the part of it spent committing (fsync on SQLite); the rest is fleet's
    own Python (building rows, judging reports, pydantic objects).
    """
    ledger = fill(target, n, "prof")
    host = "prof"
    register(ledger, host)
    profile = cProfile.Profile()
    profile.enable()
    while batch := ledger.claim(host, CLAIM_BATCH, time.time(), 60.0):
        ledger.complete_many(host, [succeeded(a) for a in batch], time.time())
    profile.disable()
    ledger.engine.dispose()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    total = driver = commit = 0.0
    for (path, _line, name), (_cc, _nc, tottime, _ct, _callers) in stats.items():
        total += tottime
        if "sqlite3." in name or "psycopg" in path:
            driver += tottime
            # (SQLite: the ledger runs BEGIN and COMMIT on the connection, every statement on
            # a cursor; BEGIN IMMEDIATE only takes the lock)
            if "commit" in name or name == "<method 'execute' of 'sqlite3.Connection' objects>":
                commit += tottime
    per = 1e6 / n
    return {"total_us": total * per, "driver_us": driver * per, "commit_us": commit * per}


API_CONCURRENCY = 32
API_POLLERS = 4


async def api_round(tmp: str, secure: bool, n: int) -> tuple[float, float]:
    """Submit and claim+complete through a real gRPC server (SQLite ledger): plaintext with no
    identity, or TLS with an API key for the submitter and a client certificate for the host.
    Returns (submits/s, jobs/s)."""
    paths = Paths.from_env()
    where = Path(tempfile.mkdtemp(dir=tmp))
    ledger = Ledger.sqlite(where / "api.sqlite3")
    ca = CertificateAuthority.init(where / "ca") if secure else None
    security = Security(ca, host_listen="127.0.0.1:0") if ca is not None else None
    server = FleetServer(ledger, ImageStore(paths.images, paths.recipes), "127.0.0.1:0",
                         ServerConfig(lease_ttl_s=60.0), security)  # fmt: skip
    await server.start()
    key = ""
    if ca is not None:
        _, presented = ledger.identities.create_key(
            "bench", frozenset({Scope.ROLLOUTS_READ, Scope.ROLLOUTS_WRITE}), None, time.time()
        )
        key = format_api_key(presented)
    caps = HostCapabilities(
        host_id="bench-host", host_class=HostClass.CPU, runtime=RuntimeKind.NAMESPACE,
        isolation=Isolation.NAMESPACE, cpus=1, memory_mib=1, cuda_devices=0,
    )  # fmt: skip
    if ca is not None:
        identity = local_host_identity(ca, ledger, caps, server.address, server.core.host_port)
        host_channel = grpc.aio.secure_channel(identity.host_address,
                                               identity.channel_credentials())  # fmt: skip
    else:
        host_channel = grpc.aio.insecure_channel(server.address)
    client_channel = ClientAuth(ca.pem if ca else None, key).channel(server.address)
    run = uuid.uuid4().hex[:8]
    requests = [
        fleet_pb2.SubmitRolloutRequest(
            request_id=f"{run}-{i}", idempotency_key=f"{run}-{i}",
            smolfile='image = "minimal"\n', steps=[types_pb2.Step(argv=["true"])],
        )
        for i in range(n)
    ]  # fmt: skip
    try:
        async with client_channel, host_channel:
            api = fleet_pb2_grpc.FleetServiceStub(client_channel)
            hosts = host_pb2_grpc.HostServiceStub(host_channel)
            await hosts.RegisterHost(host_pb2.RegisterHostRequest(
                host_id="bench-host", host_class=types_pb2.HOST_CLASS_CPU,
                capabilities=convert.capabilities_to_pb(caps),
                agent_version=__version__))  # fmt: skip
            gate = asyncio.Semaphore(API_CONCURRENCY)

            async def submit(req: fleet_pb2.SubmitRolloutRequest) -> None:
                async with gate:
                    await api.SubmitRollout(req, timeout=60)

            t = time.perf_counter()
            await asyncio.gather(*(submit(r) for r in requests))
            submits = n / (time.perf_counter() - t)

            async def poller() -> int:
                done = 0
                while True:
                    reply = await hosts.ClaimWork(
                        host_pb2.ClaimWorkRequest(
                            host_id="bench-host", max_items=CLAIM_BATCH, wait_s=0
                        ),
                        timeout=60,
                    )
                    if not reply.items:
                        return done
                    await asyncio.gather(*(
                        hosts.CompleteWork(host_pb2.CompleteWorkRequest(
                            host_id="bench-host", work_id=item.work_id,
                            fencing_token=item.fencing_token,
                            outcome=types_pb2.OUTCOME_SUCCEEDED,
                            results=[types_pb2.StepResult(index=0, exit_code=0)]), timeout=60)
                        for item in reply.items
                    ))  # fmt: skip
                    done += len(reply.items)

            t = time.perf_counter()
            finished = sum(await asyncio.gather(*(poller() for _ in range(API_POLLERS))))
            jobs = finished / (time.perf_counter() - t)
            assert finished == n, (finished, n)
    finally:
        await server.stop()
        ledger.engine.dispose()
    return submits, jobs


def api_rates(tmp: str, n: int) -> dict[str, float]:
    """Plaintext and TLS rounds in turns (A B B A), each mode's rates the mean of its two."""
    rounds: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for secure in (False, True, True, False):
        rounds[secure].append(asyncio.run(api_round(tmp, secure, n)))
    out = {}
    for secure, name in ((False, "plain"), (True, "tls")):
        out[f"api_submit_{name}_s"] = sum(r[0] for r in rounds[secure]) / 2
        out[f"api_jobs_{name}_s"] = sum(r[1] for r in rounds[secure]) / 2
    return out


def baseline(url: str, n: int) -> tuple[float, float, float, float]:
    """procrastinate's (one by one, CALLERS one at a time each, batched, jobs/s); its
    connector's default pool."""
    env = {**os.environ, "PYTHONPATH": str(REPO / ".bench-deps")}
    out = subprocess.run(
        [sys.executable, "-c", BASELINE, url, str(n), str(CALLERS)], env=env,
        capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    one, callers, batch, jobs = (float(x) for x in out.stdout.split()[-4:])
    return one, callers, batch, jobs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small counts: done in under 60 s")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args()
    quiet()
    jobs_n, enqueue_n, base_n = (600, 300, 300) if args.quick else (4000, 2000, 2000)
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp, postgres_server() as server:
        sqlite = str(Path(tmp) / "bench.sqlite3")
        results: dict[str, float] = {}
        results["sqlite_served_s"] = served(str(Path(tmp) / "served.sqlite3"), jobs_n)
        results["postgres_served_s"] = served(create_database(server), jobs_n)
        results["sqlite_jobs_s"] = drain(sqlite, jobs_n)
        results["jobs_floor_s"] = drain_floor(str(Path(tmp) / "jf.sqlite3"), jobs_n)
        results["postgres_jobs_s"] = drain(create_database(server), jobs_n)
        results["enqueue_one_s"] = enqueue(str(Path(tmp) / "e1.sqlite3"), enqueue_n, "one", 1)
        results["enqueue_batch_s"] = enqueue(str(Path(tmp) / "eb.sqlite3"), enqueue_n * 5, "b", 500)
        results["enqueue_floor_s"] = enqueue_floor(
            str(Path(tmp) / "ef.sqlite3"), enqueue_n * 5, 500
        )
        results["enqueue_one_floor_s"] = enqueue_floor(str(Path(tmp) / "e1f.sqlite3"), enqueue_n, 1)
        results["postgres_jobs_floor_s"] = drain_floor(create_database(server), jobs_n)
        results["postgres_enqueue_one_floor_s"] = enqueue_floor(
            create_database(server), enqueue_n, 1
        )
        results["postgres_enqueue_floor_s"] = enqueue_floor(
            create_database(server), enqueue_n * 5, 500
        )
        results["enqueue_callers_s"] = served_enqueue(str(Path(tmp) / "ec.sqlite3"), enqueue_n, "c")
        pg_one = enqueue(create_database(server), enqueue_n, "pone", 1)
        pg_callers = served_enqueue(create_database(server), enqueue_n, "pc")
        pg_batch = enqueue(create_database(server), enqueue_n * 5, "pb", 500)
        b_one, b_callers, b_batch, b_jobs = baseline(create_database(server), base_n)
        prof_n = 640 if args.quick else 2000
        lite_prof = where_time_goes(str(Path(tmp) / "prof.sqlite3"), prof_n)
        pg_prof = where_time_goes(create_database(server), prof_n)
        fsyncs = fsync_rate(tmp)
        results.update(api_rates(tmp, 400 if args.quick else 2000))
        results["baseline_jobs_s"] = b_jobs
        results["postgres_enqueue_one_s"], results["postgres_enqueue_callers_s"] = (
            pg_one,
            pg_callers,
        )
        results["baseline_enqueue_one_s"], results["baseline_enqueue_callers_s"] = b_one, b_callers
    rows = [
        (
            "claim+complete jobs/s, one server, 4 hosts",
            results["sqlite_served_s"],
            results["postgres_served_s"],
            b_jobs,
        ),
        (
            "  the same, 4 processes on one database",
            results["sqlite_jobs_s"],
            results["postgres_jobs_s"],
            b_jobs,
        ),
        ("enqueue rows/s, one by one", results["enqueue_one_s"], pg_one, b_one),
        (
            f"  one at a time each, {CALLERS} callers",
            results["enqueue_callers_s"],
            pg_callers,
            b_callers,
        ),
        ("enqueue rows/s, batched", results["enqueue_batch_s"], pg_batch, b_batch),
    ]
    table = Table(44, (("fleet/SQLite", 14), ("fleet/PG", 12), ("procrastinate", 15),
                       ("SQLite ratio", 14), ("PG ratio", 10)))  # fmt: skip
    table.print_header()
    # The floors: the database alone running the same statements (no fleet code), under the
    # rows they bound, and fleet's share of each.
    floors = {1: (results["jobs_floor_s"], results["postgres_jobs_floor_s"]),
              2: (results["enqueue_one_floor_s"], results["postgres_enqueue_one_floor_s"]),
              4: (results["enqueue_floor_s"], results["postgres_enqueue_floor_s"])}  # fmt: skip
    for k, (name, lite, pg, base) in enumerate(rows):
        table.print_row(name, f"{lite:.0f}", f"{pg:.0f}", f"{base:.0f}", f"{lite / base:.1f}x",
                        f"{pg / base:.1f}x")  # fmt: skip
        if k in floors:
            lite_floor, pg_floor = floors[k]
            table.print_row("  the database alone, same statements (floor)", f"{lite_floor:.0f}",
                            f"{pg_floor:.0f}", "fleet / floor", f"{lite / lite_floor:.2f}x",
                            f"{pg / pg_floor:.2f}x")  # fmt: skip
    print(f"(jobs: {jobs_n} fleet, {3 * base_n} procrastinate; SQLite synchronous=FULL, "
          "PostgreSQL synchronous_commit=on; same machine, one run)")  # fmt: skip
    print()
    print(f"where one worker's time goes, per claim+complete job (cProfile, {prof_n} jobs, "
          f"batches of {CLAIM_BATCH}):")  # fmt: skip
    profiled = Table(44, (("fleet/SQLite", 14), ("fleet/PG", 12)))
    profiled.print_header()
    for key, name in (("total_us", "all (us/job)"), ("driver_us", "inside the driver (us/job)"),
                      ("commit_us", "  of which BEGIN and COMMIT (us/job)")):  # fmt: skip
        profiled.print_row(name, f"{lite_prof[key]:.0f}", f"{pg_prof[key]:.0f}")
    own = [(p["total_us"] - p["driver_us"]) for p in (lite_prof, pg_prof)]
    profiled.print_row("fleet Python (us/job)", f"{own[0]:.0f}", f"{own[1]:.0f}")
    profiled.print_row("CPU ceiling on 2 cores (jobs/s)", f"{2e6 / lite_prof['total_us']:.0f}",
                       f"{2e6 / pg_prof['total_us']:.0f}")  # fmt: skip
    print(
        f"bare write+fsync on this disk: {fsyncs:.0f}/s (the ceiling for durable one-by-one "
        "commits from one client)"
    )
    print()
    print("through the gRPC API (a real server, SQLite, client and server in one process; "
          "rounds A B B A):")  # fmt: skip
    api = Table(44, (("plaintext", 14), ("TLS+keys", 12), ("TLS/plain", 11)))
    api.print_header()
    for key, name in (("submit", f"submit rollouts/s, {API_CONCURRENCY} in flight"),
                      ("jobs", f"claim+complete jobs/s, {API_POLLERS} pollers")):  # fmt: skip
        plain, tls = results[f"api_{key}_plain_s"], results[f"api_{key}_tls_s"]
        api.print_row(name, f"{plain:.0f}", f"{tls:.0f}", f"{tls / plain:.2f}x")
    print(
        "(TLS+keys: the submitter sends an API key checked on every call, the host calls "
        "with its client certificate over mutual TLS)"
    )
    if args.json:
        print_json(results, 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
