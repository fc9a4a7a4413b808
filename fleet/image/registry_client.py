"""The client of one registry repository over the OCI distribution API (`Registry`), and the
streaming, digest-verified blob download it pulls layers with.

Every request is checked against the `RegistryPolicy` (`fleet.image.registry_policy`) before
it is sent; what a fleet image is, and how one is pushed, resolved and fetched, is
`fleet.image.oci`'s (which also says why this is a small client over `httpx`).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http
import http.client
import json
import os
import queue
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import structlog

from fleet.core.errors import (
    FailedPrecondition,
    FleetError,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from fleet.core.manifest import is_digest
from fleet.image.registry_policy import Credentials, Reference, RegistryPolicy, tls_context

log = structlog.get_logger(__name__)

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
CHUNK = 1 << 20
RETRIES = 5
MAX_DOCUMENT_BYTES = 4 << 20
"""The largest manifest, index, config or tag list read from a registry."""
MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)


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
