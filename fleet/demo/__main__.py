"""`python -m fleet.demo`: the same as `fleet demo`."""

from __future__ import annotations

import asyncio
import sys

from fleet import logs
from fleet.core.errors import FleetError


def main(argv: list[str] | None = None) -> int:
    import argparse

    from fleet.demo.cli import add_arguments, command

    parser = argparse.ArgumentParser(prog="fleet demo", description="evaluate a shipped suite "
                                     "on an embedded fleet")  # fmt: skip
    parser.add_argument("--log-level", default="error", help="debug, info, warning, error")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logs.configure(args.log_level)
    try:
        return asyncio.run(command(args, args.log_level))
    except FleetError as exc:
        print(f"fleet demo: {exc.code}: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
