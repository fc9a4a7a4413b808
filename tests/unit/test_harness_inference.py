"""What the harness providers ask for when a sample's or trial's machine calls models: the
upstream models its rollout must allow, the environment sent with its commands, and the
inspect_ai model API's configuration (gateway URL, CA, token), refused with a clear error when
wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.providers.inference import ModelListError, command_env, upstream_models


def test_upstream_models_come_from_a_list_or_a_command_lines_string() -> None:
    assert upstream_models(None, "models") == ()
    assert upstream_models("vllm/llama-3-8b, hosted/*,,vllm/llama-3-8b", "m") == (
        "vllm/llama-3-8b",
        "hosted/*",
    )
    assert upstream_models(["a/b"], "m") == ("a/b",)
    with pytest.raises(ModelListError, match=r"--ek models\[1\] 'gpt-4o' is not UPSTREAM/MODEL"):
        upstream_models("a/b,gpt-4o", "--ek models")


def test_a_harness_never_sets_the_model_variables_of_an_inference_machine() -> None:
    harness = {"OPENAI_API_KEY": "sk-host", "OPENAI_BASE_URL": "https://api.example/v1",
               "OPENAI_API_BASE": "https://api.example/v1", "TERM": "xterm"}  # fmt: skip
    assert command_env(harness, inference=True) == {"TERM": "xterm"}
    assert command_env(harness, inference=False) == harness  # (its own machine, its choice)
    assert command_env(None, inference=True) == {}


def test_the_inspect_model_api_is_registered_and_configured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from inspect_ai.model import get_model

    from fleet.providers.inspect_model import FleetModelAPI, GatewayConfigError

    monkeypatch.delenv("FLEET_INFERENCE_TOKEN", raising=False)
    monkeypatch.setenv("FLEET_GATEWAY_URL", "http://127.0.0.1:8081")
    model = get_model("fleet/fleet-tiny-chat-v1", memoize=False)
    assert isinstance(model.api, FleetModelAPI)
    assert model.api.base_url == "http://127.0.0.1:8081/v1"
    assert model.api.rollout_models == ()  # (the gateway's own model needs no listing)
    upstream = get_model("fleet/vllm/llama-3-8b", models="hosted/*", memoize=False)
    assert isinstance(upstream.api, FleetModelAPI)
    assert upstream.api.rollout_models == ("vllm/llama-3-8b", "hosted/*")
    assert upstream.api.service_model_name() == "vllm/llama-3-8b"

    with pytest.raises(GatewayConfigError, match=r"-M models\[0\] 'gpt' is not UPSTREAM/MODEL"):
        get_model("fleet/m", models="gpt", memoize=False)
    monkeypatch.setenv("FLEET_GATEWAY_URL", "ftp://gateway:21")
    with pytest.raises(GatewayConfigError, match="is not http"):
        get_model("fleet/m", memoize=False)
    monkeypatch.setenv("FLEET_GATEWAY_URL", "http://user:pw@127.0.0.1:8081")
    with pytest.raises(GatewayConfigError, match="credentials in it"):
        get_model("fleet/m", memoize=False)
    monkeypatch.delenv("FLEET_GATEWAY_URL")
    with pytest.raises(GatewayConfigError, match="FLEET_GATEWAY_URL"):
        get_model("fleet/m", memoize=False)


def test_the_token_and_ca_are_checked_where_they_are_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from inspect_ai.model import get_model

    from fleet.providers.inspect_model import FleetModelAPI, GatewayConfigError

    monkeypatch.setenv("FLEET_GATEWAY_URL", "https://gateway.test:8443/v1")
    monkeypatch.setenv("FLEET_INFERENCE_TOKEN", "sk-not-a-rollout-token")
    with pytest.raises(GatewayConfigError, match=r"\$FLEET_INFERENCE_TOKEN: not an inference"):
        get_model("fleet/m", memoize=False)
    monkeypatch.setenv("FLEET_INFERENCE_TOKEN", "v1.eyJyaWQiOiJyIn0.c2ln")
    monkeypatch.setenv("FLEET_ROLLOUT_ID", "r-1")
    model = get_model("fleet/m", memoize=False)
    assert isinstance(model.api, FleetModelAPI)
    # Outside a sample with a fleet sandbox, the token given to the process is used.
    credential = model.api.credential()
    assert (credential.rollout_id, credential.token) == ("r-1", "v1.eyJyaWQiOiJyIn0.c2ln")
    assert model.api.base_url == "https://gateway.test:8443/v1"

    (tmp_path / "bad.pem").write_text("not a certificate")
    with pytest.raises(GatewayConfigError, match="the gateway CA in -M ca cannot be read"):
        get_model("fleet/m", ca=str(tmp_path / "bad.pem"), memoize=False)
    monkeypatch.setenv("FLEET_GATEWAY_CA", str(tmp_path / "missing.pem"))
    with pytest.raises(GatewayConfigError, match=r"\$FLEET_GATEWAY_CA cannot be read"):
        get_model("fleet/m", memoize=False)


def test_without_a_token_a_call_says_where_one_comes_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from inspect_ai.model import get_model

    from fleet.providers.inspect_model import FleetModelAPI

    monkeypatch.delenv("FLEET_INFERENCE_TOKEN", raising=False)
    monkeypatch.setenv("FLEET_GATEWAY_URL", "http://127.0.0.1:8081")
    model = get_model("fleet/m", memoize=False)
    assert isinstance(model.api, FleetModelAPI)
    with pytest.raises(RuntimeError, match=r'no fleet sandbox opened for inference.*"fleet"'):
        model.api.credential()
