"""inspect_ai's model API `fleet`: `--model fleet/NAME` asks the inference gateway for NAME.

    inspect eval task.py --model fleet/fleet-tiny-chat-v1 --sandbox fleet

The gateway speaks OpenAI's chat completions API, so this is inspect_ai's OpenAI-compatible
provider with two things of fleet's own:

- Every call carries a rollout's inference token, never a provider key. The token is the one
  of the sample's fleet sandbox: its session is opened with `inference=True` when the eval's
  model is a `fleet/` one (see `fleet.providers.inspect_sandbox`), and the provider reads the
  token from the sandbox of the sample the call is made for (inspect_ai runs a sample's model
  calls in the sample's context). So the ledger charges each sample's tokens to that sample's
  rollout, beside its device seconds, and the gateway's failover, budgets and `fleet report`
  apply as for any machine of the rollout. The call also names that rollout
  (`x-fleet-rollout`), so a token of another rollout is refused rather than charged.
- Outside a fleet sandbox (a task without one, or a model call of a sandbox opened without
  inference) the token comes from `$FLEET_INFERENCE_TOKEN`, as it does in a machine of an
  `--inference` rollout, or `--model-api-key`. The provider does not open a session of its own
  for a token: that would hold a machine per eval for nothing but accounting, and charge every
  sample's tokens to one rollout.

Configuration: the gateway's HTTP endpoint (`fleet gateway --http-listen`) from
`--model-base-url`, else `$FLEET_GATEWAY_URL` (`http://HOST:PORT`; `/v1` is
added when the URL has no path); a gateway serving TLS is checked against the CA in
`-M ca=PATH`, else `$FLEET_GATEWAY_CA` (a PEM file's path, or PEM text as machines get it), else
the system's. `-M models=UPSTREAM/MODEL,...` lists further upstream models the sandbox's
rollout may call (the eval's own model, when it is an upstream one, is always listed).
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from inspect_ai.model import (
    ChatMessage,
    GenerateConfig,
    ModelAPI,
    ModelOutput,
    modelapi,
)
from inspect_ai.model._model_call import ModelCall
from inspect_ai.model._providers.openai_compatible import OpenAICompatibleAPI
from inspect_ai.tool import ToolChoice, ToolInfo
from inspect_ai.util import SandboxEnvironment, sandbox
from openai import AsyncOpenAI, DefaultAsyncHttpxClient
from openai._types import NOT_GIVEN

from fleet.client.aio import AsyncSession
from fleet.providers.inference import ModelListError, upstream_models

API_NAME = "fleet"
ENV_URL = "FLEET_GATEWAY_URL"
ENV_CA = "FLEET_GATEWAY_CA"
ENV_TOKEN = "FLEET_INFERENCE_TOKEN"
ENV_ROLLOUT = "FLEET_ROLLOUT_ID"
ROLLOUT_HEADER = "x-fleet-rollout"
# What a token looks like (`v1.<payload>.<signature>`, base64url): anything else a machine
# hands back is refused before it is put in a header.
TOKEN_PATTERN = re.compile(r"v1\.[A-Za-z0-9_-]{1,8192}\.[A-Za-z0-9_-]{1,256}")
# (the placeholder the OpenAI client is built with; every request's key is the sample's token)
NO_KEY = "fleet-rollout-token"


class GatewayConfigError(ValueError):
    """The provider's configuration (gateway URL, CA, models) is missing or malformed."""


@dataclass(frozen=True)
class RolloutCredential:
    """A rollout's inference token, and the rollout it is scoped to ("" when not known)."""

    rollout_id: str
    token: str


def checked_token(token: str, where: str) -> str:
    """`token` if it has a token's shape; else an error naming `where` it came from."""
    token = token.strip()
    if not TOKEN_PATTERN.fullmatch(token):
        shown = "empty" if not token else f"{len(token)} characters not shaped v1.PAYLOAD.SIG"
        raise GatewayConfigError(f"{where}: not an inference token ({shown})")
    return token


async def read_credential(session: AsyncSession) -> RolloutCredential:
    """The inference token of a session opened with `inference=True`. The server issues it
    when the session's machine is leased and hands it to the machine only (its
    `FLEET_INFERENCE_TOKEN`), so it is read there, once, when the session opens: before any
    command of the evaluation has run in it."""
    result = await session.exec(["/bin/sh", "-c", f'printf %s "${ENV_TOKEN}"'], timeout_s=60.0)
    if result.exit_code != 0:
        raise RuntimeError(
            f"session {session.id}: reading its inference token failed "
            f"(exit {result.exit_code}): {result.stderr.decode(errors='replace')[-300:]}"
        )
    token = checked_token(
        result.stdout.decode(errors="replace"), f"session {session.id}'s ${ENV_TOKEN}"
    )
    return RolloutCredential(session.id, token)


def gateway_base_url(value: str | None) -> str:
    """The OpenAI API's base on the gateway: `value`, else `$FLEET_GATEWAY_URL`, with `/v1`
    added to a URL without a path."""
    raw = (value or os.environ.get(ENV_URL) or "").strip()
    if not raw:
        raise GatewayConfigError(
            f"model API {API_NAME!r}: no gateway URL: set ${ENV_URL} to the gateway's HTTP "
            "endpoint (http://HOST:PORT, `fleet gateway --http-listen`) or pass "
            "--model-base-url"
        )
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise GatewayConfigError(
            f"model API {API_NAME!r}: gateway URL {raw!r} is not http(s)://HOST:PORT[/v1]"
        )
    if parts.username or parts.password:
        raise GatewayConfigError(
            f"model API {API_NAME!r}: gateway URL has credentials in it; the token is the key"
        )
    return raw.rstrip("/") if parts.path.strip("/") else raw.rstrip("/") + "/v1"


def gateway_ssl_context(ca: str | None) -> ssl.SSLContext | None:
    """A context trusting the gateway's CA (a PEM file's path or PEM text), or None (the
    system's trust store) when none is given."""
    ca = (ca or os.environ.get(ENV_CA) or "").strip()
    if not ca:
        return None
    try:
        if ca.startswith("-----BEGIN"):
            return ssl.create_default_context(cadata=ca)
        return ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        source = "-M ca" if ca != os.environ.get(ENV_CA, "").strip() else f"${ENV_CA}"
        raise GatewayConfigError(
            f"model API {API_NAME!r}: the gateway CA in {source} cannot be read: {exc}"
        ) from exc


def rollout_models(model_name: str, extra: str | Sequence[str] | None) -> tuple[str, ...]:
    """The upstream models (`UPSTREAM/MODEL`) a sample's rollout must be allowed: the model
    itself when it is an upstream one (the gateway's own model has no `/`), and `extra`."""
    try:
        own = upstream_models([model_name] if "/" in model_name else [], f"{API_NAME}/")
        return tuple(dict.fromkeys(own + upstream_models(extra, "-M models")))
    except ModelListError as exc:
        raise GatewayConfigError(f"model API {API_NAME!r}: {exc}") from exc


def sample_credential() -> RolloutCredential | None:
    """The credential of the sandbox of the sample this call runs for, when it is a fleet
    session opened for inference (else None)."""
    try:
        environment = sandbox()
    except (ProcessLookupError, ValueError):  # no sample, or a task without sandboxes
        return None
    # (inspect_ai hands out its logging proxy; as_type gives the environment behind it)
    inner = environment.as_type(SandboxEnvironment)  # type: ignore[type-abstract]
    credential = getattr(inner, "rollout_credential", None)
    return credential if isinstance(credential, RolloutCredential) else None


class FleetModelAPI(OpenAICompatibleAPI):
    """The gateway's models through inspect_ai's OpenAI-compatible provider, each call with
    the token of the rollout it is made for."""

    def __init__(
        self,
        model_name: str,
        base_url: str | None = None,
        api_key: str | None = None,
        config: GenerateConfig | None = None,
        **model_args: Any,
    ) -> None:
        self.rollout_models = rollout_models(model_name, model_args.pop("models", None))
        self._ssl_context = gateway_ssl_context(model_args.pop("ca", None))
        fallback = api_key or os.environ.get(ENV_TOKEN) or ""
        self._fallback = (
            RolloutCredential(
                os.environ.get(ENV_ROLLOUT, ""),
                checked_token(fallback, "--model-api-key" if api_key else f"${ENV_TOKEN}"),
            )
            if fallback
            else None
        )
        super().__init__(
            model_name,
            base_url=gateway_base_url(base_url),
            api_key=NO_KEY,
            config=config or GenerateConfig(),
            service=API_NAME,
            responses_api=False,
            **model_args,
        )

    def credential(self) -> RolloutCredential:
        """The token this call is made with: the sample's sandbox's, else the fallback."""
        found = sample_credential() or self._fallback
        if found is None:
            raise RuntimeError(
                f"{API_NAME}/{self.model_name}: no inference token for this call: the sample "
                'has no fleet sandbox opened for inference (use sandbox="fleet" with a '
                f"{API_NAME}/ model as the eval's model), and ${ENV_TOKEN} is not set"
            )
        return found

    async def _token(self) -> str:
        return self.credential().token

    def _create_http_client(self) -> DefaultAsyncHttpxClient:
        if self._ssl_context is None:
            return super()._create_http_client()
        from inspect_ai._util.http_defaults_httpx2 import default_client_kwargs

        return DefaultAsyncHttpxClient(**default_client_kwargs(verify=self._ssl_context))

    def _create_client(self) -> AsyncOpenAI:
        # The key is asked for at each request, in the calling sample's context; it is sent
        # as the Authorization header and kept out of the request inspect_ai logs.
        return AsyncOpenAI(
            api_key=self._token,
            base_url=self.base_url,
            http_client=self.http_client,
            timeout=self.client_timeout if self.client_timeout is not None else NOT_GIVEN,
            **self.model_args,
        )

    def service_model_name(self) -> str:
        return self.model_name  # (the gateway's own id, or UPSTREAM/MODEL as it is)

    def request_headers(self, config: GenerateConfig) -> dict[str, str]:
        rollout_id = self.credential().rollout_id
        return {ROLLOUT_HEADER: rollout_id} if rollout_id else {}

    async def generate(
        self,
        input: list[ChatMessage],
        tools: list[ToolInfo],
        tool_choice: ToolChoice,
        config: GenerateConfig,
    ) -> ModelOutput | tuple[ModelOutput | Exception, ModelCall]:
        self.credential()  # (no token: said here, before a request is built)
        return await super().generate(input, tools, tool_choice, config)


@modelapi(name=API_NAME)
def fleet_model_api() -> type[ModelAPI]:
    """Registers `fleet/NAME` (loaded through fleet's `inspect_ai` entry point)."""
    return FleetModelAPI
