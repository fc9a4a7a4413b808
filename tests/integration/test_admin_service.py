"""AdminService: with only the server's address, the CA and a key of admin scope, an operator
lists hosts, drains one, makes join tokens and tenant keys and sets pools' caps, each seen in
the ledger; any other key is refused every call; and `fleet host|key|pool --server` does the
same from a machine that holds no ledger."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fleet.api.pb import admin_pb2, admin_pb2_grpc, fleet_pb2, fleet_pb2_grpc, types_pb2
from fleet.client import AsyncFleet
from fleet.core.credentials import Scope
from fleet.core.errors import PermissionDenied
from fleet.core.placement import HostClass, Pool
from fleet.image.store import ImageStore
from tests.integration.harness import Harness, harness, register_cpu_host

REPO = Path(__file__).resolve().parents[2]


async def enrolled_host(h: Harness, host_id: str) -> grpc.aio.Channel:
    """A cpu host enrolled and registered over its own certificate, as an agent would be."""
    identity = h.identity(host_id, HostClass.CPU)
    channel = grpc.aio.secure_channel(identity.host_address, identity.channel_credentials())
    from fleet.api.pb import host_pb2_grpc

    await register_cpu_host(host_pb2_grpc.HostServiceStub(channel), cpus=2)
    return channel


async def test_an_admin_key_lists_drains_and_creates_over_grpc(
    tmp_path: Path, images: ImageStore
) -> None:
    async with harness(tmp_path, images, secure=True) as h:
        host = await enrolled_host(h, "worker-1")
        ledger = h.server.core.ledger
        async with h.connect(h.admin_key) as channel:
            admin = admin_pb2_grpc.AdminServiceStub(channel)

            listed = await admin.ListHosts(admin_pb2.ListHostsRequest())
            assert [x.host_id for x in listed.hosts] == ["worker-1"]
            assert listed.hosts[0].host_class == types_pb2.HOST_CLASS_CPU
            assert listed.hosts[0].cert_expires_at > time.time()

            deadline = time.time() + 600
            await admin.DrainHost(admin_pb2.DrainHostRequest(host_id="worker-1", deadline=deadline))
            states = {v.capabilities.host_id: v.state for v in ledger.host_table(time.time(), 60)}
            assert states["worker-1"] == "draining"
            with pytest.raises(grpc.aio.AioRpcError) as past:
                await admin.DrainHost(admin_pb2.DrainHostRequest(host_id="worker-1", deadline=1))
            assert past.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "deadline" in (past.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await admin.CordonHost(admin_pb2.HostRequest(host_id="no-such-host"))
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

            made = await admin.CreateJoinToken(admin_pb2.CreateJoinTokenRequest(
                host_class=types_pb2.HOST_CLASS_GPU, labels={"zone": "b"}, ttl_s=600, uses=2,
            ))  # fmt: skip
            assert made.secret and made.ca_fingerprint == h.ca.fingerprint  # type: ignore[union-attr]
            token = {t.id: t for t in ledger.identities.join_tokens()}[made.token.id]
            assert (token.host_class, token.labels, token.uses_left) == (
                HostClass.GPU, {"zone": "b"}, 2)  # fmt: skip

            key = await admin.CreateKey(admin_pb2.CreateKeyRequest(
                tenant="team-a", scopes=["rollouts:read"]))  # fmt: skip
            stored = {k.id: k for k in ledger.identities.keys("team-a")}[key.key.id]
            assert stored.scopes == frozenset({Scope.ROLLOUTS_READ})
            async with h.connect(key.secret) as tenant:  # (the new key works at once)
                await fleet_pb2_grpc.FleetServiceStub(tenant).ListRollouts(
                    fleet_pb2.ListRolloutsRequest())  # fmt: skip

            await admin.SetPool(admin_pb2.SetPoolRequest(pool=admin_pb2.Pool(
                name="batch", host_class=types_pb2.HOST_CLASS_CPU, max_running=3)))  # fmt: skip
            pools = {v.pool.name: v.pool for v in ledger.pools()}
            assert pools["batch"].max_running == 3 and pools["batch"].host_class == HostClass.CPU
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await admin.SetPool(admin_pb2.SetPoolRequest(pool=admin_pb2.Pool(
                    name="batch", host_class=types_pb2.HOST_CLASS_CPU,
                    gates=admin_pb2.PoolGates(retry_rate=2))))  # fmt: skip
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "pool.gates.retry_rate" in (bad.value.details() or "")
            assert ledger.pools()[0].pool.gates.retry_rate == 0  # (the refused one changed none)

            listed_pools = await admin.ListPools(admin_pb2.ListPoolsRequest())
            assert [p.pool.max_running for p in listed_pools.pools] == [3]
            await admin.RevokeKey(admin_pb2.RevokeRequest(id=key.key.id))
            assert ledger.identities.keys("team-a")[0].revoked_at is not None
        await host.close()


async def test_the_typed_client_has_the_admin_calls(tmp_path: Path, images: ImageStore) -> None:
    async with harness(tmp_path, images, secure=True) as h:
        host = await enrolled_host(h, "worker-1")
        assert h.ca is not None
        ledger = h.server.core.ledger
        health = await health_pb2_grpc.HealthStub(h.channel).Check(
            health_pb2.HealthCheckRequest(service="fleet.v1.AdminService"))  # fmt: skip
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        async with AsyncFleet(h.server.address, key=h.admin_key, ca=h.ca.pem) as fleet:
            assert [x.host_id for x in await fleet.admin.hosts()] == ["worker-1"]
            await fleet.admin.cordon("worker-1")
            states = {v.capabilities.host_id: v.state for v in ledger.host_table(time.time(), 60)}
            assert states["worker-1"] == "cordoned"
            pool = await fleet.admin.set_pool(Pool(name="gpus", host_class=HostClass.GPU,
                                                   max_running=2))  # fmt: skip
            assert pool.max_running == 2 and ledger.pools()[0].pool == pool
            made = await fleet.admin.create_key("team-c", ["rollouts:read"])
            assert [k.id for k in await fleet.admin.keys("team-c")] == [made.key.id]
            token = await fleet.admin.create_join_token("cpu", labels={"site": "x"})
            assert [t.id for t in ledger.identities.join_tokens()] == [token.token.id]
        async with AsyncFleet(h.server.address, key=h.key("team-c"), ca=h.ca.pem) as fleet:
            with pytest.raises(PermissionDenied):
                await fleet.admin.hosts()
        await host.close()


def every_call() -> list[tuple[str, object]]:
    """Each AdminService method with a request that would change the ledger were it allowed."""
    return [
        ("ListHosts", admin_pb2.ListHostsRequest()),
        ("CordonHost", admin_pb2.HostRequest(host_id="worker-1")),
        ("UncordonHost", admin_pb2.HostRequest(host_id="worker-1")),
        ("DrainHost", admin_pb2.DrainHostRequest(host_id="worker-1", deadline=time.time() + 60)),
        ("RevokeHost", admin_pb2.HostRequest(host_id="worker-1")),
        ("CreateJoinToken", admin_pb2.CreateJoinTokenRequest(
            host_class=types_pb2.HOST_CLASS_CPU, ttl_s=60)),
        ("ListJoinTokens", admin_pb2.ListJoinTokensRequest()),
        ("RevokeJoinToken", admin_pb2.RevokeRequest(id="t1")),
        ("CreateKey", admin_pb2.CreateKeyRequest(tenant="team-b", scopes=["admin"])),
        ("ListKeys", admin_pb2.ListKeysRequest()),
        ("RevokeKey", admin_pb2.RevokeRequest(id="k1")),
        ("SetPool", admin_pb2.SetPoolRequest(pool=admin_pb2.Pool(
            name="p", host_class=types_pb2.HOST_CLASS_CPU, max_running=1))),
        ("ListPools", admin_pb2.ListPoolsRequest()),
        ("DeletePool", admin_pb2.DeletePoolRequest(name="p")),
        ("ListPoolEvents", admin_pb2.ListPoolEventsRequest(window_s=3600)),
        ("Rollback", admin_pb2.RollbackRequest(deadline=time.time() + 60)),
        ("UndoRollback", admin_pb2.UndoRollbackRequest()),
        ("GetRollback", admin_pb2.GetRollbackRequest()),
        ("Report", admin_pb2.ReportRequest(window_s=3600)),
    ]  # fmt: skip


async def test_a_tenant_key_is_refused_every_admin_call(tmp_path: Path, images: ImageStore) -> None:
    async with harness(tmp_path, images, secure=True) as h:
        host = await enrolled_host(h, "worker-1")
        ledger = h.server.core.ledger
        keys_before = len(ledger.identities.keys())
        # Even a key with both rollout scopes: only the admin scope runs AdminService.
        tenant_key = h.key("team-a", "rollouts:read,rollouts:write")
        names = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].methods_by_name
        assert sorted(names) == sorted(name for name, _ in every_call())
        for key, code in ((tenant_key, grpc.StatusCode.PERMISSION_DENIED),
                          ("", grpc.StatusCode.UNAUTHENTICATED)):  # fmt: skip
            async with h.connect(key) as channel:
                admin = admin_pb2_grpc.AdminServiceStub(channel)
                for name, request in every_call():
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await getattr(admin, name)(request)
                    assert refused.value.code() == code, name
                    if key:  # (refused for the scope it lacks, not as a call no one may make)
                        assert "lacks the scope admin" in (refused.value.details() or ""), name
        states = {v.capabilities.host_id: v.state for v in ledger.host_table(time.time(), 60)}
        assert states == {"worker-1": "ready"}
        assert len(ledger.identities.keys()) == keys_before + 1  # (the tenant's own only)
        assert ledger.identities.join_tokens() == [] and ledger.pools() == []
        assert ledger.rollback_state() is None
        await host.close()


async def fleet_cli(home: Path, *argv: str) -> tuple[int, str, str]:
    """`fleet ARGV` as an operator's machine runs it: its own $FLEET_HOME, no $FLEET_* else."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update(FLEET_HOME=str(home), PYTHONPATH=str(REPO))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleet.cli.main", *argv, env=env, cwd=home,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_the_cli_administers_a_remote_server_with_address_ca_and_key(
    tmp_path: Path, images: ImageStore
) -> None:
    async with harness(tmp_path / "server", images, secure=True) as h:
        host = await enrolled_host(h, "worker-1")
        ledger = h.server.core.ledger
        home = tmp_path / "operator"
        home.mkdir()
        assert h.ca is not None
        (home / "fleet-ca.crt").write_bytes(h.ca.pem)
        remote = ["--server", h.server.address, "--key", h.admin_key, "--ca", "fleet-ca.crt"]

        rc, out, err = await fleet_cli(home, "host", "list", *remote)
        assert rc == 0, err
        assert "worker-1" in out and "ready" in out

        rc, out, err = await fleet_cli(home, "host", "drain", "worker-1", "--deadline", "5m",
                                       *remote)  # fmt: skip
        assert rc == 0, err
        states = {v.capabilities.host_id: v.state for v in ledger.host_table(time.time(), 60)}
        assert states["worker-1"] == "draining"

        rc, out, err = await fleet_cli(home, "pool", "set", "batch", "--class", "cpu",
                                       "--max-running", "4", *remote)  # fmt: skip
        assert rc == 0, err
        assert ledger.pools()[0].pool.max_running == 4

        rc, out, err = await fleet_cli(home, "key", "create", "--tenant", "team-a", *remote)
        assert rc == 0, err
        assert [k.tenant for k in ledger.identities.keys("team-a")] == ["team-a"]

        tenant_key = h.key("team-a")
        rc, out, err = await fleet_cli(home, "host", "list", "--server", h.server.address,
                                       "--key", tenant_key, "--ca", "fleet-ca.crt")  # fmt: skip
        assert rc == 2 and "PERMISSION_DENIED" in err
        assert not (home / "ledger.sqlite3").exists()  # (no ledger was opened on its side)
        await host.close()
