"""`fleet demo`'s arguments and command, defined here so that `fleet demo` and
`python -m fleet.demo` take the same flags. Light to import: the parser is built for every
command, and the demo's modules load only when it runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from fleet.config import Paths
from fleet.demo.common import SUITES


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--suite", choices=SUITES, default=SUITES[0],
                    help="llm-agent: the language model as a tool-using agent on the shipped "
                    "tasks; gridworld: the scripted suite, then the gridworld policy")  # fmt: skip
    sp.add_argument(
        "--quick", action="store_true",
        help="a few tasks (llm-agent: one per family; gridworld: 16 episodes)",
    )  # fmt: skip
    sp.add_argument("--json", action="store_true",
                    help="end with one JSON line: the llm-agent summary")  # fmt: skip
    sp.add_argument("--price", type=float, default=None, metavar="PER_MTOK",
                    help="the model's price per million tokens, for cost per trajectory "
                    "(none: cost is null)")  # fmt: skip
    sp.add_argument("--timeout-s", type=float, default=600.0)
    sp.add_argument("--out", default="fleet-demo-out", help="where the chart is written")
    sp.add_argument("--episodes", type=int, default=64, help="gridworld episodes to evaluate")


async def command(args: argparse.Namespace, log_level: str) -> int:
    from fleet.demo.run import run_demo

    return await run_demo(
        Paths.from_env(), timeout_s=args.timeout_s, out_dir=Path(args.out),
        episodes=args.episodes, log_level=log_level, suite=args.suite, quick=args.quick,
        json_out=args.json, price_per_mtok=args.price,
    )  # fmt: skip
