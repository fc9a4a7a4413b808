"""fleet.safepath against generated archives and trees: whatever an archive holds (symlinks,
chains past PATH_MAX, hard links through links, absolute and `..` names, whiteouts, duplicate
names, directories replaced by links), nothing outside the root is created, changed or
deleted; what fleet writes (`repack_tar`, `write_tar`) is always accepted by its own strict
extraction; and a benign archive comes back as it went in."""

from __future__ import annotations

import contextlib
import io
import os
import stat
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar, cast

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fleet import safepath, safepath_paths
from fleet.safepath import ExtractPolicy, Limits, UnsafeArchive, UnsafePath
from tests.hostile_tars import Entry, chain_escape, tar_bytes

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
REFUSED = (UnsafeArchive, UnsafePath)


# -- a root with a sentinel beside it ----------------------------------------------------------


@contextlib.contextmanager
def playground() -> Iterator[Path]:
    """`base/root` (empty) beside `base/sentinel`, a small tree that must never change."""
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        (base / "root").mkdir()
        sentinel = base / "sentinel"
        (sentinel / "sub").mkdir(parents=True)
        (sentinel / "file").write_bytes(b"host file\n")
        (sentinel / "sub" / "inner").write_bytes(b"inner\n")
        os.symlink("file", sentinel / "link")
        os.chmod(sentinel / "file", 0o640)
        yield base


def snapshot(path: Path) -> dict[str, tuple[object, ...]]:
    """Every entry beneath `path` with its type, mode, size, inode, links, mtime and content."""
    seen: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            st_ = full.lstat()
            body: object = None
            if stat.S_ISREG(st_.st_mode):
                body = full.read_bytes()
            elif stat.S_ISLNK(st_.st_mode):
                body = os.readlink(full)
            seen[str(full.relative_to(path))] = (
                st_.st_mode, st_.st_size, st_.st_ino, st_.st_nlink, st_.st_mtime_ns, body
            )  # fmt: skip
    return seen


def outside(base: Path) -> tuple[object, ...]:
    """What must stay byte-identical: the sentinel tree, and what `base` holds."""
    return (snapshot(base / "sentinel"), sorted(os.listdir(base)), (base / "sentinel").lstat())


# -- generated archives ------------------------------------------------------------------------

COMPONENTS = ["a", "b", "c", "..", ".", "", "sentinel", ".wh.a", ".wh..wh..opq"]
TARGETS = [
    "a", "b", "a/b", "../sentinel", "../sentinel/file", "../../", "..", ".", "/",
    "/etc", "c/../../sentinel", "escape", "escape/file",
]  # fmt: skip


@st.composite
def names(draw: st.DrawFn) -> str:
    parts = draw(st.lists(st.sampled_from(COMPONENTS), min_size=1, max_size=4))
    name = "/".join(parts)
    return "/" + name if draw(st.booleans()) and draw(st.booleans()) else name


@st.composite
def entries(draw: st.DrawFn, base: str) -> Entry:
    kind = draw(st.sampled_from([
        tarfile.REGTYPE, tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.SYMTYPE,
        tarfile.LNKTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE, tarfile.FIFOTYPE,
    ]))  # fmt: skip
    target = draw(st.sampled_from([*TARGETS, f"{base}/sentinel", f"{base}/sentinel/file"]))
    return Entry(
        draw(names()), kind, data=draw(st.binary(max_size=16)), link=target,
        mode=draw(st.sampled_from([0o644, 0o755, 0o4755, 0o2777, 0o1777, 0o000, 0o555])),
        uid=draw(st.sampled_from([0, 1234])),
    )  # fmt: skip


policies = st.builds(
    ExtractPolicy,
    owners=st.just(False),
    setuid=st.booleans(),
    devices=st.sampled_from(["refuse", "skip"]),
    whiteouts=st.booleans(),
    links_out=st.booleans(),
)


def hostile(data: st.DataObject, base: Path) -> bytes:
    draw = data.draw
    members = draw(st.lists(entries(str(base)), max_size=14))
    if draw(st.booleans()):  # a symlink chain past PATH_MAX, a hard link through it
        chain = chain_escape(1, "sentinel/file", b"written by a tenant\n")
        cut = draw(st.integers(0, len(members)))
        members = members[:cut] + chain + members[cut:]
    return tar_bytes(members)


def extract(data: bytes, root: Path, policy: ExtractPolicy) -> list[str] | None:
    try:
        return safepath.extract_tar(io.BytesIO(data), root, policy)
    except REFUSED:
        return None


@SETTINGS
@given(data=st.data(), policy=policies)
def test_no_archive_touches_anything_outside_its_root(
    data: st.DataObject, policy: ExtractPolicy
) -> None:
    with playground() as base:
        before = outside(base)
        archive = hostile(data, base)
        extract(archive, base / "root", policy)
        assert outside(base) == before
        for path in (base / "root").rglob("*"):
            mode = path.lstat().st_mode
            assert stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode), path
            if not policy.setuid:
                assert not mode & (stat.S_ISUID | stat.S_ISGID), path
            if stat.S_ISLNK(mode) and not policy.links_out:
                resolved = os.path.normpath(path.parent / os.readlink(path))
                assert resolved.startswith(str(base / "root")), (path, os.readlink(path))


@SETTINGS
@given(data=st.data())
def test_what_fleet_repacks_its_own_strict_extraction_accepts(data: st.DataObject) -> None:
    """`repack_tar` either refuses or writes an archive that `extract_tar` with the strictest
    policy places whole, without touching anything outside."""
    with playground() as base:
        before = outside(base)
        archive = hostile(data, base)
        out = io.BytesIO()
        try:
            safepath.repack_tar(io.BytesIO(archive), out, Limits(), devices="skip")
        except UnsafeArchive:
            return
        out.seek(0)
        with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as check:
            written = check.getmembers()
            for m in written:
                assert m.uid == 0 and m.gid == 0 and not m.mode & 0o6000, m.name
                assert not (m.ischr() or m.isblk() or m.isfifo()), m.name
                assert not m.name.startswith("/") and ".." not in m.name.split("/"), m.name
        placed = safepath.extract_tar(out, base / "root", ExtractPolicy())
        assert outside(base) == before
        assert len(placed) == len(written)


def test_the_cve_2025_4517_chain_is_refused_and_the_host_file_kept() -> None:
    """The published shape, aimed at the sentinel: refused under every policy, by extraction
    and by repacking alike."""
    with playground() as base:
        before = outside(base)
        archive = tar_bytes(chain_escape(1, "sentinel/file", b"written by a tenant\n"))
        for links_out in (False, True):
            with pytest.raises(UnsafeArchive, match="is a link"):
                safepath.extract_tar(
                    io.BytesIO(archive), base / "root", ExtractPolicy(links_out=links_out)
                )
        with pytest.raises(UnsafeArchive):
            safepath.repack_tar(io.BytesIO(archive), io.BytesIO(), Limits())
        assert outside(base) == before


@pytest.mark.parametrize(
    ("members", "why"),
    [
        ([Entry("/etc/passwd")], "absolute names are refused"),
        ([Entry("a/../../x")], "'..' is refused"),
        ([Entry("a", tarfile.SYMTYPE, link="b"), Entry("a/x")], "is a link"),
        ([Entry("a", tarfile.DIRTYPE), Entry("a", tarfile.SYMTYPE, link="b")], "replace a dir"),
        ([Entry("a", tarfile.SYMTYPE, link="b"), Entry("h", tarfile.LNKTYPE, link="a")], "hard"),
        ([Entry("h", tarfile.LNKTYPE, link="../sentinel/file")], "'..' is refused"),
        ([Entry("n", tarfile.CHRTYPE)], "device nodes"),
        ([Entry("l", tarfile.SYMTYPE, link="../x")], "leaves the tree"),
        ([Entry("x" * 300)], "over 255 bytes"),
        ([Entry("/".join(["d"] * 200))], "deeper than"),
    ],
)
def test_each_kind_of_bad_member_is_named_in_its_refusal(members: list[Entry], why: str) -> None:
    with playground() as base, pytest.raises(REFUSED, match=why):
        safepath.extract_tar(io.BytesIO(tar_bytes(members)), base / "root", ExtractPolicy())


def test_bounds_are_kept() -> None:
    with playground() as base:
        many = tar_bytes([Entry(f"f{i}") for i in range(5)])
        big = tar_bytes([Entry("f", data=b"x" * 100)])
        with pytest.raises(UnsafeArchive, match="more than 4 members"):
            safepath.extract_tar(
                io.BytesIO(many), base / "root", ExtractPolicy(limits=Limits(max_members=4))
            )
        with pytest.raises(UnsafeArchive, match="more than 99 bytes"):
            safepath.extract_tar(
                io.BytesIO(big), base / "root", ExtractPolicy(limits=Limits(max_bytes=99))
            )
        with pytest.raises(UnsafeArchive, match="not a readable tar"):
            safepath.extract_tar(io.BytesIO(b"junk" * 300), base / "root", ExtractPolicy())


def test_whiteouts_remove_lower_layers_without_following_links() -> None:
    with playground() as base:
        root = base / "root"
        before = outside(base)
        lower = [
            Entry("etc", tarfile.DIRTYPE), Entry("etc/keep"), Entry("etc/gone"),
            Entry("opq", tarfile.DIRTYPE), Entry("opq/old"),
            Entry("out", tarfile.SYMTYPE, link=str(base / "sentinel")),
        ]  # fmt: skip
        upper = [
            Entry("etc/.wh.gone"), Entry("opq/new"), Entry("opq/.wh..wh..opq"),
            Entry("out/.wh.file"), Entry(".wh.nothing"),
        ]  # fmt: skip
        layers = ExtractPolicy(whiteouts=True, links_out=True)
        safepath.extract_tar(io.BytesIO(tar_bytes(lower)), root, layers)
        with pytest.raises(UnsafePath, match="is a symlink"):
            safepath.extract_tar(io.BytesIO(tar_bytes(upper)), root, layers)
        safepath.extract_tar(io.BytesIO(tar_bytes(upper[:3])), root, layers)
        assert sorted(os.listdir(root / "etc")) == ["keep"]
        assert sorted(os.listdir(root / "opq")) == ["new"]
        assert outside(base) == before


# -- benign archives round-trip ------------------------------------------------------------------

SAFE = st.sampled_from(["a", "b", "c", "dir", "x.txt", "ü"])


@st.composite
def benign(draw: st.DrawFn) -> list[Entry]:
    """A tree as `tar` would write it: parents before children, unique names, files, inner
    relative symlinks and hard links to files already written."""
    out: list[Entry] = []
    dirs = [""]
    files: list[str] = []
    used: set[str] = set()
    for _ in range(draw(st.integers(0, 12))):
        parent = draw(st.sampled_from(dirs))
        name = f"{parent}/{draw(SAFE)}".lstrip("/")
        if name in used:
            continue
        used.add(name)
        kind = draw(st.sampled_from(["file", "file", "dir", "sym", "hard"]))
        if kind == "dir":
            out.append(
                Entry(name, tarfile.DIRTYPE, mode=draw(st.sampled_from([0o755, 0o700, 0o555])))
            )
            dirs.append(name)
        elif kind == "sym":
            out.append(Entry(name, tarfile.SYMTYPE, link=draw(SAFE)))
        elif kind == "hard" and files:
            out.append(Entry(name, tarfile.LNKTYPE, link=draw(st.sampled_from(files))))
        else:
            mode = draw(st.sampled_from([0o644, 0o600, 0o755, 0o444]))
            out.append(Entry(name, data=draw(st.binary(max_size=64)), mode=mode))
            files.append(name)
    return out


def tree(root: Path) -> dict[str, tuple[object, ...]]:
    """A tree's names, types, modes, content and which files share an inode."""
    found = snapshot(root)
    inode_names: dict[object, str] = {}
    shown: dict[str, tuple[object, ...]] = {}
    for name, (mode, _size, ino, _nlink, _mtime, body) in sorted(found.items()):
        same = inode_names.setdefault(ino, name) if stat.S_ISREG(cast(int, mode)) else name
        shown[name] = (mode, body, same)
    return shown


@SETTINGS
@given(members=benign())
def test_a_benign_archive_round_trips(members: list[Entry]) -> None:
    with playground() as base:
        first, second, third = base / "root", base / "second", base / "third"
        placed = safepath.extract_tar(io.BytesIO(tar_bytes(members)), first, ExtractPolicy())
        assert placed == [m.name for m in members]
        made = io.BytesIO()
        safepath.write_tar(first, "", made, Limits())
        made.seek(0)
        safepath.extract_tar(made, second, ExtractPolicy())
        repacked = io.BytesIO()
        safepath.repack_tar(io.BytesIO(tar_bytes(members)), repacked, Limits())
        repacked.seek(0)
        safepath.extract_tar(repacked, third, ExtractPolicy())
        assert tree(first) == tree(second) == tree(third)
        for m in members:
            path = first / m.name
            if m.kind == tarfile.REGTYPE:
                assert path.read_bytes() == m.data and stat.S_IMODE(path.stat().st_mode) == m.mode
            elif m.kind == tarfile.SYMTYPE:
                assert os.readlink(path) == m.link


# -- path operations on a tree a tenant shaped -------------------------------------------------

OPS = st.sampled_from(["write", "remove", "chmod", "read", "open_dir", "open_file"])
RELS = st.sampled_from([
    "out", "out/file", "out/new", "dir/out/file", "dir", "dir/x", "up", "up/sentinel/file",
    "file", "new/deeper/file", "../sentinel/file", "/etc/passwd", "dir/../..", "",
])  # fmt: skip


@SETTINGS
@given(ops=st.lists(st.tuples(OPS, RELS), min_size=1, max_size=8))
def test_path_operations_never_reach_outside_the_root(ops: list[tuple[str, str]]) -> None:
    with playground() as base:
        root = base / "root"
        sentinel = base / "sentinel"
        (root / "dir").mkdir()
        (root / "file").write_bytes(b"mine")
        os.symlink(sentinel, root / "out")
        os.symlink(sentinel, root / "dir" / "out")
        os.symlink("..", root / "up")
        before = outside(base)
        for op, rel in ops:
            with contextlib.suppress(*REFUSED, FileNotFoundError, IsADirectoryError):
                if op == "write":
                    safepath.write_bytes(root, rel, b"tenant")
                elif op == "remove":
                    safepath.remove(root, rel)
                elif op == "chmod":
                    safepath.chmod(root, rel, 0o777)
                elif op == "read":
                    assert safepath.read_bytes(root, rel, 100) != b"host file\n"
                elif op == "open_dir":
                    os.close(safepath.open_dir(root, rel, create=True))
                else:
                    os.close(safepath.open_file(root, rel, os.O_RDWR | os.O_CREAT | os.O_TRUNC))
        safepath.copy_tree(root, base / "copy")
        made = io.BytesIO()
        safepath.write_tar(root, "", made, Limits())
        made.seek(0)
        with tarfile.open(fileobj=made) as archive:
            assert all(not m.name.startswith("sentinel") for m in archive.getmembers())
        assert outside(base)[0] == before[0]
        assert (base / "sentinel").lstat() == before[2]
        for path in (base / "copy").rglob("*"):
            assert not path.is_symlink() or os.readlink(path) in (str(sentinel), "..")


@example(rel="a//b/./c")
@given(rel=st.text(alphabet="ab./\0", max_size=12))
@SETTINGS
def test_member_name_is_lexical_and_never_leaves(rel: str) -> None:
    try:
        name = safepath.member_name(rel)
    except UnsafePath:
        return
    assert not name.is_absolute() and ".." not in name.parts and "\0" not in str(name)
    assert str(name) not in ("", ".")


# -- unpacking keeps directories open between members -------------------------------------------


Tree = dict[tuple[str, ...], object]
V = TypeVar("V")


def drop(table: dict[tuple[str, ...], V], gone: tuple[str, ...]) -> None:
    """Removes `gone` and what lies beneath it from `table`."""
    for key in [k for k in table if k[: len(gone)] == gone]:
        del table[key]


def placed_tree(root: Path) -> Tree:
    """What is beneath `root`: "dir", ("file", content) or ("link", target) by path."""
    found: Tree = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            parts = full.relative_to(root).parts
            mode = full.lstat().st_mode
            if stat.S_ISLNK(mode):
                found[parts] = ("link", os.readlink(full))
            elif stat.S_ISDIR(mode):
                found[parts] = "dir"
            else:
                found[parts] = ("file", full.read_bytes())
    return found


def model_layer(tree: Tree, members: list[Entry]) -> bool:
    """Applies one layer (whiteouts kept) to `tree` the way it is meant to be unpacked: missing
    parents made, an entry replaced whole (a directory with its contents), whiteouts removing
    what is there, an opaque one what this layer did not list. False where the layer is refused
    (a parent that is not a directory, by what the layer itself listed or by what is there);
    `tree` then holds what was placed before."""
    listed: dict[tuple[str, ...], str] = {}

    for e in members:
        parts = tuple(e.name.split("/"))
        if any(listed.get(parts[:depth], "dir") != "dir" for depth in range(1, len(parts))):
            return False
        for depth in range(1, len(parts)):
            have = tree.setdefault(parts[:depth], "dir")
            if have != "dir":
                return False
        at, name = parts[:-1], parts[-1]
        if name == ".wh..wh..opq":
            for key in [k for k in tree if k[:-1] == at and k not in listed]:
                drop(tree, key)
            continue
        if name.startswith(".wh."):
            drop(tree, (*at, name[4:]))
            drop(listed, (*at, name[4:]))
            continue
        kind = {tarfile.DIRTYPE: "dir", tarfile.SYMTYPE: "link"}.get(e.kind, "file")
        if listed.get(parts) == "dir" and kind != "dir":
            drop(listed, parts)
        listed[parts] = kind
        if kind == "dir":
            if tree.get(parts) != "dir":
                drop(tree, parts)
                tree[parts] = "dir"
        else:
            drop(tree, parts)
            tree[parts] = ("link", e.link) if kind == "link" else ("file", e.data)
    return True


@st.composite
def layer(draw: st.DrawFn, tag: str) -> list[Entry]:
    """A layer over a tiny name space, so that members keep replacing, whiting out and
    re-making each other's directories (and the directories lower layers made)."""
    out: list[Entry] = []
    for i in range(draw(st.integers(0, 12))):
        parts = draw(st.lists(st.sampled_from(["a", "b"]), min_size=1, max_size=3))
        kind = draw(st.sampled_from(["dir", "dir", "file", "file", "link", "wh", "opq"]))
        if kind == "wh":
            parts[-1] = ".wh." + parts[-1]
        elif kind == "opq":
            parts[-1] = ".wh..wh..opq"
        name = "/".join(parts)
        if kind == "dir":
            out.append(Entry(name, tarfile.DIRTYPE, mode=0o755))
        elif kind == "link":
            out.append(Entry(name, tarfile.SYMTYPE, link=f"t{tag}{i}"))
        else:
            out.append(Entry(name, data=f"{tag}{i}".encode()))
    return out


@SETTINGS
@given(lower=layer("lower"), upper=layer("upper"))
def test_layers_place_what_a_model_of_them_places(lower: list[Entry], upper: list[Entry]) -> None:
    """Members after a directory was replaced, whited out or emptied land in what is at that
    path now, never in a directory the layer removed (whose fd an unpack might still hold)."""
    layers = ExtractPolicy(whiteouts=True, links_out=True)
    with playground() as base:
        root = base / "root"
        expected: Tree = {}
        for members in (lower, upper):
            ok = model_layer(expected, members)
            if ok:
                safepath.extract_tar(io.BytesIO(tar_bytes(members)), root, layers)
            else:
                with pytest.raises(REFUSED, match=r"not a directory|is a symlink|its parent"):
                    safepath.extract_tar(io.BytesIO(tar_bytes(members)), root, layers)
            assert placed_tree(root) == expected
            if not ok:
                break


def test_members_after_a_replaced_directory_land_in_the_new_one() -> None:
    layers = ExtractPolicy(whiteouts=True, links_out=True)
    with playground() as base:
        root = base / "root"
        lower = [
            Entry("d", tarfile.DIRTYPE, mode=0o755), Entry("d/e", tarfile.DIRTYPE, mode=0o755),
            Entry("d/e/old"), Entry("w", tarfile.DIRTYPE, mode=0o755), Entry("w/x/old"),
        ]  # fmt: skip
        safepath.extract_tar(io.BytesIO(tar_bytes(lower)), root, layers)
        upper = [
            Entry("d/e/mine", data=b"1"),  # the unpack now holds d and d/e open
            Entry("d", tarfile.SYMTYPE, link="elsewhere"),  # d goes, with e
            Entry("d", tarfile.DIRTYPE, mode=0o755),
            Entry("d/e/new", data=b"2"),
            Entry("w/x/mine", data=b"3"),  # w and w/x open
            Entry(".wh.w"),
            Entry("w/x/new", data=b"4"),
            Entry("w/x/more", data=b"5"),
            Entry("w/.wh..wh..opq"),  # x was made by a parent walk, not listed: it goes
            Entry("w/x/last", data=b"6"),
        ]  # fmt: skip
        placed = safepath.extract_tar(io.BytesIO(tar_bytes(upper)), root, layers)
        assert ".wh.w" not in placed
        assert placed_tree(root) == {
            ("d",): "dir", ("d", "e"): "dir", ("d", "e", "new"): ("file", b"2"),
            ("w",): "dir", ("w", "x"): "dir", ("w", "x", "last"): ("file", b"6"),
        }  # fmt: skip


def test_an_archive_opens_each_directory_once_not_once_per_member(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A directory's members are placed through one fd of it, opened once, not through a walk
    from the root per member (which made unpacking an image several times slower)."""
    deep = ["d1", "d1/d2", "d1/d2/d3", "d1/d2/d3/d4", "d1/d2/d3/d4/d5"]
    members = [Entry(d, tarfile.DIRTYPE, mode=0o755) for d in deep]
    members += [Entry(f"{deep[-1]}/f{i}", data=b"x") for i in range(100)]
    members += [Entry(f"{deep[1]}/g{i}", data=b"y") for i in range(100)]
    real_open = os.open
    opened: list[int] = []

    def counting_open(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if flags & os.O_DIRECTORY:
            opened.append(flags)
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    with playground() as base:
        monkeypatch.setattr(os, "open", counting_open)
        placed = safepath.extract_tar(
            io.BytesIO(tar_bytes(members)), base / "root", ExtractPolicy()
        )
        monkeypatch.undo()
        assert len(placed) == len(members)
        assert (base / "root" / deep[-1] / "f99").read_bytes() == b"x"
        # the root, each directory as it is made, and each again to set its mode at the end
        assert len(opened) <= 1 + 2 * len(deep), len(opened)


def test_a_directory_forgotten_by_the_chain_is_walked_again() -> None:
    """`_Chain.forget` drops the fds of a path and beneath it: after the directory there was
    replaced, the next open finds the new one instead of looking in the removed one."""
    with playground() as base:
        root = base / "root"
        (root / "a" / "b").mkdir(parents=True)
        top = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        chain = safepath_paths._Chain(top, create=False, mode=0o755)
        try:
            chain.open(("a", "b"))
            os.rename(root / "a", base / "gone")
            (root / "a" / "c").mkdir(parents=True)
            with pytest.raises(FileNotFoundError):  # still the old a, which has no c
                chain.open(("a", "c"))
            chain.forget(("a",))
            assert chain.names == []
            fd = chain.open(("a", "c"))
            assert os.fstat(fd).st_ino == (root / "a" / "c").stat().st_ino
        finally:
            chain.close()
            os.close(top)
