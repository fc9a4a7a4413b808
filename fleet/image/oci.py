"""Images as OCI artifacts, over the OCI distribution API (any registry that speaks it).

A fleet image is an OCI image of one uncompressed layer whose digest is the archive's digest
(digests stay the content address), a config naming that layer as its one diff id, and a
manifest. `push` uploads the layer and config where the registry lacks them and puts the
manifest under a tag; `pull` reads a manifest (OCI or Docker v2), downloads its one layer with
resumable, digest-verified range requests, and stores it. Layers compressed with gzip (as most
registries' images are) are unpacked as they arrive and checked against both the compressed
digest and the config's diff id.

The client is a small one over `httpx` rather than `oras`: fleet needs four endpoints of the
distribution API (blob HEAD/GET with ranges, the upload session, manifest GET/PUT), resumable
downloads verified by digest as they stream, and no extra process or binary on the hosts.

A Smolfile's `image` may name a registry, so what a reference makes the server and hosts do is
bounded by a `RegistryPolicy` the operator sets (`FLEET_REGISTRY_*`): tenants name only the
configured registry and those on an allowlist, never the artifacts repository; the fleet's
credentials go only to the registries they were configured for, and never across a redirect;
plain HTTP only to hosts opted into it; redirects only to the same host or an allowed one;
documents and blobs bounded in size (a blob by its manifest's declared size and a cap) and
requests in time; and a registry's error is reported by its status, never its body.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import http
import http.client
import json
import os
import queue
import re
import ssl
import tempfile
import threading
import time
import urllib.parse
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import structlog

from fleet.core.errors import (
    FailedPrecondition,
    FleetError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from fleet.core.manifest import is_digest
from fleet.settings import RegistrySettings, SettingsError

log = structlog.get_logger(__name__)

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
LAYER_TAR_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
CHUNK = 1 << 20
RETRIES = 5


@dataclass(frozen=True)
class Reference:
    """`[https://]host[:port]/repo[:tag|@sha256:…]`."""

    base: str
    """`https://host:port` (http:// only when written so)."""
    repository: str
    tag: str = ""
    digest: str = ""

    @classmethod
    def parse(cls, text: str) -> Reference:
        scheme = "https://"
        rest = text
        for prefix in ("https://", "http://"):
            if text.startswith(prefix):
                scheme, rest = prefix, text.removeprefix(prefix)
        host, sep, path = rest.partition("/")
        if not sep or not host or not path:
            raise InvalidArgument(f"registry reference {text!r}: expected HOST[:PORT]/REPO[:TAG]")
        name, colon, port = host.rpartition(":") if not host.endswith("]") else (host, "", "")
        if colon and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536 and name):
            raise InvalidArgument(
                f"registry reference {text[:200]!r}: {host[:100]!r} is not HOST[:PORT] "
                "(a port is 1-65535)"
            )
        digest = tag = ""
        if "@" in path:
            path, _, digest = path.partition("@")
            if not is_digest(digest):
                raise InvalidArgument(f"registry reference {text!r}: {digest!r} is not a digest")
        elif ":" in path.rsplit("/", 1)[-1]:
            path, _, tag = path.rpartition(":")
        if not path or any(not part for part in path.split("/")):
            raise InvalidArgument(f"registry reference {text!r}: bad repository {path!r}")
        return cls(scheme + host.lower(), path, tag, digest)

    @property
    def scheme(self) -> str:
        return self.base.partition("://")[0]

    @property
    def netloc(self) -> str:
        """`host[:port]`, lower case (how policies name registries)."""
        return self.base.partition("://")[2].lower()

    def with_tag(self, tag: str) -> Reference:
        return Reference(self.base, self.repository, tag, "")

    def __str__(self) -> str:
        suffix = f"@{self.digest}" if self.digest else (f":{self.tag}" if self.tag else "")
        return f"{self.base}/{self.repository}{suffix}"


ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def looks_like_archive(text: str) -> bool:
    """A Smolfile `image` that is an archive path (a docker-save archive or an OCI layout)."""
    return text.startswith(("/", "./", "../")) or text.endswith(ARCHIVE_SUFFIXES)


def looks_like_reference(text: str) -> bool:
    """A Smolfile `image` that names a registry: it has a host part (a dot, a port or
    localhost) before its first slash."""
    if looks_like_archive(text):
        return False
    head = text.removeprefix("https://").removeprefix("http://").split("/", 1)
    if len(head) < 2:
        return False
    host = head[0]
    return "." in host or ":" in host or host == "localhost"


def tls_context(ca_pem: bytes | None) -> ssl.SSLContext:
    """The system's roots, and the fleet CA's where given (a registry on the fleet's own
    certificate)."""
    context = ssl.create_default_context()
    if ca_pem:
        context.load_verify_locations(cadata=ca_pem.decode())
    return context


SCOPED_AUTH = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:\d+)?=([^:\s]*):(\S*)$")
"""One `HOST[:PORT]=user:password` entry of `$FLEET_REGISTRY_AUTH`."""
MAX_DOCUMENT_BYTES = 4 << 20
"""The largest manifest, index, config or tag list read from a registry."""
MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)


def registry_settings() -> RegistrySettings:
    """`FLEET_REGISTRY_*`, read afresh (a bad value is refused naming its variable)."""
    try:
        return RegistrySettings.from_args(argparse.Namespace())
    except SettingsError as exc:
        raise FailedPrecondition(f"registry settings: {exc}") from None


def _entries(text: str) -> tuple[str, ...]:
    return tuple(e.lower() for e in re.split(r"[\s,]+", text.strip()) if e)


@dataclass(frozen=True)
class Credentials:
    username: str = ""
    password: str = ""
    scoped: tuple[tuple[str, str, str], ...] = ()
    """(HOST[:PORT], user, password): credentials for that registry and no other."""

    @classmethod
    def from_env(cls) -> Credentials:
        """`$FLEET_REGISTRY_AUTH`, else anonymous."""
        return cls.parse(registry_settings().auth)

    @classmethod
    def parse(cls, text: str) -> Credentials:
        """`user:password` (for the registries this process is configured with), or
        `HOST[:PORT]=user:password` entries separated by spaces (each for its registry only).
        A malformed entry is refused by its place, never echoed (it holds a password)."""
        parts = text.split()
        if not parts or not SCOPED_AUTH.match(parts[0]):
            user, _, password = text.strip().partition(":")
            return cls(user, password)
        scoped = []
        for index, part in enumerate(parts, 1):
            match = SCOPED_AUTH.match(part)
            if match is None:
                raise FailedPrecondition(
                    f"$FLEET_REGISTRY_AUTH: entry {index} is not HOST[:PORT]=user:password"
                )
            scoped.append(((match[1] + (match[2] or "")).lower(), match[3], match[4]))
        return cls(scoped=tuple(scoped))

    def for_registry(self, netloc: str, *, configured: bool) -> Credentials | None:
        """What to send to the registry at `netloc`: its own entry, else the unscoped
        credentials where it is a registry this process is configured with (None:
        anonymous)."""
        for host, user, password in self.scoped:
            if host == netloc.lower():
                return Credentials(user, password)
        if configured and self.username:
            return Credentials(self.username, self.password)
        return None


@dataclass(frozen=True)
class RegistryPolicy:
    """Where this process may fetch from, over what, and where its credentials go.

    A Smolfile's `image` is the tenant's to write, and the server and hosts fetch it with the
    fleet's own credentials: so a tenant may name only the operator's registries, plain HTTP
    and other hosts (redirects included) are reached only where the operator listed them, and
    what a registry sends is bounded in size and time."""

    configured: tuple[Reference, ...] = ()
    """The operator's registries (`fleet serve --registry`, the one hosts are pointed at):
    tenants may name them, and unscoped credentials go to them."""
    private: tuple[Reference, ...] = ()
    """Repositories no tenant may name (the artifacts repository holds every tenant's
    uploads)."""
    allow: tuple[str, ...] = ()
    """`HOST[:PORT][/REPO]` a Smolfile may name besides the configured registries; their hosts
    are also where a registry may redirect."""
    insecure: frozenset[str] = frozenset()
    """`HOST[:PORT]` reached over plain HTTP."""
    credentials: Credentials = Credentials()
    timeout_s: float = 60.0
    max_blob_bytes: int = 64 << 30
    pull_timeout_s: float = 3600.0

    @classmethod
    def from_env(
        cls, configured: Iterable[str] = (), private: Iterable[str] = ()
    ) -> RegistryPolicy:
        """The policy of `FLEET_REGISTRY_*`, with the operator's registry repositories
        (`configured`) and those no tenant may name (`private`); empty ones are skipped."""
        settings = registry_settings()
        return cls(
            configured=tuple(Reference.parse(r) for r in configured if r),
            private=tuple(Reference.parse(r) for r in private if r),
            allow=_entries(settings.allow),
            insecure=frozenset(_entries(settings.insecure)),
            credentials=Credentials.parse(settings.auth),
            timeout_s=settings.timeout_s,
            max_blob_bytes=int(settings.max_blob_gib * (1 << 30)),
            pull_timeout_s=settings.pull_timeout_s,
        )  # fmt: skip

    def is_configured(self, netloc: str) -> bool:
        return any(c.netloc == netloc.lower() for c in self.configured)

    def check_tenant(self, ref: Reference) -> None:
        """Refuses a registry image a Smolfile names that the operator did not allow."""
        for repo in self.private:
            if repo.netloc == ref.netloc and _under(ref.repository, repo.repository):
                raise PermissionDenied(f"image {ref}: {repo} holds the fleet's artifacts; "
                                       "a Smolfile may not name it")  # fmt: skip
        if self.is_configured(ref.netloc):
            return
        for entry in self.allow:
            netloc, _, prefix = entry.partition("/")
            if netloc == ref.netloc and (not prefix or _under(ref.repository, prefix)):
                return
        allowed = sorted({c.netloc for c in self.configured} | set(self.allow))
        raise PermissionDenied(
            f"image {ref}: the registry {ref.netloc} is not one this fleet pulls from "
            f"(allowed: {', '.join(allowed) or 'none'}; an operator adds it to "
            "$FLEET_REGISTRY_ALLOW)"
        )

    def may_reach(self, origin: Reference, scheme: str, netloc: str) -> str:
        """Why a request of `origin`'s client may not go to `scheme://netloc` ("": it may):
        its own host, or a host on the allowlist (a redirect to a blob store), over HTTPS
        unless the host is listed as insecure."""
        netloc = netloc.lower()
        if "@" in netloc or not netloc:
            return f"{netloc!r} is not a registry address"
        if netloc != origin.netloc and netloc not in {e.partition("/")[0] for e in self.allow}:
            return f"{netloc} is not the registry's own host nor on $FLEET_REGISTRY_ALLOW"
        if scheme == "http" and netloc not in self.insecure:
            return (f"plain HTTP to {netloc} is refused (HTTPS, or an operator lists the host "
                    "in $FLEET_REGISTRY_INSECURE)")  # fmt: skip
        if scheme not in ("http", "https"):
            return f"{scheme}:// is not HTTP(S)"
        return ""


def _under(repository: str, prefix: str) -> bool:
    """`repository` is `prefix` or a repository below it (component-wise)."""
    repository, prefix = repository.lower(), prefix.lower().strip("/")
    return repository == prefix or repository.startswith(prefix + "/")


def _summary(exc: BaseException) -> str:
    """A transport error in a line (what the library says, not what a server sent)."""
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def _status(status: int) -> str:
    try:
        return f"{status} {http.HTTPStatus(status).phrase}"
    except ValueError:
        return str(status)


class Registry:
    """One repository of a registry, over the distribution API.

    Credentials go only to the registry's own origin (never across a redirect); a redirect
    is followed to the same host or one on the allowlist only; documents are read up to
    MAX_DOCUMENT_BYTES and blobs up to what the caller bounds them to; an error is the
    status, never the body the registry sent."""

    def __init__(
        self, ref: Reference, credentials: Credentials | None = None, ca_pem: bytes | None = None,
        timeout_s: float | None = None, policy: RegistryPolicy | None = None,
    ) -> None:  # fmt: skip
        self.ref = ref
        self.policy = policy or RegistryPolicy.from_env()
        refused = self.policy.may_reach(ref, ref.scheme, ref.netloc)
        if refused:
            raise PermissionDenied(f"registry {ref}: {refused}")
        chosen = credentials.for_registry(ref.netloc, configured=True) if credentials else None
        self._basic = ""
        if chosen is not None and chosen.username:
            token = f"{chosen.username}:{chosen.password}".encode()
            self._basic = "Basic " + base64.b64encode(token).decode()
        self._tls = tls_context(ca_pem)
        self._timeout = timeout_s or self.policy.timeout_s
        self.deadline: float | None = None
        """A monotonic time past which no request starts (resolution at submission)."""
        self.http = httpx.Client(verify=self._tls, timeout=self._timeout, follow_redirects=False)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _url(self, kind: str, name: str) -> str:
        return f"/v2/{self.ref.repository}/{kind}/{name}"

    def _target(self, url: str, what: str) -> tuple[urllib.parse.SplitResult, bool]:
        """`url` (absolute, or relative to the registry) checked against the policy, and
        whether it is the registry's own origin (the only one credentials go to)."""
        parts = urllib.parse.urlsplit(urllib.parse.urljoin(self.ref.base + "/", url))
        refused = self.policy.may_reach(self.ref, parts.scheme, parts.netloc)
        if refused:
            raise Unavailable(f"{what}: the registry at {self.ref.base} sent a request to "
                              f"another place, refused: {refused}")  # fmt: skip
        return parts, f"{parts.scheme}://{parts.netloc.lower()}" == self.ref.base

    def _timeout_now(self, what: str) -> float:
        if self.deadline is None:
            return self._timeout
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise Unavailable(f"{what}: the registry at {self.ref.base} did not answer in time")
        return min(self._timeout, left)

    def _check(self, status: int, what: str) -> None:
        error = _response_error(status, what, self.ref.base)
        if error is not None:
            raise error

    def _send(
        self, method: str, url: str, what: str, *, headers: dict[str, str] | None = None,
        content: Any = None, limit: int = MAX_DOCUMENT_BYTES,
    ) -> tuple[httpx.Response, bytes]:  # fmt: skip
        """One request (GET and HEAD follow allowed redirects) and its body, read up to
        `limit` bytes."""
        for _ in range(MAX_REDIRECTS + 1):
            parts, own = self._target(url, what)
            send = dict(headers or {})
            if own and self._basic:
                send["authorization"] = self._basic
            try:
                with self.http.stream(
                    method, parts.geturl(), headers=send, content=content,
                    timeout=self._timeout_now(what),
                ) as response:  # fmt: skip
                    if response.status_code in REDIRECTS and method in ("GET", "HEAD"):
                        location = response.headers.get("location", "")
                        url = urllib.parse.urljoin(parts.geturl(), location)
                        continue
                    self._check(response.status_code, what)
                    body = b"" if method == "HEAD" else self._read(response, limit, what)
                    return response, body
            except httpx.HTTPError as exc:
                raise Unavailable(
                    f"{what}: cannot reach the registry at {self.ref.base}: {_summary(exc)}"
                ) from None
        raise Unavailable(f"{what}: over {MAX_REDIRECTS} redirects from {self.ref.base}")

    def _read(self, response: httpx.Response, limit: int, what: str) -> bytes:
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise FailedPrecondition(f"{what}: the registry at {self.ref.base} sent {declared} "
                                     f"bytes, over the {limit} read")  # fmt: skip
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > limit:
                raise FailedPrecondition(f"{what}: the registry at {self.ref.base} sent over "
                                         f"{limit} bytes")  # fmt: skip
            self._timeout_now(what)
        return bytes(body)

    def _call(self, method: str, url: str, what: str, **kwargs: Any) -> httpx.Response:
        """`_send`'s response, for calls that need only its status and headers."""
        response, _ = self._send(method, url, what, **kwargs)
        return response

    @contextlib.contextmanager
    def _raw_get(self, path: str, headers: dict[str, str], what: str) -> Iterator[Any]:
        """A GET whose body is read with `readinto` (blobs): the standard library's client
        reads large bodies at several times httpx's rate. Follows up to MAX_REDIRECTS
        redirects (storage back ends) where the policy allows, sending credentials to the
        registry's own origin only."""
        url = path
        for _ in range(MAX_REDIRECTS + 1):
            parts, own = self._target(url, what)
            send = dict(headers)
            if own and self._basic:
                send["authorization"] = self._basic
            if parts.scheme == "https":
                conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                    parts.hostname or "", parts.port, context=self._tls, timeout=self._timeout
                )
            else:
                conn = http.client.HTTPConnection(parts.hostname or "", parts.port,
                                                  timeout=self._timeout)  # fmt: skip
            response: http.client.HTTPResponse | None = None
            try:
                target = parts.path + (f"?{parts.query}" if parts.query else "")
                conn.request("GET", target, headers=send)
                response = conn.getresponse()
                if response.status in REDIRECTS:
                    url = urllib.parse.urljoin(parts.geturl(), response.getheader("location", ""))
                    continue
                self._check(response.status, what)
                yield response
                return
            finally:
                if response is not None:  # (a closing response holds the socket, not `conn`)
                    response.close()
                conn.close()
        raise Unavailable(f"{what}: over {MAX_REDIRECTS} redirects from {self.ref.base}")

    # -- push ------------------------------------------------------------------------------

    def blob_size(self, digest: str) -> int | None:
        """The blob's size, from a HEAD request (None: the registry has no such blob)."""
        try:
            response, _ = self._send("HEAD", self._url("blobs", digest), f"blob {digest}")
        except NotFound:
            return None
        return int(response.headers.get("content-length", "0"))

    def has_blob(self, digest: str) -> bool:
        return self.blob_size(digest) is not None

    def put_blob(self, digest: str, path: Path | None = None, data: bytes = b"") -> None:
        """Uploads a blob the registry lacks, in one PUT of the upload session."""
        if self.has_blob(digest):
            return
        started = self._call("POST", f"/v2/{self.ref.repository}/blobs/uploads/", "upload")
        location = started.headers.get("location", "")
        if not location:
            raise Unavailable("the registry started an upload without a Location")
        sep = "&" if "?" in location else "?"
        size = path.stat().st_size if path is not None else len(data)

        def body() -> Iterator[bytes]:
            if path is None:
                yield data
                return
            with path.open("rb") as handle:
                while chunk := handle.read(CHUNK):
                    yield chunk

        self._call(
            "PUT", f"{location}{sep}digest={digest}", f"blob {digest}", content=body(),
            headers={"content-type": "application/octet-stream", "content-length": str(size)},
        )  # fmt: skip

    def put_manifest(self, tag: str, manifest: bytes, media_type: str = OCI_MANIFEST) -> str:
        response = self._call(
            "PUT", self._url("manifests", tag), f"manifest {tag}", content=manifest,
            headers={"content-type": media_type},
        )  # fmt: skip
        return str(response.headers.get("docker-content-digest", ""))

    def tags(self) -> list[str]:
        found: list[str] = []
        url = f"/v2/{self.ref.repository}/tags/list?n=1000"
        for _ in range(100_000):  # pages, bounded
            if not url:
                break
            try:
                response, body = self._send("GET", url, "tags")
            except NotFound:  # a repository nothing was pushed to yet
                return found
            found += json.loads(body).get("tags") or []
            link = response.headers.get("link", "")
            url = link[link.find("<") + 1 : link.find(">")] if 'rel="next"' in link else ""
        return found

    def manifest_digest(self, reference: str) -> tuple[str, dict[str, Any]]:
        response, body = self._send(
            "GET", self._url("manifests", reference), f"manifest {reference}",
            headers={"accept": OCI_MANIFEST},
        )  # fmt: skip
        digest = str(response.headers.get("docker-content-digest", ""))
        manifest: dict[str, Any] = json.loads(body)
        return digest or "sha256:" + hashlib.sha256(body).hexdigest(), manifest

    def delete_manifest(self, digest: str) -> None:
        self._call("DELETE", self._url("manifests", digest), f"manifest {digest}")

    # -- pull ------------------------------------------------------------------------------

    def get_manifest(self, reference: str, depth: int = 0) -> dict[str, Any]:
        accept = ", ".join((OCI_MANIFEST, DOCKER_MANIFEST, OCI_INDEX))
        _, body = self._send("GET", self._url("manifests", reference), f"manifest {reference}",
                             headers={"accept": accept})  # fmt: skip
        if is_digest(reference) and "sha256:" + hashlib.sha256(body).hexdigest() != reference:
            raise FailedPrecondition(f"manifest {reference} does not match its digest")
        try:
            manifest: dict[str, Any] = json.loads(body)
        except ValueError:
            raise FailedPrecondition(f"manifest {reference} from {self.ref} is not JSON") from None
        if manifest.get("mediaType") == OCI_INDEX or "manifests" in manifest:
            if depth:
                raise FailedPrecondition(f"{self.ref}: an index names another index")
            for entry in manifest.get("manifests", []):
                platform = entry.get("platform", {})
                if platform.get("os", "linux") == "linux" and platform.get(
                    "architecture", "amd64"
                ) in ("amd64", "x86_64"):
                    return self.get_manifest(str(entry["digest"]), depth + 1)
            raise NotFound(f"{self.ref}: no linux/amd64 image in the index")
        return manifest

    def get_json_blob(self, digest: str) -> dict[str, Any]:
        _, body = self._send("GET", self._url("blobs", digest), f"blob {digest}")
        if "sha256:" + hashlib.sha256(body).hexdigest() != digest:
            raise FailedPrecondition(f"blob {digest} from {self.ref} does not verify")
        result: dict[str, Any] = json.loads(body)
        return result

    def download_blob(self, digest: str, target: Path, size: int | None = None) -> int:
        """The blob into `target`, resuming a partial `target.partial` with range requests,
        kept only if it hashes to `digest`. Returns its size. At most `size` bytes (what the
        manifest declares) and the policy's cap: past either the download stops and what it
        wrote is deleted."""
        cap = self.policy.max_blob_bytes
        limit = cap if size is None else min(size, cap)
        why = f"the manifest declares {size}" if size is not None and size <= cap else (
            f"at most {cap} ($FLEET_REGISTRY_MAX_BLOB_GIB)")  # fmt: skip
        partial = target.with_name(target.name + ".partial")
        offset, hasher = hashed_file(partial)
        if offset > limit:  # an earlier download's leftover, not this blob's
            partial.unlink(missing_ok=True)
            offset, hasher = 0, hashlib.sha256()
        deadline = time.monotonic() + self.policy.pull_timeout_s
        failures = 0
        try:
            while True:
                headers = {"range": f"bytes={offset}-"} if offset else {}
                try:
                    with self._raw_get(self._url("blobs", digest), headers,
                                       f"blob {digest}") as r:  # fmt: skip
                        if offset and r.status != 206:  # no ranges here: from the start
                            offset, hasher = 0, hashlib.sha256()
                            partial.unlink(missing_ok=True)
                        length = r.getheader("content-length", "")
                        if length.isdigit() and offset + int(length) > limit:
                            raise _TooLarge(offset + int(length))
                        with partial.open("ab") as out:
                            offset += _pipelined(r, out, hasher, limit - offset, deadline)
                    break
                except (httpx.HTTPError, http.client.HTTPException, OSError) as exc:
                    failures += 1
                    if failures > RETRIES:
                        raise Unavailable(
                            f"blob {digest} from {self.ref}: {_summary(exc)}"
                        ) from None
                    # Resume from what reached the disk (and the hash) before the break.
                    offset, hasher = hashed_file(partial)
                    log.info("blob_download_resumed", digest=digest, offset=offset,
                             error=_summary(exc))  # fmt: skip
        except _TooLarge as exc:
            partial.unlink(missing_ok=True)
            raise FailedPrecondition(
                f"blob {digest} from {self.ref}: the registry sent {exc.args[0]} bytes or more, "
                f"over {limit} ({why}); the download was stopped and deleted"
            ) from None
        actual = "sha256:" + hasher.hexdigest()
        if actual != digest:
            partial.unlink(missing_ok=True)
            raise FailedPrecondition(
                f"blob {digest} from {self.ref} does not verify: its content hashes to "
                f"{actual}; it was discarded"
            )
        os.replace(partial, target)
        return offset


class _TooLarge(Exception):
    """A body past its bound (args: the bytes seen)."""


def hashed_file(path: Path) -> tuple[int, Any]:  # also the agent's resumed fetches
    """The size and running hash of what a partial download holds (0 and empty: none)."""
    hasher = hashlib.sha256()
    size = 0
    if path.exists():
        with path.open("rb") as handle:
            while chunk := handle.read(CHUNK):
                hasher.update(chunk)
                size += len(chunk)
    return size, hasher


def _pipelined(
    response: Any, out: Any, hasher: Any, max_bytes: int | None = None,
    deadline: float | None = None,
) -> int:  # fmt: skip
    """Reads the body here while another thread hashes and writes what was read (both release
    the GIL): network, hashing and disk overlap. Returns the bytes read. Past `max_bytes` it
    raises _TooLarge, past `deadline` (monotonic) Unavailable."""
    pending: queue.Queue[memoryview | None] = queue.Queue(maxsize=8)
    failed: list[BaseException] = []

    def drain() -> None:
        try:
            while (chunk := pending.get()) is not None:
                hasher.update(chunk)
                out.write(chunk)
        except BaseException as exc:  # handed to the reader, which raises it
            failed.append(exc)
            while pending.get() is not None:
                pass

    worker = threading.Thread(target=drain, name="blob-writer")
    worker.start()
    total = 0
    try:
        while not failed:
            buffer = bytearray(CHUNK)
            n = response.readinto(buffer)
            if not n:
                break
            if max_bytes is not None and total + n > max_bytes:
                raise _TooLarge(total + n)
            if deadline is not None and time.monotonic() > deadline:
                raise Unavailable("a blob download ran past $FLEET_REGISTRY_PULL_TIMEOUT_S; "
                                  "what it has is kept for the next try")  # fmt: skip
            pending.put(memoryview(buffer)[:n])
            total += n
    finally:
        pending.put(None)
        worker.join()
    if failed:
        raise failed[0]
    return total


def _response_error(status: int, what: str, base: str) -> FleetError | None:
    """A registry's error status as fleet's error, summarised: its status, never its body (a
    registry's words are not the fleet's to pass on). None: not an error."""
    if status in (401, 403):
        return Unavailable(f"{what}: the registry at {base} refused the credentials ({status}; "
                           "set $FLEET_REGISTRY_AUTH=user:password)")  # fmt: skip
    if status == 404:
        return NotFound(f"{what}: not in the registry at {base}")
    if status >= 400:
        return Unavailable(f"{what}: the registry at {base} answered {_status(status)}")
    return None


def image_manifest(layer_digest: str, layer_size: int, name: str) -> tuple[bytes, bytes, str]:
    """(config JSON, manifest JSON, config digest) of a one-layer fleet image."""
    config = json.dumps({
        "architecture": "amd64", "os": "linux", "config": {},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }, sort_keys=True, separators=(",", ":")).encode()  # fmt: skip
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(config)},
        "layers": [{"mediaType": LAYER_TAR, "digest": layer_digest, "size": layer_size}],
        "annotations": {"org.opencontainers.image.title": name},
    }, sort_keys=True, separators=(",", ":")).encode()  # fmt: skip
    return config, manifest, config_digest


def push(registry: Registry, blob: Path, digest: str, tag: str) -> str:
    """Pushes a fleet image (its archive `blob`, of `digest`) as `tag`; returns the
    manifest's digest."""
    size = blob.stat().st_size
    config, manifest, config_digest = image_manifest(digest, size, tag)
    registry.put_blob(digest, path=blob)
    registry.put_blob(config_digest, data=config)
    pushed = registry.put_manifest(tag, manifest)
    return pushed or "sha256:" + hashlib.sha256(manifest).hexdigest()


def layer_of(registry: Registry, reference: str) -> tuple[dict[str, Any], str]:
    """The one layer of an image and its uncompressed digest (the fleet image digest)."""
    manifest = registry.get_manifest(reference)
    layers = manifest.get("layers", [])
    if len(layers) != 1:
        raise FailedPrecondition(
            f"{registry.ref}: the image has {len(layers)} layers; fleet images have one "
            "(flatten it: docker export, or a recipe with base = the archive)"
        )
    layer = layers[0]
    if layer.get("mediaType") in (LAYER_TAR, "application/vnd.docker.image.rootfs.diff.tar"):
        return layer, str(layer["digest"])
    config = registry.get_json_blob(manifest["config"]["digest"])
    diff_ids = config.get("rootfs", {}).get("diff_ids", [])
    if layer.get("mediaType") not in (LAYER_TAR_GZIP, DOCKER_LAYER_GZIP) or len(diff_ids) != 1:
        raise FailedPrecondition(f"{registry.ref}: layer type {layer.get('mediaType')!r} "
                                 "is not a tar or a gzipped tar")  # fmt: skip
    return layer, str(diff_ids[0])


def pull_layer(registry: Registry, layer: dict[str, Any], digest: str, target: Path) -> int:
    """Downloads the layer to `target` as the uncompressed archive of `digest`: at most the
    size its manifest declares, and (unpacked too) the policy's cap."""
    target.parent.mkdir(parents=True, exist_ok=True)
    cap = registry.policy.max_blob_bytes
    declared = layer.get("size")
    if not isinstance(declared, int) or declared < 0:
        raise FailedPrecondition(f"{registry.ref}: the layer declares no size")
    if declared > cap:
        raise FailedPrecondition(
            f"{registry.ref}: the layer declares {declared} bytes, over the {cap} a host pulls "
            "($FLEET_REGISTRY_MAX_BLOB_GIB)"
        )
    if layer["digest"] == digest:
        return registry.download_blob(digest, target, declared)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        compressed = Path(tmp) / "layer.gz"
        registry.download_blob(str(layer["digest"]), compressed, declared)
        unpacked = Path(tmp) / "layer.tar"
        with compressed.open("rb") as src, unpacked.open("wb") as out:
            hasher = _inflate(src, out, cap, str(registry.ref))
        actual = "sha256:" + hasher.hexdigest()
        if actual != digest:
            raise FailedPrecondition(f"{registry.ref}: the unpacked layer hashes to {actual}, "
                                     f"not its diff id {digest}")  # fmt: skip
        size = unpacked.stat().st_size
        os.replace(unpacked, target)
    return size


def _inflate(src: Any, out: Any, cap: int, where: str) -> Any:
    """Gunzips `src` into `out` (a chunk at a time, however well it compresses), stopping
    past `cap` bytes; returns the hash of what it wrote."""
    hasher = hashlib.sha256()
    inflate = zlib.decompressobj(wbits=31)
    total = 0
    pending = b""
    while True:
        if not pending:
            pending = src.read(CHUNK)
            if not pending:
                break
        data = inflate.decompress(pending, CHUNK)
        pending = inflate.unconsumed_tail
        total += len(data)
        if total > cap:
            raise FailedPrecondition(f"{where}: the layer unpacks to over {cap} bytes "
                                     "($FLEET_REGISTRY_MAX_BLOB_GIB); it was deleted")  # fmt: skip
        hasher.update(data)
        out.write(data)
    rest = inflate.flush()
    total += len(rest)
    if total > cap:
        raise FailedPrecondition(f"{where}: the layer unpacks to over {cap} bytes "
                                 "($FLEET_REGISTRY_MAX_BLOB_GIB); it was deleted")  # fmt: skip
    hasher.update(rest)
    out.write(rest)
    return hasher


def resolve(
    text: str, ca_pem: bytes | None = None, policy: RegistryPolicy | None = None,
    timeout_s: float | None = None,
) -> tuple[str, str]:  # fmt: skip
    """A registry reference a tenant wrote -> (the image's digest, the reference pinned to its
    manifest's digest), for a submission to pin. Refused unless the policy allows the
    registry; credentials go there only where the operator configured them for it; no
    request starts after `timeout_s`."""
    ref = Reference.parse(text)
    policy = policy or RegistryPolicy.from_env()
    policy.check_tenant(ref)
    credentials = policy.credentials.for_registry(
        ref.netloc, configured=policy.is_configured(ref.netloc)
    )
    with Registry(ref, credentials, ca_pem, policy=policy) as registry:
        if timeout_s is not None:
            registry.deadline = time.monotonic() + timeout_s
        reference = ref.digest or ref.tag or "latest"
        manifest = registry.get_manifest(reference)
        manifest_digest = ref.digest
        if not manifest_digest:
            response, _ = registry._send(
                "HEAD", registry._url("manifests", reference), f"manifest {reference}",
                headers={"accept": ", ".join((OCI_MANIFEST, DOCKER_MANIFEST, OCI_INDEX))},
            )  # fmt: skip
            manifest_digest = str(response.headers.get("docker-content-digest", ""))
        if not is_digest(manifest_digest):
            body = json.dumps(manifest).encode()
            raise FailedPrecondition(f"{ref}: the registry named no manifest digest "
                                     f"({len(body)} bytes of manifest)")  # fmt: skip
        _, digest = layer_of(registry, manifest_digest)
    pinned = Reference(ref.base, ref.repository, "", manifest_digest)
    return digest, str(pinned)


def fetch(
    text: str, digest: str, target: Path, ca_pem: bytes | None = None,
    configured: Iterable[str] = (),
) -> int:  # fmt: skip
    """The archive of `digest` from the pinned reference `text`, verified; returns its size.
    `text` came from a submission the server allowed; credentials go to it only where the
    operator configured them for its registry (its own `HOST=` entry, or `configured`: the
    registry this host was pointed at)."""
    ref = Reference.parse(text)
    policy = RegistryPolicy.from_env(configured)
    credentials = policy.credentials.for_registry(
        ref.netloc, configured=policy.is_configured(ref.netloc)
    )
    with Registry(ref, credentials, ca_pem, policy=policy) as registry:
        layer, found = layer_of(registry, ref.digest or ref.tag or "latest")
        if found != digest:
            raise FailedPrecondition(f"{ref} holds {found}, not the pinned {digest}")
        return pull_layer(registry, layer, digest, target)
