"""A real OCI distribution registry (Debian's `docker-registry`) on loopback, with TLS from a
test CA and htpasswd authentication, started and stopped (by pid) by the test that uses it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from fleet.identity.ca import CertificateAuthority, write_private

USER, PASSWORD = "fleet-test", "s3cret-registry-password"


@dataclass(frozen=True)
class TestRegistry:
    address: str
    """host:port"""
    root: Path
    """Where it stores blobs (tests corrupt them on purpose)."""

    def repo(self, name: str = "fleet/images") -> str:
        return f"{self.address}/{name}"

    def blob_file(self, digest: str) -> Path:
        hexdigest = digest.removeprefix("sha256:")
        return (self.root / "docker/registry/v2/blobs/sha256" / hexdigest[:2] / hexdigest
                / "data")  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def registry(
    tmp: Path, ca: CertificateAuthority, host: str = "127.0.0.1"
) -> Iterator[TestRegistry]:
    """Listening on `host` (loopback, or a test address of the caller's own veth)."""
    tmp.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    key, issued = ca.issue_server([host, "127.0.0.1", "localhost"])
    (tmp / "cert.pem").write_bytes(issued.pem + ca.pem)
    write_private(tmp / "key.pem", key)
    hashed = subprocess.run(["htpasswd", "-Bbn", USER, PASSWORD], check=True,
                            capture_output=True, text=True, timeout=30).stdout  # fmt: skip
    (tmp / "htpasswd").write_text(hashed)
    data = tmp / "data"
    (tmp / "config.yml").write_text(
        "version: 0.1\n"
        "log:\n  level: error\n"
        f"storage:\n  filesystem:\n    rootdirectory: {data}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: {host}:{port}\n"
        f"  tls:\n    certificate: {tmp / 'cert.pem'}\n    key: {tmp / 'key.pem'}\n"
        f"auth:\n  htpasswd:\n    realm: fleet-test\n    path: {tmp / 'htpasswd'}\n"
    )
    log = (tmp / "registry.log").open("w")
    proc = subprocess.Popen(
        ["docker-registry", "serve", str(tmp / "config.yml")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as s:
                if s.connect_ex((host, port)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the registry did not start: {(tmp / 'registry.log').read_text()}"
                )
            time.sleep(0.05)
        yield TestRegistry(f"{host}:{port}", data)
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()
