"""Promotion gates: the limits a pool's signals must stay under for work to keep going to it.

A pool may carry limits on the gateway's p95 latency and oldest queued request, and on the
share of its hosts' attempts (over a sliding window) that ended in a retry or in an artifact
failure. When one is passed the pool is paused: no new dispatches to it, and an adaptive pool
is not raised. It resumes when every signal is back under `RECOVER` of its limit (below the
limit, so that a pool does not flap on a signal sitting at it).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

RECOVER = 0.8
"""A paused pool resumes once every signal is at most this share of its limit."""


class Gates(BaseModel):
    """A pool's limits; 0 turns a gate off."""

    model_config = ConfigDict(frozen=True)

    p95_ms: float = Field(default=0.0, ge=0)
    """The gateway's p95 request latency (queue and device), over its own recent window."""
    queue_age_ms: float = Field(default=0.0, ge=0)
    """How long the oldest request queued at the gateway has waited."""
    retry_rate: float = Field(default=0.0, ge=0, le=1)
    """Share of the pool's attempts ended in the window that are retried (a transient error,
    a lost lease)."""
    artifact_failure_rate: float = Field(default=0.0, ge=0, le=1)
    """Share of the pool's attempts ended in the window that failed to move an artifact (an
    image fetch, an input placed, an output collected)."""
    window_s: float = Field(default=60.0, gt=0)
    """The sliding window of the two rates."""
    min_attempts: int = Field(default=10, ge=1)
    """The rates are judged only over at least this many attempts (one failure of one is
    not a rate)."""

    @field_validator("window_s")
    @classmethod
    def _window(cls, value: float) -> float:
        if value > 86400:
            raise ValueError(f"window_s {value:g} is over a day")
        return value

    def any(self) -> bool:
        return bool(self.p95_ms or self.queue_age_ms or self.retry_rate or
                    self.artifact_failure_rate)  # fmt: skip

    def describe(self) -> str:
        parts = []
        if self.p95_ms:
            parts.append(f"p95<={self.p95_ms:g}ms")
        if self.queue_age_ms:
            parts.append(f"queue-age<={self.queue_age_ms:g}ms")
        if self.retry_rate:
            parts.append(f"retries<={self.retry_rate:.0%}")
        if self.artifact_failure_rate:
            parts.append(f"artifact-failures<={self.artifact_failure_rate:.0%}")
        if self.retry_rate or self.artifact_failure_rate:
            parts.append(f"over {self.window_s:g}s")
        return " ".join(parts) or "-"


class Signals(BaseModel):
    """What a pool's gates are judged on, at one moment."""

    model_config = ConfigDict(frozen=True)

    p95_ms: float | None = None
    """None: not known (no gateway watched, or it did not answer)."""
    queue_age_ms: float | None = None
    attempts: int = 0
    """The pool's attempts ended in the window."""
    retried: int = 0
    artifact_failures: int = 0

    def figures(self) -> dict[str, float]:
        """The numbers, for an event."""
        out: dict[str, float] = {"attempts": self.attempts, "retried": self.retried,
                                 "artifact_failures": self.artifact_failures}  # fmt: skip
        if self.p95_ms is not None:
            out["p95_ms"] = round(self.p95_ms, 3)
        if self.queue_age_ms is not None:
            out["queue_age_ms"] = round(self.queue_age_ms, 3)
        return out


def breaches(gates: Gates, signals: Signals, share: float = 1.0) -> list[str]:
    """Each signal over `share` of its limit, said with its number and the limit."""
    out = []
    if gates.p95_ms and signals.p95_ms is not None and signals.p95_ms > gates.p95_ms * share:
        out.append(f"gateway p95 latency {signals.p95_ms:.1f} ms > {gates.p95_ms * share:g} ms")
    age = signals.queue_age_ms
    if gates.queue_age_ms and age is not None and age > gates.queue_age_ms * share:
        out.append(f"gateway queue age {age:.1f} ms > {gates.queue_age_ms * share:g} ms")
    if signals.attempts >= gates.min_attempts:
        for limit, count, what in (
            (gates.retry_rate, signals.retried, "retry rate"),
            (gates.artifact_failure_rate, signals.artifact_failures, "artifact failure rate"),
        ):
            rate = count / signals.attempts
            if limit and rate > limit * share:
                out.append(
                    f"{what} {rate:.1%} ({count} of {signals.attempts} attempts in "
                    f"{gates.window_s:g}s) > {limit * share:.1%}"
                )
    return out


def judge(gates: Gates, signals: Signals, paused: bool) -> tuple[str, list[str]]:
    """("pause", why) when a running pool passes a limit; ("resume", []) when a paused one is
    back under RECOVER of every limit; ("stay", why) otherwise (why: what holds it paused)."""
    if not paused:
        over = breaches(gates, signals)
        return ("pause", over) if over else ("stay", [])
    still = breaches(gates, signals, RECOVER)
    return ("stay", still) if still else ("resume", [])
