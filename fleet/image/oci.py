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
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import json
import os
import queue
import ssl
import tempfile
import threading
import urllib.parse
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import structlog

from fleet.core.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from fleet.core.manifest import is_digest

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
        digest = tag = ""
        if "@" in path:
            path, _, digest = path.partition("@")
            if not is_digest(digest):
                raise InvalidArgument(f"registry reference {text!r}: {digest!r} is not a digest")
        elif ":" in path.rsplit("/", 1)[-1]:
            path, _, tag = path.rpartition(":")
        if not path or any(not part for part in path.split("/")):
            raise InvalidArgument(f"registry reference {text!r}: bad repository {path!r}")
        return cls(scheme + host, path, tag, digest)

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


@dataclass(frozen=True)
class Credentials:
    username: str = ""
    password: str = ""

    @classmethod
    def from_env(cls) -> Credentials:
        """`$FLEET_REGISTRY_AUTH` (`user:password`), else anonymous."""
        text = os.environ.get("FLEET_REGISTRY_AUTH", "")
        user, _, password = text.partition(":")
        return cls(user, password)


class Registry:
    """One repository of a registry, over the distribution API."""

    def __init__(
        self, ref: Reference, credentials: Credentials | None = None, ca_pem: bytes | None = None,
        timeout_s: float = 60.0,
    ) -> None:  # fmt: skip
        self.ref = ref
        auth = None
        self._basic = ""
        if credentials is not None and credentials.username:
            auth = httpx.BasicAuth(credentials.username, credentials.password)
            token = f"{credentials.username}:{credentials.password}".encode()
            self._basic = "Basic " + base64.b64encode(token).decode()
        self._tls = tls_context(ca_pem)
        self._timeout = timeout_s
        self.http = httpx.Client(
            base_url=ref.base, auth=auth, verify=tls_context(ca_pem), timeout=timeout_s,
            follow_redirects=True,
        )  # fmt: skip

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _url(self, kind: str, name: str) -> str:
        return f"/v2/{self.ref.repository}/{kind}/{name}"

    def _check(self, response: httpx.Response, what: str) -> httpx.Response:
        if response.status_code in (401, 403):
            raise Unavailable(
                f"{what}: the registry at {self.ref.base} refused the credentials "
                f"({response.status_code}; set $FLEET_REGISTRY_AUTH=user:password)"
            )
        if response.status_code == 404:
            raise NotFound(f"{what}: not in {self.ref}")
        if response.status_code >= 400:
            raise Unavailable(f"{what}: the registry answered {response.status_code}: "
                              f"{response.text[:300]}")  # fmt: skip
        return response

    def _call(self, method: str, url: str, what: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._check(self.http.request(method, url, **kwargs), what)
        except httpx.HTTPError as exc:
            raise Unavailable(
                f"{what}: cannot reach the registry at {self.ref.base}: {exc}"
            ) from None

    @contextlib.contextmanager
    def _raw_get(self, path: str, headers: dict[str, str], what: str) -> Iterator[Any]:
        """A GET whose body is read with `readinto` (blobs): the standard library's client
        reads large bodies at several times httpx's rate. Follows up to 5 redirects (storage
        back ends), sending credentials to the registry's own host only."""
        url = f"{self.ref.base}{path}"
        for _ in range(6):
            parts = urllib.parse.urlsplit(url)
            own = f"{parts.scheme}://{parts.netloc}" == self.ref.base
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
            try:
                target = parts.path + (f"?{parts.query}" if parts.query else "")
                conn.request("GET", target, headers=send)
                response = conn.getresponse()
                if response.status in (301, 302, 303, 307, 308):
                    url = urllib.parse.urljoin(url, response.getheader("location", ""))
                    response.read()
                    continue
                if response.status >= 400:
                    raise _response_error(response.status, response.read(300), what,
                                          self.ref.base)  # fmt: skip
                yield response
                return
            finally:
                conn.close()
        raise Unavailable(f"{what}: too many redirects")

    # -- push ------------------------------------------------------------------------------

    def blob_size(self, digest: str) -> int | None:
        """The blob's size, from a HEAD request (None: the registry has no such blob)."""
        try:
            response = self.http.head(self._url("blobs", digest))
        except httpx.HTTPError as exc:
            raise Unavailable(f"cannot reach the registry at {self.ref.base}: {exc}") from None
        if response.status_code == 404:
            return None
        self._check(response, f"blob {digest}")
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
        while url:
            try:
                response = self._call("GET", url, "tags")
            except NotFound:  # a repository nothing was pushed to yet
                return found
            found += response.json().get("tags") or []
            link = response.headers.get("link", "")
            url = link[link.find("<") + 1 : link.find(">")] if 'rel="next"' in link else ""
        return found

    def manifest_digest(self, reference: str) -> tuple[str, dict[str, Any]]:
        response = self._call("GET", self._url("manifests", reference), f"manifest {reference}",
                              headers={"accept": OCI_MANIFEST})  # fmt: skip
        digest = str(response.headers.get("docker-content-digest", ""))
        return digest or "sha256:" + hashlib.sha256(response.content).hexdigest(), response.json()

    def delete_manifest(self, digest: str) -> None:
        self._call("DELETE", self._url("manifests", digest), f"manifest {digest}")

    # -- pull ------------------------------------------------------------------------------

    def get_manifest(self, reference: str) -> dict[str, Any]:
        accept = ", ".join((OCI_MANIFEST, DOCKER_MANIFEST, OCI_INDEX))
        response = self._call("GET", self._url("manifests", reference), f"manifest {reference}",
                              headers={"accept": accept})  # fmt: skip
        body = response.content
        if is_digest(reference) and "sha256:" + hashlib.sha256(body).hexdigest() != reference:
            raise FailedPrecondition(f"manifest {reference} does not match its digest")
        manifest: dict[str, Any] = json.loads(body)
        if manifest.get("mediaType") == OCI_INDEX or "manifests" in manifest:
            for entry in manifest.get("manifests", []):
                platform = entry.get("platform", {})
                if platform.get("os", "linux") == "linux" and platform.get(
                    "architecture", "amd64"
                ) in ("amd64", "x86_64"):
                    return self.get_manifest(entry["digest"])
            raise NotFound(f"{self.ref}: no linux/amd64 image in the index")
        return manifest

    def get_json_blob(self, digest: str) -> dict[str, Any]:
        body = self._call("GET", self._url("blobs", digest), f"blob {digest}").content
        if "sha256:" + hashlib.sha256(body).hexdigest() != digest:
            raise FailedPrecondition(f"blob {digest} from {self.ref} does not verify")
        result: dict[str, Any] = json.loads(body)
        return result

    def download_blob(self, digest: str, target: Path) -> int:
        """The blob into `target`, resuming a partial `target.partial` with range requests,
        kept only if it hashes to `digest`. Returns its size."""
        partial = target.with_name(target.name + ".partial")
        offset, hasher = hashed_file(partial)
        failures = 0
        while True:
            headers = {"range": f"bytes={offset}-"} if offset else {}
            try:
                with self._raw_get(self._url("blobs", digest), headers, f"blob {digest}") as r:
                    if offset and r.status != 206:  # no ranges here: from the start
                        offset, hasher = 0, hashlib.sha256()
                        partial.unlink(missing_ok=True)
                    with partial.open("ab") as out:
                        offset += _pipelined(r, out, hasher)
                break
            except (httpx.HTTPError, http.client.HTTPException, OSError) as exc:
                failures += 1
                if failures > RETRIES:
                    raise Unavailable(f"blob {digest} from {self.ref}: {exc}") from None
                # Resume from what reached the disk (and the hash) before the break.
                offset, hasher = hashed_file(partial)
                log.info("blob_download_resumed", digest=digest, offset=offset, error=str(exc))
        actual = "sha256:" + hasher.hexdigest()
        if actual != digest:
            partial.unlink(missing_ok=True)
            raise FailedPrecondition(
                f"blob {digest} from {self.ref} does not verify: its content hashes to "
                f"{actual}; it was discarded"
            )
        os.replace(partial, target)
        return offset


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


def _pipelined(response: Any, out: Any, hasher: Any) -> int:
    """Reads the body here while another thread hashes and writes what was read (both release
    the GIL): network, hashing and disk overlap. Returns the bytes read."""
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
            pending.put(memoryview(buffer)[:n])
            total += n
    finally:
        pending.put(None)
        worker.join()
    if failed:
        raise failed[0]
    return total


def _response_error(status: int, body: bytes, what: str, base: str) -> Exception:
    if status in (401, 403):
        return Unavailable(f"{what}: the registry at {base} refused the credentials ({status}; "
                           "set $FLEET_REGISTRY_AUTH=user:password)")  # fmt: skip
    if status == 404:
        return NotFound(f"{what}: not in the registry at {base}")
    return Unavailable(f"{what}: the registry answered {status}: {body[:300]!r}")


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
    """Downloads the layer to `target` as the uncompressed archive of `digest`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if layer["digest"] == digest:
        return registry.download_blob(digest, target)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        compressed = Path(tmp) / "layer.gz"
        registry.download_blob(str(layer["digest"]), compressed)
        hasher = hashlib.sha256()
        unpacked = Path(tmp) / "layer.tar"
        inflate = zlib.decompressobj(wbits=31)
        with compressed.open("rb") as src, unpacked.open("wb") as out:
            while chunk := src.read(CHUNK):
                data = inflate.decompress(chunk)
                hasher.update(data)
                out.write(data)
            rest = inflate.flush()
            hasher.update(rest)
            out.write(rest)
        actual = "sha256:" + hasher.hexdigest()
        if actual != digest:
            raise FailedPrecondition(f"{registry.ref}: the unpacked layer hashes to {actual}, "
                                     f"not its diff id {digest}")  # fmt: skip
        size = unpacked.stat().st_size
        os.replace(unpacked, target)
    return size


def resolve(text: str, ca_pem: bytes | None = None) -> tuple[str, str]:
    """A registry reference -> (the image's digest, the reference pinned to its manifest's
    digest), for a submission to pin."""
    ref = Reference.parse(text)
    with Registry(ref, Credentials.from_env(), ca_pem) as registry:
        reference = ref.digest or ref.tag or "latest"
        manifest = registry.get_manifest(reference)
        response = registry.http.head(
            registry._url("manifests", reference),
            headers={"accept": ", ".join((OCI_MANIFEST, DOCKER_MANIFEST, OCI_INDEX))},
        )
        manifest_digest = ref.digest or str(response.headers.get("docker-content-digest", ""))
        if not is_digest(manifest_digest):
            body = json.dumps(manifest).encode()
            raise FailedPrecondition(f"{ref}: the registry named no manifest digest "
                                     f"({len(body)} bytes of manifest)")  # fmt: skip
        _, digest = layer_of(registry, manifest_digest)
    pinned = Reference(ref.base, ref.repository, "", manifest_digest)
    return digest, str(pinned)


def fetch(text: str, digest: str, target: Path, ca_pem: bytes | None = None) -> int:
    """The archive of `digest` from the pinned reference `text`, verified; returns its size."""
    ref = Reference.parse(text)
    with Registry(ref, Credentials.from_env(), ca_pem) as registry:
        layer, found = layer_of(registry, ref.digest or ref.tag or "latest")
        if found != digest:
            raise FailedPrecondition(f"{ref} holds {found}, not the pinned {digest}")
        return pull_layer(registry, layer, digest, target)
