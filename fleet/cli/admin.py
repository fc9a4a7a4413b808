"""`fleet ca`, `fleet host`, `fleet key`, `fleet pool`, `fleet rollback` and `fleet report`:
the fleet's CA, join tokens, hosts, API keys, pools, the rollback to the local pool and costs.

These act on the ledger directly (`--db`, as `fleet serve` takes it): they run where the server
runs, by whoever holds its database and CA; the first admin key is made this way. Given
`--server` (or $FLEET_SERVER) and no `--db`, all but `fleet ca` and `fleet host prepare` act
through the server's AdminService instead (`fleet.cli.admin_remote`), from any machine with
the CA's certificate and an admin-scoped key. Servers see a change within their cache time (1 s).
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from fleet.cli import admin_remote
from fleet.cli.client import parse_labels
from fleet.cli.prepare import add_prepare_command
from fleet.cli.report import DEFAULT_REPORT_CHART
from fleet.cli.report import show as show_report
from fleet.config import Paths
from fleet.core.adaptive import Adaptive
from fleet.core.cost import parse_prices
from fleet.core.credentials import format_api_key, format_join_token, parse_scopes
from fleet.core.errors import InvalidArgument
from fleet.core.gates import Gates
from fleet.core.placement import HostClass, Pool
from fleet.identity.ca import CertificateAuthority

DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}

Add = Callable[..., argparse.ArgumentParser]


def duration_s(text: str) -> float:
    """`90s`, `10m`, `1h`, `30d` -> seconds."""
    found = DURATION.match(text.strip())
    if found is None:
        raise InvalidArgument(f"duration {text!r}: expected a number and s, m, h or d (e.g. 1h)")
    return float(found.group(1)) * UNIT_S[found.group(2)]


def _when(at: float | None) -> str:
    if at is None:
        return "-"
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _ledger(args: argparse.Namespace) -> Any:
    from fleet.ledger.store import Ledger

    paths = Paths.from_env()
    return Ledger.open(args.db or str(paths.home / "ledger.sqlite3"))


async def cmd_ca(args: argparse.Namespace) -> int:
    paths = Paths.from_env()
    if args.ca_cmd == "init":
        ca = CertificateAuthority.init(paths.ca)
        print(f"created the fleet CA in {paths.ca} (ca.key is readable by its owner only)")
    else:
        ca = CertificateAuthority.load(paths.ca)
    print(f"certificate: {paths.ca / 'ca.crt'}")
    print(f"fingerprint: {ca.fingerprint}")
    return 0


async def cmd_host(args: argparse.Namespace) -> int:
    from fleet.identity.bounds import parse_runtimes, runtimes_text

    if admin_remote.is_remote(args):
        return await admin_remote.cmd_host(args, duration_s)
    ledger = _ledger(args)
    ids = ledger.identities
    now = time.time()
    if args.host_cmd == "token":
        if args.token_cmd == "create":
            ca = CertificateAuthority.load(Paths.from_env().ca)
            token, presented = ids.create_join_token(
                HostClass(args.host_class), parse_labels(args.label), duration_s(args.ttl),
                args.uses, now, runtimes=parse_runtimes(args.runtime),
            )  # fmt: skip
            uses = "once" if token.uses_left == 1 else f"{token.uses_left} times"
            runtimes = runtimes_text(token.runtimes)
            print(f"join token {token.id}: {token.host_class}-class hosts, labels "
                  f"{_labels(token.labels) or '(none)'}, runtime {runtimes}, usable {uses}, "
                  f"until {_when(token.expires_at)}")  # fmt: skip
            print(f"CA fingerprint: {ca.fingerprint}")
            print("on the new host:")
            runtime = runtimes if len(token.runtimes) == 1 else "auto"
            print(f"  fleet agent --class {token.host_class} --runtime {runtime} --server "
                  f"SERVER:PORT --ca-fingerprint {ca.fingerprint} --join TOKEN "
                  "--host-id NAME")  # fmt: skip
            print("  (NAME: this host's own id in the fleet; two hosts cannot share one)")
            print(format_join_token(presented))
        elif args.token_cmd == "list":
            print(f"{'id':<8} {'class':<5} {'runtimes':<15} {'uses left':>9}  {'expires':<20} "
                  f"{'revoked':<20} labels")  # fmt: skip
            for t in ids.join_tokens():
                labels = ",".join(f"{k}={v}" for k, v in sorted(t.labels.items()))
                print(f"{t.id:<8} {t.host_class.value:<5} {runtimes_text(t.runtimes):<15} "
                      f"{t.uses_left:>9}  {_when(t.expires_at):<20} {_when(t.revoked_at):<20} "
                      f"{labels}")  # fmt: skip
        else:
            ids.revoke_join_token(args.id, now)
            print(f"join token {args.id} revoked")
    elif args.host_cmd == "list":
        enrolled = {h.host_id: h for h in ids.hosts()}
        print(f"{'host':<24} {'class':<5} {'state':<21} {'version':<9} {'slots':>7}  "
              f"{'last beat':>9}  {'certificate until':<20} {'labels':<16} images")  # fmt: skip
        for view in ledger.host_table(now, args.unresponsive_after_s):
            caps = view.capabilities
            identity = enrolled.get(caps.host_id)
            until = _when(identity.cert_expires_at) if identity is not None else "-"
            labels = ",".join(f"{k}={v}" for k, v in sorted(identity.labels.items())) if (
                identity is not None) else ""  # fmt: skip
            print(f"{caps.host_id:<24} {caps.host_class.value:<5} {view.state:<21} "
                  f"{caps.agent_version or '-':<9} {f'{view.slots_used}/{caps.slots}':>7}  "
                  f"{_ago(now - view.last_heartbeat_at):>9}  {until:<20} {labels or '-':<16} "
                  f"{_images(view.images)}")  # fmt: skip
    elif args.host_cmd == "drain":
        deadline = now + duration_s(args.deadline)
        ledger.set_host_state(args.id, "draining", drain_deadline=deadline)
        print(f"host {args.id} draining: it takes no new work; what it holds runs until "
              f"{_when(deadline)}, then is released for retry elsewhere")  # fmt: skip
    elif args.host_cmd in ("cordon", "uncordon"):
        ledger.set_host_state(args.id, "cordoned" if args.host_cmd == "cordon" else "ready")
        what = ("takes no new work; what it holds runs on" if args.host_cmd == "cordon"
                else "takes work again")  # fmt: skip
        print(f"host {args.id} {args.host_cmd}ed: it {what}")
    elif args.host_cmd == "revoke":
        released = ids.revoke_host(args.id, now)
        print(f"host {args.id} revoked: its calls are refused from now on; "
              f"{released} leases it held were released for retry elsewhere")  # fmt: skip
    return 0


def _images(digests: list[str]) -> str:
    """`2: 3f2a9c1b0d4e,9b1c…`: how many images the host holds, by their short digests."""
    if not digests:
        return "0"
    return f"{len(digests)}: " + ",".join(d.removeprefix("sha256:")[:12] for d in digests)


def _ago(seconds: float) -> str:
    """`12s ago`, `5m ago`, `3h ago`."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return f"{max(0, int(seconds))}s ago"


def _pool_from(args: argparse.Namespace) -> Pool:
    """The pool `fleet pool set` describes; a limit out of range is refused naming its flag."""
    try:
        gates = Gates(
            p95_ms=args.gate_p95_ms, queue_age_ms=args.gate_queue_age_ms,
            retry_rate=args.gate_retry_rate, artifact_failure_rate=args.gate_artifact_failure_rate,
            window_s=duration_s(args.gate_window), min_attempts=args.gate_min_attempts,
        )  # fmt: skip
        adaptive = None
        if args.adaptive:
            adaptive = Adaptive(start=args.start, step=args.step, backoff=args.backoff,
                                interval_s=duration_s(args.interval))  # fmt: skip
    except ValidationError as exc:
        first = exc.errors()[0]
        flag = {"p95_ms": "--gate-p95-ms", "queue_age_ms": "--gate-queue-age-ms",
                "retry_rate": "--gate-retry-rate", "window_s": "--gate-window",
                "artifact_failure_rate": "--gate-artifact-failure-rate",
                "min_attempts": "--gate-min-attempts", "interval_s": "--interval",
                }.get(str(first["loc"][0]), f"--{first['loc'][0]}")  # fmt: skip
        raise InvalidArgument(f"{flag}: {first['msg']}") from None
    if adaptive is not None and args.max_running:
        raise InvalidArgument("--max-running and --adaptive: an adaptive pool's cap is sought "
                              "from --start (it never exceeds its hosts' slots)")  # fmt: skip
    return Pool(name=args.name, host_class=HostClass(args.host_class),
                labels=parse_labels(args.label), max_running=args.max_running, gates=gates,
                adaptive=adaptive)  # fmt: skip


async def cmd_pool(args: argparse.Namespace) -> int:
    if admin_remote.is_remote(args):
        return await admin_remote.cmd_pool(args, _pool_from, duration_s)
    ledger = _ledger(args)
    if args.pool_cmd == "set":
        pool = _pool_from(args)
        ledger.set_pool(pool, time.time())
        if pool.adaptive is not None:
            a = pool.adaptive
            cap = (f"an adaptive cap from {a.start}, +{a.step} every {a.interval_s:g}s while "
                   f"throughput rises")  # fmt: skip
        else:
            cap = f"at most {pool.max_running} running at once" if pool.max_running else "no cap"
        print(f"pool {pool.name}: {pool.host_class.value}-class hosts labelled "
              f"{_labels(pool.labels) or '(any)'}, {cap}; gates {pool.gates.describe()}; "
              f"claims see it at once")  # fmt: skip
    elif args.pool_cmd == "delete":
        ledger.delete_pool(args.name)
        print(f"pool {args.name} deleted: its hosts run without its cap")
    elif args.pool_cmd == "events":
        since = time.time() - duration_s(args.since)
        admin_remote.print_pool_events(ledger.pool_events(since, args.pool))
    else:
        print(f"{'pool':<16} {'class':<5} {'running':>9} {'slots':>5}  {'cap':<8} {'state':<8} "
              f"{'hosts':<5} labels  gates  members")  # fmt: skip
        for view in ledger.pools():
            pool = view.pool
            cap = f"{view.running}/{pool.max_running or '-'}"
            state = "paused" if view.paused_at is not None else "ready"
            print(f"{pool.name:<16} {pool.host_class.value:<5} {cap:>9} {view.slots:>5}  "
                  f"{'adaptive' if pool.adaptive else 'fixed':<8} {state:<8} "
                  f"{len(view.members):<5} {_labels(pool.labels) or '-'}  "
                  f"{pool.gates.describe()}  {' '.join(view.members)}")  # fmt: skip
            if view.paused_at is not None:
                print(f"  paused since {_when(view.paused_at)}: {view.paused_why}")
    return 0


async def cmd_rollback(args: argparse.Namespace) -> int:
    remote = admin_remote.is_remote(args)
    if args.undo:
        hosts = await admin_remote.undo_rollback(args) if remote else _ledger(args).undo_rollback()
        print(f"rollback undone: {len(hosts)} hosts ready again ({' '.join(hosts) or '-'})")
    elif args.to:
        if args.to != "local-only":
            raise InvalidArgument("fleet rollback --to local-only is the one rollback there is")
        now = time.time()
        deadline = now + duration_s(args.deadline)
        if remote:
            hosts, deadline = await admin_remote.rollback(args, deadline - now, args.local_pool)
        else:
            hosts = _ledger(args).rollback(deadline, now, args.local_pool)
        keep = f"pool {args.local_pool}" if args.local_pool else "fleet up's agents and gpu hosts"
        print(f"rolled back to the local pool ({keep}): {len(hosts)} hosts draining until "
              f"{_when(deadline)} ({' '.join(hosts) or '-'}); cpu work now runs there too; "
              "undo with fleet rollback --undo")  # fmt: skip
    else:
        if remote:
            state = await admin_remote.rollback_state(args)
        else:
            state = _ledger(args).rollback_state()
        if state is None:
            print("no rollback in force")
        else:
            keep = state.get("local_pool") or "fleet up's agents and gpu hosts"
            print(f"rolled back to the local pool ({keep}) since {_when(state['since'])}")
    return 0


async def cmd_report(args: argparse.Namespace) -> int:
    prices = parse_prices(args.price) if args.price else None
    window_s = duration_s(args.since)
    if admin_remote.is_remote(args):
        report = await admin_remote.report(args, window_s, prices)
    else:
        from fleet.ledger.report import read_report

        report = read_report(_ledger(args), window_s, time.time(), args.by_label, prices)
    return show_report(args, report)


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


async def cmd_key(args: argparse.Namespace) -> int:
    if admin_remote.is_remote(args):
        return await admin_remote.cmd_key(args, duration_s)
    ledger = _ledger(args)
    ids = ledger.identities
    now = time.time()
    if args.key_cmd == "create":
        expires = now + duration_s(args.expires) if args.expires else None
        key, presented = ids.create_key(args.tenant, parse_scopes(args.scope), expires, now)
        print(f"API key {key.id} for tenant {key.tenant!r}: {','.join(sorted(key.scopes))}, "
              f"expires {_when(key.expires_at) if expires else 'never'}")  # fmt: skip
        print("shown once; the ledger keeps only its hash. Use it as --key or $FLEET_KEY:")
        print(format_api_key(presented))
    elif args.key_cmd == "list":
        print(f"{'id':<14} {'tenant':<16} {'scopes':<32} {'expires':<20} {'last used':<20} revoked")
        for k in ids.keys(args.tenant or None):
            scopes = ",".join(sorted(k.scopes))
            print(f"{k.id:<14} {k.tenant:<16} {scopes:<32} {_when(k.expires_at):<20} "
                  f"{_when(k.last_used_at):<20} {_when(k.revoked_at)}")  # fmt: skip
    else:
        ids.revoke_key(args.id, now)
        print(f"API key {args.id} revoked")
    return 0


def add_commands(
    add: Callable[[str, Callable[[argparse.Namespace], Coroutine[Any, Any, int]], str],
                  argparse.ArgumentParser],
) -> None:  # fmt: skip
    def db_flag(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--db", help="the server's ledger: a SQLite file or postgresql:// URL "
                        "(default $FLEET_HOME/ledger.sqlite3)")  # fmt: skip

    def target_flags(sp: argparse.ArgumentParser) -> None:
        """The ledger (--db), or a server's AdminService (--server, --key, --ca)."""
        db_flag(sp)
        admin_remote.add_remote_flags(sp)

    sp = add("ca", cmd_ca, "the fleet's certificate authority")
    csub = sp.add_subparsers(dest="ca_cmd", required=True)
    csub.add_parser("init", help="create the CA in $FLEET_HOME/ca (refuses to replace one)")
    csub.add_parser("show", help="print the CA's certificate path and fingerprint")

    sp = add("host", cmd_host, "join tokens and enrolled hosts")
    hsub = sp.add_subparsers(dest="host_cmd", required=True)
    add_prepare_command(hsub)
    t = hsub.add_parser("token", help="join tokens new hosts enroll with")
    tsub = t.add_subparsers(dest="token_cmd", required=True)
    c = tsub.add_parser(
        "create",
        help="a join token; printed on the last line. It bounds what its hosts may be: their "
        "class, labels and runtimes, as given here, ever after",
    )  # fmt: skip
    c.add_argument("--class", dest="host_class", choices=["cpu", "gpu"], default="cpu",
                   help="the class its hosts enroll as (default cpu)")  # fmt: skip
    c.add_argument("--ttl", default="1h", help="how long it can be used (default 1h)")
    c.add_argument("--uses", type=int, default=1, help="how many hosts may use it (default 1)")
    c.add_argument("--label", action="append", default=[],
                   help="KEY=VALUE its hosts carry (repeatable; they claim no other)")  # fmt: skip
    c.add_argument(
        "--runtime", default="namespace",
        help="comma-separated runtimes its hosts may run: namespace, smol (default namespace: "
        "a smol host claims VM isolation, which only an operator may grant)",
    )  # fmt: skip
    target_flags(c)
    target_flags(tsub.add_parser("list", help="join tokens, without their secrets"))
    r = tsub.add_parser("revoke", help="a token no host may use any more")
    r.add_argument("id")
    target_flags(r)
    ls = hsub.add_parser("list", help="registered hosts: state, version, slots, last beat")
    ls.add_argument(
        "--unresponsive-after-s", type=float, default=15.0,
        help="a host that has not beaten for this long shows as unresponsive (default 15)",
    )  # fmt: skip
    target_flags(ls)
    for verb, help_ in (("cordon", "no new work for a host (what it holds runs on)"),
                        ("uncordon", "a cordoned or drained host takes work again")):  # fmt: skip
        c = hsub.add_parser(verb, help=help_)
        c.add_argument("id")
        target_flags(c)
    d = hsub.add_parser("drain", help="no new work; what it holds runs until a deadline")
    d.add_argument("id")
    d.add_argument("--deadline", default="10m", help="then its leases are released (10m)")
    target_flags(d)
    r = hsub.add_parser("revoke", help="refuse a host from now on and release its leases")
    r.add_argument("id")
    target_flags(r)

    sp = add("pool", cmd_pool, "pools of hosts (class and labels) and their caps")
    psub = sp.add_subparsers(dest="pool_cmd", required=True)
    ps = psub.add_parser("set", help="make or change a pool (claims see it at once)")
    ps.add_argument("name")
    ps.add_argument("--class", dest="host_class", choices=["cpu", "gpu"], required=True)
    ps.add_argument("--label", action="append", default=[], help="KEY=VALUE hosts must carry")
    ps.add_argument(
        "--max-running", type=int, default=0,
        help="leases its hosts may hold at once, across every server (0: no cap)",
    )  # fmt: skip
    ps.add_argument("--adaptive", action="store_true",
                    help="the server seeks the cap: raised while completed trajectories per "
                    "second rise, backed off when they stop or a gate trips")  # fmt: skip
    ps.add_argument("--start", type=int, default=2, help="an adaptive pool's first cap (2)")
    ps.add_argument("--step", type=int, default=2, help="what each raise adds (2)")
    ps.add_argument("--backoff", type=float, default=0.7, help="what a back-off keeps (0.7)")
    ps.add_argument("--interval", default="10s", help="time at a cap before it is judged (10s)")
    for flag, help_ in (
        ("--gate-p95-ms", "pause while the gateway's p95 latency is over this (ms)"),
        ("--gate-queue-age-ms", "pause while its oldest queued request is older (ms)"),
        ("--gate-retry-rate", "pause while more of the pool's attempts are retried (0-1)"),
        ("--gate-artifact-failure-rate", "pause while more fail to move an artifact (0-1)"),
    ):
        ps.add_argument(flag, type=float, default=0.0, help=help_ + "; 0: no such gate")
    ps.add_argument("--gate-window", default="60s", help="the rates' sliding window (60s)")
    ps.add_argument("--gate-min-attempts", type=int, default=10,
                    help="rates are judged over at least this many attempts (10)")  # fmt: skip
    target_flags(ps)
    pd = psub.add_parser("delete", help="remove a pool (its hosts run without its cap)")
    pd.add_argument("name")
    target_flags(pd)
    target_flags(
        psub.add_parser("list", help="pools, their hosts and what they run against the cap")
    )
    pe = psub.add_parser("events", help="pools paused, resumed and caps moved, with the numbers")
    pe.add_argument("--since", default="1h", help="events this long ago or since (1h)")
    pe.add_argument("--pool", default="", help="one pool's only")
    target_flags(pe)

    sp = add("rollback", cmd_rollback, "return to the local pool, or undo that")
    sp.add_argument("--to", choices=["local-only"], help="roll back to the local pool")
    sp.add_argument("--undo", action="store_true", help="end the rollback in force")
    sp.add_argument(
        "--deadline", default="10m",
        help="other hosts' work runs this long, then is retried locally (10m)",
    )  # fmt: skip
    sp.add_argument(
        "--local-pool", default="",
        help="the pool kept (default: fleet up's agents and gpu-class hosts)",
    )  # fmt: skip
    target_flags(sp)

    sp = add("report", cmd_report, "what completed trajectories cost, by pool or label")
    sp.add_argument("--since", default="1h", help="rollouts that ended this long ago or since")
    sp.add_argument(
        "--price", default="",
        help="cpu=0.04/h,gpu=2.10/h,tokens:MODEL=0.50/Mtok: host classes per host-hour, a "
        "language model's tokens per million (tokens: prompt and completion alike; prompt:MODEL= "
        "and completion:MODEL= each; MODEL * for any model without its own) "
        "(default: fleet serve --price's)",
    )  # fmt: skip
    sp.add_argument("--by-label", default="", help="group by this rollout label, not by pool")
    sp.add_argument("--json", action="store_true",
                    help="print the figures as one JSON object instead of the table")  # fmt: skip
    sp.add_argument(
        "--chart",
        default=None,
        help=f"write the chart here (PNG; '' for none; default {DEFAULT_REPORT_CHART} where "
        "matplotlib is installed: the demo extra)",
    )
    target_flags(sp)

    sp = add("key", cmd_key, "tenants' API keys")
    ksub = sp.add_subparsers(dest="key_cmd", required=True)
    c = ksub.add_parser("create", help="an API key; printed once, on the last line")
    c.add_argument("--tenant", required=True)
    c.add_argument("--scope", default="rollouts:read,rollouts:write",
                   help="comma-separated: rollouts:read, rollouts:write, admin "
                   "(default rollouts:read,rollouts:write)")  # fmt: skip
    c.add_argument("--expires", default="", help="e.g. 30d (default: never)")
    target_flags(c)
    ls = ksub.add_parser("list", help="keys, without their secrets")
    ls.add_argument("--tenant", default="")
    target_flags(ls)
    r = ksub.add_parser("revoke", help="refuse a key from now on")
    r.add_argument("id")
    target_flags(r)
