"""`fleet report`'s table, JSON and chart, from a `Report` read on the ledger (`--db`) or
asked of a server's AdminService (`--server`): the same figures print the same either way."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fleet.core.cost import describe_prices
from fleet.core.errors import FailedPrecondition
from fleet.core.report import Report

DEFAULT_REPORT_CHART = "fleet-report.png"


def show(args: argparse.Namespace, report: Report) -> int:
    """Prints `report` as `fleet report` ARGS asks (--json, --chart, the window's text)."""
    if args.json:
        print(json.dumps(as_json(report, args.since)))
        if args.chart:  # (written only when asked for: stdout is the JSON)
            chart(Path(args.chart), report, args.since)
            print(f"chart: {args.chart}", file=sys.stderr)
        return 0
    by = report.by
    print(f"rollouts ended in the last {args.since}, by {by}; prices: "
          f"{describe_prices(report.prices)}")  # fmt: skip
    print(f"{by.split()[0]:<16} {'completed':>9} {'attempts':>8} {'retries':>7} {'cost':>10} "
          f"{'cost/done':>10} {'cpu s/done':>10} {'dev s/done':>10} {'peak MiB':>9} "
          f"{'prompt/done':>11} {'compl/done':>10} {'tok cost/done':>13}")  # fmt: skip
    for g in report.groups:
        per = f"{g.cost_per_completed:.6f}" if g.cost_per_completed is not None else "-"
        cpu = f"{g.cpu_s_per_completed:.2f}" if g.cpu_s_per_completed is not None else "-"
        dev = f"{g.device_s_per_completed:.4f}" if g.device_s_per_completed is not None else "-"
        p_done, c_done = g.prompt_tokens_per_completed, g.completion_tokens_per_completed
        tok = g.token_cost_per_completed
        print(f"{g.name:<16} {g.completed:>9} {g.attempts:>8} {g.retries:>7} {g.cost:>10.6f} "
              f"{per:>10} {cpu:>10} {dev:>10} {g.peak_memory_mib:>9.1f} "
              f"{'-' if p_done is None else f'{p_done:.1f}':>11} "
              f"{'-' if c_done is None else f'{c_done:.1f}':>10} "
              f"{'-' if tok is None else f'{tok:.6f}':>13}")  # fmt: skip
    if not report.groups:
        print("(no rollout ended in that window)")
    for pool, (count, seconds) in sorted(report.paused.items()):
        if count or seconds:
            print(f"pool {pool}: paused {count} times by its gates, {seconds:.0f}s paused")
    path = args.chart if args.chart is not None else DEFAULT_REPORT_CHART
    if path:
        try:
            chart(Path(path), report, args.since)
        except FailedPrecondition as exc:
            if args.chart is not None:  # asked for: its refusal is the command's
                raise
            print(f"chart: not written: {exc.message}", file=sys.stderr)
        else:
            print(f"chart: {path}")
    return 0


def as_json(report: Report, window: str) -> dict[str, Any]:
    """`fleet report --json`: the table's figures, per completed trajectory where they are."""
    return {
        "since": window, "by": report.by, "prices": dict(report.prices),
        "groups": [
            {
                "name": g.name, "completed": g.completed, "attempts": g.attempts,
                "retries": g.retries, "cost": g.cost, "cost_per_completed": g.cost_per_completed,
                "cpu_s_per_completed": g.cpu_s_per_completed,
                "device_s_per_completed": g.device_s_per_completed,
                "peak_memory_mib": g.peak_memory_mib,
                "prompt_tokens": g.prompt_tokens, "completion_tokens": g.completion_tokens,
                "prompt_tokens_per_completed": g.prompt_tokens_per_completed,
                "completion_tokens_per_completed": g.completion_tokens_per_completed,
                "token_cost": g.token_cost,
                "token_cost_per_completed": g.token_cost_per_completed,
            }
            for g in report.groups
        ],
        "paused": {pool: {"times": n, "seconds": s}
                   for pool, (n, s) in sorted(report.paused.items())},
    }  # fmt: skip


def chart(path: Path, report: Report, window: str) -> None:
    """Completed trajectories and cost per slice of the window, and (for two pools at most)
    the pools' caps as their events moved them."""
    from fleet.demo.chart import line_chart

    slices = report.slices
    width_min = (report.until - report.since) / 60 / len(slices)
    panels = [
        [(t, float(done)) for t, done, _ in slices],
        [(t, cost) for t, _, cost in slices],
    ]
    titles = ["Completed trajectories", "Cost, failed attempts included"]
    y_labels = [f"per {width_min:.3g} min", f"price units per {width_min:.3g} min"]
    end_min = (report.until - report.since) / 60
    for pool in sorted({p for p, _, _ in report.caps})[:2]:
        steps = [((at - report.since) / 60, float(cap)) for p, at, cap in report.caps
                 if p == pool]  # fmt: skip
        panels.append([*steps, (end_min, steps[-1][1])])
        titles.append(f"Pool {pool}: its cap as its gates and controller moved it")
        y_labels.append("leases at once")
    line_chart(path, panels, titles=titles, y_labels=y_labels,
               x_label=f"minutes into the last {window}")  # fmt: skip
