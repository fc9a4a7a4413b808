"""A Harbor environment whose machines are fleet sessions.

Harbor (the harness for terminal-bench style tasks) runs each trial's agent and verifier
commands in an "environment". This one opens a fleet session for the trial, from the Smolfile
in the task's `environment/` directory (`environment/Smolfile`, or the `smolfile` option), and
maps Harbor's calls onto the session: `exec` -> `Session.exec`, files and directories ->
`write_file`/`upload_dir`/`read_file`/`download_dir`, `stop` -> close. Select it with

    harbor run -p TASK_DIR -a oracle -e fleet.providers.harbor:FleetEnvironment

The server and key come from the `server`/`key` options (`--ek server=HOST:PORT`), else from
`FLEET_SERVER`, `FLEET_KEY`, `FLEET_CA` (or the files `fleet up` writes), as for the client.

The Smolfile decides the machine's network: a task that asks Harbor for `no-network` is
refused when its Smolfile asks for egress; an allowlist is written in the Smolfile, not in
Harbor's task (Harbor's allowlists are refused). Commands run as the Smolfile's `user`; a
Harbor `user` other than that is refused rather than ignored.

An agent that runs in the machine and calls a model (`--ek inference=true`, or
`--ek models=UPSTREAM/MODEL,...` for upstream models besides the gateway's own) gets a session
opened for inference: its machine reaches the gateway, and its commands find
`OPENAI_BASE_URL` and `OPENAI_API_KEY` pointing there with the trial's rollout token. What
Harbor passes for these (its installed agents copy the host's `OPENAI_API_KEY`) is dropped
before a command leaves the host (`fleet.providers.inference`).

Harbor needs Python 3.12 or newer (`pip install fleet[harbor]`); this module imports it.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult  # type: ignore[import-not-found]
from harbor.environments.capabilities import (  # type: ignore[import-not-found]
    EnvironmentCapabilities,
)
from harbor.environments.options import EnvironmentOptions  # type: ignore[import-not-found]
from harbor.models.task.config import NetworkMode  # type: ignore[import-not-found]

from fleet.client_async import AsyncFleet, AsyncSession
from fleet.core.smolfile import parse_smolfile
from fleet.providers.inference import command_env, upstream_models

SMOLFILE_NAMES = ("Smolfile", "fleet.smolfile")
DEFAULT_TIMEOUT_S = 600.0


class FleetOptions(EnvironmentOptions):  # type: ignore[misc]
    """`--ek` options of the fleet environment."""

    server: str | None = None
    key: str | None = None
    smolfile: str | None = None
    idle_timeout_s: float = 1800.0
    inference: bool = False
    """The agent in the machine calls models through the gateway."""
    models: str | list[str] = ""
    """Upstream models (`UPSTREAM/MODEL`, comma-separated or a list) it may call there;
    implies `inference`."""


class FleetEnvironment(BaseEnvironment):  # type: ignore[misc]
    """One fleet session per Harbor environment (a trial's agent or verifier)."""

    options_model = FleetOptions
    options: FleetOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fleet: AsyncFleet | None = None
        self._session: AsyncSession | None = None
        self._shell = "/bin/sh"

    @staticmethod
    def type() -> str:
        return "fleet"

    @property
    def capabilities(self) -> Any:
        # No network is a Smolfile without egress; allowlists live in the Smolfile.
        return EnvironmentCapabilities(disable_internet=True)

    def _smolfile(self) -> Path:
        if self.options.smolfile:
            return Path(self.options.smolfile)
        for name in SMOLFILE_NAMES:
            path = Path(self.environment_dir) / name
            if path.is_file():
                return path
        raise FileNotFoundError(
            f"task environment {self.environment_dir} has no Smolfile: add "
            f"{self.environment_dir.name}/Smolfile (fleet runs tasks from a Smolfile, not a "
            "Dockerfile), or pass --ek smolfile=PATH"
        )

    def _validate_definition(self) -> None:
        path = self._smolfile()
        parsed = parse_smolfile(path.read_text(), str(path))  # a malformed one: refused here
        self._models()  # (a bad model name: refused here, before a machine is asked for)
        if self.network_policy.network_mode == NetworkMode.NO_NETWORK and (
            parsed.spec.egress_requested
        ):
            raise ValueError(
                f"{path}: the task asks for no network and its Smolfile asks for egress; "
                "remove the Smolfile's egress (fleet enforces the Smolfile)"
            )

    def _models(self) -> tuple[str, ...]:
        return upstream_models(self.options.models, "--ek models")

    @property
    def _inference(self) -> bool:
        return bool(self.options.inference or self.options.models)

    def _require(self) -> AsyncSession:
        if self._session is None:
            raise RuntimeError("the fleet environment is not started (call start() first)")
        return self._session

    async def start(self, force_build: bool) -> None:
        options = self.options
        self._fleet = AsyncFleet(
            options.server or os.environ.get("FLEET_SERVER") or None, key=options.key
        )
        labels = {
            "harbor.session": self.session_id[:128],
            "harbor.task": self.environment_name[:128],
        }
        try:
            self._session = await self._fleet.session(
                self._smolfile(), idle_timeout_s=options.idle_timeout_s, labels=labels,
                inference=self._inference, models=self._models(),
            )  # fmt: skip
            probe = await self._session.exec(["test", "-x", "/bin/bash"])
            self._shell = "/bin/bash" if probe.exit_code == 0 else "/bin/sh"
            if workdir := self.task_env_config.workdir:
                await self._session.exec(["mkdir", "-p", "--", workdir])
            await self.ensure_dirs(self._mount_targets(writable_only=True))
        except BaseException:
            await self.stop(delete=True)
            raise
        self.logger.debug(f"fleet session {self._session.id} on {self._session.host_id}")

    async def stop(self, delete: bool) -> None:
        session, self._session = self._session, None
        fleet, self._fleet = self._fleet, None
        try:
            if session is not None:
                await session.close()
        finally:
            if fleet is not None:
                await fleet.close()

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> Any:
        user = self._resolve_user(user)
        if user is not None and str(user) not in ("root", "0"):
            raise ValueError(
                f"user {user!r}: a fleet machine runs commands as its Smolfile's `user`; set "
                "it there instead"
            )
        result = await self._require().exec(
            [self._shell, "-c", command],
            env=command_env(self._merge_env(env), self._inference),
            cwd=cwd or self.task_env_config.workdir or "",
            timeout_s=float(timeout_sec) if timeout_sec else DEFAULT_TIMEOUT_S,
        )
        return ExecResult(
            stdout=result.stdout.decode(errors="replace"),
            stderr=result.stderr.decode(errors="replace"),
            return_code=result.exit_code,
        )

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        data = await asyncio.to_thread(Path(source_path).read_bytes)
        mode = os.stat(source_path).st_mode & 0o777
        await self._require().write_file(target_path, data, mode)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        await self._require().upload_dir(source_dir, target_dir)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self._require().read_file(source_path)
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(target.write_bytes, data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        await self._require().download_dir(source_dir, target_dir)
