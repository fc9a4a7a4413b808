"""The image store: refs resolve to digests; missing, unreadable or corrupt archives are refused."""

from __future__ import annotations

import hashlib
import io
import tarfile
import time
from pathlib import Path

import pytest

from fleet.core.errors import FailedPrecondition, NotFound
from fleet.image.store import ImageRecord, ImageStore


def tiny_store(tmp_path: Path) -> tuple[ImageStore, str]:
    store = ImageStore(tmp_path / "images", tmp_path / "recipes")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"hello\n"
        info = tarfile.TarInfo("etc/motd")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    blob = buf.getvalue()
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    for sub in ("blobs", "refs"):
        (store.root / sub).mkdir(parents=True, exist_ok=True)
    store.blob_path(digest).write_bytes(blob)
    record = ImageRecord(
        name="tiny",
        digest=digest,
        size_bytes=len(blob),
        recipe="-",
        recipe_digest="-",
        created_at=time.time(),
    )
    (store.root / "refs" / "tiny.json").write_text(record.model_dump_json())
    return store, digest


def test_ref_resolves_and_unpacks_once(tmp_path: Path) -> None:
    """A name resolves to its digest; the archive unpacks to a tree carrying the digest."""
    store, digest = tiny_store(tmp_path)
    assert store.resolve("tiny") == digest == store.resolve(digest)
    root = store.rootfs(digest)
    assert (root / "etc" / "motd").read_text() == "hello\n"
    assert store.rootfs(digest) == root
    assert [r.name for r in store.list_images()] == ["tiny"]


def test_missing_image_is_refused_with_what_exists(tmp_path: Path) -> None:
    """An unknown name is refused, listing the stored images and how to build one."""
    store, _ = tiny_store(tmp_path)
    with pytest.raises(FailedPrecondition, match=r"image 'nope' is not in the image store.*tiny"):
        store.resolve("nope")


def test_unreadable_archive_is_refused(tmp_path: Path) -> None:
    """A ref whose archive is gone is refused before anything boots."""
    store, digest = tiny_store(tmp_path)
    store.blob_path(digest).unlink()
    with pytest.raises(FailedPrecondition, match="missing or unreadable"):
        store.resolve("tiny")


def test_corrupt_or_truncated_archive_is_refused(tmp_path: Path) -> None:
    """An archive whose bytes do not hash to its digest is refused, never unpacked."""
    store, digest = tiny_store(tmp_path)
    blob = store.blob_path(digest)
    blob.write_bytes(blob.read_bytes()[:100])
    with pytest.raises(FailedPrecondition, match="corrupt or truncated"):
        store.rootfs(digest)
    assert not (store.root / "rootfs").exists() or not any((store.root / "rootfs").iterdir())


def test_unknown_recipe_is_refused(tmp_path: Path) -> None:
    """Building a recipe that does not exist names the recipes that do."""
    store, _ = tiny_store(tmp_path)
    with pytest.raises(NotFound, match="no image recipe 'ghost'"):
        store.build("ghost")


def test_default_image_is_cached_by_recipe(images: ImageStore) -> None:
    """Building the default image again is a no-op while its recipe is unchanged."""
    record, built = images.build("minimal")
    assert not built and record.digest.startswith("sha256:")


def test_remove_deletes_ref_archive_and_tree(tmp_path: Path) -> None:
    """rm removes the name, the archive and the unpacked tree; the name then resolves to nothing."""
    store, digest = tiny_store(tmp_path)
    store.rootfs(digest)
    removed = store.remove("tiny")
    assert len(removed) == 3
    assert not store.blob_path(digest).exists()
    with pytest.raises(FailedPrecondition):
        store.resolve("tiny")
    with pytest.raises(NotFound):
        store.remove("tiny")
