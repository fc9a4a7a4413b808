"""The scale benchmark (`scripts/bench-scale`): what a fleet of many hosts costs two server
replicas and their PostgreSQL database, and whether a replica's death loses or repeats work.

Two `fleet serve` replicas (processes of their own, TLS and keys, mutual TLS for hosts) share
one PostgreSQL database (a throwaway server on loopback, or `--db`). `--hosts` simulated hosts
(`benchmarks.scale_hosts`: many per process, real gRPC, each joined with the join token and its
own certificate, half on each replica) run a no-op workload. The run, in phases:

1. the replicas alone (their idle cost);
2. every host heartbeating, none claiming: the replicas' CPU for heartbeats alone;
3. claim+complete throughput through gRPC: a batch of rollouts queued, then taken by 4 hosts
   only; the same batch taken by every host;
4. every host heartbeating and waiting in ClaimWork, no work: a fleet's idle cost;
5. rollouts submitted at a rising rate, one step after another, while replica 0 is killed
   (SIGKILL) halfway through: its hosts and the submitter move to the other replica;
6. the ledger read back: rollouts not final (lost), rollouts attempted more than once although
   no host failed (duplicated).

It reports rollouts/s sustained, submit-to-claim p50/p99, heartbeats/s absorbed, the
replicas' CPU per host per minute (from /proc/PID/stat), PostgreSQL commits and row writes per
rollout (`pg_stat_database`, `pg_stat_user_tables`) and how long the dead replica's hosts took
to resume. Its last line is one JSON object.
"""

# ruff: noqa: T201 (a benchmark's output is what it prints)

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.harness import Table, percentile, print_json, quiet
from benchmarks.scale_fleet import (
    Replica,
    Submitter,
    Tally,
    Workers,
    placeholder_image,
    start_replica,
)
from benchmarks.scale_hosts import CLAIM_WAIT_S, Plan
from benchmarks.scale_pg import PgCounters, counters, postgres_server, tree_cpu_s
from fleet.config import Paths
from fleet.core.beat_pace import Pace, pace
from fleet.core.credentials import format_api_key, format_join_token, parse_scopes
from fleet.core.lifecycle import FINAL_STATES, Outcome
from fleet.core.placement import HostClass
from fleet.identity.ca import CertificateAuthority
from fleet.ledger.store import Ledger
from fleet.server.app import PACE_REFRESH_S
from fleet.server.settings import ServerConfig

TICK_S = 0.1
"""How often the rising-rate submitter sends what is due."""
SUBMITS_IN_FLIGHT = 32
KILLED = 0
"""The replica killed halfway through the rising rate."""
PG_SETTLE_S = 1.5
"""A PostgreSQL backend publishes its counters at most once a second: a phase's first reading
waits this long after the last phase's work, so that none of it is counted twice."""


def note(line: str) -> None:
    """Progress, as each phase ends (on stderr: the report is stdout's)."""
    print(line, file=sys.stderr, flush=True)


# -- measuring --------------------------------------------------------------------------------


@dataclasses.dataclass
class Reading:
    """What a phase is measured by, at one moment."""

    at: float
    replicas_cpu: tuple[float, ...]
    pg: PgCounters
    pg_cpu: float | None
    heartbeats: int


@dataclasses.dataclass
class Phase:
    name: str
    hosts: int
    seconds: float
    replicas_cpu_s: tuple[float, ...]
    pg: PgCounters
    pg_cpu_s: float | None
    heartbeats: int

    @property
    def cpu_fraction(self) -> float:
        """Both replicas' CPU as a share of one core."""
        return sum(self.replicas_cpu_s) / self.seconds

    @property
    def cpu_ms_per_host_min(self) -> float:
        return sum(self.replicas_cpu_s) * 1000 / max(self.hosts, 1) / (self.seconds / 60)


class Meter:
    def __init__(self, replicas: list[Replica], db: str, pg_pid: int | None) -> None:
        self.replicas = replicas
        self.db = db
        self.pg_pid = pg_pid

    async def read(self, tally: Tally, workers: Workers | None) -> Reading:
        if workers is not None:
            await tally.update(workers)
        pg = await asyncio.to_thread(counters, self.db)
        pg_cpu = tree_cpu_s(self.pg_pid) if self.pg_pid else None
        return Reading(time.monotonic(), tuple(r.cpu_s() for r in self.replicas), pg, pg_cpu,
                       tally.heartbeats)  # fmt: skip

    @staticmethod
    def phase(name: str, hosts: int, a: Reading, b: Reading) -> Phase:
        phase = Meter._phase(name, hosts, a, b)
        note(f"{name}: {phase.seconds:.1f} s, {phase.heartbeats / phase.seconds:.0f} beats/s, "
             f"replicas {', '.join(f'{c / phase.seconds:.1%}' for c in phase.replicas_cpu_s)} "
             f"of a core, {phase.pg.commits / phase.seconds:.0f} commits/s")  # fmt: skip
        return phase

    @staticmethod
    def _phase(name: str, hosts: int, a: Reading, b: Reading) -> Phase:
        # A replica killed during the phase reads 0 at its end: what it used is unknown then.
        cpu = tuple(max(y - x, 0.0) for x, y in zip(a.replicas_cpu, b.replicas_cpu, strict=True))
        pg_cpu = None if a.pg_cpu is None or b.pg_cpu is None else b.pg_cpu - a.pg_cpu
        return Phase(
            name, hosts, b.at - a.at, cpu, b.pg - a.pg, pg_cpu, b.heartbeats - a.heartbeats
        )


async def until_completed(tally: Tally, workers: Workers, n: int, timeout_s: float) -> None:
    """Until the hosts have completed `n` rollouts in all (bounded)."""
    deadline = time.monotonic() + timeout_s
    while (await tally.update(workers)).completed < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{n - tally.completed} rollouts not completed in {timeout_s:.0f} s")
        await asyncio.sleep(0.2)


async def claim_rate(
    submitter: Submitter, workers: Workers, tally: Tally, hosts: int, batch: int, phase: str
) -> float:
    """Claim+complete per second through gRPC: `batch` rollouts queued while no host claims,
    then taken by the first `hosts` hosts; from their start to the last report."""
    await workers.pause()
    done = (await tally.update(workers)).completed
    await submitter.queue(batch, phase)
    started = time.time()
    await workers.claim(hosts)
    try:
        await until_completed(tally, workers, done + batch, 60 + batch / 10)
    except RuntimeError as exc:  # (the rate of what was done; the rest runs on meanwhile)
        note(f"{phase}: {exc}")
    taken = tally.completed - done
    rate = taken / max(tally.last_completed_at - started, 1e-3)
    note(f"{phase}: {taken} claimed and completed by {hosts} hosts, {rate:.0f}/s "
         f"(heartbeat errors so far: {tally.heartbeat_errors})")  # fmt: skip
    return rate


@dataclasses.dataclass
class Step:
    rate: float
    seconds: float
    completed: int
    killed: bool
    sent: list[asyncio.Task[list[str]]]

    @property
    def ids(self) -> list[str]:
        """The rollouts this step submitted (once every submission has been answered)."""
        return [rid for task in self.sent for rid in task.result()]


async def rising(
    submitter: Submitter, workers: Workers, tally: Tally, rates: list[float], step_s: float,
    replicas: list[Replica],
) -> tuple[list[Step], float]:  # fmt: skip
    """Rollouts at each rate in turn, `step_s` each; replica KILLED is killed halfway through
    the middle step. Returns the steps, every submission answered, and when the kill was
    (epoch seconds)."""
    killed_at = 0.0
    kill_step = len(rates) // 2
    steps: list[Step] = []
    gate = asyncio.Semaphore(SUBMITS_IN_FLIGHT)

    async def send(n: int) -> list[str]:
        async with gate:
            return await submitter.submit(n, "rising")

    for index, rate in enumerate(rates):
        sent: list[asyncio.Task[list[str]]] = []
        done_before = (await tally.update(workers)).completed
        started = time.monotonic()
        due = 0.0
        ticks = max(1, round(step_s / TICK_S))
        for tick in range(ticks):
            due += rate * TICK_S
            if int(due):
                sent.append(asyncio.create_task(send(int(due))))
                due -= int(due)
            if index == kill_step and not killed_at and tick >= ticks // 2:
                replicas[KILLED].kill()
                killed_at = time.time()
            await asyncio.sleep(max(0.0, started + (tick + 1) * TICK_S - time.monotonic()))
        seconds = time.monotonic() - started
        completed = (await tally.update(workers)).completed - done_before
        steps.append(Step(rate, seconds, completed, index == kill_step, sent))
    await asyncio.gather(*(task for step in steps for task in step.sent))
    return steps, killed_at


def audit(db: str) -> dict[str, int]:
    """The ledger's own account: rollouts by state, and those attempted more than once
    although no attempt of theirs was a host's failure (run twice by the control plane)."""
    final = ", ".join(f"'{s.value}'" for s in FINAL_STATES)
    with psycopg.connect(db, autocommit=True) as conn:
        rows = conn.execute("SELECT state, count(*) FROM rollouts GROUP BY state").fetchall()
        states: dict[str, int] = {str(state): int(n) for state, n in rows}
        row = conn.execute(
            "SELECT count(*) FROM (SELECT w.rollout_id FROM attempts a "
            "JOIN work_items w ON w.id = a.work_id GROUP BY w.rollout_id "
            "HAVING count(*) > 1 AND sum(CASE WHEN a.outcome = %s THEN 1 ELSE 0 END) = 0) d",
            (Outcome.TRANSIENT_ERROR.value,),
        ).fetchone()
        final_row = conn.execute(
            f"SELECT count(*) FROM rollouts WHERE state IN ({final})"
        ).fetchone()
    assert row is not None and final_row is not None
    return {
        "rollouts": sum(states.values()),
        "final": int(final_row[0]),
        "succeeded": states.get("SUCCEEDED", 0),
        "repeated": int(row[0]),
    }


# -- the run ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Options:
    hosts: int
    per_process: int
    slots: int
    work_s: float
    config: ServerConfig
    baseline_s: float
    heartbeat_phase_s: float
    idle_phase_s: float
    batch: int
    rates: list[float]
    step_s: float
    claim_wait_s: float


def fleet_pace(config: ServerConfig, hosts: int) -> Pace:
    """The pace the replicas give `hosts` live hosts (`fleet.core.beat_pace`)."""
    c = config
    return pace(hosts, c.heartbeat_interval_s, c.lease_ttl_s, c.max_heartbeats_per_s)


@contextlib.contextmanager
def database(db: str) -> Iterator[tuple[str, int | None]]:
    """(the ledger's URL, PostgreSQL's postmaster pid where this run started it)."""
    if db:
        yield db, None
        return
    with postgres_server() as server:
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("CREATE DATABASE scale")
        yield server.url.rsplit("/", 1)[0] + "/scale", server.pid


async def run(opts: Options, db_url: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fleet-scale-") as tmp, database(db_url) as (db, pg):
        home = Path(tmp)
        paths = Paths(home, Paths.from_env().recipes)
        ca = CertificateAuthority.init(paths.ca)
        image = placeholder_image(paths)
        replicas: list[Replica] = []
        workers: Workers | None = None
        submitter: Submitter | None = None
        try:
            for name in ("replica-0", "replica-1"):  # (one at a time: the first migrates)
                replicas.append(start_replica(name, home, db, opts.config))
            ledger = Ledger.open(db)
            now = time.time()
            _, token = ledger.identities.create_join_token(HostClass.CPU, {}, 3600, opts.hosts, now)
            _, key = ledger.identities.create_key(
                "bench", parse_scopes("rollouts:read,rollouts:write"), None, now
            )
            ledger.engine.dispose()
            meter = Meter(replicas, db, pg)
            tally = Tally()
            phases: list[Phase] = []

            start = await meter.read(tally, None)
            await asyncio.sleep(opts.baseline_s)
            phases.append(meter.phase("replicas alone", 0, start, await meter.read(tally, None)))

            plans = [
                Plan(first, min(opts.per_process, opts.hosts - first),
                     tuple(r.api for r in replicas), tuple(r.host_endpoint for r in replicas),
                     ca.pem, format_join_token(token), opts.slots, opts.work_s,
                     opts.claim_wait_s, -(-opts.hosts // opts.per_process),
                     str(home / "hosts"))
                for first in range(0, opts.hosts, opts.per_process)
            ]  # fmt: skip
            joined_at = time.monotonic()
            workers = Workers(plans)
            joined = await asyncio.to_thread(workers.ready, 120 + opts.hosts * 0.5)
            join_s = time.monotonic() - joined_at
            submitter = Submitter([r.api for r in replicas], ca.pem, format_api_key(key), image)

            # The replicas count the hosts (every PACE_REFRESH_S), then each host hears the
            # fleet's pace at its next beat and spreads its beats over it (`beat_pace`).
            await asyncio.sleep(PACE_REFRESH_S + opts.config.heartbeat_interval_s + PG_SETTLE_S)
            a = await meter.read(tally, workers)
            await asyncio.sleep(opts.heartbeat_phase_s)
            phases.append(
                meter.phase("heartbeats only", joined, a, await meter.read(tally, workers))
            )

            four = await claim_rate(submitter, workers, tally, 4, opts.batch, "claim-4")
            every = await claim_rate(submitter, workers, tally, joined, opts.batch, "claim-all")

            await asyncio.sleep(PG_SETTLE_S)
            a = await meter.read(tally, workers)
            await asyncio.sleep(opts.idle_phase_s)
            idle = meter.phase("heartbeats + waiting claims", joined, a,
                               await meter.read(tally, workers))  # fmt: skip
            phases.append(idle)

            before = len(submitter.submitted)
            await asyncio.sleep(PG_SETTLE_S)
            a = await meter.read(tally, workers)
            steps, killed_at = await rising(submitter, workers, tally, opts.rates, opts.step_s,
                                            replicas)  # fmt: skip
            rising_n = len(submitter.submitted) - before
            expected = len(submitter.submitted)
            drain_s = 2 * fleet_pace(opts.config, joined).lease_ttl_s + 60 + expected / 20
            with contextlib.suppress(RuntimeError):  # (what is missing is counted as lost)
                await until_completed(tally, workers, expected, drain_s)
            await asyncio.sleep(PG_SETTLE_S)
            # (to the last report: what the rising rate cost includes its backlog's)
            load = meter.phase("rising rate (replica 0 killed)", joined, a,
                               await meter.read(tally, workers))  # fmt: skip
            phases.append(load)
            ledger_says = await asyncio.to_thread(audit, db)
        finally:
            if submitter is not None:
                await submitter.close()
            if workers is not None:
                await asyncio.to_thread(workers.stop)
            for replica in replicas:
                replica.stop()
        return report(opts, Results(
            joined, join_s, phases, four, every, idle, load, steps, rising_n, killed_at, tally,
            submitter, ledger_says,
        ))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Results:
    joined: int
    join_s: float
    phases: list[Phase]
    four: float
    """Claim+complete per second with 4 hosts claiming."""
    every: float
    """The same with every host claiming."""
    idle: Phase
    load: Phase
    steps: list[Step]
    rising_n: int
    killed_at: float
    tally: Tally
    submitter: Submitter
    ledger_says: dict[str, int]


def report(opts: Options, r: Results) -> dict[str, Any]:
    """Prints the tables; returns the closing JSON object."""
    phases, steps, tally, submitter = r.phases, r.steps, r.tally, r.submitter
    config = opts.config
    paced = fleet_pace(config, r.joined)
    print(f"{r.joined} simulated hosts ({opts.per_process} per process, {opts.slots} slots "
          f"each) joined two replicas in {r.join_s:.1f} s; heartbeat every "
          f"{paced.heartbeat_interval_s:g} s, lease {paced.lease_ttl_s:g} s (the pace for "
          f"{r.joined} hosts at {config.max_heartbeats_per_s:g} beats/s; base "
          f"{config.heartbeat_interval_s:g} s, {config.lease_ttl_s:g} s), claim wait "
          f"{opts.claim_wait_s:g} s")  # fmt: skip
    print()
    table = Table(34, (("s", 6), ("beats/s", 9), ("replica 0", 10), ("replica 1", 10),
                       ("ms/host/min", 12), ("pg cpu", 8), ("commits/s", 10),
                       ("writes/s", 9)), sep=" ")  # fmt: skip
    table.print_header()
    for p in phases:
        table.print_row(
            p.name, f"{p.seconds:.1f}", f"{p.heartbeats / p.seconds:.0f}",
            *(f"{c / p.seconds:.1%}" for c in p.replicas_cpu_s),
            f"{p.cpu_ms_per_host_min:.2f}" if p.hosts else "-",
            "-" if p.pg_cpu_s is None else f"{p.pg_cpu_s / p.seconds:.1%}",
            f"{p.pg.commits / p.seconds:.0f}", f"{p.pg.row_writes / p.seconds:.0f}",
        )  # fmt: skip
    print("(replica CPU and PostgreSQL's as a share of one core)")
    print()
    print(f"claim+complete through gRPC, {opts.batch} queued no-op rollouts: 4 hosts "
          f"{r.four:.0f}/s, {r.joined} hosts {r.every:.0f}/s "
          f"(ratio {r.every / r.four:.2f})")  # fmt: skip
    print()
    first_claim = {rid: min(at) for rid, at in tally.claims.items()}
    all_latencies: list[float] = []
    steps_table = Table(12, (("submitted/s", 12), ("completed/s", 12), ("claim p50 ms", 13),
                             ("claim p99 ms", 13)), sep=" ")  # fmt: skip
    print("rising rate (offered/s):")
    steps_table.print_header()
    sustained = 0.0
    for step in steps:
        latencies = [(first_claim[i] - submitter.submitted[i]) * 1000
                     for i in step.ids if i in first_claim]  # fmt: skip
        all_latencies += latencies
        done_rate = step.completed / step.seconds
        sent_rate = len(step.ids) / step.seconds
        if done_rate >= 0.95 * sent_rate:
            sustained = max(sustained, done_rate)
        p50 = f"{percentile(latencies, 0.5):.0f}" if latencies else "-"
        p99 = f"{percentile(latencies, 0.99):.0f}" if latencies else "-"
        steps_table.print_row(f"{step.rate:g}", f"{sent_rate:.1f}", f"{done_rate:.1f}", p50, p99,
                              tail="  replica 0 killed" if step.killed else "")  # fmt: skip
    killed_at = r.killed_at
    resumed = [(ok - killed_at) for _, moved, ok in tally.moves if moved >= killed_at - 1]
    hosts_moved = len({h for h, moved, _ in tally.moves if moved >= killed_at - 1})
    resume_max = max(resumed) if resumed else None
    ledger_says = r.ledger_says
    expected = len(submitter.submitted) + submitter.failed
    lost = expected - ledger_says["final"]
    claimed_twice = sum(1 for at in tally.claims.values() if len(at) > 1)
    load, idle = r.load, r.idle
    # PostgreSQL's work per rollout under the rising rate, less what the fleet's heartbeats
    # and waiting claims cost it anyway: the idle phase's per beat, times the beats absorbed.
    per_beat = idle.heartbeats and 1 / idle.heartbeats
    n = max(r.rising_n, 1)
    commits = (load.pg.commits - idle.pg.commits * per_beat * load.heartbeats) / n
    writes = (load.pg.row_writes - idle.pg.row_writes * per_beat * load.heartbeats) / n
    heartbeat_phase = phases[1]
    print()
    print(f"replica 0 killed: {hosts_moved} hosts moved to replica 1, all resumed within "
          + (f"{resume_max:.1f} s" if resume_max is not None else "- s")
          + f" (2 leases: {2 * paced.lease_ttl_s:g} s)")  # fmt: skip
    print(
        f"rollouts: {expected} submitted, {ledger_says['final']} final "
        f"({ledger_says['succeeded']} succeeded); lost {lost}, duplicated "
        f"{ledger_says['repeated']} (claimed twice as the hosts saw it: {claimed_twice})"
    )
    print(f"PostgreSQL per rollout (rising rate, less the idle fleet's own): {commits:.1f} "
          f"commits, {writes:.1f} row writes (raw: {load.pg.commits / n:.1f}, "
          f"{load.pg.row_writes / n:.1f})")  # fmt: skip
    return {
        "hosts": r.joined,
        "replicas": 2,
        "lost": lost,
        "duplicated": ledger_says["repeated"],
        "claimed_twice": claimed_twice,
        "rollouts": expected,
        "heartbeat_core_fraction": heartbeat_phase.cpu_fraction,
        "heartbeats_per_s": heartbeat_phase.heartbeats / heartbeat_phase.seconds,
        "heartbeat_cpu_ms_per_host_min": heartbeat_phase.cpu_ms_per_host_min,
        "idle_core_fraction": idle.cpu_fraction,
        "idle_cpu_ms_per_host_min": idle.cpu_ms_per_host_min,
        "load_cpu_ms_per_host_min": load.cpu_ms_per_host_min,
        "claim_per_s_4": r.four,
        "claim_per_s_all": r.every,
        "claim_ratio_1000_vs_4": r.every / r.four,
        "rollouts_per_s_sustained": sustained,
        "submit_to_claim_p50_ms": percentile(all_latencies, 0.5) if all_latencies else None,
        "submit_to_claim_p99_ms": percentile(all_latencies, 0.99) if all_latencies else None,
        "pg_commits_per_rollout": commits,
        "pg_row_writes_per_rollout": writes,
        "pg_core_fraction_load": None if load.pg_cpu_s is None else load.pg_cpu_s / load.seconds,
        "failover_hosts": hosts_moved,
        "failover_resume_max_s": resume_max,
        "heartbeat_interval_s": paced.heartbeat_interval_s,
        "lease_ttl_s": paced.lease_ttl_s,
        "max_heartbeats_per_s": config.max_heartbeats_per_s,
        "heartbeat_errors": tally.heartbeat_errors,
        "refused": tally.refused,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", type=int, default=1000, help="simulated hosts (default 1000)")
    parser.add_argument(
        "--per-process", type=int, default=250, help="simulated hosts per process (default 250)"
    )
    parser.add_argument("--slots", type=int, default=8, help="each host's slots (default 8)")
    parser.add_argument(
        "--work-s",
        type=float,
        default=0.0,
        help="how long each no-op attempt holds its lease (default 0)",
    )
    parser.add_argument(
        "--db",
        default="",
        help="a postgresql:// URL of an empty database (default: a throwaway "
        "PostgreSQL server on loopback)",
    )
    defaults = ServerConfig()
    parser.add_argument("--lease-ttl-s", type=float, default=defaults.lease_ttl_s)
    parser.add_argument("--heartbeat-s", type=float, default=defaults.heartbeat_interval_s)
    parser.add_argument("--max-heartbeats-per-s", type=float,
                        default=defaults.max_heartbeats_per_s,
                        help="the fleet's heartbeat pace (`fleet serve --max-heartbeats-per-s`; "
                             "0: every host beats at --heartbeat-s)")  # fmt: skip
    parser.add_argument("--baseline-s", type=float, default=5.0)
    parser.add_argument("--heartbeat-phase-s", type=float, default=30.0)
    parser.add_argument("--idle-phase-s", type=float, default=15.0)
    parser.add_argument(
        "--batch",
        type=int,
        default=1000,
        help="rollouts per claim+complete measurement (default 1000)",
    )
    parser.add_argument(
        "--rates",
        default="25,50,100,200,400",
        help="rollouts/s submitted, one step each (default 25,50,100,200,400)",
    )
    parser.add_argument("--step-s", type=float, default=10.0)
    parser.add_argument("--claim-wait-s", type=float, default=CLAIM_WAIT_S,
                        help=f"how long a claim waits at the server (default {CLAIM_WAIT_S:g}, "
                             "the agent's)")  # fmt: skip
    args = parser.parse_args()
    try:
        rates = [float(x) for x in args.rates.split(",")]
    except ValueError:
        parser.error(f"--rates {args.rates!r}: expected numbers separated by commas")
    if len(rates) < 2 or any(r <= 0 for r in rates):
        parser.error("--rates: at least two rates, each above 0 (a replica dies in the middle)")
    if not 4 <= args.hosts <= 10_000:
        parser.error(f"--hosts {args.hosts}: from 4 to 10000 (one join token's uses)")
    for name in ("per_process", "slots", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("lease_ttl_s", "heartbeat_s", "baseline_s", "heartbeat_phase_s",
                 "idle_phase_s", "step_s", "claim_wait_s"):  # fmt: skip
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be above 0, got {getattr(args, name)}")
    if args.work_s < 0:
        parser.error(f"--work-s must be 0 or more, got {args.work_s}")
    if args.db and not args.db.startswith(("postgresql://", "postgres://")):
        parser.error(f"--db {args.db!r}: two replicas share a PostgreSQL database: "
                     "postgresql://USER@HOST:PORT/DB")  # fmt: skip
    quiet()
    if args.max_heartbeats_per_s < 0:
        parser.error(f"--max-heartbeats-per-s must be 0 or more, got {args.max_heartbeats_per_s}")
    config = ServerConfig(lease_ttl_s=args.lease_ttl_s, heartbeat_interval_s=args.heartbeat_s,
                          max_heartbeats_per_s=args.max_heartbeats_per_s)  # fmt: skip
    opts = Options(
        args.hosts, args.per_process, args.slots, args.work_s, config, args.baseline_s,
        args.heartbeat_phase_s, args.idle_phase_s, args.batch, rates, args.step_s,
        args.claim_wait_s,
    )  # fmt: skip
    result = asyncio.run(run(opts, args.db))
    print_json(result, digits=4)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
