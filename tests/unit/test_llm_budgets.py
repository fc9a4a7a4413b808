"""Token budgets: the tenant's sliding minute, a rollout's totals with calls in progress held,
the claims that carry them, and their checks at submission."""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import json
import time
from datetime import UTC, datetime

import pytest

from fleet.api import convert
from fleet.api.pb import fleet_pb2, types_pb2
from fleet.cli.rollouts import _token_count, add_budget_arguments, budgets_of
from fleet.core.errors import InvalidArgument, Unauthenticated
from fleet.core.manifest import (
    MAX_TOKEN_BUDGET,
    Step,
    SubmitRequest,
    build_manifest,
    validate_request,
)
from fleet.core.placement import Requirements
from fleet.core.tokens import TokenClaims, issue, verify
from gateway.llm.budgets import BudgetExceeded, Budgets, TenantWindow

SECRET = b"k" * 32


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def claims(rollout: str = "r-1", tenant: str = "acme", prompt: int = 0, completion: int = 0
           ) -> TokenClaims:  # fmt: skip
    return TokenClaims(rollout_id=rollout, expires_at=time.time() + 60, tenant=tenant,
                       max_prompt_tokens=prompt, max_completion_tokens=completion)  # fmt: skip


def refusal(budgets: Budgets, c: TokenClaims, prompt: int | None, max_tokens: list[int | None],
            floor: int | None = None) -> BudgetExceeded:  # fmt: skip
    with pytest.raises(BudgetExceeded) as refused, budgets.admit(c, prompt, max_tokens, floor):
        pass
    return refused.value


def test_the_window_frees_tokens_a_minute_after_their_second() -> None:
    window = TenantWindow()
    window.add(0.2, 60)  # bucket [0, 1): counts until 61
    window.add(10.5, 30)  # bucket [10, 11): counts until 71
    assert window.total == 90
    assert window.wait_s(20.0, 100) is None  # fits already
    assert window.wait_s(20.0, 80) == pytest.approx(41.0)  # once the first bucket leaves
    assert window.wait_s(20.0, 30) == pytest.approx(41.0)
    assert window.wait_s(20.0, 20) == pytest.approx(51.0)  # both must leave
    assert window.wait_s(20.0, -1) is None  # nothing leaving is enough
    window.expire(60.9)
    assert window.total == 90
    window.expire(61.0)
    assert window.total == 30
    window.add(61.0, 5)
    window.expire(71.0)
    assert window.total == 5 and len(window.buckets) == 1


def test_a_tenant_over_its_minute_is_refused_with_when_to_retry() -> None:
    clock = Clock(1000.0)
    budgets = Budgets(tenant_tokens_per_minute=100, clock=clock)
    a, b, other = claims("r-a"), claims("r-b"), claims("r-o", tenant="other")
    with budgets.admit(a, 10, [50]):
        budgets.record("r-a", 10, 30)
    clock.now = 1030.0
    with budgets.admit(b, 10, [10]):
        budgets.record("r-b", 10, 10)
    assert budgets.tenant_used("acme") == 60
    # 60 used + 10 prompt + 40 max_tokens > 100: the first call's bucket must leave first.
    refused = refusal(budgets, b, 10, [40])
    assert refused.status == 429 and refused.code == "budget_exceeded"
    assert refused.param == "tenant_tokens_per_minute" and refused.type == "rate_limit_error"
    assert refused.retry_after_s == pytest.approx(31.0)
    assert "tenant 'acme' has used 60 of its 100 tokens per minute" in refused.message
    body = refused.reply().body
    assert body is not None and body["fleet"]["budget"]["requested"] == 50
    assert refused.reply().headers["Retry-After"] == "31.000"
    # Another tenant is not held back; a call too large for any minute never fits.
    with budgets.admit(other, 10, [40]) as allowed:
        assert allowed == [40]
    too_big = refusal(budgets, a, 10, [100])
    assert too_big.retry_after_s is None and "allow at all" in too_big.message
    # A minute after the first call's second, it fits.
    clock.now = 1061.0
    with budgets.admit(b, 10, [40]):
        pass


def test_calls_in_progress_hold_what_they_may_take() -> None:
    clock = Clock()
    budgets = Budgets(tenant_tokens_per_minute=100, clock=clock)
    a = claims("r-a")
    with budgets.admit(a, 10, [50]):
        # Nothing used yet, but 60 held: a second call of 50 would pass the minute together.
        refused = refusal(budgets, claims("r-b"), 10, [40])
        assert "60 held by calls in progress" in refused.message
        assert refused.retry_after_s is None  # (only the call in progress ending frees them)
        budgets.record("r-a", 10, 5)
    # Ended: what it used counts, the rest of what it held is free again.
    assert budgets.tenant_used("acme") == 15
    with budgets.admit(claims("r-b"), 10, [40]):
        pass


def test_a_rollouts_prompt_budget() -> None:
    budgets = Budgets()
    c = claims(prompt=12)
    with budgets.admit(c, 5, [4]):
        budgets.record("r-1", 5, 4)
    with budgets.admit(c, 5, [4]):
        budgets.record("r-1", 5, 4)
    passing = refusal(budgets, c, 5, [4])
    assert passing.param == "max_prompt_tokens" and passing.status == 429
    assert "this prompt of 5 tokens would pass its prompt-token budget" in passing.message
    assert "(max_prompt_tokens 12: 10 used, 0 held by calls in progress, 2 left)" in passing.message
    with budgets.admit(c, 2, [4]):
        budgets.record("r-1", 2, 4)
    used_up = refusal(budgets, c, 1, [4])
    assert "rollout r-1 has used its prompt-token budget (max_prompt_tokens 12: 12 used" in (
        used_up.message
    )
    # An upstream's call (its prompt unknown here) is refused only once the budget is used.
    assert refusal(budgets, c, None, [4]).param == "max_prompt_tokens"
    assert budgets.used("r-1") == (12, 12)


def test_a_rollouts_completion_budget_shrinks_only_when_the_client_allows() -> None:
    budgets = Budgets()
    c = claims(completion=10)
    with budgets.admit(c, 3, [6]) as allowed:
        assert allowed == [6]
        budgets.record("r-1", 3, 6)
    refused = refusal(budgets, c, 3, [6])
    assert refused.param == "max_completion_tokens" and refused.type == "insufficient_quota"
    assert "max_tokens 6 would pass its completion-token budget" in refused.message
    assert "4 left); send max_tokens of at most 4, or the header x-fleet-max-tokens-floor" in (
        refused.message
    )
    body = refused.reply().body
    assert body is not None
    assert body["error"]["code"] == "budget_exceeded"
    figures = {"name": "max_completion_tokens", "rollout_id": "r-1", "limit": 10, "used": 6,
               "held": 0, "requested": 6}  # fmt: skip
    assert body["fleet"]["budget"] == figures
    # With a floor: lowered to what is left (two choices share it), unless below the floor.
    with budgets.admit(c, 3, [6, 6], floor=2) as allowed:
        assert allowed == [2, 2]
    assert "below the floor of 3" in refusal(budgets, c, 3, [6, 6], floor=3).message
    with budgets.admit(c, 3, [None], floor=1) as allowed:  # an upstream call with no bound
        assert allowed == [4]
    assert "no max_tokens (unbounded)" in refusal(budgets, c, 3, [None]).message
    budgets.record("r-1", 0, 4)
    assert "has used its completion-token budget" in refusal(budgets, c, 3, [1], 1).message


def test_no_budget_no_tracking() -> None:
    budgets = Budgets()
    with budgets.admit(claims(), 10**9, [None]) as allowed:
        assert allowed == [None]
    budgets.record("r-1", 5, 5)
    assert budgets.used("r-1") == (0, 0)


def test_the_least_recently_used_rollout_is_forgotten_past_the_bound() -> None:
    budgets = Budgets(rollouts_kept=2)
    for rid in ("r-1", "r-2", "r-3"):
        with budgets.admit(claims(rid, completion=5), 1, [1]):
            budgets.record(rid, 1, 1)
    assert budgets.used("r-1") == (0, 0) and budgets.used("r-3") == (1, 1)
    assert budgets.forgotten == 1


# -- the claims -------------------------------------------------------------------------------


def _signed(payload: dict[str, object]) -> str:
    body = base64.urlsafe_b64encode(json.dumps(payload).encode()).rstrip(b"=").decode()
    sig = hmac.new(SECRET, f"v1.{body}".encode(), hashlib.sha256).digest()
    return f"v1.{body}.{base64.urlsafe_b64encode(sig).rstrip(b'=').decode()}"


def test_a_token_carries_the_tenant_and_budgets_and_old_tokens_none() -> None:
    exp = time.time() + 60
    token = issue(SECRET, "r-1", exp, tenant="acme", max_prompt_tokens=100,
                  max_completion_tokens=7)  # fmt: skip
    got = verify(SECRET, token, time.time())
    assert (got.tenant, got.max_prompt_tokens, got.max_completion_tokens) == ("acme", 100, 7)
    plain = verify(SECRET, issue(SECRET, "r-1", exp), time.time())
    assert (plain.tenant, plain.max_prompt_tokens, plain.max_completion_tokens) == ("", 0, 0)


@pytest.mark.parametrize("bad", [{"mpt": -1}, {"mct": 1.5}, {"mct": True}, {"mpt": "9"},
                                 {"tnt": 5}])  # fmt: skip
def test_a_token_with_malformed_budget_claims_is_refused(bad: dict[str, object]) -> None:
    token = _signed({"rid": "r-1", "exp": time.time() + 60, **bad})
    with pytest.raises(Unauthenticated, match="unreadable payload"):
        verify(SECRET, token, time.time())


# -- submission -------------------------------------------------------------------------------


def _request(inference: bool = True, **budgets: int) -> SubmitRequest:
    return SubmitRequest(
        idempotency_key="k", smolfile='image = "minimal"\n', steps=(Step(argv=("true",)),),
        requirements=Requirements(inference=inference), **budgets,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("budgets", "inference", "says"),
    [
        ({"max_prompt_tokens": -1}, True, "max_prompt_tokens -1 is out of range"),
        ({"max_completion_tokens": MAX_TOKEN_BUDGET + 1}, True,
         f"max_completion_tokens {MAX_TOKEN_BUDGET + 1} is out of range"),
        ({"max_completion_tokens": 5}, False,
         "max_completion_tokens: only a rollout that calls the inference gateway"),
    ],
)  # fmt: skip
def test_bad_budgets_are_refused_naming_the_field(
    budgets: dict[str, int], inference: bool, says: str
) -> None:
    with pytest.raises(InvalidArgument) as refused:
        validate_request(_request(inference, **budgets), datetime.now(UTC))
    assert says in str(refused.value)


def test_budgets_go_from_the_request_to_the_manifest_and_an_unset_one_keeps_digests() -> None:
    now = datetime.now(UTC)
    pb = fleet_pb2.SubmitRolloutRequest(
        idempotency_key="k", smolfile='image = "minimal"\n',
        steps=[types_pb2.Step(argv=["true"])], max_prompt_tokens=1000, max_completion_tokens=50,
        requirements=types_pb2.Requirements(inference=True),
    )  # fmt: skip
    request = convert.submit_from_pb(pb)
    assert (request.max_prompt_tokens, request.max_completion_tokens) == (1000, 50)
    manifest = build_manifest(request, validate_request(request, now), "sha256:" + "0" * 64, now)
    assert (manifest.max_prompt_tokens, manifest.max_completion_tokens) == (1000, 50)
    assert convert.manifest_from_pb(convert.manifest_to_pb(manifest)) == manifest
    bare = manifest.model_copy(update={"max_prompt_tokens": 0, "max_completion_tokens": 0})
    assert bare.digest != manifest.digest
    # Unset, they are left out of what is hashed, as if they did not exist.
    before = bare.model_dump_json(exclude={
        "smolfile_name", "inputs", "outputs", "session", "models", "max_prompt_tokens",
        "max_completion_tokens"})  # fmt: skip
    assert bare.digest == "sha256:" + hashlib.sha256(before.encode()).hexdigest()
    plain = request.model_copy(update={"max_prompt_tokens": 0, "max_completion_tokens": 0})
    assert request.fingerprint() != plain.fingerprint()


def test_budget_flags_take_whole_token_counts() -> None:
    parser = argparse.ArgumentParser()
    add_budget_arguments(parser)
    args = parser.parse_args(["--max-prompt-tokens", "100", "--max-completion-tokens", "20"])
    assert budgets_of(args) == {"max_prompt_tokens": 100, "max_completion_tokens": 20}
    assert budgets_of(argparse.Namespace()) == {"max_prompt_tokens": 0, "max_completion_tokens": 0}
    for bad, says in (("-1", "out of range"), ("1e3", "whole number"),
                      (str(MAX_TOKEN_BUDGET + 1), "out of range")):  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            _token_count(bad)
