"""What the console's pages read from the ledger: each function runs on one of the server's
reader threads (blocking SQL), and returns plain values for a template.

Tenancy is applied here, before anything reaches a page: a tenant's read of another tenant's
rollout raises the same NotFound as an unknown id."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from fleet.console import charts
from fleet.core.egress import EgressEvent
from fleet.core.errors import InvalidArgument, NotFound
from fleet.core.lifecycle import RolloutState
from fleet.core.rollout import Rollout, RolloutEvent
from fleet.ledger.base import HostView
from fleet.ledger.identity import HostIdentity
from fleet.ledger.records import AttemptRec
from fleet.ledger.store import Ledger

PAGE_SIZE = 50
UNRESPONSIVE_AFTER_S = 15.0
"""A host silent this long shows as unresponsive (as `fleet host list` shows it)."""
STATES = tuple(s.value for s in RolloutState)


@dataclass(frozen=True)
class RolloutPage:
    rollouts: list[Rollout]
    next_token: str
    """Where the next page starts ("": this was the last)."""


@dataclass(frozen=True)
class Filters:
    """What the rollouts list is narrowed to (each "" or None: not narrowed)."""

    tenant: str | None = None
    state: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    since: float | None = None
    until: float | None = None


def parse_label(text: str) -> dict[str, str]:
    """`key=value` -> {key: value}; "" -> {}. Anything else is refused by name."""
    text = text.strip()
    if not text:
        return {}
    key, eq, value = text.partition("=")
    if not eq or not key.strip():
        raise InvalidArgument(f"label filter {text[:80]!r}: expected KEY=VALUE")
    return {key.strip(): value.strip()}


def parse_time(name: str, text: str) -> float | None:
    """An ISO 8601 time (a browser's datetime-local value; UTC unless it names a zone) as
    epoch seconds; "" -> None. Anything else is refused, naming the filter."""
    text = text.strip()
    if not text:
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidArgument(
            f"{name} {text[:40]!r}: expected a time like 2026-12-08T09:30 (UTC)"
        ) from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def rollouts(
    ledger: Ledger, filters: Filters, after: str, size: int = PAGE_SIZE,
) -> RolloutPage:  # fmt: skip
    """Rollouts newest first, keyset-paged by the ledger's sequence (`after`: a token from the
    previous page), narrowed by `filters`, every one of them applied in the ledger's SQL (on
    its tenant and state indexes), so that a page reads about its own rows however many
    rollouts lie before it."""
    if filters.state and filters.state not in STATES:
        raise InvalidArgument(f"state {filters.state[:40]!r}: not one of {', '.join(STATES)}")
    found, token = ledger.list_rollouts(
        size, after, filters.labels, tenant=filters.tenant,
        state=RolloutState(filters.state) if filters.state else None,
        created_since=filters.since, created_before=filters.until,
    )  # fmt: skip
    return RolloutPage(found, token)


@dataclass(frozen=True)
class RolloutDetail:
    rollout: Rollout
    attempts: list[AttemptRec]
    events: list[RolloutEvent]
    egress: list[tuple[int, EgressEvent]]
    tokens: dict[str, tuple[int, int]]
    """model -> (prompt, completion) tokens the gateway charged to the rollout."""

    @property
    def last_sequence(self) -> int:
        """The sequence of the last event shown (a live page asks what came after it)."""
        return self.events[-1].sequence if self.events else 0

    @property
    def device_s(self) -> float:
        return sum(a.device_s for a in self.attempts)

    @property
    def cpu_s(self) -> float:
        return sum(a.cpu_s for a in self.attempts)


def owned(ledger: Ledger, rollout_id: str, tenant: str | None) -> Rollout:
    """The rollout, if `tenant` (None: any) may see it; else NotFound, as for an unknown id."""
    try:
        rollout = ledger.get(rollout_id)
    except NotFound:
        raise NotFound(f"no rollout {rollout_id!r}") from None
    if tenant is not None and rollout.tenant != tenant:
        raise NotFound(f"no rollout {rollout_id!r}")
    return rollout


def rollout(ledger: Ledger, rollout_id: str, tenant: str | None) -> RolloutDetail:
    """A rollout with its attempts, events (the first 500), egress refusals and tokens."""
    found = owned(ledger, rollout_id, tenant)
    return RolloutDetail(
        found, ledger.attempts(rollout_id), ledger.events(rollout_id, 0),
        ledger.egress_events(rollout_id), ledger.rollout_tokens(rollout_id),
    )  # fmt: skip


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint a hybrid rollout stored: what the page lists of it (not its data)."""

    sequence: int
    attempt: int
    host_id: str
    """Where the attempt that wrote it ran ("" when that attempt is not recorded)."""
    size: int
    created_at: float


def checkpoints(ledger: Ledger, rollout_id: str, tenant: str | None) -> list[Checkpoint]:
    """A rollout's checkpoints in order, if `tenant` may see the rollout (else NotFound)."""
    owned(ledger, rollout_id, tenant)
    hosts = {a.attempt: a.host_id for a in ledger.attempts(rollout_id)}
    return [
        Checkpoint(seq, attempt, hosts.get(attempt, ""), size, at)
        for seq, attempt, size, at in ledger.checkpoint_index(rollout_id)
    ]


def attempts_timeline(attempts: list[AttemptRec], now: float) -> charts.Chart:
    """A rollout's attempts as bars from start to end (to `now` while one runs), each labelled
    with its host and outcome."""
    return charts.timeline(
        [(a.started_at, a.ended_at, f"#{a.attempt} {a.host_id} · {a.outcome or 'running'}",
          f"attempt {a.attempt} on {a.host_id}: {a.outcome or 'running'}"
          + (f" ({a.error})" if a.error else ""))
         for a in attempts],
        now,
    )  # fmt: skip


def changed_since(ledger: Ledger, rollout_id: str, after: int) -> bool:
    """Whether a rollout has an event after sequence `after` (one indexed read)."""
    return bool(ledger.events(rollout_id, after, 1))


@dataclass(frozen=True)
class HostRow:
    view: HostView
    cert_expires_at: float
    labels: dict[str, str]

    @property
    def host_id(self) -> str:
        return self.view.capabilities.host_id


def hosts(ledger: Ledger) -> list[HostRow]:
    """Every registered host with its state, slots, images, certificate expiry and last beat."""
    enrolled: dict[str, HostIdentity] = {h.host_id: h for h in ledger.identities.hosts()}
    out = []
    for view in ledger.host_table(time.time(), UNRESPONSIVE_AFTER_S):
        identity = enrolled.get(view.capabilities.host_id)
        out.append(HostRow(
            view, identity.cert_expires_at if identity else 0.0,
            identity.labels if identity else view.capabilities.labels,
        ))  # fmt: skip
    return out
