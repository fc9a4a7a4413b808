"""How often hosts beat, and how long their leases last, as a fleet grows.

Each beat costs the replica that takes it about a millisecond of CPU (gRPC, TLS, the call's
identity, its share of a group commit) and PostgreSQL a row update. At a fixed interval that
cost grows with the fleet: 1,000 hosts beating every 3 s are 333 beats a second, about 40% of
a core. So, as Nomad paces its clients' heartbeats (`max_heartbeats_per_second`), the fleet as
a whole is asked for at most `max_per_s` beats a second: up to `base_interval_s * max_per_s`
hosts beat at the base interval; beyond that each host beats every `hosts / max_per_s`
seconds. A lease lasts at least `BEATS_PER_LEASE` of those intervals, so a host still misses
two beats before its work is retried elsewhere; that is the price of a large fleet: a dead
host is noticed later (at 1,000 hosts and 100 beats a second, 10 s beats and 30 s leases).

Every replica counts the same hosts in the shared ledger, so every replica paces alike. A
fleet whose size wavers around a step keeps its pace (`settle`): each change of pace has every
host draw a new moment to beat, and a pace that changed at every count would bunch them.
"""

from __future__ import annotations

from dataclasses import dataclass

BEATS_PER_LEASE = 3.0
"""A paced lease outlives this many intervals (the base lease may be longer still)."""
SETTLE = 0.1
"""A new pace is taken only when its interval differs from the current one by more than this
share of it (either way)."""
COUNT_AT_START_S = 3600.0
"""A server that has just started counts the hosts that beat within this long: it cannot
know the pace its hosts were last given, so it takes the longest they may have had."""


@dataclass(frozen=True)
class Pace:
    """What hosts are told: beat every `heartbeat_interval_s`; a beat renews a lease for
    `lease_ttl_s`."""

    heartbeat_interval_s: float
    lease_ttl_s: float


def pace(hosts: int, base_interval_s: float, base_lease_ttl_s: float, max_per_s: float) -> Pace:
    """The pace for a fleet of `hosts` live hosts (0 `max_per_s`: the base pace, whatever the
    fleet's size)."""
    if max_per_s <= 0 or hosts <= base_interval_s * max_per_s:
        return Pace(base_interval_s, base_lease_ttl_s)
    interval = hosts / max_per_s
    return Pace(interval, max(base_lease_ttl_s, BEATS_PER_LEASE * interval))


def settle(current: Pace, new: Pace) -> Pace:
    """The pace to keep: `new` where its interval is more than `SETTLE` from `current`'s
    (either way), else `current`."""
    a, b = current.heartbeat_interval_s, new.heartbeat_interval_s
    return new if abs(b - a) > SETTLE * a else current
