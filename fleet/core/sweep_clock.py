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
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SweepClock:
    """`now(wall)` at the start of each sweep: the time to judge leases by."""

    interval_s: float
    """The sweeper's pause between sweeps."""
    lease_ttl_s: float
    _last: float | None = None
    _behind_s: float = 0.0
    _until: float = 0.0

    @property
    def paused_s(self) -> float:
        """How far behind the wall clock this clock runs now (0: not at all)."""
        return self._behind_s

    def now(self, wall: float) -> float:
        """The sweep's time for one that starts at `wall` (seconds since the epoch)."""
        if self._last is not None:
            late = wall - self._last - self.interval_s
            if late > self.lease_ttl_s / 3:
                self._behind_s = max(late, self._behind_s if wall < self._until else 0.0)
                self._until = wall + self.lease_ttl_s
        self._last = wall
        if wall >= self._until:
            self._behind_s = 0.0
        return wall - self._behind_s
