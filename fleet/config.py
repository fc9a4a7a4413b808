"""Where fleet keeps its data, read from the environment in this one place."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fleet import resources


@dataclass(frozen=True)
class Paths:
    """Filesystem locations fleet uses."""

    home: Path
    """Fleet's data directory: image store, ledgers, machines ($FLEET_HOME)."""
    recipes: Path
    """Folder of image recipes ($FLEET_RECIPES, default: the shipped ones, `fleet.resources`)."""

    @property
    def images(self) -> Path:
        return self.home / "images"

    @property
    def machines(self) -> Path:
        return self.home / "machines"

    @property
    def tools(self) -> Path:
        """The namespace runtime's C helpers, built once per host by `fleet host prepare`
        (`fleet.runtime.helpers`), not by an agent while it runs work."""
        return self.home / "tools"

    @property
    def ca(self) -> Path:
        """The fleet CA (`ca.key`, mode 0600, and `ca.crt`): on the server's host only."""
        return self.home / "ca"

    @property
    def admin_key(self) -> Path:
        """An admin API key for the local user (mode 0600), found by the CLI."""
        return self.home / "admin.key"

    @property
    def host_identity(self) -> Path:
        """This host's key, certificate and CA after `fleet agent --join`."""
        return self.home / "host"

    def token_secret(self) -> bytes:
        """The key the server signs inference tokens with and the gateway checks them with.

        $FLEET_TOKEN_SECRET (hex) if set; otherwise `token.secret` in the data directory,
        created once with 32 random bytes, readable by its owner only. Hosts that share a
        gateway share this file (or the variable).
        """
        env = os.environ.get("FLEET_TOKEN_SECRET")
        if env:
            try:
                secret = bytes.fromhex(env)
            except ValueError:
                raise ValueError("FLEET_TOKEN_SECRET must be hex (32 bytes: 64 digits)") from None
            if len(secret) < 16:
                raise ValueError("FLEET_TOKEN_SECRET must be at least 16 bytes (32 hex digits)")
            return secret
        path = self.home / "token.secret"
        if not path.exists():
            self.home.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(os.urandom(32))
            try:
                os.link(tmp, path)  # first writer wins; others read what it wrote
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        return path.read_bytes()

    @classmethod
    def from_env(cls) -> Paths:
        home = os.environ.get("FLEET_HOME") or str(Path.home() / ".local" / "share" / "fleet")
        recipes = os.environ.get("FLEET_RECIPES")
        return cls(home=Path(home), recipes=Path(recipes) if recipes else resources.recipes())
