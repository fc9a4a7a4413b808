"""`fleet serve`'s web console setting: a flag (`--console-listen`) and a variable
(FLEET_SERVE_CONSOLE_LISTEN) beside the server's own.

Light to import: the CLI builds its flags from this model without loading the console."""

from __future__ import annotations

from pydantic_settings import SettingsConfigDict

from fleet.settings import Settings


class ConsoleSettings(Settings):
    """Where `fleet serve` serves the web console."""

    model_config = SettingsConfigDict(env_prefix="FLEET_SERVE_")

    console_listen: str = ""
    """host:port of the web console, or a port (on loopback); "": none. Beyond loopback it
    serves TLS with the API's certificate (and needs the fleet CA)."""
