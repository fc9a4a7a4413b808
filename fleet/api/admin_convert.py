"""AdminService's messages to and from fleet's own types, both ways, for the server and for
the clients that call it: a field the wire cannot carry as fleet's type is refused naming it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from pydantic import ValidationError

from fleet.api.convert import HOST_CLASS_FROM_PB, HOST_CLASS_TO_PB, RUNTIME_FROM_PB
from fleet.api.pb import admin_pb2
from fleet.core.adaptive import Adaptive
from fleet.core.errors import InvalidArgument
from fleet.core.gates import Gates
from fleet.core.placement import HostClass, Pool, RuntimeKind
from fleet.core.report import Report, Totals

if TYPE_CHECKING:
    from fleet.ledger.pools import PoolEvent


def when(at: float | None) -> float:
    """A time on the wire: 0 stands for none."""
    return at if at is not None else 0.0


def optional(at: float) -> float | None:
    """A time from the wire: 0 is none."""
    return at if at else None


def host_class(value: int, field: str) -> HostClass:
    """A host class from the wire; unspecified or unknown is refused naming `field`."""
    found: HostClass | None = HOST_CLASS_FROM_PB.get(value)  # type: ignore[call-overload]
    if found is None:
        raise InvalidArgument(f"{field}: a host class is needed (cpu or gpu), got {value}")
    return found


def runtimes(values: Iterable[int], field: str) -> frozenset[RuntimeKind]:
    out: set[RuntimeKind] = set()
    for value in values:
        found: RuntimeKind | None = RUNTIME_FROM_PB.get(value)  # type: ignore[call-overload]
        if found is None:
            raise InvalidArgument(f"{field}: unknown runtime {value} (namespace or smol)")
        out.add(found)
    return frozenset(out)


def pool_to_pb(pool: Pool) -> admin_pb2.Pool:
    g = pool.gates
    out = admin_pb2.Pool(
        name=pool.name, host_class=HOST_CLASS_TO_PB[pool.host_class], labels=pool.labels,
        max_running=pool.max_running,
        gates=admin_pb2.PoolGates(
            p95_ms=g.p95_ms, queue_age_ms=g.queue_age_ms, retry_rate=g.retry_rate,
            artifact_failure_rate=g.artifact_failure_rate, window_s=g.window_s,
            min_attempts=g.min_attempts,
        ),
    )  # fmt: skip
    if pool.adaptive is not None:
        a = pool.adaptive
        out.adaptive.CopyFrom(admin_pb2.PoolAdaptive(
            start=a.start, step=a.step, backoff=a.backoff, interval_s=a.interval_s))  # fmt: skip
    return out


def pool_from_pb(pb: admin_pb2.Pool) -> Pool:
    """The pool a SetPool request describes; a limit out of range is refused naming its field
    (`pool.gates.retry_rate: …`). Gates' window and minimum left at 0 take their defaults."""
    if not pb.name:
        raise InvalidArgument("pool.name: a pool needs a name")
    g = pb.gates
    defaults = Gates()
    where = "pool.gates"
    try:
        gates = Gates(
            p95_ms=g.p95_ms, queue_age_ms=g.queue_age_ms, retry_rate=g.retry_rate,
            artifact_failure_rate=g.artifact_failure_rate,
            window_s=g.window_s or defaults.window_s,
            min_attempts=g.min_attempts or defaults.min_attempts,
        )  # fmt: skip
        adaptive = None
        if pb.HasField("adaptive"):
            where = "pool.adaptive"
            a = pb.adaptive
            adaptive = Adaptive(start=a.start, step=a.step, backoff=a.backoff,
                                interval_s=a.interval_s)  # fmt: skip
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidArgument(f"{where}.{first['loc'][0]}: {first['msg']}") from None
    if adaptive is not None and pb.max_running:
        raise InvalidArgument("pool.max_running and pool.adaptive: an adaptive pool's cap is "
                              "sought from adaptive.start")  # fmt: skip
    return Pool(name=pb.name, host_class=host_class(pb.host_class, "pool.host_class"),
                labels=dict(pb.labels), max_running=pb.max_running, gates=gates,
                adaptive=adaptive)  # fmt: skip


def window(value: float, field: str) -> float:
    """A window's length from the wire: a finite number of seconds more than 0."""
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgument(f"{field}: a window of more than 0 seconds is needed, got {value}")
    return value


def prices(values: Mapping[str, float], field: str) -> dict[str, float] | None:
    """A report's prices from the wire (none: the server's); each finite and not negative."""
    for name, price in values.items():
        if not (math.isfinite(price) and price >= 0):
            raise InvalidArgument(f"{field}[{name!r}]: a price is 0 or more, got {price}")
    return dict(values) or None


def pool_event_to_pb(e: PoolEvent) -> admin_pb2.PoolEvent:
    return admin_pb2.PoolEvent(seq=e.seq, pool=e.pool, at=e.at, kind=e.kind, cap=e.cap,
                               message=e.message, figures=e.figures)  # fmt: skip


def report_to_pb(r: Report) -> admin_pb2.ReportResponse:
    return admin_pb2.ReportResponse(
        since=r.since, until=r.until, by_label=r.by_label, prices=dict(r.prices),
        groups=[
            admin_pb2.ReportGroup(
                name=g.name, rollouts=len(g.rollouts), completed=g.completed,
                attempts=g.attempts, cost=g.cost, cpu_s=g.cpu_s, wall_s=g.wall_s,
                device_s=g.device_s, peak_memory_mib=g.peak_memory_mib,
                prompt_tokens=g.prompt_tokens, completion_tokens=g.completion_tokens,
                token_cost=g.token_cost,
            )
            for g in r.groups
        ],
        slices=[admin_pb2.ReportSlice(minutes=t, completed=done, cost=cost)
                for t, done, cost in r.slices],
        paused=[admin_pb2.PoolPauses(pool=pool, times=n, seconds=s)
                for pool, (n, s) in sorted(r.paused.items())],
        caps=[admin_pb2.PoolCap(pool=pool, at=at, cap=cap) for pool, at, cap in r.caps],
    )  # fmt: skip


def report_from_pb(pb: admin_pb2.ReportResponse) -> Report:
    """The report a server sent, as `fleet report` prints and charts it."""
    return Report(
        since=pb.since, until=pb.until, by_label=pb.by_label, prices=dict(pb.prices),
        groups=[
            Totals(
                name=g.name, rollout_count=g.rollouts, completed=g.completed,
                attempts=g.attempts, cost=g.cost, cpu_s=g.cpu_s, wall_s=g.wall_s,
                device_s=g.device_s, peak_memory_mib=g.peak_memory_mib,
                prompt_tokens=g.prompt_tokens, completion_tokens=g.completion_tokens,
                token_cost=g.token_cost,
            )
            for g in pb.groups
        ],
        slices=[(s.minutes, s.completed, s.cost) for s in pb.slices],
        paused={p.pool: (p.times, p.seconds) for p in pb.paused},
        caps=[(c.pool, c.at, c.cap) for c in pb.caps],
    )  # fmt: skip
