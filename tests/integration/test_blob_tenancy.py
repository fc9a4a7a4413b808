"""Uploaded blobs belong to the tenant that uploaded them: another tenant that knows the digest
cannot name it (as an input or as an uploaded image) until it uploads the same bytes itself,
and each tenant's uploads are bounded by a quota. On a real server with TLS and API keys, and
the artifact store on disk."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from fleet.api.pb import fleet_pb2_grpc, types_pb2
from fleet.artifacts.store import BlobStore
from fleet.cli import client
from fleet.core.errors import ResourceExhausted
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from tests.integration.harness import harness, namespace_runtime, request


async def test_a_tenant_names_only_blobs_it_uploaded(tmp_path: Path, images: ImageStore) -> None:
    data = tmp_path / "secret.txt"
    data.write_bytes(b"team a's data, not team b's\n")
    async with harness(tmp_path / "fleet", images, secure=True) as h:
        await h.start_agent("cpu-1", HostClass.CPU)
        async with h.connect(h.key("team-a")) as ca, h.connect(h.key("team-b")) as cb:
            a, b = fleet_pb2_grpc.FleetServiceStub(ca), fleet_pb2_grpc.FleetServiceStub(cb)
            entry = await client.upload(a, data, "/in/secret.txt", False)
            own = request()
            own.inputs.append(entry)
            assert (await a.SubmitRollout(own)).created

            stolen = request()
            stolen.inputs.append(entry)
            with pytest.raises(grpc.aio.AioRpcError) as as_input:
                await b.SubmitRollout(stolen)
            as_image = request('image = "./env.tar"\n', image_upload=entry.digest)
            with pytest.raises(grpc.aio.AioRpcError) as as_upload:
                await b.SubmitRollout(as_image)

            # The same bytes uploaded by team b are then team b's to name too.
            mine = await client.upload(b, data, "/in/secret.txt", False)
            again = request()
            again.inputs.append(mine)
            assert mine.digest == entry.digest and (await b.SubmitRollout(again)).created

    for info in (as_input, as_upload):
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "was not uploaded" in (info.value.details() or "")


async def test_a_tenants_uploads_are_bounded_by_its_quota(
    tmp_path: Path, images: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_ARTIFACTS_TENANT_QUOTA_GIB", str(1 / 1024))  # 1 MiB
    first, second = tmp_path / "first.bin", tmp_path / "second.bin"
    first.write_bytes(b"1" * (600 << 10))
    second.write_bytes(b"2" * (600 << 10))
    async with harness(tmp_path / "fleet", images, secure=True) as h:
        async with h.connect(h.key("team-a")) as ca, h.connect(h.key("team-b")) as cb:
            a, b = fleet_pb2_grpc.FleetServiceStub(ca), fleet_pb2_grpc.FleetServiceStub(cb)
            await client.upload(a, first, "/in/first.bin", False)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.upload(a, second, "/in/second.bin", False)
            other = await client.upload(b, second, "/in/second.bin", False)  # its own quota
        root = h.server.core.blobs.root
        left = list((root / "tmp").iterdir())
    details = info.value.details() or ""
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "quota of 1 MiB" in details and "FLEET_ARTIFACTS_TENANT_QUOTA_GIB" in details
    assert other.size == 600 << 10 and left == []


async def test_retention_frees_what_a_tenants_quota_counts(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)

    async def body(data: bytes) -> AsyncIterator[bytes]:
        yield data

    digest, _ = await store.put(body(b"x" * 100), 1000, "an input", owner="t", quota_bytes=150)
    assert store.owns("t", digest) and not store.owns("u", digest) and store.usage("t") == 100
    with pytest.raises(ResourceExhausted, match="quota of"):
        await store.put(body(b"y" * 100), 1000, "an input", owner="t", quota_bytes=150)
    store.collect_garbage(set(), time.time() + 1)  # no rollout names it any longer
    assert not store.owns("t", digest) and store.usage("t") == 0
    await store.put(body(b"y" * 100), 1000, "an input", owner="t", quota_bytes=150)
    assert store.usage("t") == 100


async def test_replicas_share_who_uploaded_a_blob_through_the_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replicas sharing an artifacts registry: an upload through one is its tenant's on the
    other (the owner's tag), nobody else's; retention removes the owners' tags with the blob."""
    from fleet.artifacts.store import RegistryBlobStore
    from fleet.identity.ca import CertificateAuthority
    from tests.registry import PASSWORD, USER, registry

    monkeypatch.setenv("FLEET_REGISTRY_AUTH", f"{USER}:{PASSWORD}")
    ca = CertificateAuthority.init(tmp_path / "ca")

    async def body(data: bytes) -> AsyncIterator[bytes]:
        yield data

    with registry(tmp_path / "registry", ca) as reg:
        repo = reg.repo("fleet/artifacts")
        a = RegistryBlobStore(tmp_path / "a", repo, ca.pem)
        b = RegistryBlobStore(tmp_path / "b", repo, ca.pem)
        digest, _ = await a.put(body(b"uploaded through a\n"), 1000, "an input", owner="t")
        assert b.owns("t", digest) and not b.owns("u", digest)
        b.collect_garbage(set(), time.time() + 1)
        with a._registry() as client:
            tags = client.tags()
    assert not [t for t in tags if t.endswith(digest.removeprefix("sha256:"))]


@pytest.mark.sandbox
async def test_a_tenants_outputs_are_its_own_to_name_as_inputs(
    tmp_path: Path, images: ImageStore
) -> None:
    """An output a rollout stored is its tenant's: a later rollout of the same tenant may name
    it as an input; another tenant that knows its digest may not."""
    async with harness(tmp_path / "fleet", images, secure=True, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-1", HostClass.CPU)
        async with h.connect(h.key("team-a")) as ca, h.connect(h.key("team-b")) as cb:
            a, b = fleet_pb2_grpc.FleetServiceStub(ca), fleet_pb2_grpc.FleetServiceStub(cb)
            make = request('image = "minimal"\n', ["sh", "-c", "echo made > /out.txt"])
            make.outputs.append("/out.txt")
            made = await h.wait_final((await a.SubmitRollout(make)).rollout.id)
            [out] = made.outputs
            assert out.digest, out.error
            entry = types_pb2.InputFile(path="/in.txt", digest=out.digest, size=out.size)
            use = request('image = "minimal"\n', ["cat", "/in.txt"])
            use.inputs.append(entry)
            used = await h.wait_final((await a.SubmitRollout(use)).rollout.id)
            stolen = request()
            stolen.inputs.append(entry)
            with pytest.raises(grpc.aio.AioRpcError) as as_other:
                await b.SubmitRollout(stolen)

    assert used.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, used.error
    assert used.results[0].stdout == b"made\n"
    assert as_other.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "was not uploaded" in (as_other.value.details() or "")
