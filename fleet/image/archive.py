"""Images teams already have: a `docker save` archive or an OCI image layout in a tar,
flattened into one rootfs archive (layers applied in order, whiteouts honoured)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import IO, Any

from fleet.core.errors import InvalidArgument

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"


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


def _apply(layer: IO[bytes], root: Path) -> None:
    """Unpacks one layer over `root`: whiteouts remove what lower layers put there."""
    with tarfile.open(fileobj=layer, mode="r:*") as tar:
        members = []
        for member in tar.getmembers():
            path = Path(member.name)
            if path.name == OPAQUE:
                target = root / path.parent
                if target.is_dir():
                    for child in target.iterdir():
                        _remove(child)
                continue
            if path.name.startswith(WHITEOUT):
                _remove(root / path.parent / path.name[len(WHITEOUT) :])
                continue
            members.append(member)
        # "tar": owners and modes kept (a rootfs needs them), paths and links that would
        # leave the tree refused.
        tar.extractall(root, members=members, filter="tar", numeric_owner=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


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
                _apply(member, root)
        except (KeyError, tarfile.TarError, ValueError) as exc:
            raise InvalidArgument(f"{where}: not a usable image archive: {exc}") from None
        subprocess.run(
            ["tar", "-cf", str(out), "--numeric-owner", "--sort=name", "-C", str(root), "."],
            check=True, capture_output=True, timeout=3600,
        )  # fmt: skip
