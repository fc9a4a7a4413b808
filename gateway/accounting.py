"""What each rollout used of the gateway, kept until the fleet server has charged it.

The fleet server polls the gateway's Status; each poll that carries the running rollouts is
handed what was used since: device seconds (the batcher's share of each batch) and the prompt
and completion tokens of language-model answers, per rollout and model. A hand-over is numbered
(`UsageMark`: this gateway run's id and a sequence number), and the server sends back the mark
of the last one it charged. Until a hand-over is confirmed that way it is handed again, merged
with whatever came since, so a poll whose answer is lost, or whose charge fails, loses nothing;
once confirmed it is forgotten, so nothing is charged twice. A caller that sends no mark gets
the older behaviour: what it is handed counts as taken.

Memory is bounded: tokens wait for at most `ROLLOUTS_KEPT` (rollout, model) pairs, and at most
`HANDOVERS_KEPT` unconfirmed hand-overs are kept apart (older ones are merged). What cannot be
kept is counted, logged once and exported as a metric, never silently dropped.

Every answer's tokens also reach the book's `Budgets` (`gateway.llm.budgets`), which keeps what
each rollout used in all and each tenant in the last minute, for the checks that admit a call.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import structlog

from gateway.llm.budgets import Budgets

log = structlog.get_logger(__name__)

ROLLOUTS_KEPT = 100_000
"""(rollout, model) pairs whose tokens wait for the server at once (a gateway nobody polls
must not grow without bound)."""
HANDOVERS_KEPT = 64
"""Unconfirmed hand-overs kept apart; past it the two oldest are merged into the newer one."""


@dataclass
class Usage:
    """Device seconds per rollout, and (prompt, completion) tokens per (rollout, model)."""

    device_s: dict[str, float] = field(default_factory=dict)
    tokens: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.device_s or self.tokens)

    def add(self, more: Usage) -> None:
        for rollout, seconds in more.device_s.items():
            self.device_s[rollout] = self.device_s.get(rollout, 0.0) + seconds
        for key, (prompt, completion) in more.tokens.items():
            p, c = self.tokens.get(key, (0, 0))
            self.tokens[key] = (p + prompt, c + completion)

    def tokens_by_rollout(self) -> dict[str, dict[str, tuple[int, int]]]:
        """{rollout: {model: (prompt, completion)}}."""
        out: dict[str, dict[str, tuple[int, int]]] = {}
        for (rollout, model), counts in sorted(self.tokens.items()):
            out.setdefault(rollout, {})[model] = counts
        return out


Mark = tuple[str, int]
"""(gateway run id, sequence number) of a hand-over."""


class UsageBook:
    """Tokens waiting for the server, and the hand-overs it has not confirmed."""

    def __init__(self, rollouts_kept: int = ROLLOUTS_KEPT, budgets: Budgets | None = None) -> None:
        self.run_id = secrets.token_hex(8)
        """This gateway run's id: a mark from another run (a restarted gateway) confirms
        nothing here."""
        self.rollouts_kept = rollouts_kept
        self._tokens: dict[tuple[str, str], tuple[int, int]] = {}
        self._handed: list[tuple[int, Usage]] = []
        self._seq = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        """Tokens recorded since the gateway started (for its metrics)."""
        self.tokens_unkept = 0
        """Tokens that no attempt will be charged: the table was full (no server polled)."""
        self.budgets = budgets if budgets is not None else Budgets()
        """The rollouts' and tenants' token budgets, fed by every answer counted here."""

    def add_tokens(self, rollout_id: str, model: str, prompt: int, completion: int) -> None:
        """One answer's tokens (what its client received), for the rollout's next hand-over."""
        if prompt <= 0 and completion <= 0:
            return
        self.budgets.record(rollout_id, prompt, completion)
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        key = (rollout_id, model)
        have = self._tokens.get(key)
        if have is None and len(self._tokens) >= self.rollouts_kept:
            if not self.tokens_unkept:
                log.warning("tokens_unkept", rollouts_waiting=len(self._tokens),
                            why="no fleet server has polled this gateway for them")  # fmt: skip
            self.tokens_unkept += prompt + completion
            return
        p, c = have or (0, 0)
        self._tokens[key] = (p + prompt, c + completion)

    @property
    def unconfirmed(self) -> int:
        """Hand-overs the server has not confirmed yet."""
        return len(self._handed)

    def hand_over(
        self, device_s: dict[str, float], charged: Mark | None
    ) -> tuple[Usage, Mark | None]:
        """What a server's poll is handed, with the mark that covers it (None: nothing).

        `device_s`: the batcher's device seconds since the last poll; `charged`: the mark the
        server says it charged last (None: the caller does not confirm; what it is handed now
        counts as taken)."""
        if charged is None:
            self._handed.clear()
        elif charged[0] == self.run_id:
            self._handed = [(seq, u) for seq, u in self._handed if seq > charged[1]]
        new = Usage(dict(device_s), self._tokens)
        self._tokens = {}
        if new:
            self._seq += 1
            self._handed.append((self._seq, new))
        while len(self._handed) > HANDOVERS_KEPT:
            (_, oldest), (seq, newer) = self._handed[0], self._handed[1]
            oldest.add(newer)
            self._handed[:2] = [(seq, oldest)]
        if not self._handed:
            return Usage(), None
        total = Usage()
        for _, usage in self._handed:
            total.add(usage)
        mark = (self.run_id, self._handed[-1][0])
        if charged is None:
            self._handed.clear()
        return total, mark
