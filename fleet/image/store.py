"""The image store: rootfs archives addressed by sha256, named refs, unpacked trees.

An archive may be a tenant's (uploaded, pulled from a registry): it is unpacked by
`fleet.safepath` with the image policy of `fleet.image.archive` (owners kept; no setuid/setgid
bits, device nodes or fifos; nothing placed, followed or written outside the tree). An archive
that policy refuses is the tenant's error (`InvalidArgument`: the rollout is quarantined, not
retried on other hosts); a failure of the host itself (a full disk) stays a host error.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import structlog
from pydantic import BaseModel, ConfigDict, ValidationError

from fleet import safepath
from fleet.core.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from fleet.core.manifest import is_digest
from fleet.core.smolfile import check_store_name
from fleet.image.archive import flatten, image_policy

log = structlog.get_logger(__name__)

_CHUNK = 1 << 20
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MARKER = ".fleet-image-digest"
"""The file in an unpacked tree that says which archive it is (and how it was unpacked)."""
UNPACK_FORMAT = "safepath-1"
"""Bumped when the way trees are unpacked changes: a tree an older way made (GNU tar, which
kept setuid bits and device nodes) is unpacked again."""


def check_image_digest(value: str, field: str = "image") -> str:
    """`value` if it is a well-formed image digest (sha256: and 64 lower-case hex digits),
    else `InvalidArgument` naming `field` (a Smolfile's `image = "sha256:..."`). A digest names
    files in the store: nothing else may reach a path."""
    if not is_digest(value):
        raise InvalidArgument(
            f"{field} = {value[:100]!r} is not a digest (sha256: and 64 lower-case hex digits)"
        )
    return value


class Recipe(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str = ""
    suite: str = "bookworm"
    variant: str = "essential"
    include: list[str] = []
    pip: list[str] = []
    """Pinned Python packages (name==version) installed into the image's /usr/local."""
    base: str = ""
    """A `docker save` archive or an OCI image layout tar (relative to the recipe's folder),
    flattened into the image instead of a Debian bootstrap."""


class ImageRecord(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    digest: str
    size_bytes: int
    recipe: str
    recipe_digest: str
    created_at: float


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _blob_name(digest: str) -> str:
    return digest.replace(":", "-")


class ImageStore:
    """Images under `root`: blobs/, refs/, rootfs/."""

    def __init__(self, root: Path, recipes: Path) -> None:
        self.root = root
        self.recipes = recipes
        self._verified: set[str] = set()
        self._refused: dict[str, str] = {}
        """Digests whose archive fleet refused to unpack, with why (the same bytes are refused
        the same way: not read again)."""

    def _dirs(self) -> None:
        for sub in ("blobs", "refs", "rootfs", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def blob_path(self, digest: str) -> Path:
        return self.root / "blobs" / f"{_blob_name(check_image_digest(digest))}.tar"

    def load_recipe(self, name: str) -> tuple[Recipe, str]:
        path = self.recipes / check_store_name(name) / "recipe.toml"
        try:
            text = path.read_text()
        except OSError as exc:
            known = sorted(p.parent.name for p in self.recipes.glob("*/recipe.toml"))
            raise NotFound(f"no image recipe {name!r} at {path} (recipes: {known})") from exc
        try:
            recipe = Recipe.model_validate(tomllib.loads(text))
        except (tomllib.TOMLDecodeError, ValidationError) as exc:
            raise InvalidArgument(f"{path}: bad recipe: {exc}") from exc
        return recipe, "sha256:" + hashlib.sha256(text.encode()).hexdigest()

    def record(self, name: str) -> ImageRecord | None:
        path = self.root / "refs" / f"{check_store_name(name)}.json"
        try:
            return ImageRecord.model_validate_json(path.read_text())
        except (OSError, ValidationError):
            return None

    def list_images(self) -> list[ImageRecord]:
        refs = sorted((self.root / "refs").glob("*.json")) if self.root.exists() else []
        records = [self.record(p.stem) for p in refs]
        return [r for r in records if r is not None]

    def build(self, name: str, *, force: bool = False) -> tuple[ImageRecord, bool]:
        """Builds the recipe unless an image from the same recipe text is stored.

        Returns the record and whether a build ran.
        """
        recipe, recipe_digest = self.load_recipe(name)
        base: Path | None = None
        if recipe.base:
            if recipe.include or recipe.pip:
                raise InvalidArgument(
                    f"image {name!r}: a recipe with `base` takes no `include` or `pip` (yet): "
                    "put them in the archive"
                )
            base = (self.recipes / name / recipe.base).resolve()
            if not base.is_file():
                raise NotFound(f"image {name!r}: base archive {base} does not exist")
            # The archive's content is part of what the recipe says.
            recipe_digest = (
                "sha256:"
                + hashlib.sha256((recipe_digest + _sha256_file(base)).encode()).hexdigest()
            )
        current = self.record(name)
        if (
            not force
            and current is not None
            and current.recipe_digest == recipe_digest
            and self.blob_path(current.digest).exists()
        ):
            return current, False
        if base is None and shutil.which("mmdebstrap") is None:
            raise Unavailable("mmdebstrap is not installed (scripts/setup installs it)")
        self._dirs()
        started = time.monotonic()
        with tempfile.TemporaryDirectory(dir=self.root / "tmp") as tmp:
            out = Path(tmp) / "rootfs.tar"
            if base is not None:
                log.info("image_build_started", image=name, base=str(base))
                flatten(base, out)
                return self._store(name, recipe_digest, out, started)
            argv = ["mmdebstrap", "--quiet", f"--variant={recipe.variant}"]
            if recipe.include:
                argv.append("--include=" + ",".join(recipe.include))
            if recipe.pip:
                unpinned = [p for p in recipe.pip if "==" not in p]
                if unpinned:
                    raise InvalidArgument(
                        f"image {name!r}: pip packages must be pinned (name==version): "
                        f"{', '.join(unpinned)}"
                    )
                target = '"$1/usr/local/lib/python3.11/dist-packages"'
                argv.append(
                    f"--customize-hook={shlex.quote(sys.executable)} -m pip install --quiet "
                    f"--no-warn-script-location --no-cache-dir --no-deps --target {target} "
                    + " ".join(shlex.quote(p) for p in recipe.pip)
                )
            argv += [recipe.suite, str(out)]
            log.info("image_build_started", image=name, argv=argv)
            proc = subprocess.run(argv, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise Unavailable(f"building image {name!r} failed: {proc.stderr.strip()[-2000:]}")
            return self._store(name, recipe_digest, out, started)

    def _store(
        self, name: str, recipe_digest: str, out: Path, started: float
    ) -> tuple[ImageRecord, bool]:
        """Stores a built archive under its digest and names it."""
        digest = _sha256_file(out)
        size = out.stat().st_size
        os.replace(out, self.blob_path(digest))
        record = ImageRecord(
            name=name,
            digest=digest,
            size_bytes=size,
            recipe=str(self.recipes / name / "recipe.toml"),
            recipe_digest=recipe_digest,
            created_at=time.time(),
        )
        ref = self.root / "refs" / f"{name}.json"
        tmp_ref = ref.with_suffix(".tmp")
        tmp_ref.write_text(record.model_dump_json(indent=2))
        os.replace(tmp_ref, ref)
        log.info(
            "image_built",
            image=name,
            digest=digest,
            size_bytes=size,
            seconds=round(time.monotonic() - started, 1),
        )
        return record, True

    def remove(self, name: str, *, keep_tree: bool = False) -> list[str]:
        """Removes a named image: its ref, and its archive and unpacked tree unless another
        ref still points at the same digest. Returns what was removed."""
        record = self.record(name)
        if record is None:
            raise NotFound(f"no image {name!r} in {self.root}")
        removed = []
        ref = self.root / "refs" / f"{name}.json"
        ref.unlink()
        removed.append(str(ref))
        if any(r.digest == record.digest for r in self.list_images()):
            return removed
        blob = self.blob_path(record.digest)
        if blob.exists():
            blob.unlink()
            removed.append(str(blob))
        tree = self.root / "rootfs" / _blob_name(record.digest)
        if tree.exists() and not keep_tree:
            shutil.rmtree(tree)
            removed.append(str(tree))
        self._verified.discard(record.digest)
        log.info("image_removed", image=name, digest=record.digest)
        return removed

    def resolve(self, ref: str) -> str:
        """Image ref (a store name or sha256:...) -> digest of a stored, readable archive."""
        if ref.startswith("sha256:"):
            digest = check_image_digest(ref)
        else:
            record = self.record(ref)
            if record is None:
                known = [r.name for r in self.list_images()]
                raise FailedPrecondition(
                    f"image {ref!r} is not in the image store at {self.root} "
                    f"(stored: {known or 'none'}); build it with `fleet image build {ref}`"
                )
            digest = record.digest
        blob = self.blob_path(digest)
        if not os.access(blob, os.R_OK):
            raise FailedPrecondition(
                f"image {ref!r} ({digest}): archive {blob} is missing or unreadable"
            )
        return digest

    def import_archive(self, archive: Path) -> ImageRecord:
        """A docker-save archive or OCI layout tar as an image, named `archive-<its digest>`
        (flattened once per archive content)."""

        try:
            source_digest = _sha256_file(archive)
        except OSError as exc:
            raise InvalidArgument(f"image archive {archive}: cannot read: {exc}") from None
        name = f"archive-{source_digest[7:19]}"
        found = self.record(name)
        if found is not None and self.blob_path(found.digest).exists():
            return found
        self._dirs()
        started = time.monotonic()
        with tempfile.TemporaryDirectory(dir=self.root / "tmp") as tmp:
            out = Path(tmp) / "rootfs.tar"
            flatten(archive, out)
            record, _ = self._store(name, source_digest, out, started)
        return record

    def add_blob(self, digest: str, source: Path) -> None:
        """Stores an archive another store holds under its digest (checked before use)."""
        self._dirs()
        target = self.blob_path(digest)
        if target.exists():
            return
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)
        os.replace(tmp, target)

    def add_pulled(self, name: str, digest: str, source: str) -> ImageRecord:
        """Names an archive already stored under `digest` (pulled from `source`)."""
        if not _NAME_RE.match(name):
            raise InvalidArgument(f"image name {name[:80]!r}: letters, digits, '.', '_', '-'")
        blob = self.blob_path(digest)
        record = ImageRecord(
            name=name, digest=digest, size_bytes=blob.stat().st_size, recipe=source,
            recipe_digest="", created_at=time.time(),
        )  # fmt: skip
        self._dirs()
        ref = self.root / "refs" / f"{name}.json"
        tmp_ref = ref.with_suffix(".tmp")
        tmp_ref.write_text(record.model_dump_json(indent=2))
        os.replace(tmp_ref, ref)
        return record

    def mark_verified(self, digest: str) -> None:
        """The archive was hashed as it was written (a fetched image): no need to again."""
        self._verified.add(digest)

    def forget_verified(self, digest: str) -> None:
        self._verified.discard(digest)

    def verify(self, digest: str) -> Path:
        """Checks the archive against its digest (once per process) and returns its path."""
        blob = self.blob_path(digest)
        if digest in self._verified:
            return blob
        if not blob.exists():
            raise FailedPrecondition(f"image {digest}: archive {blob} is missing")
        actual = _sha256_file(blob)
        if actual != digest:
            raise FailedPrecondition(
                f"image archive {blob} is corrupt or truncated: its content hashes to {actual}, "
                f"not {digest}; rebuild it with `fleet image build`"
            )
        self._verified.add(digest)
        return blob

    def rootfs(self, digest: str) -> Path:
        """The unpacked tree of a verified archive, unpacked once and shared read-only.

        An archive fleet will not unpack raises `InvalidArgument` (the image's fault); one the
        host could not unpack (its disk) `FailedPrecondition`."""
        target = self.root / "rootfs" / _blob_name(check_image_digest(digest))
        if self._unpacked(target, digest):
            return target
        if digest in self._refused:
            raise InvalidArgument(self._refused[digest])
        blob = self.verify(digest)
        self._dirs()
        started = time.monotonic()
        staging = Path(tempfile.mkdtemp(dir=self.root / "tmp", prefix="unpack-"))
        try:
            with blob.open("rb") as source:
                members = safepath.extract_tar(source, staging, image_policy())
            os.chmod(staging, 0o755)  # (the archive's "./" is not applied to the root)
            safepath.write_bytes(staging, MARKER, self._marker(digest))
            self._install(staging, target, digest)
        except InvalidArgument as exc:
            why = f"image {digest} cannot be unpacked: {exc.message}"
            self._refused[digest] = why
            log.warning("image_refused", digest=digest, error=exc.message)
            raise InvalidArgument(why) from None
        except OSError as exc:
            raise FailedPrecondition(f"image {digest}: cannot unpack on this host: {exc}") from exc
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        log.info("image_unpacked", digest=digest, members=len(members),
                 seconds=round(time.monotonic() - started, 1))  # fmt: skip
        return target

    @staticmethod
    def _marker(digest: str) -> bytes:
        return f"{digest}\n{UNPACK_FORMAT}\n".encode()

    def _unpacked(self, target: Path, digest: str) -> bool:
        """Whether `target` is this archive's tree, unpacked the current way (its marker read
        beneath it: a tree's own link there is not followed)."""
        try:
            return safepath.read_bytes(target, MARKER, 4096) == self._marker(digest)
        except (OSError, InvalidArgument):
            return False

    def _install(self, staging: Path, target: Path, digest: str) -> None:
        """Moves an unpacked tree into place. Another process may have unpacked the same
        digest first (theirs is identical); a tree unpacked an older way is moved aside and
        removed."""
        for _ in range(3):
            try:
                os.rename(staging, target)
                return
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
            if self._unpacked(target, digest):
                return
            aside = Path(tempfile.mkdtemp(dir=self.root / "tmp", prefix="stale-"))
            try:
                os.rename(target, aside / "tree")
                log.info("image_tree_replaced", digest=digest, reason="unpacked an older way")
            except FileNotFoundError:
                pass  # (another process moved it first)
            finally:
                shutil.rmtree(aside, ignore_errors=True)
        raise FailedPrecondition(f"image {digest}: {target} keeps being replaced; not installed")
