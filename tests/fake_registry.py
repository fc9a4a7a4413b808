"""A small OCI registry stand-in on loopback (plain HTTP, a thread of its own) whose answers a
test chooses: a real manifest, an error with a body, a redirect, an answer held back, or a blob
longer than its manifest says. It records every request's headers, so a test can tell what
reached it and with which credentials."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from fleet.image import oci

LAYER = b"not really a tar, resolution never reads it"
LAYER_DIGEST = "sha256:" + hashlib.sha256(LAYER).hexdigest()
HOLD_S = 60.0
"""The longest a held answer waits for its release."""
ENDLESS_CAP = 64 << 20
"""Bytes an "endless" blob sends at most (so the loop is bounded)."""


def manifest(layer_size: int = len(LAYER)) -> bytes:
    """A one-layer image manifest whose layer is an uncompressed tar."""
    return json.dumps({
        "schemaVersion": 2, "mediaType": oci.OCI_MANIFEST,
        "config": {"mediaType": oci.OCI_CONFIG, "digest": LAYER_DIGEST, "size": 2},
        "layers": [{"mediaType": oci.LAYER_TAR, "digest": LAYER_DIGEST, "size": layer_size}],
    }).encode()  # fmt: skip


@dataclass
class FakeRegistry:
    mode: str = "ok"
    """ok | error (500 with a body) | redirect (to `redirect_to`) | hold (until released) |
    endless (blobs longer than declared)."""
    redirect_to: str = ""
    layer_size: int = len(LAYER)
    address: str = ""
    requests: list[dict[str, str]] = field(default_factory=list)
    """Each request's method, path and headers (lower-case names)."""
    release: threading.Event = field(default_factory=threading.Event)
    held: int = 0
    """Requests waiting for `release` now."""
    sent: int = 0
    """Blob bytes written to clients."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def repo(self, name: str = "team/env") -> str:
        return f"{self.address}/{name}"

    def authorizations(self) -> list[str]:
        with self.lock:
            return [r["authorization"] for r in self.requests if "authorization" in r]


def _handler(reg: FakeRegistry) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return

        def _note(self) -> None:
            with reg.lock:
                entry = {k.lower(): v for k, v in self.headers.items()}
                reg.requests.append({**entry, "method": self.command, "path": self.path})

        def _answer(self, status: int, body: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            self._note()
            if reg.mode == "hold":
                with reg.lock:
                    reg.held += 1
                try:
                    reg.release.wait(HOLD_S)
                finally:
                    with reg.lock:
                        reg.held -= 1
                self._answer(404, b"{}", {})
                return
            if reg.mode == "error":
                self._answer(500, b"SECRET-REGISTRY-BODY internal details", {})
                return
            if reg.mode == "redirect":
                self._answer(302, b"", {"location": reg.redirect_to + self.path})
                return
            body = manifest(reg.layer_size)
            if "/manifests/" in self.path:
                digest = "sha256:" + hashlib.sha256(body).hexdigest()
                self._answer(200, body, {"content-type": oci.OCI_MANIFEST,
                                         "docker-content-digest": digest})  # fmt: skip
                return
            if "/blobs/" in self.path and reg.mode == "endless":
                self.send_response(200)
                self.send_header("connection", "close")
                self.end_headers()
                chunk = bytes(1 << 20)
                try:
                    while reg.sent < ENDLESS_CAP:
                        self.wfile.write(chunk)
                        with reg.lock:
                            reg.sent += len(chunk)
                except OSError:  # the client stopped reading
                    pass
                return
            self._answer(404, b"{}", {})

    return Handler


@contextmanager
def fake_registry(host: str = "127.0.0.1", **kw: Any) -> Iterator[FakeRegistry]:
    """Serving on `host` (a loopback address) until the block ends."""
    reg = FakeRegistry(**kw)
    server = http.server.ThreadingHTTPServer((host, 0), _handler(reg))
    server.daemon_threads = True
    reg.address = f"{host}:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="fake-registry", daemon=True)
    thread.start()
    try:
        yield reg
    finally:
        reg.release.set()
        server.shutdown()
        server.server_close()
        thread.join(10)
