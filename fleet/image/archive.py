"""Images teams already have: a `docker save` archive or an OCI image layout in a tar,
flattened into one rootfs archive (layers applied in order, whiteouts honoured).

The archive is the tenant's and is flattened on whatever machine runs `fleet run`, `fleet
submit` or `fleet image build`, as whoever runs it: every layer is unpacked by
`fleet.safepath`, so no member name, whiteout or symlink of a lower layer can make it create,
remove or follow anything outside the tree it builds. What a rootfs needs is kept (numeric
owners, modes, symlinks that point anywhere: they are never followed here); what would give a
machine's files power on the host is not (setuid/setgid bits, device nodes, fifos).
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import IO, Any, BinaryIO, cast

from fleet import safepath
from fleet.core.errors import InvalidArgument

IMAGE_LIMITS = safepath.Limits(max_members=1_000_000, max_bytes=64 << 30)
"""Bounds on one image archive or layer: generous for real images (a CUDA image holds some
100,000 files in a few GiB), a stop for a crafted one."""


def image_policy(*, whiteouts: bool = False) -> safepath.ExtractPolicy:
    """How an image's tree (or, with `whiteouts`, one of its layers over the lower ones) is
    unpacked on a host.

    Numeric owners are kept where this process may set them (as root: a rootfs needs them, a
    machine's ids being the host's; anyone else gets their own files, as `tar` gives them).
    Setuid/setgid bits are dropped: the tree lies on the host's disk as root's files, and in a
    machine (no new privileges) they would do nothing anyway. Device nodes and fifos are
    skipped rather than refused: debootstrap-made images carry /dev/null and its kind, and
    every machine gets its own /dev from the runtime. Symlinks may point anywhere (absolute
    ones are a rootfs's norm): nothing on the host follows them."""
    return safepath.ExtractPolicy(
        owners=os.geteuid() == 0, setuid=False, devices="skip", whiteouts=whiteouts,
        links_out=True, limits=IMAGE_LIMITS,
    )  # fmt: skip


def _layers(archive: tarfile.TarFile, where: str) -> list[str]:
    """The archive's layer members, lowest first (docker save or OCI layout)."""
    names = set(archive.getnames())

    def read_json(name: str) -> Any:
        member = archive.extractfile(name)
        if member is None:
            raise InvalidArgument(f"{where}: {name} is not a file")
        return json.loads(member.read())

    if "manifest.json" in names:  # docker save
        manifest = read_json("manifest.json")
        if not isinstance(manifest, list) or len(manifest) != 1:
            raise InvalidArgument(f"{where}: manifest.json must describe exactly one image")
        return [str(layer) for layer in manifest[0]["Layers"]]
    if "index.json" in names:  # OCI image layout
        index = read_json("index.json")
        entries = index.get("manifests", [])
        if len(entries) != 1:
            raise InvalidArgument(f"{where}: index.json must name exactly one image")
        digest = entries[0]["digest"]
        manifest = read_json("blobs/" + digest.replace(":", "/"))
        if "manifests" in manifest:  # an index of platforms: linux/amd64
            amd64 = ("amd64", "x86_64")
            chosen = [
                m for m in manifest["manifests"]
                if m.get("platform", {}).get("architecture") in amd64
            ]  # fmt: skip
            if not chosen:
                raise InvalidArgument(f"{where}: no linux/amd64 image in the index")
            manifest = read_json("blobs/" + chosen[0]["digest"].replace(":", "/"))
        return ["blobs/" + layer["digest"].replace(":", "/") for layer in manifest["layers"]]
    raise InvalidArgument(
        f"{where}: neither a docker-save archive (manifest.json) nor an OCI image layout "
        "(index.json)"
    )


def _apply(layer: IO[bytes], root: Path, where: str, name: str) -> None:
    """Unpacks one layer over `root`; its whiteouts remove what lower layers put there, never
    through a link (a whiteout beneath a lower layer's symlink is refused)."""
    try:
        safepath.extract_tar(cast(BinaryIO, layer), root, image_policy(whiteouts=True))
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where}: layer {name}: {exc.message}") from None


def flatten(archive: Path, out: Path) -> None:
    """Writes the image in `archive` as one rootfs tar at `out`."""
    where = str(archive)
    try:
        source = tarfile.open(archive)  # noqa: SIM115 - closed by the with below
    except (OSError, tarfile.TarError) as exc:
        raise InvalidArgument(f"{where}: cannot read the archive: {exc}") from None
    with source, tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        root = Path(tmp) / "rootfs"
        root.mkdir()
        try:
            for name in _layers(source, where):
                member = source.extractfile(name)
                if member is None:
                    raise InvalidArgument(f"{where}: layer {name} is missing")
                _apply(member, root, where, name)
        except (KeyError, tarfile.TarError, ValueError) as exc:
            raise InvalidArgument(f"{where}: not a usable image archive: {exc}") from None
        subprocess.run(
            ["tar", "-cf", str(out), "--numeric-owner", "--sort=name", "-C", str(root), "."],
            check=True, capture_output=True, timeout=3600,
        )  # fmt: skip
