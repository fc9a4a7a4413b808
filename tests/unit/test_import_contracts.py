"""The import contracts in pyproject.toml (`lint-imports`, run by scripts/lint) cover all of
fleet: every top-level module has a layer, and every one but `fleet.api` is refused the
generated protobuf code. A new package that no contract names would otherwise be checked by
none, and might import anything."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def top_level_modules() -> set[str]:
    """fleet's top-level modules and packages, and gateway, as the contracts name them."""
    found = {"gateway"}
    for path in (ROOT / "fleet").iterdir():
        if path.suffix == ".py" and path.name != "__init__.py":
            found.add(f"fleet.{path.stem}")
        elif (path / "__init__.py").is_file():
            found.add(f"fleet.{path.name}")
    return found


def contract(contract_id: str) -> dict[str, Any]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert config["root_packages"] == ["fleet", "gateway"]
    (found,) = [c for c in config["contracts"] if c["id"] == contract_id]
    return dict(found)


def test_every_top_level_module_has_a_layer() -> None:
    layers = contract("layers")["layers"]
    named = [name.strip() for layer in layers for name in layer.replace(":", "|").split("|")]
    assert sorted(n for n in set(named) if named.count(n) > 1) == []
    assert sorted(top_level_modules() - set(named)) == []
    assert sorted(set(named) - top_level_modules()) == []
    assert layers[-1] == "fleet.core"


def test_only_fleet_api_may_import_the_generated_code() -> None:
    protos = contract("protos")
    assert protos["type"] == "forbidden"
    assert protos["forbidden_modules"] == ["fleet.api._proto"]
    assert sorted(protos["source_modules"]) == sorted(top_level_modules() - {"fleet.api"})


def test_the_processes_are_independent() -> None:
    processes = contract("processes")
    assert processes["type"] == "independence"
    assert set(processes["modules"]) == {"fleet.server", "fleet.agent", "gateway", "fleet.client"}


def test_the_agent_and_the_gateway_stay_off_the_server_and_the_ledger() -> None:
    hosts = contract("hosts")
    assert hosts["type"] == "forbidden"
    assert set(hosts["source_modules"]) == {"fleet.agent", "gateway"}
    assert set(hosts["forbidden_modules"]) == {"fleet.server", "fleet.ledger"}
    assert not hosts.get("allow_indirect_imports", False)
