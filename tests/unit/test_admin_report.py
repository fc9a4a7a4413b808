"""A cost report sent by AdminService reads as the same report made on the ledger: every
figure `fleet report` prints, charts or writes as JSON survives the wire; bad windows and
prices are refused naming the field."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fleet.api import admin_convert
from fleet.cli.report import as_json
from fleet.core.cost import AttemptCost
from fleet.core.errors import InvalidArgument
from fleet.core.report import build

T0 = 1_800_000_000.0


@dataclass(frozen=True)
class Mark:
    pool: str
    at: float
    kind: str
    cap: int


def attempt(rid: str, group: str, *, ok: bool = True, final: bool = True, at: float = 600,
            **kw: object) -> AttemptCost:  # fmt: skip
    return AttemptCost(
        rollout_id=rid, succeeded=ok, final=final, group=group, host_class="cpu", host_slots=2,
        wall_s=30.0, cpu_s=12.5, peak_memory_mib=64.0, ended_at=T0 + at, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_a_report_survives_the_wire_figure_for_figure() -> None:
    attempts = [
        attempt("r1", "cloud", final=False, at=100),  # retried ...
        attempt("r1", "cloud", at=200),  # ... then done
        attempt("r2", "cloud", ok=False, at=300),
        attempt("r3", "gpus", device_s=4.0, tokens={"m": (100, 40)}, at=3000),
    ]
    events = [
        Mark("cloud", T0 - 50, "paused", 4),  # (begun before the window: counts in it)
        Mark("cloud", T0 + 900, "resumed", 4),
        Mark("gpus", T0 + 1000, "raised", 6),
    ]
    prices = {"cpu": 3.6, "gpu": 2.0, "prompt:m": 1.0, "completion:m": 4.0}
    local = build(attempts, prices, events, T0, T0 + 3600)
    sent = admin_convert.report_from_pb(admin_convert.report_to_pb(local))

    assert as_json(sent, "1h") == as_json(local, "1h")
    cloud = as_json(sent, "1h")["groups"][0]
    assert (cloud["name"], cloud["completed"], cloud["attempts"], cloud["retries"]) == (
        "cloud", 1, 3, 1)  # fmt: skip
    assert (sent.since, sent.until, sent.by) == (T0, T0 + 3600, "pool")
    assert sent.slices == local.slices and sum(done for _, done, _ in sent.slices) == 2
    assert sent.paused == local.paused == {"cloud": (1, 900.0)}
    assert sent.caps == local.caps == [("gpus", T0 + 1000, 6)]
    by_label = admin_convert.report_from_pb(admin_convert.report_to_pb(
        build(attempts, prices, [], T0, T0 + 3600, by_label="team")))  # fmt: skip
    assert by_label.by == "label team"


def test_bad_windows_and_prices_are_refused_naming_the_field() -> None:
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument, match=r"ReportRequest\.window_s"):
            admin_convert.window(bad, "ReportRequest.window_s")
    assert admin_convert.window(60.0, "w") == 60.0
    with pytest.raises(InvalidArgument, match=r"ReportRequest.prices\['gpu'\]"):
        admin_convert.prices({"cpu": 1.0, "gpu": -2.0}, "ReportRequest.prices")
    assert admin_convert.prices({}, "p") is None  # (none: the server's own)
    assert admin_convert.prices({"cpu": 0.5}, "p") == {"cpu": 0.5}
