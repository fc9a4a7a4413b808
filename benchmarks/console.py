"""The web console against a large PostgreSQL ledger: server time of its pages, and what a
live page left open costs the server beside a `WatchRollout` stream.

A fresh PostgreSQL server (`benchmarks.scale_pg`) gets fleet's schema; a handful of rollouts go
through the ledger for real (submitted, claimed, charged tokens, completed), and the rest are
copied from one of them with `INSERT ... SELECT ... generate_series` straight into the tables,
the same columns as the ledger writes (rollouts, labels, work items, attempts, events), with
their own ids, tenants, states, labels and creation times.

Part one calls the console's request handler in this process (its reads on threads, as the
server's are) and reports p50 and p95 of each page's server time. Part two runs the server in a
process of its own, leaves N rollouts running, and reads that process's CPU (and PostgreSQL's)
while N live pages poll every two seconds, as console.js does, and while N clients hold a
WatchRollout stream each instead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from benchmarks.harness import (
    SECRET,
    ServerProcess,
    Table,
    percentile,
    print_json,
    process_cpu_s,
    quiet,
)
from benchmarks.scale_pg import PgServer, postgres_server, tree_cpu_s
from fleet.console.web import Backend, Console
from fleet.core.credentials import Scope, format_api_key
from fleet.core.lifecycle import Outcome
from fleet.core.manifest import Step, SubmitRequest, build_manifest, validate_request
from fleet.core.placement import HostCapabilities, HostClass, Isolation, RuntimeKind
from fleet.core.rollout import Completion, StepResult
from fleet.ledger.store import Ledger

TARGET_MS = 100.0
"""Each page's p95 server time at most this (with a million rollouts)."""
HOSTS = 50
TENANTS = 10
SMALL_TENANT = "t-small"
"""One rollout in a thousand: a tenant whose first page lies spread over the whole table."""
SPACING_S = 1.0
"""Seconds between two bulk rollouts' creation (a million: eleven and a half days)."""
CHUNK = 100_000
POLL_S = 2.0
"""A live page's period (console.js's PERIOD_MS)."""
LEASE_S = 3600.0


@dataclass(frozen=True)
class Filled:
    url: str
    n: int
    ledger: Ledger
    template: str
    """A rollout that went through the ledger for real (attempt, tokens, events)."""
    running: list[str]
    """Rollouts left running (leased to a host that never reports)."""
    admin: str
    """An admin key, as `fleet key create` prints it."""
    tenant_key: str
    """A key of SMALL_TENANT."""
    bulk_ids: list[str]
    """A few bulk rollouts' ids, spread over the table."""
    middle_seq: int
    oldest_seq: int
    now: float


def _caps(host_id: str) -> HostCapabilities:
    return HostCapabilities(
        host_id=host_id, host_class=HostClass.CPU, runtime=RuntimeKind.NAMESPACE,
        isolation=Isolation.NAMESPACE, cpus=64, memory_mib=65536, cuda_devices=0, slots=1000,
    )  # fmt: skip


def _submit(ledger: Ledger, key: str, tenant: str, now: float) -> str:
    req = SubmitRequest.model_validate({
        "idempotency_key": key, "smolfile": 'image = "minimal"\n', "tenant": tenant,
        "steps": (Step(argv=("sh", "-c", "echo hello")),), "labels": {"suite": "real"},
    })  # fmt: skip
    when = datetime.fromtimestamp(now, UTC)
    manifest = build_manifest(req, validate_request(req, when), "sha256:" + "0" * 64, when)
    rollout, _ = ledger.submit(req, manifest, now)
    return rollout.id


def _columns(db: psycopg.Connection[Any], table: str) -> list[str]:
    rows = db.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = %s "
        "ORDER BY ordinal_position", (table,),
    ).fetchall()  # fmt: skip
    return [str(r[0]) for r in rows]


def _copy(db: psycopg.Connection[Any], table: str, where: str, exprs: dict[str, str],
          skip: tuple[str, ...], lo: int, hi: int, params: dict[str, Any]) -> None:  # fmt: skip
    """Rows g = lo..hi of `table`, each a copy of its template rows (`where`, over alias t)
    with `exprs` (SQL over t and g) in place of those columns and `skip` left to their
    defaults (serial ids)."""
    cols = [c for c in _columns(db, table) if c not in skip]
    select = ", ".join(exprs.get(c, f"t.{c}") for c in cols)
    db.execute(
        f"INSERT INTO {table} ({', '.join(cols)}) SELECT {select} FROM {table} t "
        f"CROSS JOIN generate_series(%(lo)s::bigint, %(hi)s::bigint) g WHERE {where} ORDER BY g",
        {**params, "lo": lo, "hi": hi},
    )


def fill(url: str, n: int, running: int) -> Filled:
    """The ledger at `url` with n bulk rollouts, a real template, `running` live ones."""
    ledger = Ledger.open(url)
    now = time.time()
    for i in range(HOSTS):
        ledger.register_host(_caps(f"bench-host-{i:02d}"), now)
    template = _submit(ledger, "template", "t0", now)
    [lease] = ledger.claim("bench-host-00", 1, now, LEASE_S)
    ledger.add_usage({template: 1.5}, {template: {"fleet-tiny-chat-v1": (1200, 340)}})
    ledger.complete("bench-host-00", Completion(
        work_id=lease.work_id, fencing_token=lease.fencing_token, outcome=Outcome.SUCCEEDED,
        runtime="namespace", device="cpu",
        results=(StepResult(index=0, exit_code=0, stdout=b"hello\n"),),
    ), now)  # fmt: skip
    base = now - n * SPACING_S
    g_id = "'r_b' || lpad(g::text, 8, '0')"
    tenant = f"CASE WHEN g %% 1000 = 0 THEN '{SMALL_TENANT}' ELSE 't' || (g %% {TENANTS}) END"
    created = f"{base} + g * {SPACING_S}"
    rollout = {
        "id": g_id, "idempotency_key": "'bench-' || g", "tenant": tenant,
        "labels_json": """'{"suite":"s' || (g %% 100) || '"}'""",
        "state": "CASE WHEN g %% 1000 = 3 THEN 'CANCELLED' WHEN g %% 50 = 7 THEN 'FAILED' "
                 "ELSE 'SUCCEEDED' END",
        "created_at": created, "updated_at": f"{created} + 2", "started_at": f"{created} + 1",
        "finished_at": f"{created} + 2",
    }  # fmt: skip
    work_id = "'w_b' || lpad(g::text, 8, '0')"
    params = {"template": template}
    print(f"filling {n:,} rollouts ...", flush=True)  # noqa: T201
    started = time.monotonic()
    with psycopg.connect(url, autocommit=True) as db:
        db.execute("SET synchronous_commit = off")
        (work,) = db.execute("SELECT id FROM work_items WHERE rollout_id = %s",
                             (template,)).fetchone() or ("",)  # fmt: skip
        params["work"] = work
        for lo in range(1, n + 1, CHUNK):
            hi = min(lo + CHUNK - 1, n)
            with db.transaction():
                _copy(db, "rollouts", "t.id = %(template)s", rollout, ("seq",), lo, hi, params)
                _copy(db, "rollout_labels", "t.rollout_id = %(template)s",
                      {"rollout_id": g_id, "value": "'s' || (g %% 100)"}, (), lo, hi,
                      params)  # fmt: skip
                _copy(db, "work_items", "t.rollout_id = %(template)s",
                      {"id": work_id, "rollout_id": g_id, "tenant": tenant}, (), lo, hi,
                      params)  # fmt: skip
                _copy(db, "attempts", "t.work_id = %(work)s",
                      {"work_id": work_id, "started_at": f"{created} + 1",
                       "ended_at": f"{created} + 2"}, ("id",), lo, hi, params)  # fmt: skip
                _copy(db, "events", "t.rollout_id = %(template)s",
                      {"rollout_id": g_id, "at": f"{created} + 1"}, ("seq",), lo, hi,
                      params)  # fmt: skip
            print(f"  {hi:,} in {time.monotonic() - started:.0f} s", flush=True)  # noqa: T201
        db.execute("ANALYZE")
        seqs = db.execute(
            "SELECT seq FROM rollouts WHERE id IN (%s, %s)",
            (f"r_b{n // 2:08d}", f"r_b{1:08d}"),
        ).fetchall()  # fmt: skip
    live = [_submit(ledger, f"live-{i}", "t0", now) for i in range(running)]
    got = ledger.claim("bench-host-01", running, now, LEASE_S)
    assert len(got) == running, f"claimed {len(got)} of {running}"
    _, admin = ledger.identities.create_key("ops", frozenset({Scope.ADMIN}), None, now)
    _, small = ledger.identities.create_key(SMALL_TENANT, frozenset({Scope.ROLLOUTS_READ}),
                                            None, now)  # fmt: skip
    middle, oldest = sorted(int(s) for (s,) in seqs)[::-1]
    return Filled(
        url, n, ledger, template, live, format_api_key(admin), format_api_key(small),
        [f"r_b{g:08d}" for g in (n, n // 2, 1)], middle, oldest, now,
    )  # fmt: skip


# -- part one: server time of each page -------------------------------------------------------


def _console(ledger: Ledger) -> Console:
    async def read(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    async def chunks(digest: str) -> AsyncIterator[tuple[int, bytes, int]]:
        raise AssertionError("no download in this benchmark")
        yield (0, b"", 0)

    return Console(Backend(ledger, read, read, chunks, lambda: None), SECRET)


async def _cookie(console: Console, key: str) -> str:
    signed = await console.keys.sign_in(key)
    value = console.sessions.issue(signed.id, signed.tenant, tuple(sorted(signed.scopes)),
                                   time.time())  # fmt: skip
    return f"fleet_console={value}"


def _pages(f: Filled) -> list[tuple[str, str, str]]:
    """(label, who, path) of every page measured."""
    start = datetime.fromtimestamp(f.now - f.n * SPACING_S / 2, UTC)
    window = urllib.parse.urlencode({
        "since": start.strftime("%Y-%m-%dT%H:%M"),
        "until": (start + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M"),
    })  # fmt: skip
    return [
        ("rollouts, first page", "admin", "/rollouts"),
        ("rollouts, state=FAILED", "admin", "/rollouts?state=FAILED"),
        ("rollouts, state=CANCELLED (0.1%)", "admin", "/rollouts?state=CANCELLED"),
        ("rollouts, label suite=s42", "admin", "/rollouts?label=suite%3Ds42"),
        ("rollouts, one hour at 50%", "admin", f"/rollouts?{window}"),
        ("rollouts, a tenant of 0.1%", "tenant", "/rollouts"),
        ("rollouts, keyset page at 50%", "admin", f"/rollouts?after={f.middle_seq}"),
        ("rollouts, keyset page at 100%", "admin", f"/rollouts?after={f.oldest_seq + 51}"),
        ("rollout (attempts, tokens)", "admin", f"/rollouts/{f.template}"),
        ("rollout (bulk, 50% deep)", "admin", f"/rollouts/{f.bulk_ids[1]}"),
        ("rollout live poll, no change", "admin", f"/rollouts/{f.running[0]}/live?after=LAST"),
        ("hosts (50)", "admin", "/hosts"),
    ]  # fmt: skip


async def server_times(f: Filled, samples: int) -> dict[str, tuple[float, float]]:
    """label -> (p50, p95) milliseconds of the console's handler for each page."""
    console = _console(f.ledger)
    cookies = {"admin": await _cookie(console, f.admin),
               "tenant": await _cookie(console, f.tenant_key)}  # fmt: skip
    last = f.ledger.events(f.running[0], 0)[-1].sequence
    out: dict[str, tuple[float, float]] = {}
    for label, who, path in _pages(f):
        path = path.replace("LAST", str(last))
        headers = {"cookie": cookies[who], "host": "127.0.0.1"}
        answer = await console.handle("GET", path, headers, b"")
        status = int(answer.split(b" ", 2)[1])
        if status not in (200, 204) or (path.startswith("/rollouts?") and b"/rollouts/r_"
                                         not in answer):  # fmt: skip
            raise SystemExit(f"{path}: {status}\n{answer[:3000].decode(errors='replace')}")
        times = []
        for _ in range(samples):
            t0 = time.perf_counter()
            await console.handle("GET", path, headers, b"")
            times.append((time.perf_counter() - t0) * 1000)
        out[label] = (percentile(times, 0.5), percentile(times, 0.95))
    return out


# -- part two: a live page's cost beside a watch ----------------------------------------------


def _serve(url: str, port: Any, http_port: Any) -> None:
    """A `ServerProcess` target: `fleet serve` on the ledger at `url`, with its console."""
    quiet()
    from fleet.config import Paths
    from fleet.image.store import ImageStore
    from fleet.server.app import FleetServer
    from fleet.server.settings import ServerConfig

    async def main() -> None:
        paths = Paths.from_env()
        config = ServerConfig(lease_ttl_s=LEASE_S, retain_days=0, token_secret=SECRET)
        server = FleetServer(Ledger.open(url), ImageStore(paths.images, paths.recipes),
                             "127.0.0.1:0", config, None, console_listen="127.0.0.1:0")  # fmt: skip
        await server.start()
        port.value, http_port.value = server.port, server.console_port
        await server.wait()

    asyncio.run(main())


async def _pages_polling(base: str, cookie: str, ids: list[str], after: dict[str, int] | None,
                         until: float) -> int:  # fmt: skip
    """Live pages of `ids` polled every POLL_S until `until` (with ?after= when `after` is
    given, as console.js asks); returns the polls answered."""
    import httpx

    answered = 0
    limits = httpx.Limits(max_connections=len(ids), max_keepalive_connections=len(ids))
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as http:

        async def page(rid: str, offset: float) -> None:
            nonlocal answered
            await asyncio.sleep(offset)
            query = f"?after={after[rid]}" if after is not None else ""
            while time.monotonic() < until:
                reply = await http.get(f"/rollouts/{rid}/live{query}",
                                       headers={"Cookie": cookie})  # fmt: skip
                assert reply.status_code in (200, 204), reply.text[:500]
                answered += 1
                await asyncio.sleep(POLL_S)

        spread = POLL_S / len(ids)
        await asyncio.gather(*(page(rid, i * spread) for i, rid in enumerate(ids)))
    return answered


async def _watching(address: str, ids: list[str], after: dict[str, int], until: float) -> int:
    """A WatchRollout stream of each of `ids`, held until `until`; returns events received."""
    import grpc

    from fleet.api.pb import fleet_pb2, fleet_pb2_grpc

    received = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = fleet_pb2_grpc.FleetServiceStub(channel)

        async def watch(rid: str) -> None:
            nonlocal received
            call = stub.WatchRollout(
                fleet_pb2.WatchRolloutRequest(id=rid, after_sequence=after[rid])
            )
            with contextlib.suppress(asyncio.CancelledError):
                async for _ in call:
                    received += 1
            call.cancel()

        tasks = [asyncio.create_task(watch(rid)) for rid in ids]
        await asyncio.sleep(max(0.0, until - time.monotonic()))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return received


async def _cpu_over(
    pids: tuple[int, int], seconds: float, load: Callable[[float], Awaitable[int]]
) -> tuple[float, float, int]:
    """(server CPU s per minute, PostgreSQL CPU s per minute, load's count) over `seconds`."""
    await asyncio.sleep(1.0)  # (connections and streams opened before the reading starts)
    server0, pg0, t0 = process_cpu_s(pids[0]), tree_cpu_s(pids[1]), time.monotonic()
    count = await load(t0 + seconds)
    elapsed = time.monotonic() - t0
    per_min = 60.0 / elapsed
    return ((process_cpu_s(pids[0]) - server0) * per_min, (tree_cpu_s(pids[1]) - pg0) * per_min,
            count)  # fmt: skip


async def live_costs(
    f: Filled, pg: PgServer, seconds: float
) -> dict[str, tuple[float, float, int]]:
    """label -> (server CPU s/min, PostgreSQL CPU s/min, polls or events) of N live pages
    polling, with and without ?after=, of N watch streams, and of neither (idle)."""
    after = {rid: f.ledger.events(rid, 0)[-1].sequence for rid in f.running}
    with ServerProcess(_serve, f.url) as server:
        base = f"http://{server.http_address}"
        pids = (server.pid, pg.pid)
        console = _console(f.ledger)
        cookie = await _cookie(console, f.admin)

        async def idle(until: float) -> int:
            await asyncio.sleep(max(0.0, until - time.monotonic()))
            return 0

        out = {"idle (no page, no stream)": await _cpu_over(pids, seconds, idle)}
        out["live pages, ?after= (console.js)"] = await _cpu_over(
            pids, seconds, lambda until: _pages_polling(base, cookie, f.running, after, until)
        )
        out["live pages, whole fragment each poll"] = await _cpu_over(
            pids, seconds, lambda until: _pages_polling(base, cookie, f.running, None, until)
        )
        out["WatchRollout streams"] = await _cpu_over(
            pids, seconds, lambda until: _watching(server.address, f.running, after, until)
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rollouts",
        type=int,
        default=1_000_000,
        help="bulk rollouts in the ledger (default 1,000,000)",
    )
    parser.add_argument(
        "--live",
        type=int,
        default=50,
        help="live pages, and watch streams, open at once (default 50)",
    )
    parser.add_argument("--samples", type=int, default=200, help="requests per page measured")
    parser.add_argument(
        "--seconds", type=float, default=30.0, help="how long each live/watch load is measured"
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    if args.rollouts < 1000:
        parser.error("--rollouts: at least 1000 (one in a thousand is the small tenant's)")
    quiet()
    with postgres_server() as pg:
        with psycopg.connect(pg.url, autocommit=True) as db:
            db.execute('CREATE DATABASE "console"')
        url = pg.url.rsplit("/", 1)[0] + "/console"
        f = fill(url, args.rollouts, args.live)
        times = asyncio.run(server_times(f, args.samples))
        costs = asyncio.run(live_costs(f, pg, args.seconds))
    results: dict[str, Any] = {"rollouts": args.rollouts, "live": args.live}
    title = f"\nconsole with {args.rollouts:,} rollouts in PostgreSQL: server time, "
    print(title + f"{args.samples} requests a page")  # noqa: T201
    table = Table(36, (("p50 ms", 9), ("p95 ms", 9), ("target", 9), ("p95/target", 11)))
    table.print_header()
    for label, (p50, p95) in times.items():
        table.print_row(
            label,
            f"{p50:.1f}",
            f"{p95:.1f}",
            f"{TARGET_MS:.0f}",
            f"{p95 / TARGET_MS:.2f}",
            tail="" if p95 <= TARGET_MS else "  OVER",
        )
        results[f"p95_ms {label}"] = p95
    title = f"\n{args.live} open at once, {args.seconds:.0f} s each: CPU seconds per minute "
    print(title + "(idle subtracted in the last two columns)")  # noqa: T201
    cost = Table(38, (("server", 8), ("postgres", 9), ("count", 8), ("server-idle", 12),
                      ("all-idle", 9)))  # fmt: skip
    cost.print_header()
    idle_server, idle_pg, _ = costs["idle (no page, no stream)"]
    net: dict[str, float] = {}
    for label, (server_s, pg_s, count) in costs.items():
        net[label] = server_s + pg_s - idle_server - idle_pg
        cost.print_row(label, f"{server_s:.2f}", f"{pg_s:.2f}", str(count),
                       f"{server_s - idle_server:.2f}", f"{net[label]:.2f}")  # fmt: skip
        results[f"cpu_s_per_min {label}"] = server_s + pg_s
    watch = net["WatchRollout streams"]
    for label in ("live pages, ?after= (console.js)", "live pages, whole fragment each poll"):
        ratio = net[label] / watch if watch > 0 else float("inf")
        print(f"{label} / watch streams: {ratio:.2f}")  # noqa: T201
        results[f"ratio {label} / watch"] = ratio
    if args.json:
        print_json(results, 3)


if __name__ == "__main__":
    main()
