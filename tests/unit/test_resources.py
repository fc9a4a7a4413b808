"""The data fleet ships (recipes, Smolfiles, weights) is found from a checkout and from a wheel,
and a built wheel carries it, with the runtime's C sources and every module."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet import resources
from fleet.config import Paths
from fleet.core.errors import FailedPrecondition, InvalidArgument, NotFound

REPO = Path(__file__).resolve().parents[2]
SHIPPED = {"images": "images", "smolfiles": "smolfiles", "weights": "gateway/weights"}
"""Each kind of shipped data and its folder in the repository."""
C_SOURCES = ("stepexec.c", "sessiond.c", "capbound.c")
JUNK = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", ".*")


def shipped_files(folder: Path) -> list[str]:
    """Every file under `folder` (relative), as the wheel must carry it."""
    return sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not p.name.startswith(".")
    )


# -- from the checkout --------------------------------------------------------------------------


def test_each_shipped_resource_is_found_in_the_checkout() -> None:
    assert resources.recipes() == REPO / "images"
    recipe = resources.recipe("minimal")
    assert recipe == REPO / "images" / "minimal" / "recipe.toml"
    assert tomllib.loads(recipe.read_text())["name"] == "minimal"
    assert resources.smolfiles() == REPO / "smolfiles"
    assert resources.smolfile("minimal") == resources.smolfile("minimal.smolfile")
    assert resources.smolfile("minimal") == REPO / "smolfiles" / "minimal.smolfile"
    assert resources.smolfile("org-policy.example.toml").is_file()
    assert resources.weights() == REPO / "gateway" / "weights"
    manifest = tomllib.loads(resources.weights("models.toml").read_text())
    for name, model in manifest["model"].items():
        assert resources.weights(model["file"]).is_file(), name


def test_the_default_recipes_and_the_gateways_manifest_are_the_shipped_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gateway.settings import WEIGHTS_DIR, GatewayConfig

    monkeypatch.delenv("FLEET_RECIPES", raising=False)
    assert Paths.from_env().recipes == resources.recipes()
    monkeypatch.setenv("FLEET_RECIPES", "/srv/recipes")
    assert Paths.from_env().recipes == Path("/srv/recipes")
    assert resources.weights() == WEIGHTS_DIR
    assert GatewayConfig().models_toml == resources.weights("models.toml")


@pytest.mark.parametrize("name", ["", ".", "..", "../pyproject.toml", "a/b", "x\0y"])
def test_a_name_that_is_a_path_is_refused(name: str) -> None:
    with pytest.raises(InvalidArgument, match=r"shipped Smolfile .*: not a name"):
        resources.smolfile(name)
    with pytest.raises(InvalidArgument, match=r"shipped image recipe .*: not a name"):
        resources.recipe(name)
    if name:  # (no name: the folder itself)
        with pytest.raises(InvalidArgument, match=r"shipped weights entry .*: not a name"):
            resources.weights(name)


def test_an_unknown_name_is_not_found_and_the_known_ones_are_listed() -> None:
    with pytest.raises(NotFound, match=r"no shipped Smolfile 'nope.smolfile'.*minimal\.smolfile"):
        resources.smolfile("nope")
    with pytest.raises(NotFound, match=r"no shipped image recipe 'nope'.*minimal"):
        resources.recipe("nope")
    with pytest.raises(NotFound, match=r"no shipped image recipe 'README\.md'"):
        resources.recipe("README.md")


def test_the_packaged_copy_comes_first_and_a_missing_one_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Installed: `fleet/_data/KIND`; a folder of the same name beside the package that is not
    a checkout (no pyproject.toml) is never taken for it."""
    package = tmp_path / "site-packages" / "fleet"
    (package / "_data" / "smolfiles").mkdir(parents=True)
    (package / "_data" / "smolfiles" / "minimal.smolfile").write_text('image = "minimal"\n')
    (tmp_path / "site-packages" / "images").mkdir()
    monkeypatch.setattr(resources, "_package_root", lambda: package)
    assert resources.smolfile("minimal") == package / "_data" / "smolfiles" / "minimal.smolfile"
    with pytest.raises(FailedPrecondition, match="image recipes are missing"):
        resources.recipes()


# -- the packages pyproject.toml lists ----------------------------------------------------------


def test_every_directory_of_modules_is_a_listed_package() -> None:
    """The packages are listed by hand (a folder mapped under another name needs it): a new
    package missing from the list would be missing from the wheel, and a listed one that is
    gone fails the build."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = {
        ".".join(d.relative_to(REPO).parts)
        for top in ("fleet", "gateway")
        for d in [REPO / top, *(REPO / top).rglob("*")]
        if d.is_dir() and "__pycache__" not in d.parts and any(d.glob("*.py"))
    }
    code = {p for p in listed if not p.startswith("fleet._data.")}
    assert found - code == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert code - found == set(), "these listed packages are gone: remove them from pyproject.toml"
    assert listed - code == {f"fleet._data.{kind}" for kind in SHIPPED}


# -- from a built wheel -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The wheel built from a copy of what the build reads (no build/ left from earlier)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for name in ("fleet", "gateway", "images", "smolfiles"):
        shutil.copytree(REPO / name, source / name, ignore=JUNK)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(root / "dist"), str(source)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (built,) = (root / "dist").glob("fleet-*.whl")
    yield built


def test_the_wheel_carries_the_shipped_data_the_c_sources_and_every_module(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for kind, folder in SHIPPED.items():
        expected = shipped_files(REPO / folder)
        assert expected, folder
        missing = [rel for rel in expected if f"fleet/_data/{kind}/{rel}" not in names]
        assert missing == [], f"{folder}/ files missing from the wheel"
    for source in C_SOURCES:
        assert f"fleet/runtime/{source}" in names
    assert "fleet/ledger/alembic.ini" in names
    modules = [
        str(p.relative_to(REPO))
        for top in ("fleet", "gateway")
        for p in (REPO / top).rglob("*.py")
        if "__pycache__" not in p.parts
    ]
    assert [m for m in modules if m not in names] == []
    # The weights are carried once, under fleet/_data, not also where the repository keeps them.
    assert not [n for n in names if n.startswith("gateway/weights/")]


def test_an_installed_wheel_finds_its_own_data(wheel: Path, tmp_path: Path) -> None:
    """Run from outside the checkout, fleet as the wheel installs it answers with its own
    copies (`fleet/_data/`), not the repository's folders."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
         "--target", str(target), str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    script = (
        f"import sys; sys.path.insert(0, {str(target)!r})\n"
        "import fleet, json\nfrom fleet import resources\n"
        "print(json.dumps([fleet.__file__, str(resources.recipe('minimal')),"
        " str(resources.smolfile('minimal')), str(resources.weights('models.toml'))]))"
    )
    # -I: neither $PYTHONPATH nor the current directory; the wheel's copy comes first.
    done = subprocess.run(
        [sys.executable, "-I", "-c", script],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    init, recipe, smolfile, manifest = (Path(p) for p in json.loads(done.stdout))
    package = target / "fleet"
    assert init == package / "__init__.py"
    assert recipe == package / "_data" / "images" / "minimal" / "recipe.toml"
    assert smolfile == package / "_data" / "smolfiles" / "minimal.smolfile"
    assert manifest == package / "_data" / "weights" / "models.toml"
    assert recipe.read_bytes() == (REPO / "images" / "minimal" / "recipe.toml").read_bytes()
