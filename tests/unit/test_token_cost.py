"""Token prices and token cost per completed trajectory (`fleet.core.cost`, pure)."""

from __future__ import annotations

import pytest

from fleet.core.cost import (
    AttemptCost,
    describe_prices,
    parse_prices,
    tally,
    token_price,
    tokens_cost,
)
from fleet.core.errors import InvalidArgument


def test_token_prices_parse_beside_host_prices() -> None:
    prices = parse_prices(
        "cpu=0.04/h, tokens:fleet-tiny-chat-v1=0.5/Mtok, prompt:up/gpt-x=3,completion:up/gpt-x=15"
        ",tokens:*=1"
    )
    assert prices == {
        "cpu": 0.04,
        "prompt:fleet-tiny-chat-v1": 0.5, "completion:fleet-tiny-chat-v1": 0.5,
        "prompt:up/gpt-x": 3.0, "completion:up/gpt-x": 15.0,
        "prompt:*": 1.0, "completion:*": 1.0,
    }  # fmt: skip
    assert token_price(prices, "completion", "up/gpt-x") == 15.0
    assert token_price(prices, "prompt", "another") == 1.0  # (the * price)
    assert token_price({}, "prompt", "another") == 0.0
    assert describe_prices(prices).startswith("cpu 0.04/h, completion:* 1/Mtok")


@pytest.mark.parametrize(
    "bad", ["tokens=1/Mtok", "tokens:m=abc", "bytes:m=1/Mtok", "tokens:m m=1", "tokens:m=1/h"]
)
def test_a_bad_token_price_is_refused_naming_it(bad: str) -> None:
    with pytest.raises(InvalidArgument, match=r"price .*KIND:MODEL=AMOUNT/Mtok"):
        parse_prices(f"cpu=1/h,{bad}")


def test_tokens_are_summed_and_priced_per_model_per_completed_trajectory() -> None:
    prices = {"prompt:a": 2.0, "completion:a": 10.0, "prompt:*": 1.0, "completion:*": 1.0}
    done = AttemptCost("r1", True, True, "cloud", "cpu", 1, 0.0, 0.0, 0.0,
                       tokens={"a": (1_000_000, 100_000), "b": (500_000, 500_000)})  # fmt: skip
    retried = AttemptCost("r2", True, False, "cloud", "cpu", 1, 0.0, 0.0, 0.0,
                          tokens={"a": (250_000, 0)})  # fmt: skip
    last = AttemptCost("r2", True, True, "cloud", "cpu", 1, 0.0, 0.0, 0.0,
                       tokens={"a": (250_000, 50_000)})  # fmt: skip
    assert tokens_cost(done, prices) == pytest.approx(2.0 + 1.0 + 0.5 + 0.5)
    [g] = tally([done, retried, last], prices)

    assert (g.prompt_tokens, g.completion_tokens) == (2_000_000, 650_000)
    assert g.completed == 2
    assert g.prompt_tokens_per_completed == 1_000_000
    assert g.completion_tokens_per_completed == 325_000
    expected = 4.0 + 0.5 + (0.5 + 0.5)  # (the retried attempt's tokens are paid for too)
    assert g.token_cost == pytest.approx(expected)
    assert g.cost == pytest.approx(expected)  # (no host or device price set)
    assert g.token_cost_per_completed == pytest.approx(expected / 2)


def test_no_tokens_cost_nothing_and_no_completed_trajectory_has_no_figure() -> None:
    failed = AttemptCost("r1", False, True, "cloud", "cpu", 1, 3600.0, 0.0, 0.0,
                         tokens={"a": (10, 10)})  # fmt: skip
    [g] = tally([failed], {"cpu": 1.0})
    assert g.token_cost == 0.0 and g.cost == pytest.approx(1.0)
    assert g.prompt_tokens_per_completed is None and g.token_cost_per_completed is None
