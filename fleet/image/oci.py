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

import hashlib
import json
import os
import tempfile
import time
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fleet.core.errors import FailedPrecondition
from fleet.core.manifest import is_digest
from fleet.image.registry_client import (
    CHUNK,
    DOCKER_MANIFEST,
    MAX_DOCUMENT_BYTES,
    MAX_REDIRECTS,
    OCI_INDEX,
    OCI_MANIFEST,
    REDIRECTS,
    RETRIES,
    Registry,
    hashed_file,
)
from fleet.image.registry_policy import (
    ARCHIVE_SUFFIXES,
    SCOPED_AUTH,
    Credentials,
    Reference,
    RegistryPolicy,
    looks_like_archive,
    looks_like_reference,
    registry_settings,
    tls_context,
)

# The references and the policy (`fleet.image.registry_policy`) and the client
# (`fleet.image.registry_client`) have modules of their own; what callers reach through
# `fleet.image.oci` stays here.
__all__ = [
    "ARCHIVE_SUFFIXES",
    "CHUNK",
    "DOCKER_LAYER_GZIP",
    "DOCKER_MANIFEST",
    "LAYER_TAR",
    "LAYER_TAR_GZIP",
    "MAX_DOCUMENT_BYTES",
    "MAX_REDIRECTS",
    "OCI_CONFIG",
    "OCI_INDEX",
    "OCI_MANIFEST",
    "REDIRECTS",
    "RETRIES",
    "SCOPED_AUTH",
    "Credentials",
    "Reference",
    "Registry",
    "RegistryPolicy",
    "fetch",
    "hashed_file",
    "image_manifest",
    "layer_of",
    "looks_like_archive",
    "looks_like_reference",
    "pull_layer",
    "push",
    "registry_settings",
    "resolve",
    "tls_context",
]

OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
LAYER_TAR_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"


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
