"""What a heartbeat costs the server besides its batch, and what may not be cut with it: a host's
identity is looked up once for many beats and claims, yet a revoked host's very next beat and
claim are refused, by the ledger in their own transaction (on SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest

import fleet
from fleet.api import convert
from fleet.api.interceptor import MAX_REQUEST_ID, _clean
from fleet.api.pb import host_pb2, host_pb2_grpc, types_pb2
from fleet.core.errors import FailedPrecondition, Unauthenticated
from fleet.core.placement import HostCapabilities, HostClass, Isolation, RuntimeKind
from fleet.image.store import ImageStore
from fleet.ledger.leases import Beat
from fleet.ledger.store import Ledger
from fleet.server.auth import HOST_BEAT_CACHE_S
from fleet.server.host_service import _timestamp
from tests.integration.harness import harness

T0 = datetime(2030, 1, 1, tzinfo=UTC).timestamp()
CACHE_S = 0.2
"""The harness's secure server trusts what the ledger said of a host this long."""


def caps(host_id: str) -> HostCapabilities:
    return HostCapabilities(
        host_id=host_id, host_class=HostClass.CPU, runtime=RuntimeKind.NAMESPACE,
        isolation=Isolation.NAMESPACE, cpus=2, memory_mib=1024, cuda_devices=0,
    )  # fmt: skip


def last_beat(ledger: Ledger, host_id: str) -> float:
    with ledger._read() as db:
        return float(db.value("SELECT last_heartbeat_at FROM hosts WHERE id = ?", (host_id,)))


def test_a_revoked_hosts_beat_is_refused_in_its_batch(ledger: Ledger) -> None:
    """The batch that holds a revoked host's beat refuses that beat (UNAUTHENTICATED, writing
    nothing of it) and renews the others: the server's cache of who is revoked may be older
    than the revocation."""
    for host_id in ("cpu-a", "cpu-b", "cpu-open"):
        ledger.register_host(caps(host_id), T0)
    for host_id in ("cpu-a", "cpu-b"):
        ledger.identities.add_host(
            host_id, HostClass.CPU, caps(host_id).model_dump_json(), "01", T0 + 3600, T0
        )
    ledger.identities.revoke_host("cpu-b", T0 + 1)
    answers = ledger.heartbeat_batch(
        [Beat(h, [], T0 + 5, 10.0, None) for h in ("cpu-a", "cpu-b", "cpu-open", "nobody")]
    )
    assert answers[0] == ([], [])
    assert isinstance(answers[1], Unauthenticated) and "revoked" in answers[1].message
    assert answers[2] == ([], [])  # (a host with no certificate: a server without TLS)
    assert isinstance(answers[3], FailedPrecondition)
    assert last_beat(ledger, "cpu-a") == last_beat(ledger, "cpu-open") == T0 + 5
    assert last_beat(ledger, "cpu-b") < T0 + 5


async def test_beats_and_claims_reuse_a_host_identity_and_still_see_revocation(
    tmp_path: Path, images: ImageStore
) -> None:
    """Over mutual TLS: beats and claims made past the server's identity cache time are not
    looked up again (each was a ledger read, most of a beat's cost), any other host call is;
    once the host is revoked its very next beat and claim are refused, though the identity
    the server holds for them still says it is not."""
    assert HOST_BEAT_CACHE_S > 10 * CACHE_S
    async with harness(tmp_path, images, secure=True) as h:
        auth = h.server.core.auth
        assert auth is not None and auth.cache_s == CACHE_S
        identity = h.identity("cpu-a")
        looked_up: list[str] = []
        real = auth._host_row

        def counted(host_id: str) -> Any:
            looked_up.append(host_id)
            return real(host_id)

        auth._host_row = counted
        channel = grpc.aio.secure_channel(identity.host_address, identity.channel_credentials())
        stub: Any = host_pb2_grpc.HostServiceStub(channel)
        register = host_pb2.RegisterHostRequest(
            host_class=types_pb2.HOST_CLASS_CPU, agent_version=fleet.__version__,
            capabilities=host_pb2.Capabilities(
                runtime=types_pb2.RUNTIME_KIND_NAMESPACE, isolation=types_pb2.ISOLATION_NAMESPACE,
                cpus=2, slots=2,
            ),
        )  # fmt: skip
        async with channel:
            await stub.RegisterHost(register)
            assert looked_up == ["cpu-a"]
            for _ in range(3):
                await asyncio.sleep(CACHE_S * 1.5)  # (past the cache time)
                reply = await stub.Heartbeat(host_pb2.HeartbeatRequest(), timeout=30)
                assert reply.lease_expires_at.seconds > 0
                await stub.ClaimWork(host_pb2.ClaimWorkRequest(max_items=1), timeout=30)
            assert looked_up == ["cpu-a"]
            await asyncio.sleep(CACHE_S * 1.5)
            await stub.RegisterHost(register)  # (any other call: looked up after cache_s)
            assert looked_up == ["cpu-a", "cpu-a"]

            released = await h.server.core.db(
                h.server.core.ledger.identities.revoke_host, "cpu-a", time.time()
            )
            assert released == 0
            for call in (
                stub.Heartbeat(host_pb2.HeartbeatRequest(), timeout=30),
                stub.ClaimWork(host_pb2.ClaimWorkRequest(max_items=1), timeout=30),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "revoked" in (refused.value.details() or "")
            assert looked_up == ["cpu-a", "cpu-a"]  # (refused by the ledger, not the cache)
            await asyncio.sleep(CACHE_S * 1.5)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.RegisterHost(register)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("seconds", [0.0, 1.5, T0, T0 + 0.123456, 1_733_371_234.999_999_7])
def test_a_beats_lease_expiry_is_the_timestamp_a_datetime_made(seconds: float) -> None:
    assert _timestamp(seconds) == convert.ts(datetime.fromtimestamp(seconds, UTC))


@pytest.mark.parametrize(
    "value",
    ["0f3a9c", "a b", "tab\there", "del\x7f", "é-1", "x" * (MAX_REQUEST_ID + 5), "", "~!#"],
)
def test_a_request_id_is_cleaned_as_before(value: str) -> None:
    assert _clean(value) == "".join(c for c in value if " " < c <= "~")[:MAX_REQUEST_ID]
