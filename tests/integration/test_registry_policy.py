"""What a Smolfile's registry reference may make the server and hosts do: reach only the
registries an operator allowed, over HTTPS unless the operator opted a host into plain HTTP,
with the fleet's credentials sent only where they were configured for, redirects followed to
the same host or an allowed one (without credentials), bounded downloads, and errors
summarised rather than echoed. Against a small registry stand-in on loopback that records
what reaches it, and a real in-process server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from fleet.core.errors import FailedPrecondition, PermissionDenied, Unavailable
from fleet.image import oci
from fleet.image.store import ImageStore
from tests.fake_registry import ENDLESS_CAP, LAYER_DIGEST, fake_registry
from tests.integration.harness import harness, request

SECRET = "fleet-robot:registry-secret"


def smolfile(ref: str) -> str:
    return f'image = "{ref}"\n'


async def test_a_tenant_named_registry_gets_no_credentials(
    tmp_path: Path, images: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An allowed registry that is not the configured one resolves, without the fleet's
    credentials; a registry host given its own `HOST=` entry gets those, and only it."""
    monkeypatch.setenv("FLEET_REGISTRY_AUTH", SECRET)
    with fake_registry() as plain, fake_registry() as scoped:
        hosts = f"{plain.address},{scoped.address}"
        monkeypatch.setenv("FLEET_REGISTRY_ALLOW", hosts)
        monkeypatch.setenv("FLEET_REGISTRY_INSECURE", hosts)
        async with harness(tmp_path, images) as h:
            await h.register_host("cpu-1")
            reply = await h.fleet.SubmitRollout(request(smolfile(f"http://{plain.repo()}:v1")))
            assert reply.rollout.manifest.image_digest == LAYER_DIGEST
            assert plain.requests and not plain.authorizations()

            monkeypatch.setenv("FLEET_REGISTRY_AUTH", f"{scoped.address}=robot:only-there")
            await h.fleet.SubmitRollout(request(smolfile(f"http://{scoped.repo()}:v1")))
            assert scoped.authorizations() and all(
                a == "Basic cm9ib3Q6b25seS10aGVyZQ==" for a in scoped.authorizations()
            )
            assert not plain.authorizations()


async def test_a_registry_not_on_the_allowlist_is_refused_before_any_request(
    tmp_path: Path, images: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_REGISTRY_AUTH", SECRET)
    with fake_registry() as reg:
        monkeypatch.setenv("FLEET_REGISTRY_INSECURE", reg.address)
        async with harness(tmp_path, images) as h:
            await h.register_host("cpu-1")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.fleet.SubmitRollout(request(smolfile(f"http://{reg.repo()}:v1")))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "FLEET_REGISTRY_ALLOW" in (info.value.details() or "")
    assert reg.requests == []


async def test_plain_http_is_refused_unless_the_host_is_opted_in(
    tmp_path: Path, images: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    with fake_registry() as reg:
        monkeypatch.setenv("FLEET_REGISTRY_ALLOW", reg.address)
        async with harness(tmp_path, images) as h:
            await h.register_host("cpu-1")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.fleet.SubmitRollout(request(smolfile(f"http://{reg.repo()}:v1")))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "FLEET_REGISTRY_INSECURE" in (info.value.details() or "")
            assert reg.requests == []
            monkeypatch.setenv("FLEET_REGISTRY_INSECURE", reg.address)
            reply = await h.fleet.SubmitRollout(request(smolfile(f"http://{reg.repo()}:v1")))
    assert reply.rollout.manifest.image_digest == LAYER_DIGEST


async def test_a_redirect_to_another_host_is_refused(
    tmp_path: Path, images: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    with fake_registry() as elsewhere, fake_registry(mode="redirect") as reg:
        reg.redirect_to = f"http://{elsewhere.address}"
        monkeypatch.setenv("FLEET_REGISTRY_ALLOW", reg.address)
        monkeypatch.setenv("FLEET_REGISTRY_INSECURE", f"{reg.address} {elsewhere.address}")
        async with harness(tmp_path, images) as h:
            await h.register_host("cpu-1")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.fleet.SubmitRollout(request(smolfile(f"http://{reg.repo()}:v1")))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "not the registry's own host" in (info.value.details() or "")
    assert reg.requests and elsewhere.requests == []


def test_a_redirect_to_an_allowed_host_carries_no_credentials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A registry's blob redirected to its storage (a host on the allowlist) is fetched from
    there; the credentials go to the registry only."""
    with fake_registry() as storage, fake_registry(mode="redirect") as reg:
        reg.redirect_to = f"http://{storage.address}"
        monkeypatch.setenv("FLEET_REGISTRY_ALLOW", storage.address)
        monkeypatch.setenv("FLEET_REGISTRY_INSECURE", f"{reg.address},{storage.address}")
        ref = oci.Reference.parse(f"http://{reg.repo()}")
        with oci.Registry(ref, oci.Credentials.parse(SECRET)) as client:
            assert client.get_manifest("v1")["layers"][0]["digest"] == LAYER_DIGEST
    assert reg.authorizations() and storage.requests and not storage.authorizations()


async def test_a_registry_error_is_summarised_not_echoed(
    tmp_path: Path, images: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    with fake_registry(mode="error") as reg:
        monkeypatch.setenv("FLEET_REGISTRY_ALLOW", reg.address)
        monkeypatch.setenv("FLEET_REGISTRY_INSECURE", reg.address)
        async with harness(tmp_path, images) as h:
            await h.register_host("cpu-1")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.fleet.SubmitRollout(request(smolfile(f"http://{reg.repo()}:v1")))
    details = info.value.details() or ""
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "500 Internal Server Error" in details and "SECRET-REGISTRY-BODY" not in details


def test_a_pull_past_the_declared_size_is_stopped_and_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host pulling a pinned image: a registry that sends more than the manifest declares
    is cut off there, and the partial download is removed."""
    with fake_registry(mode="endless", layer_size=1 << 20) as reg:
        monkeypatch.setenv("FLEET_REGISTRY_INSECURE", reg.address)
        target = tmp_path / "image.tar"
        with pytest.raises(FailedPrecondition, match="stopped and deleted") as info:
            oci.fetch(f"http://{reg.repo()}:v1", LAYER_DIGEST, target)
        sent = reg.sent
    assert "the manifest declares 1048576" in info.value.message
    assert sent < ENDLESS_CAP
    assert list(tmp_path.iterdir()) == []


def test_a_pull_past_the_hosts_cap_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer declared over `$FLEET_REGISTRY_MAX_BLOB_GIB` is not downloaded at all; a blob
    fetched by digest alone (no declared size) is cut off at the cap."""
    with fake_registry(mode="endless", layer_size=8 << 20) as reg:
        monkeypatch.setenv("FLEET_REGISTRY_INSECURE", reg.address)
        monkeypatch.setenv("FLEET_REGISTRY_MAX_BLOB_GIB", str(2 / 1024))  # 2 MiB
        with pytest.raises(FailedPrecondition, match="FLEET_REGISTRY_MAX_BLOB_GIB"):
            oci.fetch(f"http://{reg.repo()}:v1", LAYER_DIGEST, tmp_path / "image.tar")
        assert reg.sent == 0
        with (
            oci.Registry(oci.Reference.parse(f"http://{reg.repo()}")) as client,
            pytest.raises(FailedPrecondition, match="stopped and deleted"),
        ):
            client.download_blob(LAYER_DIGEST, tmp_path / "blob")
    assert list(tmp_path.iterdir()) == []


def test_credentials_are_scoped_and_never_echoed() -> None:
    """`user:password` goes to configured registries only; `HOST=user:password` entries to
    their host only; a malformed entry is refused by its place, without its text."""
    plain = oci.Credentials.parse("robot:pw=with=equals")
    assert plain.for_registry("other:5000", configured=False) is None
    assert plain.for_registry("mine:5000", configured=True) == oci.Credentials(
        "robot", "pw=with=equals"
    )
    scoped = oci.Credentials.parse("reg.example:5000=a:b other.example=c:d")
    assert scoped.for_registry("reg.example:5000", configured=False) == oci.Credentials("a", "b")
    assert scoped.for_registry("other.example", configured=True) == oci.Credentials("c", "d")
    assert scoped.for_registry("third.example", configured=True) is None
    with pytest.raises(FailedPrecondition, match="entry 2") as info:
        oci.Credentials.parse("reg.example=a:b hunter2")
    assert "hunter2" not in info.value.message


def test_the_artifacts_repository_is_never_a_tenants_image() -> None:
    policy = oci.RegistryPolicy.from_env(["reg.example/fleet/images"], ["reg.example/fleet/art"])
    policy.check_tenant(oci.Reference.parse("reg.example/team/env:v1"))  # the configured host
    with pytest.raises(PermissionDenied, match="artifacts"):
        policy.check_tenant(oci.Reference.parse("reg.example/fleet/art@sha256:" + "0" * 64))
    with pytest.raises(PermissionDenied, match="FLEET_REGISTRY_ALLOW"):
        policy.check_tenant(oci.Reference.parse("evil.example/team/env:v1"))


async def test_a_slow_registry_holds_only_its_own_resolutions(
    tmp_path: Path, images: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forty submissions of one tenant name a registry that holds its answers: meanwhile
    another tenant's submissions, and that tenant's own by image name, are admitted."""
    with fake_registry(mode="hold") as reg:
        monkeypatch.setenv("FLEET_REGISTRY_ALLOW", reg.address)
        monkeypatch.setenv("FLEET_REGISTRY_INSECURE", reg.address)
        async with harness(tmp_path, images) as h:
            await h.register_host("cpu-1")
            held = smolfile(f"http://{reg.repo()}:v1")
            slow = [
                asyncio.ensure_future(h.fleet.SubmitRollout(request(held, tenant="slow")))
                for _ in range(40)
            ]
            for _ in range(400):  # until the registry holds some (bounded: 20 s)
                if reg.held:
                    break
                await asyncio.sleep(0.05)
            assert reg.held
            try:
                other = await asyncio.wait_for(h.fleet.SubmitRollout(request(tenant="other")), 20)
                own = await asyncio.wait_for(h.fleet.SubmitRollout(request(tenant="slow")), 20)
                still_held = reg.held
            finally:
                reg.release.set()
                done = await asyncio.wait_for(asyncio.gather(*slow, return_exceptions=True), 60)
    assert other.created and own.created and still_held
    assert all(isinstance(d, grpc.aio.AioRpcError) for d in done)
    assert {d.code() for d in done if isinstance(d, grpc.aio.AioRpcError)} <= {
        grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE
    }  # fmt: skip


def test_a_resolution_stops_at_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    with fake_registry(mode="hold") as reg:
        monkeypatch.setenv("FLEET_REGISTRY_ALLOW", reg.address)
        monkeypatch.setenv("FLEET_REGISTRY_INSECURE", reg.address)
        with pytest.raises(Unavailable, match=r"cannot reach|in time"):
            oci.resolve(f"http://{reg.repo()}:v1", timeout_s=0.5)
