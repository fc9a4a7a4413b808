"""Where the data fleet ships lives: image recipes, Smolfiles and the gateway's weights.

A wheel carries them as package data under `fleet/_data/` (pyproject.toml maps the
repository's top-level `images/`, `smolfiles/` and `gateway/weights/` there when the wheel is
built); a checkout, installed in editable mode or not, reads those folders themselves. Both are
found through `importlib.resources`, from the installed `fleet` package, never from the current
directory. The answers are real paths: the image store, the gateway's manifest and `fleet
submit` read files, and fleet is installed unpacked, never run from a zip.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Literal, NamedTuple

from fleet.core.errors import FailedPrecondition, InvalidArgument, NotFound

Kind = Literal["images", "smolfiles", "weights"]


class Shipped(NamedTuple):
    checkout: str
    """Its folder in a checkout (in a wheel: `fleet/_data/KIND`)."""
    plural: str
    noun: str
    example: str


SHIPPED: dict[Kind, Shipped] = {
    "images": Shipped("images", "image recipes", "image recipe", "minimal"),
    "smolfiles": Shipped("smolfiles", "Smolfiles", "Smolfile", "minimal.smolfile"),
    "weights": Shipped("gateway/weights", "model weights", "weights entry", "models.toml"),
}
"""Each kind of shipped data."""

SMOLFILE_SUFFIX = ".smolfile"


def _package_root() -> Path:
    root = files("fleet")
    if not isinstance(root, Path):
        raise FailedPrecondition(
            f"fleet is installed where its files are not on disk ({root}); install it unpacked "
            "(pip install does)"
        )
    return root


def folder(kind: Kind) -> Path:
    """The directory that holds the shipped data of `kind`: the wheel's copy when fleet is
    installed from one, else the checkout's folder (a checkout is told by its pyproject.toml,
    so that an installation missing its data is an error, not a stray folder beside it)."""
    root = _package_root()
    packaged = root / "_data" / kind
    if packaged.is_dir():
        return packaged
    checkout = root.parent / SHIPPED[kind].checkout
    if checkout.is_dir() and (root.parent / "pyproject.toml").is_file():
        return checkout
    raise FailedPrecondition(
        f"fleet's {SHIPPED[kind].plural} are missing: neither {packaged} (an installed wheel) nor "
        f"{checkout} (a checkout) exists; reinstall fleet"
    )


def _entry(kind: Kind, name: str) -> Path:
    """`name` within `kind`'s folder: one plain name, never a path that leads out of it."""
    shipped = SHIPPED[kind]
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise InvalidArgument(
            f"shipped {shipped.noun} {name!r}: not a name (one path component, like "
            f"{shipped.example!r})"
        )
    where = folder(kind)
    path = where / name
    if not path.exists():
        known = ", ".join(sorted(p.name for p in where.iterdir() if not p.name.startswith(".")))
        raise NotFound(f"no shipped {shipped.noun} {name!r} in {where} (there: {known})")
    return path


def recipes() -> Path:
    """The folder of image recipes, one `NAME/recipe.toml` each (`fleet image build NAME`)."""
    return folder("images")


def recipe(name: str) -> Path:
    """The shipped recipe of image `name` (its `recipe.toml`)."""
    path = _entry("images", name) / "recipe.toml"
    if not path.is_file():
        raise NotFound(f"no shipped image recipe {name!r}: {path} is not a file")
    return path


def smolfiles() -> Path:
    """The folder of shipped Smolfiles (and the example organisation policy beside them)."""
    return folder("smolfiles")


def smolfile(name: str) -> Path:
    """A shipped Smolfile by name: `minimal` and `minimal.smolfile` are the same one; another
    file there (`org-policy.example.toml`) by its full name."""
    if name and "." not in name:
        name += SMOLFILE_SUFFIX
    return _entry("smolfiles", name)


def weights(name: str = "") -> Path:
    """The gateway's weights folder, or the entry `name` in it: the model manifest
    (`models.toml`), a weight file, or a model's own directory."""
    return _entry("weights", name) if name else folder("weights")
