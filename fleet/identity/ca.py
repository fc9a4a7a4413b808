"""The fleet's certificate authority: one EC P-256 key and a self-signed CA certificate.

`CertificateAuthority.init(dir)` writes `ca.key` (mode 0600) and `ca.crt` to `$FLEET_HOME/ca/`.
The CA signs the server's certificate (naming its listen addresses) at every start, and each
host's client certificate at enrollment and renewal: a host's certificate names it by a URI
SAN, `spiffe://fleet/host/<id>`, and is short-lived (24 h by default), so revocation needs no
CRL: the ledger keeps revoked hosts and the server checks them per call.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fleet.core.credentials import HOST_ID_RE, host_id_from_uri, host_uri
from fleet.core.errors import FailedPrecondition, InvalidArgument, Unauthenticated
from fleet.identity.bounds import strict_host_id

CA_TTL = dt.timedelta(days=3650)
SERVER_TTL = dt.timedelta(days=30)
HOST_TTL = dt.timedelta(hours=24)
CLOCK_SKEW = dt.timedelta(minutes=5)
"""Certificates start this long before they are signed, for hosts whose clock is behind."""
MAX_CSR_BYTES = 16 * 1024


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )  # fmt: skip


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def fingerprint(cert: x509.Certificate) -> str:
    """`sha256:<hex>` of the certificate's DER: what a joining host pins."""
    return "sha256:" + hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def write_private(path: Path, data: bytes) -> None:
    """Writes `data` readable by its owner only, atomically (no moment with wider modes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def csr_for(key: ec.EllipticCurvePrivateKey, host_id: str) -> bytes:
    """A certificate signing request for `host_id`, signed by `key` (made on the host)."""
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host_id)]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)


def host_id_of(cert: x509.Certificate) -> str | None:
    """The host id a client certificate names by its spiffe URI SAN (None: not a host's)."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    for uri in sans.get_values_for_type(x509.UniformResourceIdentifier):
        found = host_id_from_uri(uri)
        if found is not None and HOST_ID_RE.fullmatch(found) is not None:
            return found
    return None


def signed_by(issuer: x509.Certificate, cert: x509.Certificate) -> bool:
    """Whether `issuer`'s key signed `cert` (and `cert` names it as its issuer)."""
    public = issuer.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey) or cert.issuer != issuer.subject:
        return False
    try:
        public.verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return False
    return True


def load_cert(data: bytes, what: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise InvalidArgument(f"{what}: not a PEM certificate ({exc})") from None


@dataclass(frozen=True)
class Issued:
    cert: x509.Certificate

    @property
    def pem(self) -> bytes:
        return cert_pem(self.cert)

    @property
    def serial(self) -> str:
        return format(self.cert.serial_number, "x")

    @property
    def not_after(self) -> float:
        return self.cert.not_valid_after_utc.timestamp()


class CertificateAuthority:
    """The CA's key and certificate, loaded from (or created in) a directory."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self.key = key
        self.cert = cert

    @staticmethod
    def paths(directory: Path) -> tuple[Path, Path]:
        return directory / "ca.key", directory / "ca.crt"

    @classmethod
    def exists(cls, directory: Path) -> bool:
        key, cert = cls.paths(directory)
        return key.exists() and cert.exists()

    @classmethod
    def init(cls, directory: Path, name: str = "fleet CA") -> CertificateAuthority:
        """Creates a CA in `directory`; refuses to overwrite one (hosts trust it)."""
        key_path, cert_path = cls.paths(directory)
        if key_path.exists() or cert_path.exists():
            raise FailedPrecondition(
                f"a CA already exists in {directory}: hosts and clients trust it; remove it "
                "by hand only if you mean to enroll every host again"
            )
        key = new_key()
        now = dt.datetime.now(dt.UTC)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + CA_TTL)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        write_private(key_path, key_pem(key))
        cert_path.write_bytes(cert_pem(cert))
        return cls(key, cert)

    @classmethod
    def load(cls, directory: Path) -> CertificateAuthority:
        key_path, cert_path = cls.paths(directory)
        if not key_path.exists() or not cert_path.exists():
            raise FailedPrecondition(f"no CA in {directory}: run `fleet ca init` first")
        mode = key_path.stat().st_mode & 0o777
        if mode & 0o077:
            raise FailedPrecondition(
                f"{key_path} is readable by others (mode {mode:o}): chmod 600 it"
            )
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise FailedPrecondition(f"{key_path}: not an EC private key")
        return cls(key, load_cert(cert_path.read_bytes(), str(cert_path)))

    @classmethod
    def load_or_init(cls, directory: Path) -> CertificateAuthority:
        if cls.exists(directory):
            return cls.load(directory)
        try:
            return cls.init(directory)
        except FailedPrecondition:  # another process made it first
            return cls.load(directory)

    @property
    def pem(self) -> bytes:
        return cert_pem(self.cert)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.cert)

    def _leaf(
        self, public_key: ec.EllipticCurvePublicKey, common_name: str,
        sans: list[x509.GeneralName], usage: x509.ObjectIdentifier, ttl: dt.timedelta,
    ) -> Issued:  # fmt: skip
        now = dt.datetime.now(dt.UTC)
        not_after = min(now + ttl, self.cert.not_valid_after_utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        return Issued(cert)

    def issue_server(
        self, names: list[str], ttl: dt.timedelta = SERVER_TTL
    ) -> tuple[bytes, Issued]:
        """A key and a server certificate naming `names` (IP addresses or DNS names)."""
        sans: list[x509.GeneralName] = []
        for name in dict.fromkeys(names):
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                sans.append(x509.DNSName(name))
        key = new_key()
        issued = self._leaf(
            key.public_key(), "fleet server", sans, ExtendedKeyUsageOID.SERVER_AUTH, ttl
        )
        return key_pem(key), issued

    def sign_host_csr(self, csr_pem: bytes, host_id: str, ttl: dt.timedelta = HOST_TTL) -> Issued:
        """A client certificate for `host_id` over the CSR's key. The CSR must be well formed
        and signed by the key it carries (the host holds it); its subject is ignored: the
        host id is what the server decided."""
        strict_host_id(host_id)  # (never one with a newline after it)
        if len(csr_pem) > MAX_CSR_BYTES:
            raise InvalidArgument(f"csr: {len(csr_pem)} bytes, at most {MAX_CSR_BYTES}")
        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except ValueError as exc:
            raise InvalidArgument(f"csr: not a PEM certificate signing request ({exc})") from None
        if not csr.is_signature_valid:
            raise InvalidArgument("csr: its signature does not match its key")
        public = csr.public_key()
        if not isinstance(public, ec.EllipticCurvePublicKey) or public.curve.name != "secp256r1":
            raise InvalidArgument("csr: the key must be EC P-256")
        return self._leaf(
            public, host_id, [x509.UniformResourceIdentifier(host_uri(host_id))],
            ExtendedKeyUsageOID.CLIENT_AUTH, ttl,
        )  # fmt: skip

    def verify_host_cert(self, pem: bytes, now: float) -> str:
        """The host id of a client certificate this CA signed and that is valid at `now`."""
        cert = load_cert(pem, "host certificate")
        try:
            self.key.public_key().verify(
                cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256())
            )
        except InvalidSignature:
            raise Unauthenticated(
                "the host certificate was not signed by this fleet's CA"
            ) from None
        if cert.issuer != self.cert.subject:
            raise Unauthenticated("the host certificate names another issuer")
        if not (
            cert.not_valid_before_utc.timestamp() <= now <= cert.not_valid_after_utc.timestamp()
        ):
            raise Unauthenticated("the host certificate has expired (or is not valid yet)")
        host_id = host_id_of(cert)
        if host_id is None:
            raise Unauthenticated("the certificate names no fleet host (spiffe://fleet/host/…)")
        return host_id
