"""inspect_ai's sandbox environment `fleet`: every sample gets a fleet session.

    eval(task, sandbox=("fleet", "smolfiles/minimal.smolfile"))

Registered through inspect_ai's entry point (`[project.entry-points.inspect_ai]`), so
`sandbox="fleet"` works once fleet is installed with the `inspect` extra. The sandbox config is
a Smolfile's path (none: fleet's default image). The server and key come from $FLEET_SERVER,
$FLEET_KEY and $FLEET_CA, else from the files `fleet up` writes (see `fleet.client.Fleet`).
`sample_init` opens one session per sample, `exec`/`read_file`/`write_file` are its calls,
`sample_cleanup` closes it. Relative paths resolve in /root, the sample's working directory.

When the eval's model is one of the gateway's (`--model fleet/NAME`, this module registers that
model API too: `fleet.providers.inspect_model`), each sample's session is opened with
`inference=True` (and the upstream models the model needs), and its inference token is read
once, as it opens. The sample's model calls are made with it, so the ledger holds each
sample's tokens under the sample's own rollout.
"""

from __future__ import annotations

import asyncio
import posixpath
import tempfile
from pathlib import Path
from typing import Literal, overload

from inspect_ai.util import ExecResult, SandboxEnvironment, sandboxenv
from inspect_ai.util._sandbox.environment import (
    SandboxEnvironmentConfigType,
    SandboxUserUnsupportedError,
)

from fleet.client_async import AsyncFleet, AsyncSession
from fleet.core.errors import FleetError, NotFound, PermissionDenied, Unauthenticated
from fleet.providers.inspect_model import FleetModelAPI, RolloutCredential, read_credential

WORKDIR = "/root"
DEFAULT_SMOLFILE = 'image = "minimal"\n'


def _absolute(path: str) -> str:
    return posixpath.normpath(posixpath.join(WORKDIR, path))


def _smolfile(config: SandboxEnvironmentConfigType | None) -> str:
    """The Smolfile's path: the config, or a default one written for the purpose."""
    if isinstance(config, str) and config:
        return config
    default = Path(tempfile.gettempdir()) / "fleet-inspect-default.smolfile"
    if not default.exists():
        default.write_text(DEFAULT_SMOLFILE)
    return str(default)


def _inference() -> tuple[str, ...] | None:
    """The upstream models a sample's session must allow when the eval's model is one of the
    gateway's (an empty tuple: the gateway's own model), or None when it is not."""
    from inspect_ai.model._model import active_model

    model = active_model()
    if model is None or not isinstance(model.api, FleetModelAPI):
        return None
    return model.api.rollout_models


@sandboxenv(name="fleet")
class FleetSandboxEnvironment(SandboxEnvironment):
    """One sample's fleet session."""

    def __init__(
        self, session: AsyncSession, rollout_credential: RolloutCredential | None = None
    ) -> None:
        super().__init__()
        self.session = session
        self.rollout_credential = rollout_credential
        """The session's inference token (opened for a `fleet/` model), for the sample's
        model calls."""

    @classmethod
    async def sample_init(
        cls, task_name: str, config: SandboxEnvironmentConfigType | None, metadata: dict[str, str]
    ) -> dict[str, SandboxEnvironment]:
        fleet = await asyncio.to_thread(AsyncFleet)
        labels = {"inspect.task": task_name[:200]}
        models = _inference()
        session: AsyncSession | None = None
        try:
            session = await fleet.session(
                _smolfile(config), labels=labels, inference=models is not None,
                models=models or (),
            )  # fmt: skip
            credential = await read_credential(session) if models is not None else None
        except BaseException:
            try:
                if session is not None:
                    await session.close()
            finally:
                await fleet.close()
            raise
        return {"default": cls(session, credential)}

    @classmethod
    async def sample_cleanup(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        environments: dict[str, SandboxEnvironment],
        interrupted: bool,
    ) -> None:
        for environment in environments.values():
            if isinstance(environment, FleetSandboxEnvironment):
                try:
                    await environment.session.close()
                except FleetError:
                    pass  # already closed (idle) or its host is gone: nothing left to free
                finally:
                    await environment.session.fleet.close()

    async def exec(
        self,
        cmd: list[str],
        input: str | bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        timeout: int | None = None,  # noqa: ASYNC109 (inspect_ai's signature)
        timeout_retry: bool = True,
        concurrency: bool = True,
    ) -> ExecResult[str]:
        if user is not None and user not in ("root", "0"):
            raise SandboxUserUnsupportedError(
                f"fleet sessions run commands as the Smolfile's user, not {user!r}"
            )
        stdin = input.encode() if isinstance(input, str) else (input or b"")
        result = await self.session.exec(
            cmd, env=env or {}, cwd=_absolute(cwd or "."), stdin=stdin,
            timeout_s=float(timeout) if timeout else 600.0,
        )  # fmt: skip
        if result.timed_out:
            raise TimeoutError(f"{cmd[0]} timed out after {timeout} s in a fleet session")
        return ExecResult(
            success=result.exit_code == 0, returncode=result.exit_code,
            stdout=result.stdout.decode(errors="replace"),
            stderr=result.stderr.decode(errors="replace"),
        )  # fmt: skip

    async def write_file(self, file: str, contents: str | bytes) -> None:
        data = contents.encode() if isinstance(contents, str) else contents
        try:
            await self.session.write_file(_absolute(file), data)
        except (PermissionDenied, Unauthenticated) as exc:
            raise PermissionError(exc.message) from exc

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        try:
            data = await self.session.read_file(_absolute(file))
        except NotFound as exc:
            raise FileNotFoundError(exc.message) from exc
        return data.decode() if text else data
