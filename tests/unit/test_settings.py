"""A process's settings: one model gives the defaults, the FLEET_ variables and the flags."""

from __future__ import annotations

import argparse
import os

import pytest

from fleet.server.settings import ServerConfig, ServeSettings
from fleet.settings import SettingsError


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fleet serve")
    ServeSettings.add_flags(parser)
    return parser.parse_args(list(argv))


def test_defaults_come_from_the_model_and_each_field_has_its_flag_and_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in list(os.environ):
        if name.startswith("FLEET_SERVE_"):
            monkeypatch.delenv(name)
    settings = ServeSettings.from_args(parse())
    assert settings.lease_ttl_s == ServerConfig().lease_ttl_s == 15.0
    parser = argparse.ArgumentParser()
    ServeSettings.add_flags(parser)
    text = " ".join(parser.format_help().split())
    assert "--heartbeat-s" in text and "$FLEET_SERVE_HEARTBEAT_INTERVAL_S" in text
    assert "default 15.0" in text  # (the model's default, shown, not written again)
    # Every tunable but the two read from files is a flag.
    flags = ServeSettings.flags()
    assert set(ServerConfig.model_fields) - set(flags) == {"token_secret", "registry_ca"}


def test_a_flag_beats_its_variable_which_beats_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEET_SERVE_LEASE_TTL_S", "7")
    monkeypatch.setenv("FLEET_SERVE_RETAIN_DAYS", "2")
    settings = ServeSettings.from_args(parse("--lease-ttl-s", "3", "--san", "a", "--san", "b"))
    assert settings.lease_ttl_s == 3.0 and settings.retain_days == 2.0
    assert settings.san == ["a", "b"]
    config = settings.server_config(b"secret", b"")
    assert isinstance(config, ServerConfig) and not isinstance(config, ServeSettings)
    assert config.lease_ttl_s == 3.0 and config.token_secret == b"secret"
    assert config.max_deadline_s == config.max_deadline_h * 3600


def test_a_bad_value_is_refused_naming_where_it_came_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEET_SERVE_SWEEP_INTERVAL_S", "often")
    with pytest.raises(SettingsError, match=r"\$FLEET_SERVE_SWEEP_INTERVAL_S: .*number"):
        ServeSettings.from_args(parse())
    monkeypatch.delenv("FLEET_SERVE_SWEEP_INTERVAL_S")
    with pytest.raises(SettingsError, match=r"--lease-ttl-s: Input should be greater than 0"):
        ServeSettings.from_args(parse("--lease-ttl-s", "0"))
    with pytest.raises(SettingsError, match="--max-running-per-tenant"):
        ServeSettings.from_args(parse("--max-running-per-tenant", "-1"))


def test_the_agents_settings_come_from_flags_and_fleet_agent_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fleet.agent.settings import DEFAULT_SLOTS, AgentSettings

    parser = argparse.ArgumentParser(prog="fleet agent")
    AgentSettings.add_flags(parser)
    monkeypatch.delenv("FLEET_AGENT_HOST_CLASS", raising=False)
    with pytest.raises(SettingsError, match=r"--class \(or \$FLEET_AGENT_HOST_CLASS\): .*required"):
        AgentSettings.from_args(parser.parse_args([]))
    monkeypatch.setenv("FLEET_AGENT_HOST_CLASS", "cpu")
    monkeypatch.setenv("FLEET_AGENT_LABEL", '["zone=a"]')  # (a list, as JSON)
    monkeypatch.setenv("FLEET_SERVER", "10.0.0.1:50051")
    settings = AgentSettings.from_args(parser.parse_args(["--registry-ca", "/ca.pem"]))
    assert (settings.host_class, settings.slots) == ("cpu", DEFAULT_SLOTS)
    assert settings.label == ["zone=a"] and settings.registry_ca_file == "/ca.pem"
    assert settings.server == "10.0.0.1:50051"  # (the client's $FLEET_SERVER, when unset here)
    with pytest.raises(SystemExit):  # argparse's own refusal: not a class it knows
        parser.parse_args(["--class", "tpu"])
    monkeypatch.setenv("FLEET_AGENT_HOST_CLASS", "tpu")
    with pytest.raises(SettingsError, match=r"\$FLEET_AGENT_HOST_CLASS: Input should be 'gpu'"):
        AgentSettings.from_args(parser.parse_args([]))


def test_the_gateways_settings_carry_the_batchers_and_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gateway.settings import BatchConfig, GatewayConfig, GatewaySettings

    parser = argparse.ArgumentParser(prog="fleet gateway")
    GatewaySettings.add_flags(parser)
    monkeypatch.setenv("FLEET_GATEWAY_MAX_BATCH", "8")
    settings = GatewaySettings.from_args(parser.parse_args(["--no-reserve", "--max-wait-ms", "1"]))
    config = settings.gateway_config(b"secret", "debug")
    assert type(config) is GatewayConfig and type(config.batch) is BatchConfig
    assert (config.batch.max_batch, config.batch.max_wait_ms) == (8, 1.0)
    assert config.batch.max_queue == BatchConfig().max_queue  # (the model's default)
    assert not config.reserve_device_memory and config.secret == b"secret"
    assert config.log_level == "debug"
    flags = GatewaySettings.flags()
    assert "secret" not in flags and "batch" not in flags and "log_level" not in flags
