"""What a join token lets a host be, over the real gRPC API with TLS: the class, labels and
runtimes its token allows, at enrollment and at every registration after it; names with a
control character refused; bad tokens answered without the ledger's writer, and at a bounded
rate."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import grpc
import pytest

import fleet
from fleet.agent.capabilities import capabilities
from fleet.agent.link import enroll
from fleet.api import convert
from fleet.api.pb import fleet_pb2, fleet_pb2_grpc, host_pb2, host_pb2_grpc
from fleet.core.credentials import format_join_token
from fleet.core.errors import InvalidArgument, PermissionDenied
from fleet.core.placement import HostCapabilities, HostClass, Isolation, RuntimeKind
from fleet.identity.ca import csr_for, new_key
from fleet.identity.tls import HostFiles, HostIdentityMaterial
from fleet.image.store import ImageStore
from tests.integration.harness import NAMESPACE, Harness, harness, namespace_runtime, request

BAD_TOKEN = "abcdef." + "0" * 32
"""Well formed, so that it is looked up: no such token."""


def cpu_caps(host_id: str, **update: object) -> HostCapabilities:
    return capabilities(host_id, HostClass.CPU, NAMESPACE, 2).model_copy(update=update)


async def enrolled(h: Harness, token: str, caps: HostCapabilities) -> HostIdentityMaterial:
    assert h.ca is not None
    files = HostFiles(h.tmp / f"id-{caps.host_id.strip()}")
    return await enroll(h.server.address, token, caps.host_id, caps, files, ca_pem=h.ca.pem)


async def refusal(call) -> grpc.aio.AioRpcError:  # type: ignore[no-untyped-def]
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the call was not refused")


def register(caps: HostCapabilities) -> host_pb2.RegisterHostRequest:
    req = host_pb2.RegisterHostRequest(
        host_class=convert.HOST_CLASS_TO_PB[caps.host_class],
        capabilities=convert.capabilities_to_pb(caps),
        agent_version=fleet.__version__,
    )
    req.capabilities.labels.update(caps.labels)
    return req


async def test_a_join_token_bounds_what_its_host_enrolls_and_registers_as(
    tmp_path: Path, images: ImageStore
) -> None:
    """A token made without a runtime allows the namespace runtime only: a host that claims a
    microVM (VM isolation), a label the token lacks or CUDA devices on the cpu class is
    refused PERMISSION_DENIED naming the bound, and spends no use. Enrolled, the host may not
    register as more either (labels, class). A token that allows smol enrolls a smol host."""

    async with harness(tmp_path, images, secure=True) as h:
        ids = h.server.core.ledger.identities
        token, presented = ids.create_join_token(HostClass.CPU, {"site": "cloud"}, 60, 1,
                                                 time.time())  # fmt: skip
        text = format_join_token(presented)
        smol = cpu_caps("cloud-1", runtime=RuntimeKind.SMOL, isolation=Isolation.VM)
        with pytest.raises(PermissionDenied, match=r"runtime smol \(allowed: namespace\)") as e:
            await enrolled(h, text, smol)
        assert f"join token {token.id}" in str(e.value)
        with pytest.raises(PermissionDenied, match=r"labels gpu=a100 \(allowed: site=cloud\)"):
            await enrolled(h, text, cpu_caps("cloud-1", labels={"gpu": "a100"}))
        with pytest.raises(PermissionDenied, match="8 CUDA devices"):
            await enrolled(h, text, cpu_caps("cloud-1", cuda_devices=8))
        assert [t.uses_left for t in ids.join_tokens()] == [1]  # nothing was spent
        assert ids.hosts() == []

        # Within the bound: enrolled, with the token's labels and runtimes kept.
        identity = await enrolled(h, text, cpu_caps("cloud-1", labels={"site": "cloud"}))
        host = ids.host("cloud-1")
        assert host is not None and host.runtimes == {RuntimeKind.NAMESPACE}
        assert host.labels == {"site": "cloud"}

        channel = grpc.aio.secure_channel(identity.host_address, identity.channel_credentials())
        async with channel:
            stub = host_pb2_grpc.HostServiceStub(channel)
            ok = await stub.RegisterHost(register(cpu_caps("cloud-1")))
            assert ok.host_id == "cloud-1"
            for lie, word in [
                (cpu_caps("cloud-1", labels={"site": "onprem"}), "labels site=onprem"),
                (cpu_caps("cloud-1", labels={"tier": "gold"}), "labels tier=gold"),
                (cpu_caps("cloud-1", host_class=HostClass.GPU), "class gpu (allowed: cpu)"),
                (cpu_caps("cloud-1", runtime=RuntimeKind.SMOL, isolation=Isolation.VM),
                 "runtime smol (allowed: namespace)"),
            ]:  # fmt: skip
                e2 = await refusal(stub.RegisterHost(register(lie)))
                assert e2.code() == grpc.StatusCode.PERMISSION_DENIED, e2.details()
                assert word in (e2.details() or ""), e2.details()
        [view] = h.server.core.ledger.hosts()
        assert view.labels == {"site": "cloud"} and view.runtime == RuntimeKind.NAMESPACE

        # An operator who allows microVMs: the smol host enrolls.
        _, vm = ids.create_join_token(HostClass.CPU, {}, 60, 1, time.time(),
                                      runtimes=frozenset({RuntimeKind.SMOL}))  # fmt: skip
        await enrolled(h, format_join_token(vm), cpu_caps("cloud-2", runtime=RuntimeKind.SMOL,
                                                          isolation=Isolation.VM))  # fmt: skip
        assert ids.host("cloud-2").runtimes == {RuntimeKind.SMOL}  # type: ignore[union-attr]


async def test_names_with_a_trailing_newline_are_refused(
    tmp_path: Path, images: ImageStore
) -> None:
    """`cloud-1\\n` passes a `^…$` pattern: refused as a host id (enrollment, a certificate)
    and as a tenant (a key, a submission naming it)."""

    async with harness(tmp_path, images, secure=True) as h:
        assert h.ca is not None
        ids = h.server.core.ledger.identities
        _, presented = ids.create_join_token(HostClass.CPU, {}, 60, 1, time.time())
        with pytest.raises(InvalidArgument, match="control character"):
            await enrolled(h, format_join_token(presented), cpu_caps("cloud-1\n"))
        assert ids.hosts() == [] and ids.join_tokens()[0].uses_left == 1
        with pytest.raises(InvalidArgument, match="control character"):
            h.ca.sign_host_csr(csr_for(new_key(), "cloud-1"), "cloud-1\n")
        with pytest.raises(InvalidArgument, match="control character"):
            ids.create_key("team-a\n", frozenset(ids.keys()[0].scopes), None, time.time())
        e = await refusal(h.fleet.SubmitRollout(request(tenant="team-a\n")))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "tenant" in (e.details() or "")


async def test_bad_join_tokens_wait_for_no_writer_and_are_rate_limited(
    tmp_path: Path, images: ImageStore
) -> None:
    """A bad token is refused while the ledger's one writer is held by something else (its
    check is a read); a burst of them from one peer is answered RESOURCE_EXHAUSTED past the
    limiter's bound, without being checked, while tenants' submissions go on succeeding."""

    async with harness(tmp_path, images, secure=True) as h:
        identity = h.identity("cpu-a")
        async with grpc.aio.secure_channel(
            identity.host_address, identity.channel_credentials()
        ) as host_channel:
            await host_pb2_grpc.HostServiceStub(host_channel).RegisterHost(
                register(cpu_caps("cpu-a"))
            )
        bad = host_pb2.EnrollHostRequest(join_token=BAD_TOKEN, host_id="mallory",
                                         csr_pem=csr_for(new_key(), "mallory"))  # fmt: skip
        async with h.connect("") as channel:
            stub = host_pb2_grpc.HostServiceStub(channel)
            # The writer thread held: a bad token is still answered (bounded by the timeout).
            held = threading.Event()
            writer = asyncio.ensure_future(h.server.core.db(held.wait, 60))
            try:
                e = await refusal(stub.EnrollHost(bad, timeout=20))
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e.details()
            finally:
                held.set()
                await writer

            # The limiter's clock stands still: exactly its bound is checked, then refused.
            from fleet.server.auth import RefusalLimiter

            h.server.host_servicer.enroll_refusals = RefusalLimiter(
                per_peer=5, per_peer_per_s=1.0, overall=1000, clock=lambda: 0.0
            )

            async def burst() -> list[grpc.StatusCode]:
                codes = []
                for _ in range(60):
                    codes.append((await refusal(stub.EnrollHost(bad, timeout=20))).code())
                return codes

            async def submissions() -> list[str]:
                done = []
                for _ in range(5):
                    reply = await h.fleet.SubmitRollout(request(), timeout=20)
                    done.append(reply.rollout.id)
                return done

            codes, submitted = await asyncio.gather(burst(), submissions())
            limited = await refusal(stub.EnrollHost(bad, timeout=20))
        stored = [(await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=r))).id
                  for r in submitted]  # fmt: skip

    assert codes[:5] == [grpc.StatusCode.UNAUTHENTICATED] * 5
    assert codes[5:] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 55
    assert "too many refused EnrollHost calls from ipv" in (limited.details() or "")
    assert len(set(submitted)) == 5 and stored == submitted


async def test_claim_wait_must_be_a_finite_non_negative_number(
    tmp_path: Path, images: ImageStore
) -> None:
    """NaN would hold the call for good (no comparison with it is ever true); infinity and a
    negative wait are as meaningless: INVALID_ARGUMENT, naming the field."""

    async with harness(tmp_path, images) as h:
        await h.register_host("cpu-a")
        codes = []
        for wait in (float("nan"), float("inf"), -1.0):
            claim = host_pb2.ClaimWorkRequest(host_id="cpu-a", max_items=1, wait_s=wait)
            e = await refusal(h.hosts.ClaimWork(claim, timeout=45))
            codes.append((e.code(), "wait_s" in (e.details() or "")))
        # A huge wait is the server's longest; work already there answers at once.
        await h.fleet.SubmitRollout(request())
        claim = host_pb2.ClaimWorkRequest(host_id="cpu-a", max_items=1, wait_s=1e300)
        reply = await h.hosts.ClaimWork(claim, timeout=45)

    assert codes == [(grpc.StatusCode.INVALID_ARGUMENT, True)] * 3
    assert len(reply.items) == 1 and reply.items[0].fencing_token > 0


@pytest.mark.sandbox
async def test_a_tenant_key_may_fork_its_session(tmp_path: Path, images: ImageStore) -> None:
    """ForkSession under TLS and keys: the session's tenant (rollouts:write) forks it, and the
    fork sees the source's files; a read-only key is refused naming the scope it lacks."""

    async with harness(tmp_path, images, secure=True, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU, slots=4)
        async with (
            h.connect(h.key("team-a")) as ch,
            h.connect(h.key("team-a", "rollouts:read")) as ro,
        ):
            stub = fleet_pb2_grpc.SessionServiceStub(ch)
            reader = fleet_pb2_grpc.SessionServiceStub(ro)
            s = await stub.OpenSession(fleet_pb2.OpenSessionRequest(
                smolfile='image = "minimal"\n', smolfile_name="s.smolfile", ready_timeout_s=60,
            ))  # fmt: skip
            write = fleet_pb2.ExecRequest(session_id=s.id, shell="echo base > /srv/state")
            async for _ in stub.Exec(write):
                pass
            fork = fleet_pb2.ForkSessionRequest(session_id=s.id, count=1, ready_timeout_s=60)
            denied = await refusal(reader.ForkSession(fork))
            [copy] = (await stub.ForkSession(fork)).sessions
            out = b""
            read = fleet_pb2.ExecRequest(session_id=copy.id, shell="cat /srv/state")
            async for chunk in stub.Exec(read):
                if chunk.WhichOneof("kind") == "stdout":
                    out += chunk.stdout
            for x in (copy.id, s.id):
                await stub.CloseSession(fleet_pb2.CloseSessionRequest(session_id=x))

    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "rollouts:write" in (denied.details() or "")
    assert copy.id != s.id and out == b"base\n"
