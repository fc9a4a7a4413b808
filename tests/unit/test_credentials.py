"""Join tokens, API keys and host certificates: formats, expiry, revocation, wrong CA, wrong
host, tampering. The ledger is a real SQLite file."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID

from fleet.cli.admin import duration_s
from fleet.core.credentials import (
    Scope,
    bearer,
    check_host_id,
    format_api_key,
    format_join_token,
    matches,
    new_api_key,
    new_join_token,
    parse_api_key,
    parse_join_token,
    parse_scopes,
    secret_hash,
)
from fleet.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unauthenticated,
)
from fleet.core.placement import HostClass
from fleet.identity.ca import CertificateAuthority, csr_for, host_id_of, new_key
from fleet.identity.tls import server_names
from fleet.ledger.store import Ledger


def test_join_tokens_round_trip_and_refuse_malformed_text() -> None:
    token = new_join_token()
    text = format_join_token(token)
    assert parse_join_token(text) == token and len(token.secret) == 32
    for bad in ["", "abc", text + "0", text.upper(), text.replace(".", "_"), " . "]:
        with pytest.raises(Unauthenticated, match="malformed join token") as caught:
            parse_join_token(bad)
        assert token.secret not in caught.value.message


def test_api_keys_round_trip_and_bearer_metadata() -> None:
    key = new_api_key()
    text = format_api_key(key)
    assert parse_api_key(text) == key
    assert bearer({"authorization": f"Bearer {text}"}) == key
    assert bearer({"authorization": f"bearer {text}"}) == key
    with pytest.raises(Unauthenticated, match="no API key"):
        bearer({})
    with pytest.raises(Unauthenticated, match="Bearer"):
        bearer({"authorization": f"Basic {text}"})
    with pytest.raises(Unauthenticated, match="malformed API key") as caught:
        bearer({"authorization": f"Bearer {text}x"})
    assert key.secret not in caught.value.message


def test_secrets_are_kept_as_hashes_and_compared_whole() -> None:
    stored = secret_hash("s3cret")
    assert stored != "s3cret" and len(stored) == 64
    assert matches("s3cret", stored) and not matches("s3creT", stored)


def test_scopes_parse_and_refuse_unknown_ones() -> None:
    assert parse_scopes("rollouts:read, rollouts:write") == {
        Scope.ROLLOUTS_READ, Scope.ROLLOUTS_WRITE,
    }  # fmt: skip
    with pytest.raises(InvalidArgument, match="unknown scope 'rollouts:delete'"):
        parse_scopes("rollouts:read,rollouts:delete")
    with pytest.raises(InvalidArgument, match="at least one"):
        parse_scopes(" , ")


def test_host_ids_and_durations_are_checked() -> None:
    assert check_host_id("cloud-1.eu_west") == "cloud-1.eu_west"
    for bad in ["", "-x", "a/b", "a" * 64, "a\x00b", "spiffe://x"]:
        with pytest.raises(InvalidArgument):
            check_host_id(bad)
    assert duration_s("90s") == 90 and duration_s("1h") == 3600 and duration_s("30d") == 2592000
    with pytest.raises(InvalidArgument, match="duration"):
        duration_s("1 week")


def test_the_ca_key_is_private_and_the_ca_is_never_replaced(tmp_path: Path) -> None:
    ca = CertificateAuthority.init(tmp_path / "ca")
    assert (tmp_path / "ca" / "ca.key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "ca").stat().st_mode & 0o777 == 0o700
    with pytest.raises(FailedPrecondition, match="already exists"):
        CertificateAuthority.init(tmp_path / "ca")
    assert CertificateAuthority.load(tmp_path / "ca").fingerprint == ca.fingerprint
    (tmp_path / "ca" / "ca.key").chmod(0o644)
    with pytest.raises(FailedPrecondition, match="readable by others"):
        CertificateAuthority.load(tmp_path / "ca")
    with pytest.raises(FailedPrecondition, match="fleet ca init"):
        CertificateAuthority.load(tmp_path / "none")


def test_host_certificates_name_the_host_and_are_checked(tmp_path: Path) -> None:
    """A certificate from this CA for the host the server chose; another CA's, an expired
    one and a tampered one are refused; a CSR not signed by its key is refused."""
    ca = CertificateAuthority.init(tmp_path / "ca")
    key = new_key()
    issued = ca.sign_host_csr(csr_for(key, "whatever-the-host-asked"), "cloud-7")
    assert host_id_of(issued.cert) == "cloud-7"
    now = time.time()
    assert ca.verify_host_cert(issued.pem, now) == "cloud-7"
    with pytest.raises(Unauthenticated, match="expired"):
        ca.verify_host_cert(issued.pem, issued.not_after + 1)
    other = CertificateAuthority.init(tmp_path / "other")
    foreign = other.sign_host_csr(csr_for(key, "cloud-7"), "cloud-7")
    with pytest.raises(Unauthenticated, match="not signed by this fleet's CA"):
        ca.verify_host_cert(foreign.pem, now)
    der = bytearray(issued.cert.public_bytes(serialization.Encoding.DER))
    der[-10] ^= 0xFF  # a flipped bit in the signature
    tampered = x509.load_der_x509_certificate(bytes(der)).public_bytes(serialization.Encoding.PEM)
    with pytest.raises(Unauthenticated):
        ca.verify_host_cert(tampered, now)
    # A CSR whose signature is not its key's.
    mallory = new_key()
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")]))
        .sign(mallory, hashes.SHA256())
    )
    good = csr.public_bytes(serialization.Encoding.PEM)
    broken = bytearray(csr.public_bytes(serialization.Encoding.DER))
    broken[-5] ^= 0xFF
    with pytest.raises(InvalidArgument):
        ca.sign_host_csr(bytes(broken), "x")
    assert host_id_of(ca.sign_host_csr(good, "x").cert) == "x"
    with pytest.raises(InvalidArgument, match="csr"):
        ca.sign_host_csr(b"not a csr", "x")
    with pytest.raises(InvalidArgument, match="host id"):
        ca.sign_host_csr(good, "../etc")
    short = ca.sign_host_csr(good, "x", dt.timedelta(seconds=60))
    assert short.not_after - now < 120


def test_the_server_certificate_names_its_addresses(tmp_path: Path) -> None:
    ca = CertificateAuthority.init(tmp_path / "ca")
    names = server_names("10.77.0.1:50051", ["fleet.example.internal"])
    assert names[0] == "10.77.0.1" and "127.0.0.1" in names
    _, issued = ca.issue_server(names)
    sans = issued.cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]
    assert "10.77.0.1" in ips and "fleet.example.internal" in sans.get_values_for_type(x509.DNSName)


def test_join_tokens_in_the_ledger(tmp_path: Path) -> None:
    """Stored hashed; single use by default; expired, revoked, used-up and wrong-secret
    tokens are refused; a refused enrollment spends no use."""
    ledger = Ledger.sqlite(tmp_path / "l.sqlite3")
    ids = ledger.identities
    now = time.time()
    token, presented = ids.create_join_token(HostClass.CPU, {"site": "cloud"}, 3600, 1, now)
    with ledger.engine.connect() as conn:
        from sqlalchemy import text

        stored = conn.execute(text("SELECT secret_hash FROM join_tokens")).scalar_one()
    assert presented.secret not in stored and stored == secret_hash(presented.secret)

    def enroll(p, host_id: str, at: float = now):  # type: ignore[no-untyped-def]
        return ids.enroll(p, host_id, lambda c: "{}", lambda: ("ab", at + 60), at)

    from fleet.core.credentials import Presented

    with pytest.raises(Unauthenticated, match="unknown or wrong secret"):
        enroll(Presented(presented.id, "0" * 32), "h1")
    with pytest.raises(Unauthenticated, match="expired"):
        enroll(presented, "h1", now + 3601)
    host, used = enroll(presented, "h1")
    assert host.host_class == HostClass.CPU and host.labels == {"site": "cloud"}
    assert used.id == token.id
    with pytest.raises(Unauthenticated, match="used up"):
        enroll(presented, "h2")
    _, many = ids.create_join_token(HostClass.GPU, {}, 3600, 3, now)
    with pytest.raises(AlreadyExists, match="enrolled already"):
        enroll(many, "h1")
    assert [t.uses_left for t in ids.join_tokens() if t.id == many.id] == [3]
    ids.revoke_join_token(many.id, now)
    with pytest.raises(Unauthenticated, match="revoked"):
        enroll(many, "h3")
    with pytest.raises(NotFound):
        ids.revoke_join_token("ffffff", now)
    with pytest.raises(InvalidArgument):
        ids.create_join_token(HostClass.CPU, {}, 0, 1, now)
    assert ids.revoke_host("h1", now) == 0
    assert ids.host("h1").revoked_at is not None  # type: ignore[union-attr]
    with pytest.raises(NotFound):
        ids.revoke_host("nobody", now)


def test_api_keys_in_the_ledger(tmp_path: Path) -> None:
    ledger = Ledger.sqlite(tmp_path / "l.sqlite3")
    ids = ledger.identities
    now = time.time()
    key, presented = ids.create_key("team-a", frozenset({Scope.ROLLOUTS_READ}), None, now)
    found = ids.key_row(presented.id)
    assert found is not None and matches(presented.secret, found[1])
    assert found[0].tenant == "team-a" and found[0].scopes == {Scope.ROLLOUTS_READ}
    assert presented.secret not in found[1]
    ids.revoke_key(key.id, now)
    assert ids.key_row(key.id)[0].revoked_at is not None  # type: ignore[index]
    with pytest.raises(NotFound):
        ids.revoke_key("000000000000", now)
    with pytest.raises(InvalidArgument, match="tenant"):
        ids.create_key("bad tenant!", frozenset({Scope.ADMIN}), None, now)
    with pytest.raises(InvalidArgument, match="future"):
        ids.create_key("t", frozenset({Scope.ADMIN}), now - 1, now)
    assert [k.tenant for k in ids.keys("team-a")] == ["team-a"]
