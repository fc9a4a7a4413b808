"""Hostile images: what a tenant's archive or image tree may hold, and what fleet does with it on
the host that flattens or unpacks it.

Flattening (`fleet run`, `fleet submit`, `fleet image build` on a docker-save archive) applies
whiteouts without following links and refuses names that leave the tree; unpacking an image on
an agent keeps numeric owners but drops setuid/setgid bits and device nodes and fifos (a machine
gets its own /dev); an archive fleet refuses is the tenant's error (quarantined, not retried);
the image's /etc/passwd and /etc/group are read beneath its root, never through a link out.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
import time
from pathlib import Path

import pytest

from fleet.agent.images import ImageCache
from fleet.api.pb import types_pb2
from fleet.core.errors import InvalidArgument
from fleet.core.placement import HostClass
from fleet.image import store as image_store
from fleet.image.store import ImageRecord, ImageStore
from fleet.runtime import users
from tests.integration.harness import harness, request
from tests.integration.test_image_archive import docker_save

KEEP = b"a file of the host's, outside every image tree\n"


def _info(
    name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, **kw: object
) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode = kind, mode
    for key, value in kw.items():
        setattr(info, key, value)
    return info


def _tar(*members: tarfile.TarInfo | tuple[tarfile.TarInfo, bytes]) -> bytes:
    """A tar of `members` as given (absolute names, `..`, links and device nodes included)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for member in members:
            info, data = member if isinstance(member, tuple) else (member, b"")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)
    return buffer.getvalue()


def _file(name: str, data: bytes = b"x\n", mode: int = 0o644, uid: int = 0, gid: int = 0
          ) -> tuple[tarfile.TarInfo, bytes]:  # fmt: skip
    return _info(name, mode=mode, uid=uid, gid=gid), data


def _dir(name: str, mode: int = 0o755) -> tarfile.TarInfo:
    return _info(name, tarfile.DIRTYPE, mode)


def _symlink(name: str, target: str) -> tarfile.TarInfo:
    return _info(name, tarfile.SYMTYPE, 0o777, linkname=target)


def _whiteout(name: str) -> tuple[tarfile.TarInfo, bytes]:
    return _info(name), b""


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A directory of the host's, outside every tree, with a sentinel file in it."""
    where = tmp_path / "host"
    where.mkdir()
    (where / "sentinel").write_bytes(KEEP)
    return where


def _untouched(host: Path) -> None:
    assert sorted(os.listdir(host)) == ["sentinel"]
    assert (host / "sentinel").read_bytes() == KEEP


def _base() -> bytes:
    return _tar(_dir("etc/"), _file("etc/hostname", b"image\n"))


# -- flattening a layered archive ------------------------------------------------------------


def _escapes(host: Path) -> dict[str, list[bytes]]:
    """Layer stacks whose whiteouts name the host's sentinel (or its directory)."""
    up = "../" * 40 + str(host).lstrip("/")
    return {
        "an absolute whiteout": [_base(), _tar(_whiteout(f"{host}/.wh.sentinel"))],
        "a whiteout through ..": [_base(), _tar(_whiteout(f"{up}/.wh.sentinel"))],
        "a whiteout through a lower layer's symlink": [
            _tar(_symlink("escape", str(host))),
            _tar(_whiteout("escape/.wh.sentinel")),
        ],
        "an opaque whiteout through a lower layer's symlink": [
            _tar(_symlink("escape", str(host))),
            _tar(_whiteout("escape/.wh..wh..opq")),
        ],
        "a whiteout through a relative symlink": [
            _tar(_dir("a/"), _symlink("a/up", "../" * 40 + str(host).lstrip("/"))),
            _tar(_whiteout("a/up/.wh.sentinel")),
        ],
    }


@pytest.mark.parametrize(
    "case",
    [
        "an absolute whiteout",
        "a whiteout through ..",
        "a whiteout through a lower layer's symlink",
        "an opaque whiteout through a lower layer's symlink",
        "a whiteout through a relative symlink",
    ],
)
def test_whiteouts_never_remove_anything_outside_the_tree(
    tmp_path: Path, host: Path, case: str
) -> None:
    """A layer's whiteout names the host's file (absolute, through `..` or through a symlink a
    lower layer laid): the archive is refused and the host's file is still there."""
    archive = tmp_path / "hostile.tar"
    docker_save(archive, _escapes(host)[case])
    store = ImageStore(tmp_path / "images", tmp_path / "recipes")
    with pytest.raises(InvalidArgument, match=r"hostile\.tar"):
        store.import_archive(archive)
    _untouched(host)


def test_flattening_applies_whiteouts_beneath_the_tree(tmp_path: Path) -> None:
    """The whiteouts a real image has still work: a file, a directory, an opaque directory."""
    archive = tmp_path / "layers.tar"
    docker_save(archive, [
        _tar(_dir("opt/"), _file("opt/gone.txt"), _dir("opt/cache/"), _file("opt/cache/a"),
             _dir("opt/task/"), _file("opt/task/old.txt")),
        _tar(_whiteout("opt/.wh.gone.txt"), _whiteout("opt/.wh.cache"),
             _file("opt/task/new.txt", b"new\n"), _whiteout("opt/task/.wh..wh..opq")),
    ])  # fmt: skip
    store = ImageStore(tmp_path / "images", tmp_path / "recipes")
    record = store.import_archive(archive)
    with tarfile.open(store.blob_path(record.digest)) as tar:
        names = {name.removeprefix("./") for name in tar.getnames()}
    assert "opt/task/new.txt" in names
    assert not names & {"opt/gone.txt", "opt/cache", "opt/cache/a", "opt/task/old.txt"}
    assert not any(".wh." in name for name in names)


def _privileged_members() -> list[tarfile.TarInfo | tuple[tarfile.TarInfo, bytes]]:
    return [
        _dir("usr/"), _dir("usr/bin/"), _dir("dev/"), _dir("run/"), _dir("home/"),
        _dir("home/app/"),
        _file("usr/bin/su", b"\x7fELF setuid root\n", 0o4755),
        _file("usr/bin/wall", b"\x7fELF setgid tty\n", 0o2755, gid=5),
        _file("home/app/notes.txt", b"mine\n", 0o640, uid=1000, gid=1000),
        _info("dev/mem", tarfile.CHRTYPE, 0o666, devmajor=1, devminor=1),
        _info("dev/sda", tarfile.BLKTYPE, 0o666, devmajor=8, devminor=0),
        _info("run/pipe", tarfile.FIFOTYPE, 0o666),
    ]  # fmt: skip


def test_flattening_drops_setuid_bits_and_device_nodes(tmp_path: Path) -> None:
    """A flattened image keeps its owners and modes, less setuid/setgid bits, and holds no
    device node or fifo."""
    archive = tmp_path / "privileged.tar"
    docker_save(archive, [_tar(*_privileged_members())])
    store = ImageStore(tmp_path / "images", tmp_path / "recipes")
    record = store.import_archive(archive)
    with tarfile.open(store.blob_path(record.digest)) as tar:
        members = {m.name.removeprefix("./"): m for m in tar.getmembers()}
    assert not {"dev/mem", "dev/sda", "run/pipe"} & members.keys()
    assert not [m.name for m in members.values() if m.isdev()]
    assert members["usr/bin/su"].mode == 0o755 and members["usr/bin/wall"].mode == 0o755
    notes = members["home/app/notes.txt"]
    assert (notes.uid, notes.gid, notes.mode) == (1000, 1000, 0o640)


# -- unpacking an image on an agent ----------------------------------------------------------


def _stored(tmp_path: Path, blob: bytes, name: str = "hostile") -> tuple[ImageStore, str]:
    """A store holding `blob` under its digest, named `name` (as a tenant's upload would be)."""
    store = ImageStore(tmp_path / "images", tmp_path / "recipes")
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    for sub in ("blobs", "refs"):
        (store.root / sub).mkdir(parents=True, exist_ok=True)
    store.blob_path(digest).write_bytes(blob)
    record = ImageRecord(name=name, digest=digest, size_bytes=len(blob), recipe="-",
                         recipe_digest="-", created_at=time.time())  # fmt: skip
    (store.root / "refs" / f"{name}.json").write_text(record.model_dump_json())
    return store, digest


def test_an_unpacked_image_has_no_setuid_bits_nor_device_nodes(tmp_path: Path) -> None:
    """The agent's copy of a tenant's image: owners kept (a rootfs needs them), setuid/setgid
    bits, device nodes and fifos not (a machine has its own /dev, made by the runtime)."""
    store, digest = _stored(tmp_path, _tar(*_privileged_members()))
    root = store.rootfs(digest)
    found = []
    for where, dirs, files in os.walk(root):
        for name in dirs + files:
            mode = os.lstat(os.path.join(where, name)).st_mode
            if mode & (stat.S_ISUID | stat.S_ISGID) and not stat.S_ISDIR(mode):
                found.append(f"{name}: setuid/setgid")
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode):
                found.append(f"{name}: device or fifo")
    assert not found
    assert not (root / "dev" / "mem").exists() and not (root / "run" / "pipe").exists()
    su = (root / "usr" / "bin" / "su").stat()
    assert (su.st_uid, stat.S_IMODE(su.st_mode)) == (0, 0o755)
    notes = (root / "home" / "app" / "notes.txt").stat()
    assert (notes.st_uid, notes.st_gid, stat.S_IMODE(notes.st_mode)) == (1000, 1000, 0o640)


def test_an_image_cannot_redirect_the_stores_marker(tmp_path: Path, host: Path) -> None:
    """The store marks an unpacked tree with its digest; an image whose tree has a symlink where
    the marker goes does not make the store write through it."""
    blob = _tar(_dir("etc/"), _symlink(".fleet-image-digest", str(host / "sentinel")))
    store, digest = _stored(tmp_path, blob)
    root = store.rootfs(digest)
    _untouched(host)
    marker = root / ".fleet-image-digest"
    assert not marker.is_symlink() and digest in marker.read_text()
    assert store.rootfs(digest) == root  # (and it is recognised as unpacked)


def test_a_tree_unpacked_the_old_way_is_unpacked_again(tmp_path: Path) -> None:
    """A tree GNU tar unpacked (setuid bits and device nodes kept, the marker holding only the
    digest) is not reused: it is replaced by one unpacked the current way."""
    store, digest = _stored(tmp_path, _tar(*_privileged_members()))
    root = store.rootfs(digest)
    (root / ".fleet-image-digest").write_text(digest)  # how the older unpack marked its tree
    (root / "usr" / "bin" / "su").chmod(0o4755)
    again = ImageStore(store.root, store.recipes).rootfs(digest)
    assert again == root
    assert stat.S_IMODE((root / "usr" / "bin" / "su").stat().st_mode) == 0o755
    assert not any((store.root / "tmp").iterdir())


def _refused(host: Path) -> dict[str, bytes]:
    up = "../" * 40 + str(host).lstrip("/")
    return {
        "not a tar": b"this is not a tar archive\n" * 40,
        "a name through ..": _tar(_dir("etc/"), _file(f"{up}/escaped")),
        "an absolute name": _tar(_file(f"{host}/escaped")),
        "a hard link out": _tar(_info("held", tarfile.LNKTYPE, linkname=f"{host}/sentinel")),
        "a file through a symlink": _tar(_symlink("out", str(host)), _file("out/escaped")),
    }


@pytest.mark.parametrize(
    "case",
    ["not a tar", "a name through ..", "an absolute name", "a hard link out",
     "a file through a symlink"],
)  # fmt: skip
def test_an_image_fleet_cannot_unpack_is_the_tenants_error(
    tmp_path: Path, host: Path, case: str
) -> None:
    """An archive fleet refuses to unpack is refused as invalid (the tenant's error, never
    retried as a host's), and nothing of it is left in the store."""
    store, digest = _stored(tmp_path, _refused(host)[case])
    with pytest.raises(InvalidArgument, match=digest):
        store.rootfs(digest)
    assert not any((store.root / "rootfs").iterdir())
    assert not any((store.root / "tmp").iterdir())
    _untouched(host)


async def test_a_rollout_on_an_image_fleet_refuses_is_quarantined(
    tmp_path: Path, host: Path
) -> None:
    """An agent that cannot unpack a rollout's image reports malformed input: the rollout is
    quarantined after one attempt, not retried on every host."""
    store, digest = _stored(tmp_path, _refused(host)["not a tar"])
    async with harness(tmp_path / "fleet", store) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        rid = (await h.fleet.SubmitRollout(request(f'image = "{digest}"\n'))).rollout.id
        r = await h.wait_final(rid)
    assert r.state == types_pb2.ROLLOUT_STATE_QUARANTINED, r.error
    assert "malformed input" in r.error and digest in r.error


# -- image digests named by a Smolfile -------------------------------------------------------


@pytest.mark.parametrize("value", ["sha256:../../x", "sha256:", "sha256:" + "A" * 64,
                                   "sha256:" + "0" * 63 + "/"])  # fmt: skip
def test_a_malformed_digest_is_refused_naming_the_field(tmp_path: Path, value: str) -> None:
    store = ImageStore(tmp_path / "images", tmp_path / "recipes")
    with pytest.raises(InvalidArgument, match=r"image = .*is not a digest"):
        store.resolve(value)
    with pytest.raises(InvalidArgument, match=r"image = .*is not a digest"):
        image_store.check_image_digest(value)
    assert image_store.check_image_digest("sha256:" + "0" * 64) == "sha256:" + "0" * 64


# -- the image's users, read on the host ------------------------------------------------------


PASSWD = b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n"


def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    return root


def test_users_are_read_from_the_images_own_files(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "etc" / "passwd").write_bytes(PASSWD)
    (root / "etc" / "group").write_bytes(b"app:x:1000:\nstaff:x:50:app\n")
    assert users.resolve("app", root) == users.StepUser(1000, 1000, (1000, 50), "/home/app")


@pytest.mark.parametrize("link", ["passwd", "etc"])
def test_a_passwd_that_links_out_of_the_image_is_not_read(
    tmp_path: Path, host: Path, link: str
) -> None:
    """An image whose /etc/passwd (or /etc) is a symlink to a file of the host: the host's file
    is not read as the image's (the user it names is not found there)."""
    (host / "passwd").write_bytes(b"eve:x:4242:4242::/home/eve:/bin/sh\n")
    root = tmp_path / "rootfs"
    root.mkdir()
    if link == "etc":
        (root / "etc").symlink_to(host)
    else:
        (root / "etc").mkdir()
        (root / "etc" / "passwd").symlink_to(host / "passwd")
    with pytest.raises(InvalidArgument, match=r"user = 'eve'.*/etc"):
        users.resolve("eve", root)


def test_an_oversized_passwd_is_refused(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    with (root / "etc" / "passwd").open("wb") as out:
        out.write(PASSWD)
        out.truncate(users.TABLE_MAX_BYTES + 1)
    with pytest.raises(InvalidArgument, match=r"user = 'app'.*/etc/passwd.*larger"):
        users.resolve("app", root)


def test_eviction_skips_a_marker_that_names_no_digest(tmp_path: Path) -> None:
    """The image cache's markers name digests; one that does not (a damaged disk) names no
    file of the store and is passed over, not followed into a path."""
    store, digest = _stored(tmp_path, _base())
    (store.root / "fetched").mkdir()
    (store.root / "fetched" / "odd").write_text("sha256:../../blobs/x")
    (store.root / "fetched" / digest.replace(":", "-")).write_text(digest)
    cache = ImageCache(store, cap_bytes=0)
    assert cache.evict() == [digest]
    assert not store.blob_path(digest).exists()
