"""The package's layers, read from its source: the command line is the outermost layer (no
library module imports it), and `fleet.core` is pure (the standard library, pydantic, the
public suffix table and itself; no I/O framework, database, gRPC or other fleet package)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE_MAY_IMPORT = {"pydantic", "pydantic_core", "publicsuffixlist", "fleet"}
"""(publicsuffixlist: a lookup table of domain suffixes, for the egress policy's names.)"""


def imports(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function (absolute names)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def sources(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py")
                  if "_proto" not in p.parts)  # fmt: skip


def test_no_library_module_imports_the_command_line() -> None:
    cli = ROOT / "fleet" / "cli"
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            m for m in imports(path) if m == "fleet.cli" or m.startswith("fleet.cli.")
        )
        for path in sources("fleet", "gateway")
        if cli not in path.parents
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_core_imports_only_the_standard_library_pydantic_and_itself() -> None:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    offenders: dict[str, list[str]] = {}
    for path in sources("fleet/core"):
        bad = sorted(
            m for m in imports(path)
            if m.split(".")[0] not in stdlib | CORE_MAY_IMPORT
            or (m.startswith("fleet") and not m.startswith("fleet.core"))
        )  # fmt: skip
        if bad:
            offenders[str(path.relative_to(ROOT))] = bad
    assert offenders == {}
