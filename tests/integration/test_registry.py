"""Images through a real OCI registry (Debian's docker-registry, TLS and htpasswd): pushed and
pulled by the CLI, fetched by hosts by digest when the server points them at it, and a copy
corrupted in the registry refused by digest while another host runs the rollout."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from fleet.api.pb import fleet_pb2, types_pb2
from fleet.core.placement import HostClass
from fleet.identity.ca import CertificateAuthority
from fleet.image.store import ImageStore
from fleet.server.app import ServerConfig
from tests.conftest import REPO
from tests.integration.harness import SECRET, harness, registered, request
from tests.registry import PASSWORD, USER, registry

FLEET = [str(REPO / ".venv" / "bin" / "python"), "-m", "fleet.cli.main"]


def fleet_cli(
    home: Path, *args: str, auth: str = f"{USER}:{PASSWORD}"
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FLEET_HOME": str(home), "FLEET_REGISTRY_AUTH": auth}
    return subprocess.run([*FLEET, *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=REPO)  # fmt: skip


def test_push_and_pull_through_a_registry(tmp_path: Path, images: ImageStore) -> None:
    record = images.record("minimal")
    assert record is not None
    ca = CertificateAuthority.init(tmp_path / "ca")
    ca_file = str(tmp_path / "ca" / "ca.crt")
    with registry(tmp_path / "registry", ca) as reg:
        pushed = fleet_cli(images.root.parent, "image", "push", "minimal", "--registry",
                           reg.repo(), "--ca", ca_file)  # fmt: skip
        assert pushed.returncode == 0, pushed.stderr
        assert record.digest in pushed.stdout
        again = fleet_cli(images.root.parent, "image", "push", "minimal", "--registry",
                          reg.repo(), "--ca", ca_file)  # fmt: skip
        assert again.returncode == 0, again.stderr  # the blobs are there already: skipped
        home = tmp_path / "other-host"
        pulled = fleet_cli(home, "image", "pull", f"{reg.repo()}:minimal", "--ca", ca_file)
        assert pulled.returncode == 0, pulled.stderr
        store = ImageStore(home / "images", images.recipes)
        assert store.verify(record.digest) and store.record("minimal") is not None
        refused = fleet_cli(tmp_path / "h2", "image", "pull", f"{reg.repo()}:minimal", "--ca",
                            ca_file, auth=f"{USER}:wrong")  # fmt: skip
        assert refused.returncode != 0 and "refused the credentials" in refused.stderr
        missing = fleet_cli(tmp_path / "h3", "image", "pull", f"{reg.repo()}:nope", "--ca",
                            ca_file)  # fmt: skip
        assert missing.returncode != 0 and "not in" in missing.stderr
        untrusted = fleet_cli(tmp_path / "h4", "image", "pull", f"{reg.repo()}:minimal")
        assert untrusted.returncode != 0 and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr


def test_hosts_fetch_from_the_registry_and_refuse_a_corrupt_copy(
    tmp_path: Path, images: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = images.record("minimal")
    assert record is not None
    ca = CertificateAuthority.init(tmp_path / "ca")
    monkeypatch.setenv("FLEET_REGISTRY_AUTH", f"{USER}:{PASSWORD}")
    ca_file = str(tmp_path / "ca" / "ca.crt")

    async def good(reg_repo: str) -> tuple[list[types_pb2.Rollout], list[str]]:
        config = ServerConfig(lease_ttl_s=5, heartbeat_interval_s=0.5, token_secret=SECRET,
                              registry=reg_repo)  # fmt: skip
        async with harness(tmp_path / "good", images, config, secure=True) as h:
            assert h.ca is not None
            store = ImageStore(tmp_path / "good-host", images.recipes)
            # The registry's certificate is from `ca`, not the fleet's.
            agent = await h.start_agent("cloud-1", HostClass.CPU, images=store,
                                        registry_ca=ca.pem)  # fmt: skip
            ids = [(await h.fleet.SubmitRollout(request())).rollout.id for _ in range(3)]
            return [await h.wait_final(i) for i in ids], agent.images.sources

    async def corrupt(reg_repo: str) -> types_pb2.Rollout:
        config = ServerConfig(lease_ttl_s=5, heartbeat_interval_s=0.5, token_secret=SECRET,
                              registry=reg_repo)  # fmt: skip
        async with harness(tmp_path / "bad", images, config, secure=True) as h:
            store = ImageStore(tmp_path / "bad-host", images.recipes)
            await h.start_agent("cloud-2", HostClass.CPU, images=store, registry_ca=ca.pem)
            req = request()
            req.retry.max_attempts = 3
            rid = (await h.fleet.SubmitRollout(req)).rollout.id
            for _ in range(600):
                r = await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=rid))
                if r.attempt_history and r.attempt_history[0].outcome:
                    break
                await asyncio.sleep(0.05)
            # A host that holds a good copy (the server's own store) joins.
            await h.start_agent("local-1", HostClass.CPU)
            return await h.wait_final(rid)

    with registry(tmp_path / "registry", ca) as reg:
        pushed = fleet_cli(images.root.parent, "image", "push", "minimal", "--registry",
                           reg.repo(), "--ca", ca_file)  # fmt: skip
        assert pushed.returncode == 0, pushed.stderr
        final, sources = asyncio.run(good(reg.repo()))
        assert all(r.state == types_pb2.ROLLOUT_STATE_SUCCEEDED for r in final), final[0].error
        assert sources == [reg.repo()]
        blob = reg.blob_file(record.digest)
        with blob.open("r+b") as handle:
            handle.seek(blob.stat().st_size // 2)
            byte = handle.read(1)
            handle.seek(-1, os.SEEK_CUR)
            handle.write(bytes([byte[0] ^ 0xFF]))
        r = asyncio.run(corrupt(reg.repo()))
    assert r.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, r.error
    assert r.host_id == "local-1"
    assert r.attempt_history[0].host_id == "cloud-2"
    assert "does not verify" in r.attempt_history[0].error
    assert not ImageStore(tmp_path / "bad-host", images.recipes).blob_path(record.digest).exists()


def test_a_smolfile_may_name_a_registry_image(
    tmp_path: Path, images: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`image = "host:port/repo:tag"` is resolved at submit and pinned by digest (the manifest's
    and the image's); a host without it pulls exactly that."""
    record = images.record("minimal")
    assert record is not None
    ca = CertificateAuthority.init(tmp_path / "ca")
    monkeypatch.setenv("FLEET_REGISTRY_AUTH", f"{USER}:{PASSWORD}")

    async def body(ref: str) -> tuple[types_pb2.Rollout, list[str]]:
        config = ServerConfig(lease_ttl_s=5, heartbeat_interval_s=0.5, token_secret=SECRET,
                              registry_ca=ca.pem)  # fmt: skip
        async with harness(tmp_path / "fleet", images, config, secure=True) as h:
            store = ImageStore(tmp_path / "host-images", images.recipes)
            agent = await h.start_agent("cloud-1", HostClass.CPU, images=store,
                                        registry_ca=ca.pem)  # fmt: skip
            req = request(f'image = "{ref}"\n', ["cat", "/etc/debian_version"])
            rid = (await h.fleet.SubmitRollout(req)).rollout.id
            return await h.wait_final(rid), agent.images.sources

    with registry(tmp_path / "registry", ca) as reg:
        # A tenant may name only a registry the operator allowed, and the fleet's credentials
        # go only to the registry they were given for.
        monkeypatch.setenv("FLEET_REGISTRY_ALLOW", reg.address)
        monkeypatch.setenv("FLEET_REGISTRY_AUTH", f"{reg.address}={USER}:{PASSWORD}")
        pushed = fleet_cli(images.root.parent, "image", "push", "minimal", "--registry",
                           reg.repo("team/env"), "--tag", "v1", "--ca",
                           str(tmp_path / "ca" / "ca.crt"))  # fmt: skip
        assert pushed.returncode == 0, pushed.stderr
        r, sources = asyncio.run(body(f"{reg.repo('team/env')}:v1"))
    assert r.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, r.error
    assert r.manifest.image_digest == record.digest
    assert r.manifest.image_ref.startswith(f"https://{reg.repo('team/env')}@sha256:")
    assert sources == [r.manifest.image_ref]


def test_a_registry_download_resumes_and_verifies(tmp_path: Path, images: ImageStore) -> None:
    """A partial download is continued with a range request; a wrong prefix is caught by the
    digest and discarded."""
    from fleet.image import oci

    record = images.record("minimal")
    assert record is not None
    blob = images.blob_path(record.digest).read_bytes()
    ca = CertificateAuthority.init(tmp_path / "ca")
    with registry(tmp_path / "registry", ca) as reg:
        ref = oci.Reference.parse(reg.repo())
        credentials = oci.Credentials(USER, PASSWORD)
        with oci.Registry(ref, credentials, ca.pem) as client:
            oci.push(client, images.blob_path(record.digest), record.digest, "minimal")
            good = tmp_path / "good.tar"
            (tmp_path / "good.tar.partial").write_bytes(blob[: len(blob) // 2])
            assert client.download_blob(record.digest, good) == len(blob)
            assert good.read_bytes() == blob
            bad = tmp_path / "bad.tar"
            (tmp_path / "bad.tar.partial").write_bytes(bytes(len(blob) // 2))
            with pytest.raises(Exception, match="does not verify"):
                client.download_blob(record.digest, bad)
            assert not bad.exists() and not (tmp_path / "bad.tar.partial").exists()


def test_replicas_share_inputs_and_outputs_through_a_registry(
    tmp_path: Path, images: ImageStore, postgres: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two servers on one PostgreSQL ledger, their blobs in one registry: an input uploaded to
    one is run through the other, and the output is downloaded from the first."""
    from fleet.agent.agent import Agent
    from fleet.agent.config import AgentConfig
    from fleet.api.pb import fleet_pb2_grpc
    from fleet.cli import client
    from fleet.ledger.store import Ledger
    from fleet.server.app import FleetServer
    from tests.integration.harness import NAMESPACE
    from tests.pgserver import create_database

    monkeypatch.setenv("FLEET_REGISTRY_AUTH", f"{USER}:{PASSWORD}")
    ca = CertificateAuthority.init(tmp_path / "ca")
    url = create_database(postgres)
    data = tmp_path / "input.txt"
    data.write_bytes(b"shared through the registry\n")

    async def body(repo: str) -> bytes:
        servers = []
        for name in ("a", "b"):
            config = ServerConfig(lease_ttl_s=5, heartbeat_interval_s=0.5, token_secret=SECRET,
                                  artifacts_registry=repo, registry_ca=ca.pem,
                                  artifacts_dir=str(tmp_path / f"cache-{name}"))  # fmt: skip
            server = FleetServer(Ledger.open(url), images, "127.0.0.1:0", config)
            await server.start()
            servers.append(server)
        a, b = servers
        stop = asyncio.Event()
        agent = Agent(AgentConfig(server=b.address, host_id="cpu-b", host_class=HostClass.CPU,
                                  runtime=NAMESPACE, machines_dir=tmp_path / "machines",
                                  images=images, claim_wait_s=1.0))  # fmt: skip
        task = asyncio.create_task(agent.run(stop))
        try:
            await registered(b, "cpu-b")
            async with grpc_channel(a.address) as ca_, grpc_channel(b.address) as cb:
                sa, sb = fleet_pb2_grpc.FleetServiceStub(ca_), fleet_pb2_grpc.FleetServiceStub(cb)
                entry = await client.upload(sa, data, "/in/input.txt", False)
                req = request(
                    'image = "minimal"\n',
                    ["sh", "-c", "mkdir -p /out && (cat /in/input.txt; echo done) > /out/o.txt"],
                )
                req.inputs.append(entry)
                req.outputs.append("/out/o.txt")
                rid = (await sb.SubmitRollout(req)).rollout.id
                for _ in range(1200):
                    r = await sa.GetRollout(fleet_pb2.GetRolloutRequest(id=rid))
                    if r.state == types_pb2.ROLLOUT_STATE_SUCCEEDED:
                        break
                    assert r.state in (types_pb2.ROLLOUT_STATE_QUEUED,
                                       types_pb2.ROLLOUT_STATE_RUNNING), r.error  # fmt: skip
                    await asyncio.sleep(0.05)
                await client.download(sa, r, tmp_path / "got")
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
            for server in servers:
                await server.stop()
        return (tmp_path / "got" / "o.txt").read_bytes()

    with registry(tmp_path / "registry", ca) as reg:
        got = asyncio.run(body(reg.repo("fleet/artifacts")))
        tags = fleet_tags(reg.repo("fleet/artifacts"), ca.pem)
    assert got == data.read_bytes() + b"done\n"
    assert len([t for t in tags if t.startswith("sha256-")]) == 2  # the input and the output


def grpc_channel(address: str):  # type: ignore[no-untyped-def]
    import grpc

    return grpc.aio.insecure_channel(address)


def fleet_tags(repo: str, ca_pem: bytes) -> list[str]:
    from fleet.image import oci

    with oci.Registry(oci.Reference.parse(repo), oci.Credentials(USER, PASSWORD), ca_pem) as r:
        return r.tags()
