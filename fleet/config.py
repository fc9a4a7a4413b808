"""Where fleet keeps its data, read from the environment in this one place."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Paths:
    """Filesystem locations fleet uses."""

    home: Path
    """Fleet's data directory: image store, ledgers, machines ($FLEET_HOME)."""
    recipes: Path
    """Folder of image recipes ($FLEET_RECIPES, default: the repository's images/)."""

    @property
    def images(self) -> Path:
        return self.home / "images"

    @property
    def machines(self) -> Path:
        return self.home / "machines"

    @classmethod
    def from_env(cls) -> Paths:
        home = os.environ.get("FLEET_HOME") or str(Path.home() / ".local" / "share" / "fleet")
        recipes = os.environ.get("FLEET_RECIPES") or str(_REPO_ROOT / "images")
        return cls(home=Path(home), recipes=Path(recipes))
