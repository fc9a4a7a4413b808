"""Server address lists (`fleet.connect`): what `--server` takes for several replicas, how a
replica's host endpoint is named, what counts as a replica gone, and the agent's flag."""

from __future__ import annotations

import argparse

import grpc
import pytest

from fleet.agent.settings import AgentSettings
from fleet.connect import Replicas, is_gone, parse_servers, with_port
from fleet.core.errors import InvalidArgument
from fleet.settings import SettingsError


def test_several_addresses_are_taken_in_order_each_once() -> None:
    assert parse_servers("a:1, [::1]:2,a:1") == ["a:1", "[::1]:2"]
    assert parse_servers(["a:1,b:2", "dns:///fleet.internal:50051"]) == [
        "a:1", "b:2", "dns:///fleet.internal:50051",
    ]  # fmt: skip
    assert parse_servers("dns://10.0.0.2/fleet:1") == ["dns://10.0.0.2/fleet:1"]


@pytest.mark.parametrize("bad", ["a", "a:0", "a:99999", "http://a:1", "::1:2", "dns:///a"])
def test_an_address_that_is_not_one_is_refused_naming_it_and_where(bad: str) -> None:
    with pytest.raises(InvalidArgument, match=rf"^--server: '{bad}' is not a server address"):
        parse_servers(f"ok:1,{bad}")
    with pytest.raises(InvalidArgument, match="no server address given"):
        parse_servers(" , ")


def test_a_replicas_host_endpoint_is_its_address_on_the_host_port() -> None:
    assert with_port("10.0.0.5:50051", 50052) == "10.0.0.5:50052"
    assert with_port("[::1]:50051", 7) == "[::1]:7"
    assert with_port("dns://10.0.0.2/fleet.internal:50051", 7) == "dns://10.0.0.2/fleet.internal:7"


def test_replicas_move_once_for_the_calls_that_failed_on_the_same_one() -> None:
    replicas = Replicas("a:1,b:2")
    assert replicas.move_from(0, "refused") and replicas.current == "b:2"
    assert not replicas.move_from(0, "refused")  # (a second call that failed on a)
    assert replicas.move_from(1, "refused") and replicas.current == "a:1"
    assert replicas.moves == 2
    assert not Replicas("a:1").move_from(0, "refused")


class Failed(grpc.RpcError):  # type: ignore[misc]
    def __init__(self, code: grpc.StatusCode, trailers: tuple[tuple[str, bytes], ...]) -> None:
        self._code, self._trailers = code, trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return self._trailers

    def details(self) -> str:
        return ""


def test_only_the_channels_own_unavailable_means_the_replica_is_gone() -> None:
    assert is_gone(Failed(grpc.StatusCode.UNAVAILABLE, ()))
    # A fleet server's own refusal (a host not connected) carries fleet's status details.
    assert not is_gone(Failed(grpc.StatusCode.UNAVAILABLE, (("grpc-status-details-bin", b""),)))
    assert not is_gone(Failed(grpc.StatusCode.PERMISSION_DENIED, ()))


def test_the_agent_takes_replicas_comma_separated_and_refuses_a_bad_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parser = argparse.ArgumentParser(prog="fleet agent")
    AgentSettings.add_flags(parser)
    monkeypatch.setenv("FLEET_AGENT_HOST_CLASS", "cpu")
    given = parser.parse_args(["--server", "10.0.0.1:50051, 10.0.0.2:50051"])
    assert AgentSettings.from_args(given).server == "10.0.0.1:50051,10.0.0.2:50051"
    with pytest.raises(SettingsError, match=r"--server: .*'10.0.0.2' is not a server address"):
        AgentSettings.from_args(parser.parse_args(["--server", "10.0.0.1:50051,10.0.0.2"]))
