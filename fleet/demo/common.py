"""What the demo's parts share: its suites' names and the summary tables."""

from __future__ import annotations

SUITES = ("llm-agent", "gridworld")
"""The suites `fleet demo --suite` runs; the first is the default."""


def print_table(title: str, rows: list[tuple[str, str]], value_width: int) -> None:
    """A titled two-column table between rules, keys left and values right."""
    width = max(len(k) for k, _ in rows)
    print()
    print(title)
    print("-" * (width + 2 + value_width))
    for key, value in rows:
        print(f"{key:<{width}}  {value:>{value_width}}")
    print("-" * (width + 2 + value_width))
