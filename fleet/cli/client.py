"""Building submissions from files and flags, and talking to a server, for the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import stat
import tarfile
import tempfile
import tomllib
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from fleet import safepath
from fleet._proto.fleet.v1 import fleet_pb2, types_pb2
from fleet.core.errors import InvalidArgument
from fleet.core.manifest import image_of
from fleet.core.smolfile import load_smolfile
from fleet.image.archive import flatten
from fleet.image.oci import looks_like_archive

PLAN_KEYS = {"argv", "env", "workdir", "timeout_s", "name"}


def load_plan(path: str) -> list[types_pb2.Step]:
    """A plan file: TOML with [[steps]] tables (argv, env, workdir, timeout_s, name)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{path}: cannot read plan: {exc}") from exc
    return parse_plan(text, path)


def parse_plan(text: str, path: str = "<plan>") -> list[types_pb2.Step]:
    """A plan's text as steps; anything else is refused with InvalidArgument saying where."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"{path}: cannot read plan: {exc}") from exc
    except RecursionError:
        raise InvalidArgument(f"{path}: cannot read plan: nested too deeply") from None
    steps = data.get("steps")
    unknown = set(data) - {"steps"}
    if unknown:
        raise InvalidArgument(f"{path}: unknown plan keys {sorted(unknown)[:10]}")
    if not isinstance(steps, list) or not steps:
        raise InvalidArgument(f"{path}: a plan needs at least one [[steps]] table")
    out = []
    for index, step in enumerate(steps):
        where = f"{path}: steps[{index}]"
        if not isinstance(step, dict):
            raise InvalidArgument(f"{where} must be a table")
        bad = set(step) - PLAN_KEYS
        if bad:
            raise InvalidArgument(f"{where}: unknown keys {sorted(bad)[:10]}")
        argv = step.get("argv")
        if isinstance(argv, str):
            try:
                argv = shlex.split(argv)
            except ValueError as exc:
                raise InvalidArgument(f"{where}.argv: {exc}") from None
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise InvalidArgument(f"{where}.argv must be a list of strings")
        env = step.get("env", {})
        if not isinstance(env, dict) or not all(
            isinstance(v, str | int | float | bool) for v in env.values()
        ):
            raise InvalidArgument(f"{where}.env must be a table of strings")
        workdir, name = step.get("workdir", ""), step.get("name", "")
        if not isinstance(workdir, str) or not isinstance(name, str):
            raise InvalidArgument(f"{where}: workdir and name must be strings")
        timeout = step.get("timeout_s", 0)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise InvalidArgument(f"{where}.timeout_s must be a number of seconds")
        try:
            pb = types_pb2.Step(
                argv=argv, env={str(k): str(v) for k, v in env.items()}, workdir=workdir,
                timeout_s=float(timeout), name=name,
            )  # fmt: skip
        except (ValueError, OverflowError) as exc:  # (a string protobuf cannot hold)
            raise InvalidArgument(f"{where}: {exc}") from None
        out.append(pb)
    return out


def parse_labels(items: list[str]) -> dict[str, str]:
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidArgument(f"label {item!r} is not KEY=VALUE")
        labels[key] = value
    return labels


def submit_request(
    smolfile_path: str,
    steps: list[types_pb2.Step],
    *,
    key: str | None = None,
    labels: dict[str, str] | None = None,
    deadline_s: float | None = None,
    max_attempts: int = 0,
    require_vm: bool = False,
    require_cuda_device: bool = False,
    inference: bool = False,
    versions: dict[str, str] | None = None,
    tenant: str = "",
    inputs: list[types_pb2.InputFile] | None = None,
    outputs: list[str] | None = None,
) -> fleet_pb2.SubmitRolloutRequest:
    parsed = load_smolfile(smolfile_path)  # fail fast, locally, with file and line
    if not steps and (parsed.spec.entrypoint or parsed.spec.cmd):
        steps = [types_pb2.Step(argv=[*parsed.spec.entrypoint, *parsed.spec.cmd], name="main")]
    request = fleet_pb2.SubmitRolloutRequest(
        request_id=uuid.uuid4().hex,
        idempotency_key=key or uuid.uuid4().hex,
        smolfile=parsed.text,
        smolfile_name=smolfile_path,
        steps=steps,
        labels=labels or {},
        tenant=tenant,
        retry=types_pb2.RetryPolicy(max_attempts=max_attempts),
        requirements=types_pb2.Requirements(
            isolation=types_pb2.ISOLATION_VM if require_vm else types_pb2.ISOLATION_UNSPECIFIED,
            cuda_device=require_cuda_device,
            inference=inference,
        ),
        versions=types_pb2.Versions(**(versions or {})),
        inputs=inputs or [],
        outputs=outputs or [],
    )
    if deadline_s is not None:
        request.deadline.FromDatetime(datetime.now(UTC) + timedelta(seconds=deadline_s))
    return request


def steps_from_flags(step_flags: list[str]) -> list[types_pb2.Step]:
    return [types_pb2.Step(argv=shlex.split(s), name=f"step-{i}") for i, s in enumerate(step_flags)]


def rollout_dict(r: types_pb2.Rollout) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    out: dict[str, Any] = MessageToDict(r, preserving_proto_field_name=True)
    return out


# -- files -------------------------------------------------------------------------------------

UPLOAD_CHUNK = 1 << 20


def parse_input(spec: str) -> tuple[Path, str, bool]:
    """`SRC:/path/in/machine` -> (SRC, path, SRC is a directory); SRC may itself hold ':'
    (split at the last)."""
    src, sep, dest = spec.rpartition(":")
    if not sep or not src or not dest.startswith("/"):
        raise InvalidArgument(f"--input {spec!r}: expected SRC:/absolute/path/in/machine")
    path = Path(src)
    if not path.exists():
        raise InvalidArgument(f"--input {spec!r}: {src} does not exist")
    return path, dest, path.is_dir()


def tar_directory(src: Path, out: Any) -> None:
    """A directory as a tar whose bytes depend on its content only (sorted entries, owner 0),
    so the same tree uploaded twice is stored once."""

    def reset(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(src.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(src)), recursive=False, filter=reset)


async def upload(stub: Any, src: Path, dest: str, directory: bool) -> types_pb2.InputFile:
    """Uploads a file, or a directory as one tar, with PutBlob; returns the manifest entry."""

    with tempfile.TemporaryFile() as spool:
        if directory:
            await asyncio.to_thread(tar_directory, src, spool)
            spool.seek(0)
            handle: Any = spool
        else:
            handle = src.open("rb")

        async def parts() -> Any:
            while data := await asyncio.to_thread(handle.read, UPLOAD_CHUNK):
                yield fleet_pb2.BlobPart(data=data)

        try:
            reply = await stub.PutBlob(parts(), timeout=3600)
        finally:
            if handle is not spool:
                handle.close()
    return types_pb2.InputFile(path=dest, digest=reply.digest, size=reply.size,
                               directory=directory)  # fmt: skip


async def download(stub: Any, rollout: types_pb2.Rollout, into: Path) -> list[str]:
    """Writes each stored output of `rollout` under `into` (a directory's tar unpacked into a
    folder of its name); returns what it wrote.

    A directory's archive is unpacked by `fleet.safepath` (never tarfile's filter): nothing is
    written outside its folder, no link is followed, and no owners, setuid bits, device nodes
    or symlinks pointing out of the folder are made. An output that cannot be written so is
    skipped, the others are still written, and then `UnsafeArchive` names each one refused."""

    written = []
    refused = []
    os.makedirs(into, exist_ok=True)
    for output in rollout.outputs:
        if not output.digest:
            continue
        try:
            name = str(safepath.member_name(Path(output.path).name))
        except safepath.UnsafePath as exc:
            refused.append(f"output {output.path!r}: {exc.message}")
            continue
        target = into / name
        with tempfile.TemporaryFile() as spool:
            call = stub.GetArtifact(
                fleet_pb2.GetArtifactRequest(rollout_id=rollout.id, digest=output.digest)
            )
            async for chunk in call:
                await asyncio.to_thread(spool.write, chunk.data)
            spool.seek(0)
            try:
                await asyncio.to_thread(_write_output, spool, into, name, output.directory)
            except (safepath.UnsafeArchive, safepath.UnsafePath) as exc:
                refused.append(f"output {output.path!r}: {exc.message}")
                continue
        written.append(str(target))
    if refused:
        raise safepath.UnsafeArchive(
            f"{len(refused)} output(s) not written under {into} "
            f"({len(written)} written): " + "; ".join(refused)
        )
    return written


def _write_output(spool: Any, into: Path, name: str, directory: bool) -> None:
    """One output at `into/name`: a directory's archive unpacked there, a file's bytes written
    there; never through a link already at that name, never over a directory."""
    if directory:
        fd = safepath.open_dir(into, name, create=True)
        try:
            safepath.extract_tar(spool, fd, safepath.ExtractPolicy())
        finally:
            os.close(fd)
        return
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(into / name).st_mode):
            raise safepath.UnsafePath(f"{into / name}: is a directory")
        os.unlink(into / name)
    fd = safepath.open_file(into, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as out:
        while data := spool.read(UPLOAD_CHUNK):
            out.write(data)


def archive_path(smolfile: str, image: str) -> Path:
    """An `image` archive path as the Smolfile means it: relative to the Smolfile."""
    return Path(smolfile).resolve().parent / image


async def upload_image_archive(stub: Any, smolfile: str) -> str:
    """When the Smolfile's `image` is an archive path (relative to the Smolfile): the image
    flattened here and uploaded; its digest ("" for any other `image`)."""

    image = image_of(load_smolfile(smolfile))
    if not looks_like_archive(image):
        return ""
    archive = archive_path(smolfile, image)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rootfs.tar"
        await asyncio.to_thread(flatten, archive, out)
        entry = await upload(stub, out, "/", False)
    return str(entry.digest)
