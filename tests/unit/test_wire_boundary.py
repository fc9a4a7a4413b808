"""The wire boundary, read from the source and from a fresh interpreter: only `fleet.api` imports
the generated protobuf code (everything else goes through `fleet.api.pb`), and neither the host
agent nor the gateway loads the server or the ledger when imported."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.api import convert
from fleet.api.pb import host_pb2, types_pb2
from fleet.core.errors import InvalidArgument
from fleet.core.labels import MAX_LABEL_BYTES, MAX_LABELS, check_labels

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("fleet", "gateway", "scripts", "benchmarks")
"""The trees that ship or run fleet's code; tests may import the generated code's home freely."""
API = Path("fleet/api")


def python_files(root: Path) -> list[Path]:
    """Every Python source under the scanned trees: `*.py`, and scripts with a python shebang."""
    found: list[Path] = []
    for tree in SCANNED:
        for path in sorted((root / tree).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            if path.suffix == ".py":
                found.append(path)
            elif path.suffix == "":
                first = path.read_bytes()[:128].split(b"\n", 1)[0]
                if first.startswith(b"#!") and b"python" in first:
                    found.append(path)
    return found


def module_of(path: Path, root: Path) -> str:
    """The dotted package `path` is in, to resolve its relative imports against."""
    return ".".join(path.relative_to(root).parent.parts)


def imported(path: Path, root: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function, as an absolute name
    (relative imports resolved), with each imported name as a possible submodule."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module_of(path, root).split(".")
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def proto_importers(root: Path) -> dict[str, list[str]]:
    """The files outside fleet/api that import generated protobuf code directly, and what."""
    offenders: dict[str, list[str]] = {}
    for path in python_files(root):
        relative = path.relative_to(root)
        if relative.is_relative_to(API):
            continue
        bad = sorted(m for m in imported(path, root) if "_proto" in m.split("."))
        if bad:
            offenders[str(relative)] = bad
    return offenders


def loaded_fleet_modules(module: str, cwd: Path) -> list[str]:
    """The fleet modules a fresh interpreter holds after importing `module` (run from `cwd`)."""
    code = (
        f"import json, sys; import {module}; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('fleet'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    loaded: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


def below_server(loaded: list[str]) -> list[str]:
    """The server's and the ledger's modules among `loaded`."""
    return [m for m in loaded if m.split(".")[:2] in (["fleet", "server"], ["fleet", "ledger"])]


def test_only_fleet_api_imports_the_generated_protobuf_code() -> None:
    assert python_files(ROOT), "no sources found: the scan looks in the wrong place"
    assert proto_importers(ROOT) == {}


def test_the_scan_sees_a_direct_import_of_the_generated_code(tmp_path: Path) -> None:
    """Each way of reaching the generated code past `fleet.api.pb` is caught (so the test above
    cannot pass by seeing nothing)."""
    (tmp_path / "fleet" / "agent").mkdir(parents=True)
    (tmp_path / "fleet" / "api").mkdir()
    (tmp_path / "scripts").mkdir()
    (tmp_path / "gateway").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "fleet" / "agent" / "a.py").write_text(
        "from fleet.api._proto.fleet.v1 import host_pb2\n"
    )
    (tmp_path / "fleet" / "agent" / "b.py").write_text("from ..api import _proto\n")
    (tmp_path / "fleet" / "agent" / "ok.py").write_text("from fleet.api.pb import host_pb2\n")
    (tmp_path / "fleet" / "api" / "pb.py").write_text("from fleet.api._proto import x\n")
    (tmp_path / "gateway" / "g.py").write_text("def f():\n    import fleet._proto.fleet.v1\n")
    (tmp_path / "scripts" / "tool").write_text("#!/usr/bin/env python3\nimport fleet._proto\n")
    (tmp_path / "scripts" / "run").write_text("#!/usr/bin/env bash\necho fleet._proto\n")
    assert proto_importers(tmp_path) == {
        "fleet/agent/a.py": ["fleet.api._proto.fleet.v1", "fleet.api._proto.fleet.v1.host_pb2"],
        "fleet/agent/b.py": ["fleet.api._proto"],
        "gateway/g.py": ["fleet._proto.fleet.v1"],
        "scripts/tool": ["fleet._proto"],
    }


@pytest.mark.parametrize("module", ["fleet.agent.agent", "gateway.service", "gateway.client"])
def test_the_agent_and_the_gateway_load_neither_the_server_nor_the_ledger(module: str) -> None:
    """An agent or a gateway stands on `fleet.api` (wire) and `fleet.core` (domain); the server and
    the ledger are the control plane's own, and loading them on a host would tie each release of
    the agent to the server's internals."""
    loaded = loaded_fleet_modules(module, ROOT)
    assert "fleet.api.pb" in loaded  # it did reach the wire, through the public surface
    assert below_server(loaded) == []


def test_the_wire_refuses_a_registration_with_labels_out_of_bounds() -> None:
    """The labels a host registers with are bounded where they come off the wire, with the words
    the ledger uses for a join token's or a pool's."""
    caps = host_pb2.Capabilities(
        runtime=types_pb2.RUNTIME_KIND_NAMESPACE, isolation=types_pb2.ISOLATION_NAMESPACE
    )

    def register(labels: dict[str, str]) -> host_pb2.RegisterHostRequest:
        caps.labels.clear()
        caps.labels.update(labels)
        return host_pb2.RegisterHostRequest(
            host_id="h1", host_class=types_pb2.HOST_CLASS_CPU, capabilities=caps
        )

    fine = {f"k{i}": "v" for i in range(MAX_LABELS)}
    assert convert.capabilities_from_pb(register(fine)).labels == fine
    with pytest.raises(InvalidArgument, match=f"labels: at most {MAX_LABELS}, got 33"):
        convert.capabilities_from_pb(register({**fine, "one-more": "v"}))
    with pytest.raises(InvalidArgument, match="label 'k': empty key or longer than 256"):
        convert.capabilities_from_pb(register({"k": "v" * MAX_LABEL_BYTES}))
    with pytest.raises(InvalidArgument, match="label '': empty key"):
        check_labels({"": "v"})
