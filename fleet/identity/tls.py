"""TLS for fleet's gRPC endpoints: server credentials, the CA's discovery by a joining host,
and the files a host keeps its identity in."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import ssl
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509

from fleet.core.errors import FailedPrecondition, Unauthenticated, Unavailable
from fleet.identity.ca import (
    CertificateAuthority,
    cert_pem,
    fingerprint,
    host_id_of,
    load_cert,
    signed_by,
    write_private,
)

LOOPBACK_NAMES = ("127.0.0.1", "::1", "localhost")


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        return host, int(port)
    except ValueError:
        raise FailedPrecondition(f"{address!r} is not HOST:PORT") from None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_addresses() -> list[str]:
    """This host's IP addresses (every interface), for a server listening on a wildcard."""
    found: list[str] = []
    try:
        out = subprocess.run(
            ["ip", "-j", "addr", "show"], capture_output=True, text=True, timeout=5, check=True
        ).stdout
        for link in json.loads(out):
            for info in link.get("addr_info", []):
                if info.get("scope") in ("global", "host"):
                    found.append(str(info["local"]))
    except (OSError, subprocess.SubprocessError, ValueError, KeyError):
        pass
    return found


def server_names(listen: str, extra: list[str]) -> list[str]:
    """What the server's certificate names: its listen address (every local address for a
    wildcard one), loopback names, this host's name, and any `--san` given."""
    host, _ = split_address(listen)
    names: list[str] = []
    if host in ("", "0.0.0.0", "::"):
        names += local_addresses()
    else:
        names.append(host)
    names += [*LOOPBACK_NAMES, socket.gethostname(), *extra]
    return list(dict.fromkeys(n for n in names if n))


@dataclass(frozen=True)
class ServerTls:
    """A server's TLS material: the CA, and a key and certificate issued at start."""

    ca: CertificateAuthority
    key_pem: bytes
    cert_pem: bytes

    @classmethod
    def issue(cls, ca: CertificateAuthority, names: list[str]) -> ServerTls:
        key, issued = ca.issue_server(names)
        return cls(ca, key, issued.pem)

    def credentials(self, *, require_client_cert: bool) -> grpc.ServerCredentials:
        # The chain carries the CA too, so a joining host can read it and check its pin.
        chain = self.cert_pem + self.ca.pem
        return grpc.ssl_server_credentials(
            [(self.key_pem, chain)],
            root_certificates=self.ca.pem if require_client_cert else None,
            require_client_auth=require_client_cert,
        )


def server_ssl_context(tls: ServerTls) -> ssl.SSLContext:
    """The same certificate for a plain TLS listener (the gateway's HTTP endpoint)."""

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
        with open(cert, "wb") as handle:
            handle.write(tls.cert_pem + tls.ca.pem)
        fd = os.open(key, os.O_WRONLY | os.O_CREAT, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(tls.key_pem)
        context.load_cert_chain(cert, key)
    return context


def client_ssl_context(ca_pem: bytes) -> ssl.SSLContext:
    """Verifies a fleet server's certificate (chain to the fleet CA, server purpose), not its
    name: machines reach the gateway at addresses its certificate cannot know in advance."""
    context = ssl.create_default_context(cadata=ca_pem.decode())
    context.check_hostname = False
    return context


def discover_ca(address: str, pinned: str, timeout_s: float = 10.0) -> bytes:
    """The fleet CA's certificate, read from the chain the server presents at `address` and
    accepted only if its fingerprint is `pinned` (`sha256:<hex>`, as `fleet host token create`
    printed it) and it signed the server's certificate: nothing is sent before that holds."""
    host, port = split_address(address)
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # verified below, against the pin
    context.set_alpn_protocols(["h2"])
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as raw,
            context.wrap_socket(raw, server_hostname=host) as tls,
        ):
            chain = _unverified_chain(tls)
    except OSError as exc:
        raise Unavailable(f"cannot reach the fleet server at {address}: {exc}") from None
    certs = [x509.load_der_x509_certificate(der) for der in chain]
    for cert in certs:
        if fingerprint(cert) == pinned.strip().lower():
            if certs[0] is not cert and not signed_by(cert, certs[0]):
                break
            return cert_pem(cert)
    raise Unauthenticated(
        f"the server at {address} presents no CA with fingerprint {pinned}: wrong server, "
        "wrong fingerprint, or someone in between; nothing was sent"
    )


def _unverified_chain(tls: ssl.SSLSocket) -> list[bytes]:
    public = getattr(tls, "get_unverified_chain", None)  # Python 3.13+
    if public is not None:
        return list(public())
    sslobj: Any = tls._sslobj  # type: ignore[attr-defined]
    return [c.public_bytes(ssl._ssl.ENCODING_DER) for c in sslobj.get_unverified_chain()]  # type: ignore[attr-defined]


@dataclass
class HostFiles:
    """A host's identity on its own disk: `$FLEET_HOME/host/` holds `host.key` (mode 0600),
    `host.crt`, `ca.crt` and `server.json` (the server it enrolled with)."""

    directory: Path

    @property
    def key(self) -> Path:
        return self.directory / "host.key"

    @property
    def cert(self) -> Path:
        return self.directory / "host.crt"

    @property
    def ca(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def server(self) -> Path:
        return self.directory / "server.json"

    def exists(self) -> bool:
        return all(p.exists() for p in (self.key, self.cert, self.ca, self.server))

    def save(self, key_pem: bytes, cert: bytes, ca: bytes, api: str, host_port: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.directory.chmod(0o700)
        write_private(self.key, key_pem)
        write_private(self.cert, cert)
        write_private(self.ca, ca)
        write_private(self.server, json.dumps({"api": api, "host_port": host_port}).encode())

    def renewed(self, key_pem: bytes, cert: bytes) -> None:
        # The certificate first: a crash between the two leaves the old key with a new
        # certificate, which the next start sees as a mismatch and reports.
        write_private(self.key.with_suffix(".key.new"), key_pem)
        write_private(self.cert, cert)
        self.key.with_suffix(".key.new").replace(self.key)

    def load(self) -> HostIdentityMaterial:
        if not self.exists():
            raise FailedPrecondition(
                f"no host identity in {self.directory}: enroll with --join TOKEN"
            )
        server = json.loads(self.server.read_text())
        return HostIdentityMaterial(
            key_pem=self.key.read_bytes(), cert_pem=self.cert.read_bytes(),
            ca_pem=self.ca.read_bytes(), api=str(server["api"]),
            host_port=int(server["host_port"]),
        )  # fmt: skip


@dataclass(frozen=True)
class HostIdentityMaterial:
    key_pem: bytes
    cert_pem: bytes
    ca_pem: bytes
    api: str
    host_port: int

    @property
    def certificate(self) -> x509.Certificate:
        return load_cert(self.cert_pem, "host certificate")

    @property
    def host_id(self) -> str:
        found = host_id_of(self.certificate)
        if found is None:
            raise FailedPrecondition("the host certificate names no fleet host")
        return found

    @property
    def not_before(self) -> float:
        return self.certificate.not_valid_before_utc.timestamp()

    @property
    def not_after(self) -> float:
        return self.certificate.not_valid_after_utc.timestamp()

    def valid(self, now: float | None = None) -> bool:
        return (now if now is not None else time.time()) < self.not_after

    @property
    def host_address(self) -> str:
        host, _ = split_address(self.api)
        return f"[{host}]:{self.host_port}" if ":" in host else f"{host}:{self.host_port}"

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem, private_key=self.key_pem,
            certificate_chain=self.cert_pem,
        )  # fmt: skip
