"""Inputs in, outputs out: uploaded by digest, placed read-only before the first step,
collected after the last (a failed one included), downloaded byte for byte, visible only to
the tenant whose rollout they belong to."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import grpc
import pytest

from fleet.api.pb import fleet_pb2, fleet_pb2_grpc, types_pb2
from fleet.cli import client
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from fleet.server.app import ServerConfig
from tests.integration.harness import SECRET, harness, namespace_runtime, request

STEP = r"""
set -e
cat /data/in/hello.txt
sha256sum /data/in/sub/blob.bin | cut -d' ' -f1
if touch /data/in/new 2>/dev/null; then echo WRITABLE; else echo read-only; fi
if echo x >> /data/in/hello.txt 2>/dev/null; then echo WRITABLE; else echo read-only; fi
cat /config.json
mkdir -p /out/tree/deeper
cp /data/in/hello.txt /out/tree/
echo nested > /out/tree/deeper/n.txt
head -c 300000 /data/in/sub/blob.bin > /out/result.bin
"""


def make_inputs(root: Path) -> tuple[Path, Path, bytes]:
    data = root / "data"
    (data / "sub").mkdir(parents=True)
    (data / "hello.txt").write_text("hello input\n")
    blob = os.urandom(1 << 20)
    (data / "sub" / "blob.bin").write_bytes(blob)
    config = root / "config.json"
    config.write_text('{"seed": 7}\n')
    return data, config, blob


@pytest.mark.sandbox
async def test_inputs_in_and_outputs_out(tmp_path: Path, images: ImageStore) -> None:
    data, config, blob = make_inputs(tmp_path)

    async with harness(tmp_path, images, secure=True, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        key = h.key("team-a")
        async with h.connect(key) as channel:
            stub = fleet_pb2_grpc.FleetServiceStub(channel)
            tree = await client.upload(stub, data, "/data/in", True)
            again = await client.upload(stub, data, "/data/in", True)
            one = await client.upload(stub, config, "/config.json", False)
            blobs = (tmp_path / "artifacts" / "sha256").rglob("*")
            stored = len([p for p in blobs if p.is_file()])
            req = request('image = "minimal"\n', ["sh", "-c", STEP])
            req.inputs.extend([tree, one])
            req.outputs.extend(["/out/result.bin", "/out/tree", "/out/missing"])
            rid = (await stub.SubmitRollout(req)).rollout.id
            final = await h.wait_final(rid)
            written = await client.download(stub, final, tmp_path / "got")
            # Another tenant cannot read them, even knowing the digest.
            async with h.connect(h.key("team-b")) as other:
                call = fleet_pb2_grpc.FleetServiceStub(other).GetArtifact(
                    fleet_pb2.GetArtifactRequest(rollout_id=rid, digest=tree.digest)
                )
                try:
                    async for _ in call:
                        pass
                    refused = False
                except grpc.aio.AioRpcError as exc:
                    refused = exc.code() == grpc.StatusCode.NOT_FOUND
        refused = refused and again.digest == tree.digest

    assert final.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, final.error
    out = final.results[0].stdout.decode().splitlines()
    assert out[0] == "hello input"
    assert out[1] == hashlib.sha256(blob).hexdigest()
    assert out[2:4] == ["read-only", "read-only"]
    assert out[4] == '{"seed": 7}'
    assert refused
    assert stored == 2  # the tree uploaded twice is stored once
    by_path = {o.path: o for o in final.outputs}
    assert by_path["/out/missing"].digest == "" and "no such file" in by_path["/out/missing"].error
    assert by_path["/out/result.bin"].size == 300000 and not by_path["/out/result.bin"].directory
    assert by_path["/out/tree"].directory
    assert (tmp_path / "got" / "result.bin").read_bytes() == blob[:300000]
    assert (tmp_path / "got" / "tree" / "hello.txt").read_text() == "hello input\n"
    assert (tmp_path / "got" / "tree" / "deeper" / "n.txt").read_text() == "nested\n"
    assert sorted(Path(w).name for w in written) == ["result.bin", "tree"]


@pytest.mark.sandbox
async def test_limits_bad_input_and_outputs_after_a_failed_step(
    tmp_path: Path, images: ImageStore
) -> None:
    """Over the input limit: refused at upload; an input never uploaded, or at a bad path:
    refused at submit; a failing step's outputs are still collected; an output over the limit
    is reported as such, not stored."""
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(3 << 20))
    small = tmp_path / "small.txt"
    small.write_text("small\n")
    config = ServerConfig(lease_ttl_s=5, heartbeat_interval_s=0.5, token_secret=SECRET,
                          max_input_mib=2, max_output_mib=1)  # fmt: skip

    async with harness(tmp_path, images, config, secure=True, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        codes = []
        async with h.connect(h.key("team-a")) as channel:
            stub = fleet_pb2_grpc.FleetServiceStub(channel)
            try:
                await client.upload(stub, big, "/big.bin", False)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
                assert "2 MiB" in (exc.details() or "")
            one = await client.upload(stub, small, "/in/small.txt", False)
            ghost = types_pb2.InputFile(path="/x", digest="sha256:" + "1" * 64, size=1)
            for inputs, outputs in (
                ([ghost], []),
                ([one], ["/out/../etc"]),
                ([types_pb2.InputFile(path="rel", digest=one.digest, size=one.size)], []),
            ):
                req = request('image = "minimal"\n', ["true"])
                req.inputs.extend(inputs)
                req.outputs.extend(outputs)
                try:
                    await stub.SubmitRollout(req)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
            script = (
                "mkdir -p /out && cp /in/small.txt /out/copy.txt && "
                "head -c 2000000 /dev/zero > /out/huge.bin && exit 3"
            )
            req = request('image = "minimal"\n', ["sh", "-c", script])
            req.inputs.append(one)
            req.outputs.extend(["/out/copy.txt", "/out/huge.bin"])
            rid = (await stub.SubmitRollout(req)).rollout.id
            final = await h.wait_final(rid)

    assert codes == [
        grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT,
    ]  # fmt: skip
    assert final.state == types_pb2.ROLLOUT_STATE_FAILED and "exited 3" in final.error
    by_path = {o.path: o for o in final.outputs}
    assert by_path["/out/copy.txt"].size == 6 and by_path["/out/copy.txt"].digest
    assert by_path["/out/huge.bin"].digest == "" and "1 MiB" in by_path["/out/huge.bin"].error


@pytest.mark.parametrize("lines", [25600, 76800], ids=["200KiB-held", "600KiB-spooled"])
@pytest.mark.sandbox
async def test_output_past_the_inline_limit_is_kept_whole(
    tmp_path: Path, images: ImageStore, lines: int
) -> None:
    """A step that prints 200 KiB (held in the agent's memory until kept) or 600 KiB (spooled
    to its disk as it comes): the result keeps the head inline and the whole of it as an
    output, `step-0.stdout`, byte for byte."""
    code = f"import sys; sys.stdout.write(''.join(f'{{i:07d}}\\n' for i in range({lines})))"

    async with harness(tmp_path, images, secure=True, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        async with h.connect(h.key("team-a")) as channel:
            stub = fleet_pb2_grpc.FleetServiceStub(channel)
            req = request('image = "minimal"\n', ["python3", "-c", code])
            rid = (await stub.SubmitRollout(req)).rollout.id
            final = await h.wait_final(rid)
            await client.download(stub, final, tmp_path / "got")
            whole = (tmp_path / "got" / "step-0.stdout").read_bytes()

    expected = "".join(f"{i:07d}\n" for i in range(lines)).encode()
    assert final.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, final.error
    assert final.results[0].stdout_truncated and expected.startswith(final.results[0].stdout)
    [log] = [o for o in final.outputs if o.path == "step-0.stdout"]
    assert log.size == len(expected) and whole == expected
    assert not any(o.path == "step-0.stderr" for o in final.outputs)
