"""Retry policy: how many attempts, and how long to wait before the next one."""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_MAX_ATTEMPTS = 3


class RetryPolicy(BaseModel):
    """Attempts in all (the first included) and exponential backoff with full jitter."""

    model_config = ConfigDict(frozen=True)

    max_attempts: int = Field(default=DEFAULT_MAX_ATTEMPTS, ge=1, le=100)
    initial_backoff_s: float = Field(default=0.5, ge=0, le=3600)
    max_backoff_s: float = Field(default=30.0, ge=0, le=86400)

    def backoff_s(self, failed_attempt: int, rng: random.Random | None = None) -> float:
        """Delay before the attempt after `failed_attempt` (1-based)."""
        ceiling = min(self.max_backoff_s, self.initial_backoff_s * 2 ** (failed_attempt - 1))
        return (rng or random).uniform(ceiling / 2, ceiling)

    def may_retry(self, failed_attempt: int) -> bool:
        return failed_attempt < self.max_attempts
