"""What completed trajectories cost: each attempt holds one slot of its host for its wall time,
priced at the host class's hourly price shared among the host's slots, plus the gateway's device
seconds its requests took, at the gpu price (the device is the GPU host's, and a batch's time is
shared among its requests), plus the language-model tokens of its answers at each model's price
per million tokens (prompt and completion apart, as providers price them). Failed attempts and
failed rollouts are paid for too; only succeeded rollouts count as completed trajectories.

Prices are one mapping: "cpu" and "gpu" per host-hour; "prompt:MODEL" and "completion:MODEL"
per million tokens, where MODEL "*" prices every model without a price of its own."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from fleet.core.errors import InvalidArgument

_AMOUNT = r"(\d+(?:\.\d+)?)"
_PRICE = re.compile(rf"(cpu|gpu)={_AMOUNT}(?:/h)?")
_TOKEN_PRICE = re.compile(rf"(tokens|prompt|completion):([A-Za-z0-9._/@:*-]+)={_AMOUNT}(?:/Mtok)?")
PER_TOKENS = 1_000_000
"""Token prices are per this many tokens."""


def parse_prices(text: str) -> dict[str, float]:
    """`cpu=0.04/h,gpu=2.10/h,tokens:MODEL=0.50/Mtok` -> {"cpu": 0.04, "gpu": 2.1,
    "prompt:MODEL": 0.5, "completion:MODEL": 0.5}: host classes per host-hour, a model's
    tokens per million (`tokens:` prices prompt and completion alike, `prompt:` and
    `completion:` each; MODEL `*`: any model without a price of its own)."""
    prices: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        found = _PRICE.fullmatch(part)
        if found is not None:
            prices[found[1]] = float(found[2])
            continue
        tokens = _TOKEN_PRICE.fullmatch(part)
        if tokens is None:
            raise InvalidArgument(
                f"price {part!r}: expected CLASS=AMOUNT/h (cpu or gpu) or "
                "KIND:MODEL=AMOUNT/Mtok (KIND tokens, prompt or completion; MODEL a model's "
                "name or *)"
            )
        kind, model, amount = tokens[1], tokens[2], float(tokens[3])
        for each in ("prompt", "completion") if kind == "tokens" else (kind,):
            prices[f"{each}:{model}"] = amount
    return prices


def token_price(prices: Mapping[str, float], kind: str, model: str) -> float:
    """A model's price per million `kind` (prompt or completion) tokens (0: none set)."""
    return prices.get(f"{kind}:{model}", prices.get(f"{kind}:*", 0.0))


def describe_prices(prices: Mapping[str, float]) -> str:
    """The prices as a line says them: host classes per hour, then tokens per million."""
    hours = [f"{k} {v:g}/h" for k, v in sorted(prices.items()) if ":" not in k]
    tokens = [f"{k} {v:g}/Mtok" for k, v in sorted(prices.items()) if ":" in k]
    return ", ".join(hours + tokens) or "none set"


@dataclass(frozen=True)
class AttemptCost:
    """One attempt of a rollout that ended in the report's window."""

    rollout_id: str
    succeeded: bool
    """Whether its rollout succeeded (a completed trajectory)."""
    final: bool
    """Whether this is its rollout's last attempt."""
    group: str
    host_class: str
    host_slots: int
    wall_s: float
    cpu_s: float
    peak_memory_mib: float
    device_s: float = 0.0
    ended_at: float = 0.0
    tokens: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Its language-model tokens by model: (prompt, completion)."""

    @property
    def prompt_tokens(self) -> int:
        return sum(p for p, _ in self.tokens.values())

    @property
    def completion_tokens(self) -> int:
        return sum(c for _, c in self.tokens.values())


@dataclass
class Group:
    """Totals for one pool (or label value)."""

    name: str
    rollouts: set[str] = field(default_factory=set)
    completed: int = 0
    attempts: int = 0
    cost: float = 0.0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    device_s: float = 0.0
    peak_memory_mib: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    token_cost: float = 0.0
    """What the tokens cost (part of `cost`)."""

    @property
    def retries(self) -> int:
        return self.attempts - len(self.rollouts)

    @property
    def cost_per_completed(self) -> float | None:
        return self.cost / self.completed if self.completed else None

    @property
    def cpu_s_per_completed(self) -> float | None:
        return self.cpu_s / self.completed if self.completed else None

    @property
    def device_s_per_completed(self) -> float | None:
        return self.device_s / self.completed if self.completed else None

    @property
    def prompt_tokens_per_completed(self) -> float | None:
        return self.prompt_tokens / self.completed if self.completed else None

    @property
    def completion_tokens_per_completed(self) -> float | None:
        return self.completion_tokens / self.completed if self.completed else None

    @property
    def token_cost_per_completed(self) -> float | None:
        return self.token_cost / self.completed if self.completed else None


def tokens_cost(a: AttemptCost, prices: Mapping[str, float]) -> float:
    """What an attempt's tokens cost, each model's at its price."""
    return sum(
        (p * token_price(prices, "prompt", model) + c * token_price(prices, "completion", model))
        / PER_TOKENS
        for model, (p, c) in a.tokens.items()
    )


def attempt_cost(a: AttemptCost, prices: Mapping[str, float]) -> float:
    slot = a.wall_s / 3600 * prices.get(a.host_class, 0.0) / max(1, a.host_slots)
    return slot + a.device_s / 3600 * prices.get("gpu", 0.0) + tokens_cost(a, prices)


def tally(attempts: Iterable[AttemptCost], prices: Mapping[str, float]) -> list[Group]:
    """Per group (the pool of the attempt's host, or a label's value), sorted by name."""
    groups: dict[str, Group] = {}
    for a in attempts:
        g = groups.setdefault(a.group, Group(a.group))
        g.rollouts.add(a.rollout_id)
        g.attempts += 1
        g.cost += attempt_cost(a, prices)
        g.token_cost += tokens_cost(a, prices)
        g.prompt_tokens += a.prompt_tokens
        g.completion_tokens += a.completion_tokens
        g.cpu_s += a.cpu_s
        g.wall_s += a.wall_s
        g.device_s += a.device_s
        g.peak_memory_mib = max(g.peak_memory_mib, a.peak_memory_mib)
        if a.final and a.succeeded:
            g.completed += 1
    return [groups[name] for name in sorted(groups)]


def timeline(
    attempts: Iterable[AttemptCost], prices: Mapping[str, float], since: float, now: float,
    buckets: int = 30,
) -> list[tuple[float, int, float]]:  # fmt: skip
    """(minutes since `since` at the bucket's end, trajectories completed in it, what its
    ended attempts cost), over `buckets` equal slices of the window."""
    width = max(1e-9, (now - since) / buckets)
    done = [0] * buckets
    cost = [0.0] * buckets
    for a in attempts:
        i = min(buckets - 1, max(0, int((a.ended_at - since) / width)))
        cost[i] += attempt_cost(a, prices)
        if a.final and a.succeeded:
            done[i] += 1
    return [((i + 1) * width / 60, done[i], cost[i]) for i in range(buckets)]


def pauses(
    events: Iterable[tuple[str, float, str]], since: float, now: float
) -> dict[str, tuple[int, float]]:
    """Per pool: (times its gates paused it, seconds it spent paused) within the window, from
    its (pool, at, kind) events in order (a pause still in force counts up to `now`)."""
    out: dict[str, tuple[int, float]] = {}
    started: dict[str, float] = {}
    for pool, at, kind in events:
        count, seconds = out.get(pool, (0, 0.0))
        if kind == "paused":
            started[pool] = at
            out[pool] = (count + 1, seconds)
        elif kind == "resumed":
            begun = started.pop(pool, since)
            out[pool] = (count, seconds + at - max(begun, since))
    for pool, begun in started.items():
        count, seconds = out[pool]
        out[pool] = (count, seconds + now - max(begun, since))
    return out
