"""A host without the image fetches it from the server's store by digest, verifies it, keeps
it in a bounded cache, and never runs a copy that does not verify."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
from pathlib import Path

import grpc
import pytest

from fleet.agent.images import ImageCache
from fleet.api.pb import host_pb2, host_pb2_grpc, types_pb2
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from tests.integration.harness import (
    Harness,
    harness,
    namespace_runtime,
    register_cpu_host,
    request,
)


def go(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def lease_work(h: Harness, stub: host_pb2_grpc.HostServiceStub) -> None:
    """Registers the host behind `stub` and leases it one rollout on the default image: a host
    reads an image only while it leases work that runs it."""
    await register_cpu_host(stub)
    await h.fleet.SubmitRollout(request())
    claimed = await stub.ClaimWork(host_pb2.ClaimWorkRequest(max_items=1, wait_s=5))
    assert len(claimed.items) == 1


def empty_store(tmp: Path, name: str, images: ImageStore) -> ImageStore:
    return ImageStore(tmp / name, images.recipes)


@pytest.mark.sandbox
async def test_an_empty_host_fetches_the_image_once_for_many_rollouts(
    tmp_path: Path, images: ImageStore
) -> None:
    """Five rollouts on a host with an empty store: one download, verified, then cached."""
    record = images.record("minimal")
    assert record is not None

    async with harness(tmp_path, images, secure=True, runtime=namespace_runtime) as h:
        store = empty_store(tmp_path, "remote-images", images)
        agent = await h.start_agent("cloud-1", HostClass.CPU, slots=4, images=store)
        step = ["cat", "/etc/os-release"]
        submitted = [
            (await h.fleet.SubmitRollout(request('image = "minimal"\n', step))).rollout.id
            for _ in range(5)
        ]
        final = [await h.wait_final(r) for r in submitted]
        fetches = agent.images.fetches

    assert all(r.state == types_pb2.ROLLOUT_STATE_SUCCEEDED for r in final), final[0].error
    assert all(b"Debian" in r.results[0].stdout for r in final)
    assert fetches == 1
    store = empty_store(tmp_path, "remote-images", images)
    assert store.verify(record.digest) == store.blob_path(record.digest)
    assert not list((tmp_path / "remote-images" / "tmp").glob("*.partial"))


async def test_a_copy_that_does_not_verify_is_refused_and_retried(
    tmp_path: Path, images: ImageStore
) -> None:
    """The server's copy of an image is corrupt: the host discards it, the attempt is a host
    error (retried), and no machine ever runs it."""
    record = images.record("minimal")
    assert record is not None
    server_store = empty_store(tmp_path, "server-images", images)
    (server_store.root / "blobs").mkdir(parents=True)
    bad = server_store.blob_path(record.digest)
    shutil.copyfile(images.blob_path(record.digest), bad)
    with bad.open("r+b") as handle:  # one flipped byte in the middle
        handle.seek(bad.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))

    async with harness(tmp_path, server_store, secure=True) as h:
        store = empty_store(tmp_path, "remote-images", images)
        await h.start_agent("cloud-1", HostClass.CPU, images=store)
        req = request(f'image = "{record.digest}"\n', ["true"])
        req.retry.max_attempts = 2
        rid = (await h.fleet.SubmitRollout(req)).rollout.id
        r = await h.wait_final(rid, timeout_s=90)

    assert r.state != types_pb2.ROLLOUT_STATE_SUCCEEDED
    assert all("does not verify" in a.error for a in r.attempt_history), r.attempt_history
    assert not (tmp_path / "remote-images" / "blobs" / bad.name).exists()


def test_an_interrupted_download_resumes_from_what_it_has(
    tmp_path: Path, images: ImageStore
) -> None:
    """A partial archive from an earlier run is continued, not started again: a correct
    prefix completes to a verified image; a wrong one is caught by the digest."""
    record = images.record("minimal")
    assert record is not None
    blob = images.blob_path(record.digest).read_bytes()

    async def fetch(prefix: bytes, name: str) -> str:
        async with harness(tmp_path / name, images, secure=True) as h:
            identity = h.identity("cloud-1")
            store = empty_store(tmp_path, f"{name}-images", images)
            (store.root / "tmp").mkdir(parents=True)
            partial = store.root / "tmp" / f"{record.digest.replace(':', '-')}.partial"
            partial.write_bytes(prefix)
            cache = ImageCache(store, None)
            creds = identity.channel_credentials()
            async with grpc.aio.secure_channel(identity.host_address, creds) as channel:
                stub = host_pb2_grpc.HostServiceStub(channel)
                await lease_work(h, stub)
                try:
                    await cache.acquire(stub, record.digest)
                except Exception as exc:
                    return str(exc)
            cache.release(record.digest)
            got = store.blob_path(record.digest).read_bytes()
            return "sha256:" + hashlib.sha256(got).hexdigest()

    (tmp_path / "good").mkdir()
    (tmp_path / "bad").mkdir()
    assert go(fetch(blob[: len(blob) // 3], "good")) == record.digest
    wrong = bytes(len(blob) // 3)  # zeros: the right length, the wrong content
    assert "does not verify" in go(fetch(wrong, "bad"))


async def test_blobs_are_served_to_hosts_only_and_checked(
    tmp_path: Path, images: ImageStore
) -> None:
    record = images.record("minimal")
    assert record is not None

    async with harness(tmp_path, images, secure=True) as h:
        codes = []
        ask = host_pb2.GetBlobRequest(digest=record.digest)
        try:  # a tenant's channel: no certificate
            async for _ in h.hosts.GetBlob(ask):
                break
        except grpc.aio.AioRpcError as exc:
            codes.append(exc.code())
        identity = h.identity("cloud-1")
        creds = identity.channel_credentials()
        async with grpc.aio.secure_channel(identity.host_address, creds) as channel:
            stub = host_pb2_grpc.HostServiceStub(channel)

            async def ask_each(asks: list[host_pb2.GetBlobRequest]) -> None:
                for bad in asks:
                    try:
                        async for _ in stub.GetBlob(bad):
                            pass
                    except grpc.aio.AioRpcError as exc:
                        codes.append(exc.code())

            # Holding no lease: no image at all.
            await ask_each([
                host_pb2.GetBlobRequest(digest="../../etc/passwd"),
                host_pb2.GetBlobRequest(digest="sha256:" + "0" * 64),
                host_pb2.GetBlobRequest(digest=record.digest),
            ])  # fmt: skip
            # Leasing work on the default image: that image only, and within its size.
            await lease_work(h, stub)
            await ask_each([
                host_pb2.GetBlobRequest(digest="sha256:" + "0" * 64),
                host_pb2.GetBlobRequest(digest=record.digest, offset=1 << 40),
            ])  # fmt: skip
        result = codes

    assert result == [
        grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OUT_OF_RANGE,
    ]  # fmt: skip


def test_the_cache_evicts_least_recently_used_never_one_in_use(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images", tmp_path)
    (store.root / "blobs").mkdir(parents=True)
    (store.root / "fetched").mkdir()
    digests = []
    for i in range(4):
        data = bytes([i]) * 1000
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        store.blob_path(digest).write_bytes(data)
        marker = store.root / "fetched" / digest.replace(":", "-")
        marker.write_text(digest)
        os.utime(marker, (1000 + i, 1000 + i))  # 0 is the least recently used
        digests.append(digest)
    cache = ImageCache(store, cap_bytes=2 * 2 * 1000)  # room for two (archive + tree each)
    cache._in_use[digests[0]] = 1  # a machine uses the oldest
    removed = cache.evict()
    assert removed == [digests[1], digests[2]]
    assert store.blob_path(digests[0]).exists() and store.blob_path(digests[3]).exists()
    assert ImageCache(store, None).evict() == []


async def test_a_smolfile_without_an_image_runs_on_the_default_one(
    tmp_path: Path, images: ImageStore
) -> None:
    async with harness(tmp_path, images, secure=True) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        rid = (await h.fleet.SubmitRollout(request("cpus = 1\n", ["true"]))).rollout.id
        r = await h.wait_final(rid)

    record = images.record("minimal")
    assert record is not None
    assert r.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, r.error
    assert r.manifest.image_ref == "minimal" and r.manifest.image_digest == record.digest
