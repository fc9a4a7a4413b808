"""`fleet host prepare`: builds this host's runtime helpers once, when the host is set up.

The namespace runtime runs three small static C programs in its machines
(`fleet.runtime.helpers`). A wheel carries their sources; this compiles them into
`$FLEET_HOME/tools` (or `--tools`), so that agents find them ready. scripts/setup runs it; so
does the wheel's smoke run. Also `python -m fleet.cli.prepare`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from fleet import logs
from fleet.config import Paths
from fleet.core.errors import FleetError

HELP = "build the namespace runtime's C helpers into $FLEET_HOME/tools (once, at setup)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tools", default="", metavar="DIR",
        help="where the programs go (default $FLEET_HOME/tools, where agents look)",
    )  # fmt: skip


def add_prepare_command(host_commands: Any) -> None:
    """`prepare` among `fleet host`'s subcommands (`host_commands`: their subparsers)."""
    parser = host_commands.add_parser("prepare", help=HELP, description=__doc__)
    add_arguments(parser)
    parser.set_defaults(fn=cmd_prepare, default_log_level="warning")


async def cmd_prepare(args: argparse.Namespace) -> int:
    from fleet.runtime import helpers

    tools = Path(args.tools) if args.tools else Paths.from_env().tools
    built = await asyncio.to_thread(helpers.prepare, tools)
    for path in built:
        print(f"built {path}")
    state = f"{len(built)} built now" if built else "all up to date"
    print(f"fleet host prepare: {len(helpers.HELPERS)} runtime helpers in {tools} ({state})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleet host prepare", description=__doc__)
    parser.add_argument("--log-level", default="warning")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logs.configure(args.log_level)
    try:
        return asyncio.run(cmd_prepare(args))
    except FleetError as exc:
        print(f"fleet host prepare: {exc.code}: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
