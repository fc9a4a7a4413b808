"""No import cycles among fleet's and gateway's modules, read from the source.

A cycle is found whatever hides it: an import under `if TYPE_CHECKING:` or one inside a
function is still a dependency of one module on the other, only taken later. A module that
needs a piece of another that needs it back gets that piece moved below both (or a protocol
that names what it needs), never a deferred import. Importing a submodule also runs its
packages' `__init__`, which often imports the submodule back: that is how packages work and
is no cycle; `from package import name` of a name the `__init__` defines is one.
"""

from __future__ import annotations

import ast
import itertools
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fleet", "gateway")


def modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module under `packages` (dotted name: its file), packages by their `__init__`."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imported(name: str, node: ast.Import | ast.ImportFrom, known: Mapping[str, Path]) -> set[str]:
    """The modules of `known` that `node`, in module `name`, imports by name."""
    if isinstance(node, ast.Import):
        wanted = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = name.split(".")
            if known[name].name != "__init__.py":
                package.pop()
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, base] if base else package)
        # `from p import x`: the submodule p.x when there is one, else a name p defines.
        wanted = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    targets: set[str] = set()
    for target in wanted:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            targets.add(target)
    return targets


def import_graph(known: Mapping[str, Path]) -> dict[str, dict[str, int]]:
    """Each module's imports of the others: {importer: {imported: line of the first import}},
    wherever in the file the import statement is."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in known.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _imported(name, node, known):
                    edges[target] = min(edges.get(target, node.lineno), node.lineno)
        graph[name] = edges
    return graph


def _components(graph: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, {})))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def _shortest_cycle(graph: Mapping[str, Mapping[str, int]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, as the modules in order."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node]):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if child in members and child not in came_from:
                came_from[child] = node
                queue.append(child)
    raise AssertionError(f"{component} is not a cycle")


def cycles(root: Path, packages: Iterable[str] = PACKAGES) -> list[str]:
    """Each cycle among the packages' modules, as `a (l.N) -> b (l.M) -> a`: each module with
    the line of its import of the next."""
    known = modules(root, packages)
    graph = import_graph(known)
    named = []
    for component in _components(graph):
        path = _shortest_cycle(graph, component)
        hops = [f"{a} (l.{graph[a][b]})" for a, b in itertools.pairwise(path)]
        named.append(" -> ".join([*hops, path[-1]]))
    return named


def test_fleet_and_gateway_have_no_import_cycles() -> None:
    found = cycles(ROOT)
    assert not found, "import cycles (move the shared piece below both):\n" + "\n".join(found)


def _write(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_is_named_wherever_its_imports_hide(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg import a\n",
            # type-only, relative, and deferred into a function: each still a dependency
            "pkg/a.py": "import typing\nif typing.TYPE_CHECKING:\n    from . import b\n",
            "pkg/b.py": "import os\n\n\ndef f():\n    from pkg.sub.c import C\n    return C\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/c.py": "from ..a import *\nC = 1\n",
            # not part of any cycle: a submodule and the package that re-exports it
            "pkg/d.py": "from pkg import sub\n",
        },
    )
    assert cycles(tmp_path, ["pkg"]) == ["pkg.a (l.3) -> pkg.b (l.5) -> pkg.sub.c (l.1) -> pkg.a"]


def test_a_name_from_a_package_init_that_imports_back_is_a_cycle(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.models import Model\nNAME = 'pkg'\n",
            "pkg/models.py": "from pkg import NAME\n\n\nclass Model: ...\n",
            "pkg/plain.py": "from pkg import models\n",
        },
    )
    assert cycles(tmp_path, ["pkg"]) == ["pkg (l.1) -> pkg.models (l.1) -> pkg"]
