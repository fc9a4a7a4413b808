"""Identity over the real gRPC API with TLS: API keys and tenants, host certificates, join
tokens, revocation and renewal. Each test is one a probe of the API without identity passed."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from pathlib import Path

import grpc
import pytest

import fleet
from fleet.agent.link import enroll
from fleet.api import convert
from fleet.api.pb import fleet_pb2, fleet_pb2_grpc, host_pb2, host_pb2_grpc, types_pb2
from fleet.core.credentials import format_join_token
from fleet.core.placement import HostClass, Isolation
from fleet.identity.ca import CertificateAuthority, csr_for, key_pem, new_key
from fleet.identity.tls import HostFiles, HostIdentityMaterial
from fleet.image.store import ImageStore
from tests.integration.harness import (
    FINAL,
    Harness,
    harness,
    namespace_runtime,
    registered,
    request,
)

SECRET_STEP = ["sh", "-c", "echo secret-output; sleep 1"]


async def code_of(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    raise AssertionError("the call was not refused")


async def refusal(call) -> grpc.aio.AioRpcError:  # type: ignore[no-untyped-def]
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the call was not refused")


def host_stub(h: Harness, identity: HostIdentityMaterial) -> tuple[grpc.aio.Channel, object]:
    channel = grpc.aio.secure_channel(identity.host_address, identity.channel_credentials())
    return channel, host_pb2_grpc.HostServiceStub(channel)


def caps_pb(isolation: int = types_pb2.ISOLATION_NAMESPACE, cuda: int = 0,
            gateway: bool = False) -> host_pb2.Capabilities:  # fmt: skip
    return host_pb2.Capabilities(
        runtime=types_pb2.RUNTIME_KIND_NAMESPACE, isolation=isolation, cpus=2,
        cuda_devices=cuda, slots=2, gateway=gateway,
    )  # fmt: skip


async def test_api_keys_are_required_and_checked(tmp_path: Path, images: ImageStore) -> None:
    """No key, a malformed, unknown, revoked or expired key: UNAUTHENTICATED, saying which and
    never echoing the secret; health needs nothing."""

    async with harness(tmp_path, images, secure=True) as h:
        get = fleet_pb2.GetRolloutRequest(id="r-1")
        async with h.connect("") as ch:
            e = await refusal(fleet_pb2_grpc.FleetServiceStub(ch).GetRollout(get))
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "no API key" in e.details()
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        async with h.connect("flt_nonsense") as ch:
            e = await refusal(fleet_pb2_grpc.FleetServiceStub(ch).GetRollout(get))
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "malformed" in e.details()
        key = h.key("alice")
        key_id = key.split("_")[1]
        wrong = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
        async with h.connect(wrong) as ch:
            e = await refusal(fleet_pb2_grpc.FleetServiceStub(ch).GetRollout(get))
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "wrong secret" in e.details() and wrong.split("_", 2)[2] not in e.details()
        unknown = "flt_000000000000_" + "A" * 43
        async with h.connect(unknown) as ch:
            e = await refusal(fleet_pb2_grpc.FleetServiceStub(ch).GetRollout(get))
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "unknown" in e.details()
        ids = h.server.core.ledger.identities
        async with h.connect(key) as ch:
            stub = fleet_pb2_grpc.FleetServiceStub(ch)
            assert await code_of(stub.GetRollout(get)) == grpc.StatusCode.NOT_FOUND
            ids.revoke_key(key_id, time.time())
            await asyncio.sleep(0.3)  # the server's cache (0.2 s here)
            e = await refusal(stub.GetRollout(get))
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in e.details()
        _, presented = ids.create_key(
            "alice", frozenset(ids.keys()[0].scopes), time.time() + 0.5, time.time()
        )
        from fleet.core.credentials import format_api_key

        await asyncio.sleep(0.6)
        async with h.connect(format_api_key(presented)) as ch:
            e = await refusal(fleet_pb2_grpc.FleetServiceStub(ch).GetRollout(get))
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "expired" in e.details()


@pytest.mark.sandbox
async def test_tenants_see_only_their_own_rollouts(tmp_path: Path, images: ImageStore) -> None:
    """Tenant B cannot get, list, watch, cancel or read the egress events of tenant A's
    rollout (NOT_FOUND, as for an unknown id), nor submit as A; a read-only key cannot submit."""

    async with harness(tmp_path, images, secure=True, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        a, b = h.key("tenant-a"), h.key("tenant-b")
        reader = h.key("tenant-a", "rollouts:read")
        async with h.connect(a) as ca, h.connect(b) as cb, h.connect(reader) as cr:
            sa, sb = fleet_pb2_grpc.FleetServiceStub(ca), fleet_pb2_grpc.FleetServiceStub(cb)
            sr = fleet_pb2_grpc.FleetServiceStub(cr)
            submit = request('image = "minimal"\nenv = ["API_KEY=a-secret"]\n', SECRET_STEP)
            reply = await sa.SubmitRollout(submit)
            rid = reply.rollout.id
            assert reply.rollout.tenant == "tenant-a"
            unknown = await refusal(sb.GetRollout(fleet_pb2.GetRolloutRequest(id="nope")))
            other = await refusal(sb.GetRollout(fleet_pb2.GetRolloutRequest(id=rid)))
            assert other.code() == unknown.code() == grpc.StatusCode.NOT_FOUND
            assert other.details() == unknown.details().replace("nope", rid)
            listed = await sb.ListRollouts(fleet_pb2.ListRolloutsRequest(page_size=100))
            assert [r.id for r in listed.rollouts] == []
            watch = sb.WatchRollout(fleet_pb2.WatchRolloutRequest(id=rid))
            assert await code_of(watch.read()) == grpc.StatusCode.NOT_FOUND
            cancel = sb.CancelRollout(fleet_pb2.CancelRolloutRequest(id=rid, reason="x"))
            assert await code_of(cancel) == grpc.StatusCode.NOT_FOUND
            egress = sb.ListEgressEvents(fleet_pb2.ListEgressEventsRequest(rollout_id=rid))
            assert await code_of(egress) == grpc.StatusCode.NOT_FOUND
            as_a = request('image = "minimal"\n', ["true"], tenant="tenant-a")
            e = await refusal(sb.SubmitRollout(as_a))
            assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "tenant-a" in e.details()
            e = await refusal(sr.SubmitRollout(request('image = "minimal"\n', ["true"])))
            assert e.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "rollouts:write" in e.details()
            assert (await sr.GetRollout(fleet_pb2.GetRolloutRequest(id=rid))).id == rid
            final = await h.wait_final(rid)
            assert final.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, final.error
            assert final.results[0].stdout == b"secret-output\n"
            mine = await sa.ListRollouts(fleet_pb2.ListRolloutsRequest(page_size=100))
            assert [r.id for r in mine.rollouts] == [rid]
            # B still cannot cancel it now that it ran; A can see it all.
            cancel = sb.CancelRollout(fleet_pb2.CancelRolloutRequest(id=rid))
            assert await code_of(cancel) == grpc.StatusCode.NOT_FOUND


async def test_host_calls_need_the_hosts_certificate(tmp_path: Path, images: ImageStore) -> None:
    """HostService without a client certificate is refused; with host X's certificate a
    request naming host Y is PERMISSION_DENIED; ReclaimWork cannot touch another's leases."""

    async with harness(tmp_path, images, secure=True) as h:
        claim = host_pb2.ClaimWorkRequest(host_id="cpu-a", max_items=1, wait_s=0)
        # On the API endpoint, with an admin key but no certificate.
        e = await refusal(h.hosts.ClaimWork(claim))
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED
        assert f"port {h.server.core.host_port}" in e.details()
        # On the host endpoint without a certificate: the handshake itself fails.
        assert h.ca is not None
        creds = grpc.ssl_channel_credentials(root_certificates=h.ca.pem)
        async with grpc.aio.secure_channel(h.server.host_address, creds) as ch:
            call = host_pb2_grpc.HostServiceStub(ch).ClaimWork(claim, timeout=5)
            assert await code_of(call) == grpc.StatusCode.UNAVAILABLE
        # A certificate from another CA: refused at the handshake too.
        other = CertificateAuthority.init(tmp_path / "other-ca")
        key = new_key()
        foreign = other.sign_host_csr(csr_for(key, "cpu-a"), "cpu-a")
        creds = grpc.ssl_channel_credentials(h.ca.pem, key_pem(key), foreign.pem)
        async with grpc.aio.secure_channel(h.server.host_address, creds) as ch:
            call = host_pb2_grpc.HostServiceStub(ch).ClaimWork(claim, timeout=5)
            assert await code_of(call) == grpc.StatusCode.UNAVAILABLE
        await h.start_agent("cpu-a", HostClass.CPU)
        rid = (
            await h.fleet.SubmitRollout(request('image = "minimal"\n', ["sleep", "3"]))
        ).rollout.id
        for _ in range(200):
            r = await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=rid))
            if r.state == types_pb2.ROLLOUT_STATE_RUNNING:
                break
            await asyncio.sleep(0.05)
        [attempt] = r.attempt_history
        work_id = h.server.core.ledger.attempts(rid)[0].work_id
        token = h.server.core.ledger.attempts(rid)[0].fencing_token
        mallory = h.identity("mallory")
        channel, stub = host_stub(h, mallory)
        async with channel:
            await stub.RegisterHost(
                host_pb2.RegisterHostRequest(  # type: ignore[attr-defined]
                    host_class=types_pb2.HOST_CLASS_CPU,
                    capabilities=caps_pb(),
                    agent_version=fleet.__version__,
                )
            )
            reclaim = host_pb2.ReclaimWorkRequest(host_id="cpu-a")
            e = await refusal(stub.ReclaimWork(reclaim))  # type: ignore[attr-defined]
            assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "mallory" in e.details()
            forged = host_pb2.CompleteWorkRequest(
                host_id="cpu-a",
                work_id=work_id,
                fencing_token=token,
                outcome=types_pb2.OUTCOME_SUCCEEDED,
            )
            e = await refusal(stub.CompleteWork(forged))  # type: ignore[attr-defined]
            assert e.code() == grpc.StatusCode.PERMISSION_DENIED
            forged.host_id = ""  # as itself, with the right token: not its lease
            e = await refusal(stub.CompleteWork(forged))  # type: ignore[attr-defined]
            assert e.code() == grpc.StatusCode.ABORTED and "not leased" in e.details()
            beat = host_pb2.HeartbeatRequest(
                leases=[host_pb2.LeaseRef(work_id=work_id, fencing_token=token)]
            )
            e = await refusal(stub.Heartbeat(beat))  # type: ignore[attr-defined]
            assert e.code() == grpc.StatusCode.ABORTED  # not its lease: nothing renewed
            mine = await stub.ReclaimWork(host_pb2.ReclaimWorkRequest())  # type: ignore[attr-defined]
            assert list(mine.items) == [] and list(mine.released_work_ids) == []
        final = await h.wait_final(rid)
        assert final.state == types_pb2.ROLLOUT_STATE_SUCCEEDED and final.host_id == "cpu-a"
        assert attempt.host_id == "cpu-a" and final.attempts == 1


async def test_a_host_may_not_claim_more_than_it_enrolled_with(
    tmp_path: Path, images: ImageStore
) -> None:
    """A namespace cpu host re-registering as a VM, with CUDA devices, a gateway or as the gpu
    class is refused (PERMISSION_DENIED, naming each)."""

    async with harness(tmp_path, images, secure=True) as h:
        identity = h.identity("cpu-a")
        channel, stub = host_stub(h, identity)
        async with channel:
            ok = host_pb2.RegisterHostRequest(
                host_class=types_pb2.HOST_CLASS_CPU,
                capabilities=caps_pb(),
                agent_version=fleet.__version__,
            )
            assert (await stub.RegisterHost(ok)).host_id == "cpu-a"  # type: ignore[attr-defined]
            for bad, word in [
                (caps_pb(isolation=types_pb2.ISOLATION_VM), "isolation"),
                (caps_pb(cuda=8), "CUDA"),
                (caps_pb(gateway=True), "gateway"),
            ]:
                lie = host_pb2.RegisterHostRequest(host_class=types_pb2.HOST_CLASS_CPU,
                                                   capabilities=bad,
                                                   agent_version=fleet.__version__)  # fmt: skip
                e = await refusal(stub.RegisterHost(lie))  # type: ignore[attr-defined]
                assert e.code() == grpc.StatusCode.PERMISSION_DENIED and word in e.details()
            gpu = host_pb2.RegisterHostRequest(
                host_class=types_pb2.HOST_CLASS_GPU,
                capabilities=caps_pb(),
                agent_version=fleet.__version__,
            )
            e = await refusal(stub.RegisterHost(gpu))  # type: ignore[attr-defined]
            assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "class" in e.details()
        hosts = h.server.core.ledger.hosts()
        assert [(c.host_id, c.isolation) for c in hosts] == [("cpu-a", Isolation.NAMESPACE)]


async def test_fencing_tokens_cannot_be_guessed(tmp_path: Path, images: ImageStore) -> None:
    """The next attempt's fencing token is not the last one plus one."""

    async with harness(tmp_path, images, secure=True) as h:
        identity = h.identity("cpu-a")
        channel, stub = host_stub(h, identity)
        tokens = []
        async with channel:
            await stub.RegisterHost(
                host_pb2.RegisterHostRequest(  # type: ignore[attr-defined]
                    host_class=types_pb2.HOST_CLASS_CPU,
                    capabilities=caps_pb(),
                    agent_version=fleet.__version__,
                )
            )
            await h.fleet.SubmitRollout(request('image = "minimal"\n', ["true"]))
            for _ in range(3):
                reply = await stub.ClaimWork(  # type: ignore[attr-defined]
                    host_pb2.ClaimWorkRequest(max_items=1, wait_s=5)
                )
                [item] = reply.items
                tokens.append(item.fencing_token)
                await stub.CompleteWork(
                    host_pb2.CompleteWorkRequest(  # type: ignore[attr-defined]
                        work_id=item.work_id,
                        fencing_token=item.fencing_token,
                        outcome=types_pb2.OUTCOME_TRANSIENT_ERROR,
                        error="test",
                    )
                )
                h.server.core.ledger.engine.dispose()
                with h.server.core.ledger.engine.begin() as conn:
                    from sqlalchemy import text

                    conn.execute(text("UPDATE work_items SET not_before = 0"))
        tokens = tokens

    steps = [b - a for a, b in itertools.pairwise(tokens)]
    assert all(s > 0 for s in steps) and any(s != 1 for s in steps), tokens


async def test_enrollment_with_join_tokens(tmp_path: Path, images: ImageStore) -> None:
    """A join token enrolls one host; reused, expired, revoked or tampered it is refused; a
    wrong CA pin sends nothing; a restarted agent needs no token."""

    async with harness(tmp_path, images, secure=True) as h:
        assert h.ca is not None
        ids = h.server.core.ledger.identities
        api = h.server.address
        from fleet.agent.capabilities import capabilities
        from tests.integration.harness import NAMESPACE

        caps = capabilities("cloud-1", HostClass.CPU, NAMESPACE, 2)
        _, token = ids.create_join_token(HostClass.CPU, {"site": "cloud"}, 60, 1, time.time())
        text = format_join_token(token)
        with pytest.raises(Exception, match="presents no CA with fingerprint"):
            await enroll(
                api,
                text,
                "cloud-1",
                caps,
                HostFiles(tmp_path / "h0"),
                ca_fingerprint="sha256:" + "0" * 64,
            )
        assert ids.join_tokens()[0].uses_left == 1  # nothing was sent
        files = HostFiles(tmp_path / "h1")
        identity = await enroll(api, text, "cloud-1", caps, files, ca_fingerprint=h.ca.fingerprint)
        assert identity.host_id == "cloud-1" and files.exists()
        assert (files.key.stat().st_mode & 0o777) == 0o600
        assert identity.host_address == h.server.host_address
        with pytest.raises(Exception, match="used up"):
            await enroll(
                api,
                text,
                "cloud-2",
                caps.model_copy(update={"host_id": "cloud-2"}),
                HostFiles(tmp_path / "h2"),
                ca_pem=h.ca.pem,
            )
        tampered = text[:-1] + ("0" if text[-1] != "0" else "1")
        with pytest.raises(Exception, match="unknown or wrong secret"):
            await enroll(
                api, tampered, "cloud-2", caps, HostFiles(tmp_path / "h3"), ca_pem=h.ca.pem
            )
        _, short = ids.create_join_token(HostClass.CPU, {}, 0.2, 1, time.time())
        await asyncio.sleep(0.3)
        with pytest.raises(Exception, match="expired"):
            await enroll(
                api,
                format_join_token(short),
                "cloud-3",
                caps,
                HostFiles(tmp_path / "h4"),
                ca_pem=h.ca.pem,
            )
        _, revoked = ids.create_join_token(HostClass.CPU, {}, 60, 5, time.time())
        ids.revoke_join_token(revoked.id, time.time())
        with pytest.raises(Exception, match="revoked"):
            await enroll(
                api,
                format_join_token(revoked),
                "cloud-4",
                caps,
                HostFiles(tmp_path / "h5"),
                ca_pem=h.ca.pem,
            )
        _, again = ids.create_join_token(HostClass.CPU, {}, 60, 1, time.time())
        with pytest.raises(Exception, match="enrolled already"):
            await enroll(
                api,
                format_join_token(again),
                "cloud-1",
                caps,
                HostFiles(tmp_path / "h6"),
                ca_pem=h.ca.pem,
            )
        assert ids.join_tokens()[-1].uses_left == 1  # a refused enrollment spends no use
        # The enrolled host runs work with the identity on its disk (as after a restart).
        from fleet.agent.agent import Agent
        from fleet.agent.config import AgentConfig

        agent = Agent(
            AgentConfig(
                server=api,
                host_id="cloud-1",
                host_class=HostClass.CPU,
                runtime=NAMESPACE,
                machines_dir=tmp_path / "machines",
                images=images,
                claim_wait_s=1.0,
                identity=files.load(),
                identity_files=files,
            )
        )
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        try:
            await registered(h.server, "cloud-1")
            rid = (await h.fleet.SubmitRollout(request())).rollout.id
            r = await h.wait_final(rid)
            assert r.state == types_pb2.ROLLOUT_STATE_SUCCEEDED and r.host_id == "cloud-1"
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)


async def test_a_plain_server_refuses_enrollment(tmp_path: Path, images: ImageStore) -> None:
    async with harness(tmp_path, images) as h:
        e = await refusal(h.hosts.EnrollHost(host_pb2.EnrollHostRequest(join_token="x")))
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "TLS" in e.details()


@pytest.mark.sandbox
async def test_a_revoked_host_is_refused_and_its_work_runs_elsewhere(
    tmp_path: Path, images: ImageStore
) -> None:
    """Revoking a host that holds a lease: its next call is refused, the agent stops, and the
    rollout finishes on another host with exactly one result."""

    async with harness(tmp_path, images, secure=True, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        rid = (
            await h.fleet.SubmitRollout(
                request('image = "minimal"\n', ["sh", "-c", "sleep 2; echo done"])
            )
        ).rollout.id
        for _ in range(400):
            r = await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=rid))
            if r.state == types_pb2.ROLLOUT_STATE_RUNNING:
                break
            await asyncio.sleep(0.02)
        assert r.host_id == "" or r.state == types_pb2.ROLLOUT_STATE_RUNNING
        released = await h.server.core.db(
            h.server.core.ledger.identities.revoke_host, "cpu-a", time.time()
        )
        assert released == 1
        _, task = h.agents["cpu-a"]
        with pytest.raises(Exception, match="revoked"):
            await asyncio.wait_for(task, 30)
        h.agents.pop("cpu-a")
        await h.start_agent("cpu-b", HostClass.CPU)
        final = await h.wait_final(rid)
        assert final.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, final.error
        assert final.host_id == "cpu-b" and final.results[0].stdout == b"done\n"
        assert [a.host_id for a in final.attempt_history] == ["cpu-a", "cpu-b"]
        assert len(final.results) == 1
        hosts = [c.host_id for c in h.server.core.ledger.hosts()]
        assert "cpu-a" not in hosts


async def test_an_agent_renews_its_certificate_without_dropping_work(
    tmp_path: Path, images: ImageStore
) -> None:
    """With 3-second certificates an agent renews at two thirds of their life, again and
    again, while its rollouts run and finish."""

    async with harness(tmp_path, images, secure=True, host_cert_ttl_s=3.0) as h:
        ids = h.server.core.ledger.identities
        from fleet.agent.capabilities import capabilities
        from tests.integration.harness import NAMESPACE

        assert h.ca is not None
        _, token = ids.create_join_token(HostClass.CPU, {}, 60, 1, time.time())
        files = HostFiles(tmp_path / "host")
        caps = capabilities("cpu-r", HostClass.CPU, NAMESPACE, 2)
        identity = await enroll(
            h.server.address, format_join_token(token), "cpu-r", caps, files, ca_pem=h.ca.pem
        )
        first = identity.certificate.serial_number
        from fleet.agent.agent import Agent
        from fleet.agent.config import AgentConfig

        agent = Agent(
            AgentConfig(
                server=h.server.address,
                host_id="cpu-r",
                host_class=HostClass.CPU,
                runtime=NAMESPACE,
                machines_dir=tmp_path / "machines",
                images=images,
                claim_wait_s=1.0,
                identity=identity,
                identity_files=files,
            )
        )
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        try:
            await registered(h.server, "cpu-r")
            rids = []
            for _ in range(4):
                rids.append(
                    (
                        await h.fleet.SubmitRollout(
                            request('image = "minimal"\n', ["sleep", "1.5"])
                        )
                    ).rollout.id
                )
                await asyncio.sleep(1.0)
            for rid in rids:
                r = await h.wait_final(rid)
                assert r.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, r.error
                assert r.attempts == 1
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
        renewed = files.load()
        assert renewed.certificate.serial_number != first
        assert renewed.valid() and renewed.host_id == "cpu-r"
        # (The ledger may be one renewal ahead: a renewal in flight when the agent stopped.)
        assert ids.host("cpu-r").cert_serial != format(first, "x")  # type: ignore[union-attr]


async def test_the_agent_refuses_work_its_runtime_cannot_honour(
    tmp_path: Path, images: ImageStore
) -> None:
    """A namespace host registered as a VM (a server without identity believes it) gets a
    require-vm rollout: the agent refuses to run it as a host error, never as a success."""

    async with harness(tmp_path, images) as h:
        agent = await h.start_agent("liar", HostClass.CPU)
        await h.stop_agent("liar")
        agent.caps = agent.caps.model_copy(update={"isolation": Isolation.VM})
        stop = asyncio.Event()
        h.agents["liar"] = (stop, asyncio.create_task(agent.run(stop)))
        for _ in range(100):
            if any(c.isolation == Isolation.VM for c in h.server.core.ledger.hosts()):
                break
            await asyncio.sleep(0.05)
        req = request('image = "minimal"\n', ["true"], key=uuid.uuid4().hex)
        req.requirements.isolation = types_pb2.ISOLATION_VM
        req.retry.max_attempts = 1
        rid = (await h.fleet.SubmitRollout(req)).rollout.id
        r = await h.wait_final(rid)

    assert r.state != types_pb2.ROLLOUT_STATE_SUCCEEDED and r.state in FINAL
    assert "requires vm isolation" in r.attempt_history[0].error


async def test_the_embedded_fleet_enrolls_its_own_agents(
    tmp_path: Path, images: ImageStore
) -> None:
    """Local agents get certificates by the CA's holder, with no token; `convert` round-trips
    their capabilities into the identity table unchanged."""

    async with harness(tmp_path, images, secure=True) as h:
        await h.start_agent("gpu-x", HostClass.GPU)
        host = h.server.core.ledger.identities.host("gpu-x")
        assert host is not None and host.host_class == HostClass.GPU
        [caps] = h.server.core.ledger.hosts()
        assert caps.host_id == "gpu-x"
        assert convert.HOST_CLASS_TO_PB[caps.host_class] == types_pb2.HOST_CLASS_GPU
