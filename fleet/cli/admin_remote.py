"""`fleet host|key|pool|rollback|report --server`: the admin commands over AdminService, from
any machine that holds the server's address, the fleet CA's certificate and a key with the
admin scope (no ledger, no CA key). Their output is the same as the `--db` commands'; a list
is asked for before its header is printed, so a refused command prints no empty table."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Protocol

from fleet.api import admin_convert
from fleet.api.convert import HOST_CLASS_FROM_PB, RUNTIME_FROM_PB
from fleet.cli.client import connect, parse_labels
from fleet.client import AsyncFleet
from fleet.core.credentials import parse_scopes
from fleet.core.errors import InvalidArgument
from fleet.core.placement import HostClass, Pool
from fleet.core.report import Report


def add_remote_flags(sp: argparse.ArgumentParser) -> None:
    """--server, --key, --ca and --plaintext, as every remote command takes them; --server
    here has no default but $FLEET_SERVER (without one the command opens the ledger)."""
    sp.add_argument(
        "--server", default=os.environ.get("FLEET_SERVER", ""),
        help="act through this server's AdminService (host:port; default $FLEET_SERVER), with "
        "an admin-scoped --key; without one, on the ledger (--db)",
    )  # fmt: skip
    sp.add_argument("--key", default="",
                    help="an API key with the admin scope (default $FLEET_KEY, else "
                    "$FLEET_HOME/admin.key when it exists)")  # fmt: skip
    sp.add_argument("--ca", default="",
                    help="the fleet CA's certificate (default $FLEET_CA, else "
                    "$FLEET_HOME/ca/ca.crt when it exists; without one, no TLS)")  # fmt: skip
    sp.add_argument("--plaintext", action="store_true",
                    help="no TLS (a server started with --insecure or without a CA)")  # fmt: skip


def is_remote(args: argparse.Namespace) -> bool:
    """Whether the command goes through a server: --server (or $FLEET_SERVER) and no --db."""
    return bool(getattr(args, "server", "")) and not getattr(args, "db", None)


def _when(at: float) -> str:
    if not at:
        return "-"
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _labels(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _class(value: int) -> str:
    found: HostClass | None = HOST_CLASS_FROM_PB.get(value)  # type: ignore[call-overload]
    return found.value if found is not None else "-"


def _runtimes(values: Iterable[int]) -> str:
    found = (RUNTIME_FROM_PB.get(v) for v in values)  # type: ignore[call-overload]
    return ",".join(sorted(r.value for r in found if r is not None))


class PoolEventLike(Protocol):
    """A pool event as the ledger reads it or AdminService sends it."""

    @property
    def at(self) -> float: ...
    @property
    def pool(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def message(self) -> str: ...
    @property
    def figures(self) -> Mapping[str, float]: ...


def print_pool_events(events: Iterable[PoolEventLike]) -> None:
    """`fleet pool events`, one line each, whether from the ledger or a server."""
    for e in events:
        figures = " ".join(f"{k}={v:g}" for k, v in sorted(e.figures.items()))
        print(f"{_when(e.at)}  {e.pool:<12} {e.kind:<8} {e.message}  [{figures}]")


async def _with(args: argparse.Namespace, run: Callable[[AsyncFleet], Awaitable[None]]) -> int:
    """`run` on a connection to --server, closed after it."""
    async with connect(args) as fleet:
        await run(fleet)
    return 0


async def cmd_host(args: argparse.Namespace, duration_s: Callable[[str], float]) -> int:
    from fleet.identity.bounds import parse_runtimes

    async def run(fleet: AsyncFleet) -> None:
        admin = fleet.admin
        if args.host_cmd == "token":
            if args.token_cmd == "create":
                made = await admin.create_join_token(
                    HostClass(args.host_class), labels=parse_labels(args.label),
                    ttl_s=duration_s(args.ttl), uses=args.uses,
                    runtimes=parse_runtimes(args.runtime),
                )  # fmt: skip
                t = made.token
                uses = "once" if t.uses_left == 1 else f"{t.uses_left} times"
                runtimes = _runtimes(t.runtimes)
                print(f"join token {t.id}: {_class(t.host_class)}-class hosts, labels "
                      f"{_labels(t.labels) or '(none)'}, runtime {runtimes}, usable {uses}, "
                      f"until {_when(t.expires_at)}")  # fmt: skip
                print(f"CA fingerprint: {made.ca_fingerprint}")
                print("on the new host:")
                runtime = runtimes if len(t.runtimes) == 1 else "auto"
                print(f"  fleet agent --class {_class(t.host_class)} --runtime {runtime} "
                      f"--server {fleet.server} --ca-fingerprint {made.ca_fingerprint} "
                      "--join TOKEN --host-id NAME")  # fmt: skip
                print("  (NAME: this host's own id in the fleet; two hosts cannot share one)")
                print(made.secret)
            elif args.token_cmd == "list":
                tokens = await admin.join_tokens()
                print(f"{'id':<8} {'class':<5} {'runtimes':<15} {'uses left':>9}  "
                      f"{'expires':<20} {'revoked':<20} labels")  # fmt: skip
                for t in tokens:
                    print(f"{t.id:<8} {_class(t.host_class):<5} {_runtimes(t.runtimes):<15} "
                          f"{t.uses_left:>9}  {_when(t.expires_at):<20} "
                          f"{_when(t.revoked_at):<20} {_labels(t.labels)}")  # fmt: skip
            else:
                await admin.revoke_join_token(args.id)
                print(f"join token {args.id} revoked")
        elif args.host_cmd == "list":
            now = time.time()
            hosts = await admin.hosts(args.unresponsive_after_s)
            print(f"{'host':<24} {'class':<5} {'state':<21} {'version':<9} {'slots':>7}  "
                  f"{'last beat':>9}  {'certificate until':<20} {'labels':<16} images")  # fmt: skip
            for h in hosts:
                short = ",".join(d.removeprefix("sha256:")[:12] for d in h.images)
                images = f"{len(h.images)}: {short}" if h.images else "0"
                ago = f"{max(0, int(now - h.last_heartbeat_at))}s ago"
                print(f"{h.host_id:<24} {_class(h.host_class):<5} {h.state:<21} "
                      f"{h.agent_version or '-':<9} {f'{h.slots_used}/{h.slots}':>7}  "
                      f"{ago:>9}  {_when(h.cert_expires_at):<20} {_labels(h.labels) or '-':<16} "
                      f"{images}")  # fmt: skip
        elif args.host_cmd == "drain":
            reply = await admin.drain(args.id, duration_s(args.deadline))
            until = _when(reply.drain_deadline)
            print(f"host {args.id} draining: it takes no new work; what it holds runs until "
                  f"{until}, then is released for retry elsewhere")  # fmt: skip
        elif args.host_cmd in ("cordon", "uncordon"):
            await (admin.cordon if args.host_cmd == "cordon" else admin.uncordon)(args.id)
            what = ("takes no new work; what it holds runs on" if args.host_cmd == "cordon"
                    else "takes work again")  # fmt: skip
            print(f"host {args.id} {args.host_cmd}ed: it {what}")
        elif args.host_cmd == "revoke":
            revoked = await admin.revoke_host(args.id)
            print(f"host {args.id} revoked: its calls are refused from now on; "
                  f"{revoked.leases_released} leases it held were released for retry "
                  "elsewhere")  # fmt: skip
        else:
            raise InvalidArgument(f"fleet host {args.host_cmd} has no --server form")

    return await _with(args, run)


async def cmd_pool(
    args: argparse.Namespace, pool_from: Callable[[argparse.Namespace], Pool],
    duration_s: Callable[[str], float],
) -> int:  # fmt: skip
    async def run(fleet: AsyncFleet) -> None:
        admin = fleet.admin
        if args.pool_cmd == "set":
            pool = await admin.set_pool(pool_from(args))
            cap = f"at most {pool.max_running} running at once" if pool.max_running else "no cap"
            if pool.adaptive is not None:
                cap = f"an adaptive cap from {pool.adaptive.start}"
            print(f"pool {pool.name}: {pool.host_class.value}-class hosts labelled "
                  f"{_labels(pool.labels) or '(any)'}, {cap}; gates {pool.gates.describe()}; "
                  "claims see it at once")  # fmt: skip
        elif args.pool_cmd == "delete":
            await admin.delete_pool(args.name)
            print(f"pool {args.name} deleted: its hosts run without its cap")
        elif args.pool_cmd == "list":
            views = await admin.pools()
            print(f"{'pool':<16} {'class':<5} {'running':>9} {'slots':>5}  {'cap':<8} "
                  f"{'state':<8} {'hosts':<5} labels  gates  members")  # fmt: skip
            for view in views:
                pool = admin_convert.pool_from_pb(view.pool)
                cap = f"{view.running}/{pool.max_running or '-'}"
                state = "paused" if view.paused_at else "ready"
                print(f"{pool.name:<16} {pool.host_class.value:<5} {cap:>9} {view.slots:>5}  "
                      f"{'adaptive' if pool.adaptive else 'fixed':<8} {state:<8} "
                      f"{len(view.members):<5} {_labels(pool.labels) or '-'}  "
                      f"{pool.gates.describe()}  {' '.join(view.members)}")  # fmt: skip
                if view.paused_at:
                    print(f"  paused since {_when(view.paused_at)}: {view.paused_why}")
        elif args.pool_cmd == "events":
            print_pool_events(await admin.pool_events(duration_s(args.since), args.pool))
        else:
            raise InvalidArgument(f"fleet pool {args.pool_cmd} has no --server form (use --db)")

    return await _with(args, run)


async def cmd_key(args: argparse.Namespace, duration_s: Callable[[str], float]) -> int:
    async def run(fleet: AsyncFleet) -> None:
        admin = fleet.admin
        if args.key_cmd == "create":
            expires = time.time() + duration_s(args.expires) if args.expires else None
            scopes = sorted(s.value for s in parse_scopes(args.scope))
            made = await admin.create_key(args.tenant, scopes, expires)
            k = made.key
            print(f"API key {k.id} for tenant {k.tenant!r}: {','.join(k.scopes)}, "
                  f"expires {_when(k.expires_at) if expires else 'never'}")  # fmt: skip
            print("shown once; the ledger keeps only its hash. Use it as --key or $FLEET_KEY:")
            print(made.secret)
        elif args.key_cmd == "list":
            keys = await admin.keys(args.tenant)
            print(f"{'id':<14} {'tenant':<16} {'scopes':<32} {'expires':<20} "
                  f"{'last used':<20} revoked")  # fmt: skip
            for k in keys:
                print(f"{k.id:<14} {k.tenant:<16} {','.join(k.scopes):<32} "
                      f"{_when(k.expires_at):<20} {_when(k.last_used_at):<20} "
                      f"{_when(k.revoked_at)}")  # fmt: skip
        else:
            await admin.revoke_key(args.id)
            print(f"API key {args.id} revoked")

    return await _with(args, run)


async def rollback(
    args: argparse.Namespace, deadline_s: float, local_pool: str
) -> tuple[list[str], float]:
    """`fleet rollback --to local-only` through --server: the hosts set draining and the
    deadline as the server set it."""
    async with connect(args) as fleet:
        reply = await fleet.admin.rollback(deadline_s, local_pool)
    return list(reply.hosts), reply.deadline


async def undo_rollback(args: argparse.Namespace) -> list[str]:
    async with connect(args) as fleet:
        return await fleet.admin.undo_rollback()


async def rollback_state(args: argparse.Namespace) -> dict[str, Any] | None:
    async with connect(args) as fleet:
        return await fleet.admin.rollback_state()


async def report(
    args: argparse.Namespace, window_s: float, prices: Mapping[str, float] | None
) -> Report:
    """`fleet report` through --server: the server sums its ledger, this prints it."""
    async with connect(args) as fleet:
        return await fleet.admin.report(window_s, by_label=args.by_label, prices=prices)
