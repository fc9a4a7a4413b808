"""Images teams already have: a `docker save` archive (or an OCI layout) as a recipe's base,
flattened with its whiteouts honoured, and run like any fleet image."""

from __future__ import annotations

import asyncio
import io
import json
import tarfile
from pathlib import Path

import pytest

from fleet.api.pb import types_pb2
from fleet.core.errors import InvalidArgument
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from tests.integration.harness import harness, namespace_runtime, request


def _layer(files: dict[str, bytes | None]) -> bytes:
    """A layer tar: name -> content (None: a directory)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def docker_save(path: Path, layers: list[bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        names = []
        for index, layer in enumerate(layers):
            name = f"layer{index}/layer.tar"
            info = tarfile.TarInfo(name)
            info.size = len(layer)
            tar.addfile(info, io.BytesIO(layer))
            names.append(name)
        manifest = json.dumps([{"Config": "config.json", "RepoTags": ["t:1"],
                                "Layers": names}]).encode()  # fmt: skip
        info = tarfile.TarInfo("manifest.json")
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))


@pytest.mark.sandbox
async def test_a_docker_save_archive_becomes_a_fleet_image(
    tmp_path: Path, images: ImageStore
) -> None:
    record = images.record("minimal")
    assert record is not None
    recipes = tmp_path / "recipes"
    (recipes / "custom").mkdir(parents=True)
    base = images.blob_path(record.digest).read_bytes()  # a whole Debian root as layer 0
    docker_save(recipes / "custom" / "env.tar", [
        base,
        _layer({"opt/task/": None, "opt/task/old.txt": b"old\n", "opt/gone.txt": b"x\n"}),
        _layer({"opt/task/.wh..wh..opq": b"", "opt/task/new.txt": b"new\n",
                "opt/.wh.gone.txt": b""}),
    ])  # fmt: skip
    (recipes / "custom" / "recipe.toml").write_text('name = "custom"\nbase = "env.tar"\n')
    store = ImageStore(tmp_path / "images", recipes)
    built, ran = store.build("custom")
    assert ran
    again, ran_again = store.build("custom")
    assert not ran_again and again.digest == built.digest  # same recipe, same archive: cached
    with tarfile.open(store.blob_path(built.digest)) as tar:
        names = set(tar.getnames())
    assert "./opt/task/new.txt" in names and "./usr/bin/python3" in names
    assert "./opt/task/old.txt" not in names and "./opt/gone.txt" not in names

    async with harness(tmp_path / "fleet", store, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        req = request('image = "custom"\n', ["sh", "-c", "cat /opt/task/new.txt; ls /opt"])
        rid = (await h.fleet.SubmitRollout(req)).rollout.id
        r = await h.wait_final(rid)

    assert r.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, r.error
    assert r.results[0].stdout == b"new\ntask\n"


def test_a_bad_base_archive_is_refused(tmp_path: Path) -> None:
    recipes = tmp_path / "recipes"
    (recipes / "bad").mkdir(parents=True)
    (recipes / "bad" / "env.tar").write_bytes(_layer({"hello.txt": b"not an image\n"}))
    (recipes / "bad" / "recipe.toml").write_text('name = "bad"\nbase = "env.tar"\n')
    store = ImageStore(tmp_path / "images", recipes)
    with pytest.raises(InvalidArgument, match="neither a docker-save archive"):
        store.build("bad")
    (recipes / "bad" / "recipe.toml").write_text(
        'name = "bad"\nbase = "env.tar"\ninclude = ["curl"]\n'
    )
    with pytest.raises(InvalidArgument, match="takes no `include` or `pip`"):
        store.build("bad")


@pytest.mark.sandbox
async def test_a_smolfile_may_name_an_archive(tmp_path: Path, images: ImageStore) -> None:
    """`image = "./env.tar"`: `fleet run` flattens it locally; `fleet submit` flattens and
    uploads it, and the server stores and pins it for the hosts."""
    import os
    import subprocess

    from tests.acceptance.procs import FLEET
    from tests.conftest import REPO

    record = images.record("minimal")
    assert record is not None
    docker_save(tmp_path / "env.tar", [
        images.blob_path(record.digest).read_bytes(),
        _layer({"opt/": None, "opt/hello.txt": b"hello from the archive\n"}),
    ])  # fmt: skip
    smolfile = tmp_path / "task.smolfile"
    smolfile.write_text('image = "./env.tar"\n')
    home = tmp_path / "home"
    env = {**os.environ, "FLEET_HOME": str(home), "FLEET_SERVER": "", "FLEET_KEY": ""}
    argv = [*FLEET, "run", "-s", str(smolfile), "--", "cat", "/opt/hello.txt"]
    ran = await asyncio.to_thread(
        subprocess.run, argv, capture_output=True, text=True, timeout=300, env=env, cwd=REPO
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "hello from the archive\n"

    async with harness(tmp_path / "fleet", images, secure=True, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        assert h.ca is not None
        submit = await asyncio.create_subprocess_exec(
            *FLEET,
            "submit",
            "--server",
            h.server.address,
            "--ca",
            str(tmp_path / "fleet" / "ca" / "ca.crt"),
            "--key",
            h.key("team-a"),
            "-s",
            str(smolfile),
            "--step",
            "cat /opt/hello.txt",
            "-q",
            env=env,
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await submit.communicate()
        assert submit.returncode == 0, err.decode()
        rid = out.decode().strip()
        r = await h.wait_final(rid, timeout_s=120)

    assert r.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, r.error
    assert r.results[0].stdout == b"hello from the archive\n"
    assert r.manifest.image_ref == "./env.tar" and r.manifest.image_digest.startswith("sha256:")
