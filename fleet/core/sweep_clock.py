"""The clock a server's sweeper judges leases by, which does not count time the server itself
was not running.

A lease expires when its host has not beaten for a lease's length. But a host's beats reach
the ledger only through a server: while the server is paused (a VM stopped and resumed, the
process stopped, its ledger thread stuck behind a disk), no beat is recorded, and on resuming
the wall clock has moved on. Judged by the wall clock, every lease would then look lost at the
first sweep, before any host had a chance to beat again, and every rollout in flight would run
twice. So a sweep that starts later than it should have (by more than a third of a lease) sets
its clock back by the time it was late, for one lease's length: the hosts get a whole lease of
the server's own time to beat again, as if the pause had not happened. A lease that had expired
before the pause still expires at once; one whose host is really gone expires at most the
pause's length later.

A server that has just started is the same case with the pause unmeasured: it may have been
down for a second or a day, and its hosts are only now reconnecting. So for its first lease
(of its own time) it judges no lease at all; then it judges by the wall clock, and a lease
whose host did not come back expires at most one lease after the start. With replicas, the
others judge by their own clocks meanwhile: one that starts holds only its own sweeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class SweepClock:
    """`now(wall)` at the start of each sweep: the time to judge leases by, or None while
    no lease may be judged yet."""

    interval_s: float
    """The sweeper's pause between sweeps."""
    lease_ttl_s: float
    _last: float | None = None
    _behind_s: float = 0.0
    """How far the clock is set back (infinite: as far as any lease, after a start)."""
    _until: float = 0.0
    _late_s: float = 0.0

    @property
    def paused_s(self) -> float:
        """How far behind the wall clock this clock runs now (0: not at all; infinite while
        holding after a start)."""
        return self._behind_s

    @property
    def late_s(self) -> float:
        """How late the latest sweep started, if that counted as a pause (else 0)."""
        return self._late_s

    def now(self, wall: float) -> float | None:
        """The sweep's time for one that starts at `wall` (seconds since the epoch); None
        while holding after the start (its first lease, or a lease after a pause in that
        time), when no lease may be judged."""
        if self._last is None:
            self._behind_s, self._until = math.inf, wall + self.lease_ttl_s
        else:
            late = wall - self._last - self.interval_s
            self._late_s = late if late > self.lease_ttl_s / 3 else 0.0
            if self._late_s:
                # (Paused while holding after a start, even past that hold's end: the hosts
                # have not had their lease yet, and the hold starts again.)
                holding = math.isinf(self._behind_s) or wall < self._until
                self._behind_s = max(late, self._behind_s if holding else 0.0)
                self._until = wall + self.lease_ttl_s
        self._last = wall
        if wall >= self._until:
            self._behind_s = 0.0
        return None if math.isinf(self._behind_s) else wall - self._behind_s
