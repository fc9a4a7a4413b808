"""Rollout-scoped inference tokens."""

from __future__ import annotations

import pytest

from fleet.core.errors import PermissionDenied, Unauthenticated
from fleet.core.tokens import issue, verify

KEY = b"k" * 32
NOW = 1_900_000_000.0


def test_a_token_verifies_for_its_rollout_until_its_deadline() -> None:
    """The claims come back: rollout and expiry."""
    token = issue(KEY, "r-1", NOW + 60)
    claims = verify(KEY, token, NOW, "r-1")
    assert claims.rollout_id == "r-1" and claims.expires_at == NOW + 60


@pytest.mark.parametrize(
    ("token", "rollout", "now", "error", "text"),
    [
        (issue(KEY, "r-1", NOW + 60), "r-2", NOW, PermissionDenied, "scoped to rollout r-1"),
        (issue(KEY, "r-1", NOW + 60), "r-1", NOW + 61, PermissionDenied, "expired"),
        (issue(b"x" * 32, "r-1", NOW + 60), "r-1", NOW, Unauthenticated, "signature"),
        ("", "r-1", NOW, Unauthenticated, "no inference token"),
        ("v1.garbage", "r-1", NOW, Unauthenticated, "malformed"),
        ("v1.!!!.???", "r-1", NOW, Unauthenticated, "malformed"),
    ],
)
def test_bad_tokens_are_refused_saying_why(
    token: str, rollout: str, now: float, error: type[Exception], text: str
) -> None:
    """Another rollout's, an expired, a foreign-signed, a missing or a mangled token."""
    with pytest.raises(error) as info:
        verify(KEY, token, now, rollout)
    assert text in str(info.value)


def test_a_tampered_payload_fails_the_signature() -> None:
    """Rewriting the rollout id inside a token breaks it."""
    good = issue(KEY, "r-1", NOW + 60).split(".")
    other = issue(KEY, "r-2", NOW + 60).split(".")
    with pytest.raises(Unauthenticated):
        verify(KEY, f"v1.{other[1]}.{good[2]}", NOW)


def test_short_secrets_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        issue(b"short", "r-1", NOW)


def test_a_remembered_token_still_expires_and_is_still_scoped() -> None:
    """A verified signature is remembered; the deadline and the rollout are checked each use,
    and the same token under another key is still refused."""
    token = issue(KEY, "r-9", NOW + 60)
    assert verify(KEY, token, NOW, "r-9").rollout_id == "r-9"
    assert verify(KEY, token, NOW + 59, "r-9").rollout_id == "r-9"
    with pytest.raises(PermissionDenied, match="expired"):
        verify(KEY, token, NOW + 60, "r-9")
    with pytest.raises(PermissionDenied, match="not to r-8"):
        verify(KEY, token, NOW, "r-8")
    with pytest.raises(Unauthenticated, match="signature"):
        verify(b"z" * 32, token, NOW, "r-9")
