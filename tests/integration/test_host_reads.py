"""What an enrolled host may read and learn through HostService: an image only while it holds
a lease whose manifest names it; an output over its limit answered as that, not as an internal
error; and no refusal names another lease's fencing token."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from fleet.api.pb import host_pb2, host_pb2_grpc, types_pb2
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from fleet.server.settings import ServerConfig
from tests.integration.harness import SECRET, Harness, harness, register_cpu_host, request

MIB = 1 << 20


def host_channel(h: Harness, host_id: str) -> grpc.aio.Channel:
    identity = h.identity(host_id, HostClass.CPU)
    return grpc.aio.secure_channel(identity.host_address, identity.channel_credentials())


async def registered_stub(channel: grpc.aio.Channel) -> host_pb2_grpc.HostServiceStub:
    stub = host_pb2_grpc.HostServiceStub(channel)
    await register_cpu_host(stub, cpus=2)
    return stub


async def read_blob(stub: host_pb2_grpc.HostServiceStub, digest: str) -> bytes:
    out = bytearray()
    async for chunk in stub.GetBlob(host_pb2.GetBlobRequest(digest=digest), timeout=60):
        out += chunk.data
    return bytes(out)


async def test_a_host_reads_an_image_only_while_it_leases_work_that_runs_it(
    tmp_path: Path, images: ImageStore
) -> None:
    """Host A leases a rollout of the image and reads it whole; host B, with no such lease,
    is refused PERMISSION_DENIED (as is A once its lease is done)."""
    record = images.record("minimal")
    assert record is not None
    digest = record.digest

    async with (
        harness(tmp_path, images, secure=True) as h,
        host_channel(h, "cpu-a") as ca,
        host_channel(h, "cpu-b") as cb,
    ):
        a, b = await registered_stub(ca), await registered_stub(cb)
        before: list[grpc.StatusCode] = []
        try:
            await read_blob(a, digest)
        except grpc.aio.AioRpcError as exc:
            before.append(exc.code())
        await h.fleet.SubmitRollout(request())
        claim = host_pb2.ClaimWorkRequest(max_items=1, wait_s=5)
        [item] = (await a.ClaimWork(claim)).items
        data = await read_blob(a, digest)
        try:
            await read_blob(b, digest)
            other = grpc.StatusCode.OK
            details = ""
        except grpc.aio.AioRpcError as exc:
            other, details = exc.code(), exc.details() or ""
        await a.CompleteWork(
                host_pb2.CompleteWorkRequest(
                    work_id=item.work_id, fencing_token=item.fencing_token,
                    outcome=types_pb2.OUTCOME_SUCCEEDED,
                )
            )  # fmt: skip
        try:
            await read_blob(a, digest)
            after = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            after = exc.code()

    assert before == [grpc.StatusCode.PERMISSION_DENIED]
    assert data == images.blob_path(digest).read_bytes()
    assert other == grpc.StatusCode.PERMISSION_DENIED and "cpu-b" in details
    assert after == grpc.StatusCode.PERMISSION_DENIED


async def test_an_output_over_its_limit_is_refused_as_such_however_much_follows(
    tmp_path: Path, images: ImageStore
) -> None:
    """A host that goes on sending past the output limit is told RESOURCE_EXHAUSTED naming the
    limit, every time (the server reads the rest before it answers: a call ended while the
    host still sent reached it as INTERNAL)."""
    config = ServerConfig(lease_ttl_s=30, heartbeat_interval_s=0.5, token_secret=SECRET,
                          max_output_mib=1)  # fmt: skip
    block = b"x" * MIB

    async with (
        harness(tmp_path, images, config, secure=True) as h,
        host_channel(h, "cpu-a") as channel,
    ):
        stub = await registered_stub(channel)
        await h.fleet.SubmitRollout(request())
        claim = host_pb2.ClaimWorkRequest(max_items=1, wait_s=5)
        [item] = (await stub.ClaimWork(claim)).items
        answers = []
        for _ in range(6):

            async def parts() -> AsyncIterator[host_pb2.ArtifactPart]:
                yield host_pb2.ArtifactPart(work_id=item.work_id, fencing_token=item.fencing_token)
                for _ in range(40):
                    yield host_pb2.ArtifactPart(data=block)

            try:
                await stub.PutArtifact(parts(), timeout=120)
                answers.append((grpc.StatusCode.OK, ""))
            except grpc.aio.AioRpcError as exc:
                answers.append((exc.code(), exc.details() or ""))

        # Within the limit, the same call stores it.
        async def small() -> AsyncIterator[host_pb2.ArtifactPart]:
            yield host_pb2.ArtifactPart(
                work_id=item.work_id, fencing_token=item.fencing_token, data=b"fits"
            )

        stored = await stub.PutArtifact(small(), timeout=60)

    assert [code for code, _ in answers] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 6, answers
    assert all("limit of 1 MiB" in d and "--max-output-mib" in d for _, d in answers), answers
    assert stored.size == 4 and stored.digest.startswith("sha256:")


async def test_refusals_never_name_another_leases_fencing_token(
    tmp_path: Path, images: ImageStore
) -> None:
    """Host B, reporting on host A's lease with a guessed token, is refused; no refusal (a
    completion, a checkpoint, a heartbeat) holds A's current token."""

    async with (
        harness(tmp_path, images, secure=True) as h,
        host_channel(h, "cpu-a") as ca,
        host_channel(h, "cpu-b") as cb,
    ):
        a, b = await registered_stub(ca), await registered_stub(cb)
        await h.fleet.SubmitRollout(request())
        [item] = (await a.ClaimWork(host_pb2.ClaimWorkRequest(max_items=1, wait_s=5))).items
        guess = 1
        calls = [
            b.CompleteWork(
                host_pb2.CompleteWorkRequest(
                    work_id=item.work_id,
                    fencing_token=guess,
                    outcome=types_pb2.OUTCOME_SUCCEEDED,
                )
            ),
            b.PutCheckpoint(
                host_pb2.PutCheckpointRequest(
                    work_id=item.work_id, fencing_token=guess, sequence=1, data=b"x"
                )
            ),
            b.Heartbeat(
                host_pb2.HeartbeatRequest(
                    leases=[host_pb2.LeaseRef(work_id=item.work_id, fencing_token=guess)]
                )
            ),
            # A's own stale report, under an old token, learns nothing newer either.
            a.PutCheckpoint(
                host_pb2.PutCheckpointRequest(
                    work_id=item.work_id,
                    fencing_token=item.fencing_token - 1,
                    sequence=1,
                    data=b"x",
                )
            ),
        ]
        refused = []
        for call in calls:
            try:
                await call
                refused.append((grpc.StatusCode.OK, ""))
            except grpc.aio.AioRpcError as exc:
                refused.append((exc.code(), exc.details() or ""))
        batch = await b.PutCheckpoints(
            host_pb2.PutCheckpointsRequest(
                checkpoints=[
                    host_pb2.PutCheckpointRequest(
                        work_id=item.work_id, fencing_token=guess, sequence=2, data=b"y"
                    )
                ]
            )
        )
        refused.extend(("", o.message) for o in batch.outcomes)

    current = str(item.fencing_token)
    assert all(code != grpc.StatusCode.OK for code, _ in refused), refused
    for _, details in refused:
        assert current not in re.findall(r"\d+", details), details
