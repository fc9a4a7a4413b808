"""Where a client's CA and API key come from, and a CA that cannot be read."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.client import Fleet
from fleet.connect import ClientAuth
from fleet.core.errors import InvalidArgument


def test_the_key_comes_from_the_flag_then_the_environment_then_fleet_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FLEET_KEY", raising=False)
    monkeypatch.delenv("FLEET_CA", raising=False)
    assert ClientAuth.find(tmp_path) == ClientAuth(None, "")
    (tmp_path / "admin.key").write_text("fk_admin\n")
    assert ClientAuth.find(tmp_path).key == "fk_admin"
    monkeypatch.setenv("FLEET_KEY", "fk_env")
    assert ClientAuth.find(tmp_path).key == "fk_env"
    auth = ClientAuth.find(tmp_path, key="fk_flag")
    assert auth.key == "fk_flag"
    assert auth.metadata == (("authorization", "Bearer fk_flag"),)


def test_fleet_ups_ca_means_tls_unless_plaintext_is_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FLEET_CA", raising=False)
    (tmp_path / "ca").mkdir()
    (tmp_path / "ca" / "ca.crt").write_bytes(b"PEM")
    assert ClientAuth.find(tmp_path).ca_pem == b"PEM"
    assert ClientAuth.find(tmp_path, plaintext=True).ca_pem is None


def test_a_ca_that_cannot_be_read_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "nowhere" / "ca.crt"
    with pytest.raises(InvalidArgument, match=f"CA certificate {missing}.*cannot read"):
        ClientAuth.find(tmp_path, ca=str(missing))
    monkeypatch.setenv("FLEET_HOME", str(tmp_path))
    with pytest.raises(InvalidArgument, match=f"CA certificate {missing}.*cannot read"):
        Fleet("127.0.0.1:1", ca=str(missing))
