"""The cost report read from the ledger, for `fleet report --db` and AdminService's Report
alike (`fleet.core.report` sums it)."""

from __future__ import annotations

from collections.abc import Mapping

from fleet.core.report import PAUSES_BEFORE_S, Report, build
from fleet.ledger.hosts import Hosts


def read_report(
    ledger: Hosts, window_s: float, now: float, by_label: str = "",
    prices: Mapping[str, float] | None = None,
) -> Report:  # fmt: skip
    """The rollouts that ended in the last `window_s` before `now`, priced at `prices` (None:
    the server's, as `fleet serve --price` set them)."""
    since = now - window_s
    attempts = ledger.cost_attempts(since, by_label)
    events = ledger.pool_events(since - PAUSES_BEFORE_S)
    return build(attempts, ledger.prices() if prices is None else prices, events, since, now,
                 by_label)  # fmt: skip
