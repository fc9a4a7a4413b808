"""`fleet run` and `fleet image`: what runs on the local machine alone."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from fleet.client import Smolfile
from fleet.client.transfer import archive_path
from fleet.config import Paths
from fleet.core.manifest import image_of


def dev_volumes(
    smolfile: str, volumes: list[str]
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """[dev] volumes `SOURCE:TARGET[:ro]` (SOURCE relative to the Smolfile) -> (read-only,
    writable) pairs of (host path, path in the machine); a missing SOURCE is refused."""
    base = Path(smolfile).resolve().parent
    read_only: list[tuple[str, str]] = []
    writable: list[tuple[str, str]] = []
    for volume in volumes:
        source, target, *mode = volume.split(":")
        host = (base / source).resolve()
        if not host.exists():
            raise SystemExit(f"fleet run: [dev] volume {volume!r}: {host} does not exist")
        (read_only if mode == ["ro"] else writable).append((str(host), target))
    return read_only, writable


async def cmd_run(args: argparse.Namespace) -> int:
    """One machine from a Smolfile, the command's output streamed to this terminal."""
    from fleet.agent.capabilities import choose_runtime, make_runtime
    from fleet.image.store import ImageStore
    from fleet.runtime.base import MachineSpec, resolve_secrets

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    loaded = Smolfile.load(args.smolfile)
    parsed = loaded.parsed
    if not command:
        command = [*parsed.spec.entrypoint, *parsed.spec.cmd]
    if not command:
        print(
            "fleet run: no command given and the Smolfile has no entrypoint or cmd", file=sys.stderr
        )
        return 2
    paths = Paths.from_env()
    images = ImageStore(paths.images, paths.recipes)
    choice = choose_runtime(args.runtime, paths.home, images)
    print(f"fleet run: runtime {choice.kind} ({choice.reason})", file=sys.stderr, flush=True)
    runtime = make_runtime(choice, paths.machines)
    dev = parsed.spec.dev
    read_only: list[tuple[str, str]] = []
    writable: list[tuple[str, str]] = []
    if dev is not None:
        # [dev] is for this path: applied here, refused where it cannot be, never dropped.
        unsupported = ["ports"] if dev.ports else []
        if dev.volumes and not runtime.mounts_read_only:
            unsupported.append("volumes")
        if unsupported:
            what = ", ".join(unsupported)
            print(f"fleet run: {args.smolfile}: [dev] {what} is not supported by the "
                  f"{choice.kind} runtime; remove it to run here", file=sys.stderr)  # fmt: skip
            return 2
        read_only, writable = await asyncio.to_thread(dev_volumes, args.smolfile, dev.volumes)
    archive = archive_path(loaded)
    if archive is not None:
        digest = (await asyncio.to_thread(images.import_archive, archive)).digest
    else:
        digest = images.resolve(image_of(parsed))
    smolfile = parsed.spec
    if dev is not None and dev.user:  # [dev] user stands for the Smolfile's own
        smolfile = smolfile.model_copy(update={"user": dev.user})
    spec = MachineSpec(
        name="fleet-run-" + os.urandom(4).hex(),
        smolfile=smolfile,
        image_digest=digest,
        rootfs=await asyncio.to_thread(images.rootfs, digest),
        labels={"fleet": "run"},
        secrets=resolve_secrets(parsed.spec),
        read_only=tuple(read_only),
        writable=tuple(writable),
    )
    machine = await runtime.create(spec)
    dev_env = dict(item.split("=", 1) for item in dev.env) if dev is not None else {}
    workdir = dev.workdir if dev is not None else None
    inits = [*parsed.spec.init, *(dev.init if dev is not None else [])]

    def show(stream: str, chunk: bytes) -> None:
        out = sys.stdout.buffer if stream == "stdout" else sys.stderr.buffer
        out.write(chunk)
        out.flush()

    try:
        for init in inits:
            res = await machine.exec(
                ["/bin/sh", "-c", init], env=dev_env, timeout_s=args.timeout_s, on_output=show
            )
            if res.exit_code != 0 or res.oom_killed:
                said = ended_badly(res, smolfile.memory_mib_effective, args.timeout_s)
                print(f"fleet run: init {init!r} {said or f'exited {res.exit_code}'}",
                      file=sys.stderr)  # fmt: skip
                return exit_status(res)
        result = await machine.exec(command, env=dev_env, workdir=workdir,
                                    timeout_s=args.timeout_s, on_output=show)  # fmt: skip
    finally:
        await machine.delete()
    said = ended_badly(result, smolfile.memory_mib_effective, args.timeout_s)
    if said:
        print(f"fleet run: {said}", file=sys.stderr)
    return exit_status(result)


def ended_badly(result: Any, memory_mib: int, timeout_s: float) -> str:
    """Why a command ended that its own output may not say ("": it ended by itself): killed
    for memory (the kernel's OOM killer leaves no message), or past its timeout."""
    if result.oom_killed:
        return (
            f"killed: out of memory (exit code {result.exit_code}; the Smolfile's memory "
            f"limit is {memory_mib} MiB)"
        )
    if result.timed_out:
        return f"timed out after {timeout_s:g}s"
    return ""


def exit_status(result: Any) -> int:
    """`fleet run`'s own exit status for a command's result: its exit code, 124 past its
    timeout, and 137 (killed) for one killed for memory that reported none."""
    if result.timed_out and not result.oom_killed:
        return 124
    code = int(result.exit_code)
    if result.oom_killed and code == 0:
        return 137
    return code if 0 <= code <= 255 else min(255, 128 + abs(code))  # (-9: killed, 137)


async def cmd_image(args: argparse.Namespace) -> int:
    from fleet.image.store import ImageStore

    paths = Paths.from_env()
    store = ImageStore(paths.images, paths.recipes)
    if args.image_cmd == "build":
        record, built = await asyncio.to_thread(store.build, args.name, force=args.force)
        if not args.quiet or built:
            print(
                f"{record.name} {record.digest} {'built' if built else 'cached'}", file=sys.stderr
            )
    elif args.image_cmd == "list":
        for r in store.list_images():
            print(f"{r.name:<16} {r.digest}  {r.size_bytes / 1e6:8.1f} MB")
    elif args.image_cmd == "inspect":
        found = store.record(args.name)
        if found is None:
            print(f"fleet image: no image {args.name!r}", file=sys.stderr)
            return 1
        print(found.model_dump_json(indent=2))
    elif args.image_cmd == "rm":
        # A running namespace machine has the unpacked tree as its read-only lower layer.
        busy = any(paths.machines.glob("*/*"))
        for path in store.remove(args.name, keep_tree=busy):
            print(f"removed {path}")
        if busy:
            print(f"kept the unpacked tree: machines exist under {paths.machines}")
    elif args.image_cmd == "pack":
        return await pack_image(store, paths, args.name, args.out)
    elif args.image_cmd in ("push", "pull"):
        return await asyncio.to_thread(push_or_pull, store, args)
    return 0


def push_or_pull(store: Any, args: argparse.Namespace) -> int:
    """`fleet image push NAME|DIGEST --registry URL/REPO` / `fleet image pull REF`."""
    from fleet.image import oci

    ca = Path(args.ca).read_bytes() if args.ca else None
    credentials = oci.Credentials.from_env()
    if args.image_cmd == "push":
        digest = store.resolve(args.name)
        blob = store.verify(digest)
        repo = oci.Reference.parse(args.registry)
        tag = args.tag or (args.name if not args.name.startswith("sha256:") else digest[7:19])
        with oci.Registry(repo, credentials, ca) as registry:
            manifest = oci.push(registry, blob, digest, tag)
        print(f"pushed {args.name} ({digest}) as {repo.with_tag(tag)} (manifest {manifest})")
        return 0
    ref = oci.Reference.parse(args.ref)
    with oci.Registry(ref, credentials, ca) as registry:
        layer, digest = oci.layer_of(registry, ref.digest or ref.tag or "latest")
        if not store.blob_path(digest).exists():
            oci.pull_layer(registry, layer, digest, store.blob_path(digest))
    store.mark_verified(digest)
    name = args.name or (ref.tag if ref.tag else ref.repository.rsplit("/", 1)[-1])
    record = store.add_pulled(name, digest, str(ref))
    print(f"pulled {ref} as {record.name} ({digest}, {record.size_bytes / 1e6:.1f} MB)")
    return 0


async def pack_image(store: Any, paths: Paths, name: str, out: str) -> int:
    """`fleet image pack`: a .smolmachine of the image, where microVMs boot."""
    from fleet.agent.capabilities import canary_image
    from fleet.core.smolfile import parse_smolfile
    from fleet.runtime import smol as smol_runtime
    from fleet.runtime.base import MachineSpec

    record = store.record(name)
    if record is None:
        print(f"fleet image pack: no image {name!r} (fleet image build {name})", file=sys.stderr)
        return 1
    ok, why = await asyncio.to_thread(
        smol_runtime.preflight, paths.home, lambda: canary_image(store)
    )
    if not ok:
        print(f"fleet image pack: microVMs cannot boot here: {why}", file=sys.stderr)
        return 1
    rootfs = await asyncio.to_thread(store.rootfs, record.digest)
    spec = MachineSpec(
        name=f"fleet-pack-{name}", smolfile=parse_smolfile(f'image = "{name}"\n').spec,
        image_digest=record.digest, rootfs=rootfs, labels={"fleet": "1", "pack": name},
    )  # fmt: skip
    target = Path.cwd() / (out or f"{name}-{record.digest[7:19]}.smolmachine")
    path = await smol_runtime.SmolRuntime().pack(spec, target)
    print(f"{name} {record.digest} packed: {path}")
    return 0
