"""The image and file benchmark (`scripts/bench-images`). One table, side by side.

(1) The first rollout of an image on a host whose store is empty (it fetches the image from the
    server by digest, verifies and unpacks it) against the same rollout on a host that has it.
(2) Fetch throughput, server to host over gRPC with TLS (hashing and syncing as it writes),
    against `curl` of the same blob from a plain HTTP server on the same loopback.
(3) Inputs and outputs: a directory of 1 MiB and one of 256 MiB uploaded, mounted, copied to an
    output by the step, collected, and downloaded again, byte for byte.
"""

# ruff: noqa: T201 (a benchmark's output is what it prints)

from __future__ import annotations

import argparse
import asyncio
import hashlib
import http.server
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import grpc

import fleet
from benchmarks.harness import Table, minimal_image, percentile, print_json, quiet
from fleet.agent.images import ImageCache
from fleet.api.pb import fleet_pb2, fleet_pb2_grpc, host_pb2, host_pb2_grpc, types_pb2
from fleet.cli import client
from fleet.core.placement import HostClass
from fleet.identity.ca import CertificateAuthority
from fleet.image import oci
from fleet.image.store import ImageStore
from tests.integration.harness import FINAL, harness, namespace_runtime, request
from tests.registry import PASSWORD, USER, registry

MIB = 1 << 20


async def first_vs_cached(tmp: Path, images: ImageStore, repeats: int) -> dict[str, float]:
    async with harness(tmp / "first", images, secure=True, runtime=namespace_runtime) as h:
        store = ImageStore(tmp / "empty-host-images", images.recipes)
        await h.start_agent("cloud-1", HostClass.CPU, images=store)

        async def one() -> float:
            started = time.perf_counter()
            rid = (await h.fleet.SubmitRollout(request('image = "minimal"\n', ["true"]))).rollout.id
            for _ in range(6000):
                r = await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=rid))
                if r.state in FINAL:
                    assert r.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, r.error
                    return time.perf_counter() - started
                await asyncio.sleep(0.01)
            raise AssertionError("rollout did not finish")

        first = await one()
        cached = percentile([await one() for _ in range(repeats)], 0.5)
    return {"first_rollout_s": first, "cached_rollout_s": cached}


async def fetch_rate(tmp: Path, images: ImageStore, digest: str) -> float:
    """MiB/s of one image fetch, server to host: a host reads an image only while it leases
    work that runs it, so the fetcher registers and leases a rollout of `minimal` first (before
    the clock starts)."""
    async with harness(
        tmp / f"fetch-{uuid.uuid4().hex[:6]}", images, secure=True, runtime=namespace_runtime
    ) as h:
        identity = h.identity("fetcher")
        store = ImageStore(tmp / f"fetch-{uuid.uuid4().hex[:6]}", images.recipes)
        cache = ImageCache(store, None)
        creds = identity.channel_credentials()
        async with grpc.aio.secure_channel(identity.host_address, creds) as channel:
            stub = host_pb2_grpc.HostServiceStub(channel)
            await stub.RegisterHost(host_pb2.RegisterHostRequest(
                host_class=types_pb2.HOST_CLASS_CPU, agent_version=fleet.__version__,
                capabilities=host_pb2.Capabilities(runtime=types_pb2.RUNTIME_KIND_NAMESPACE,
                                                   isolation=types_pb2.ISOLATION_NAMESPACE,
                                                   cpus=1),
            ))  # fmt: skip
            await h.fleet.SubmitRollout(request('image = "minimal"\n', ["true"]))
            claimed = await stub.ClaimWork(host_pb2.ClaimWorkRequest(max_items=1, wait_s=5))
            if len(claimed.items) != 1:
                raise RuntimeError(f"the fetcher leased {len(claimed.items)} rollouts, not 1")
            started = time.perf_counter()
            await cache.acquire(stub, digest)
            seconds = time.perf_counter() - started
        cache.release(digest)
        size = store.blob_path(digest).stat().st_size
        shutil.rmtree(store.root)
    return size / MIB / seconds


def curl_rate(blob: Path, tmp: Path) -> float:
    """curl of the same blob from a plain HTTP server on loopback, written to disk."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    def handler(*args: object) -> Quiet:
        return Quiet(*args, directory=str(blob.parent))  # type: ignore[arg-type]

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        out = tmp / "curl.out"
        started = time.perf_counter()
        subprocess.run(
            ["curl", "-sf", "-o", str(out), f"http://127.0.0.1:{server.server_port}/{blob.name}"],
            check=True, timeout=600,
        )  # fmt: skip
        seconds = time.perf_counter() - started
        size = out.stat().st_size
        out.unlink()
    finally:
        server.shutdown()
    return size / MIB / seconds


def registry_rates(tmp: Path, images: ImageStore, digest: str, repeats: int) -> tuple[float, float]:
    """Pull throughput from a real registry (TLS, htpasswd) vs curl of the same blob from it."""
    ca = CertificateAuthority.init(tmp / "registry-ca")
    blob = images.blob_path(digest)
    size = blob.stat().st_size
    ours, curls = [], []
    with registry(tmp / "registry", ca) as reg:
        ref = oci.Reference.parse(reg.repo())
        credentials = oci.Credentials(USER, PASSWORD)
        with oci.Registry(ref, credentials, ca.pem) as client_:
            oci.push(client_, blob, digest, "bench")
        url = f"https://{reg.address}/v2/{ref.repository}/blobs/{digest}"
        for i in range(repeats):
            target = tmp / f"pulled-{i}.tar"
            started = time.perf_counter()
            with oci.Registry(ref, credentials, ca.pem) as client_:
                client_.download_blob(digest, target)
            ours.append(size / MIB / (time.perf_counter() - started))
            target.unlink()
            out = tmp / f"curl-{i}.tar"
            started = time.perf_counter()
            subprocess.run(["curl", "-sfL", "-u", f"{USER}:{PASSWORD}", "--cacert",
                            str(tmp / "registry-ca" / "ca.crt"), "-o", str(out), url],
                           check=True, timeout=600)  # fmt: skip
            curls.append(size / MIB / (time.perf_counter() - started))
            out.unlink()
    return percentile(ours, 0.5), percentile(curls, 0.5)


async def round_trip(tmp: Path, images: ImageStore, mib: int) -> float:
    """Seconds to upload a directory of `mib` MiB, run a step that copies it to an output,
    and download that output, checked byte for byte."""
    source = tmp / f"dir-{mib}"
    (source / "sub").mkdir(parents=True)
    data = os.urandom(mib * MIB)
    (source / "sub" / "data.bin").write_bytes(data)
    (source / "notes.txt").write_text("notes\n")
    async with harness(tmp / f"rt-{mib}", images, secure=True, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        async with h.connect(h.key("bench")) as channel:
            stub = fleet_pb2_grpc.FleetServiceStub(channel)
            started = time.perf_counter()
            entry = await client.upload(stub, source, "/in", True)
            req = request(
                'image = "minimal"\n', ["sh", "-c", "mkdir -p /out && cp -r /in /out/copy"]
            )
            req.inputs.append(entry)
            req.outputs.append("/out/copy")
            rid = (await stub.SubmitRollout(req)).rollout.id
            final = await h.wait_final(rid, timeout_s=900)
            assert final.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, final.error
            await client.download(stub, final, tmp / f"got-{mib}")
            seconds = time.perf_counter() - started
    got = (tmp / f"got-{mib}" / "copy" / "sub" / "data.bin").read_bytes()
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    return seconds


async def run(args: argparse.Namespace) -> dict[str, float]:
    images, record = minimal_image()
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="fleet-bench-images-") as tmp_name:
        tmp = Path(tmp_name)
        out.update(await first_vs_cached(tmp, images, 3 if args.quick else 5))
        rates = [
            await fetch_rate(tmp, images, record.digest) for _ in range(1 if args.quick else 3)
        ]
        curls = [curl_rate(images.blob_path(record.digest), tmp)
                 for _ in range(1 if args.quick else 3)]  # fmt: skip
        out["fetch_mib_s"] = percentile(rates, 0.5)
        out["curl_mib_s"] = percentile(curls, 0.5)
        out["image_mib"] = images.blob_path(record.digest).stat().st_size / MIB
        pull, curl = registry_rates(tmp, images, record.digest, 1 if args.quick else 3)
        out["registry_pull_mib_s"], out["registry_curl_mib_s"] = pull, curl
        for mib in (1, 16 if args.quick else 256):
            out[f"round_trip_{mib}mib_s"] = await round_trip(tmp, images, mib)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, 16 MiB not 256")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args()
    quiet()
    r = asyncio.run(run(args))
    table = Table(56, (("fleet", 12), ("baseline", 12), ("ratio", 9)))
    table.print_header()
    table.print_row("(1) a rollout of `true`, s: empty host vs host with it",
                    f"{r['first_rollout_s']:.2f}", f"{r['cached_rollout_s']:.2f}",
                    f"{r['first_rollout_s'] / r['cached_rollout_s']:.1f}x")  # fmt: skip
    table.print_row("(2) fetch MiB/s, gRPC+TLS vs curl over plain HTTP",
                    f"{r['fetch_mib_s']:.0f}", f"{r['curl_mib_s']:.0f}",
                    f"{r['fetch_mib_s'] / r['curl_mib_s']:.2f}x")  # fmt: skip
    table.print_row("(2) pull MiB/s from a registry (TLS, htpasswd) vs curl",
                    f"{r['registry_pull_mib_s']:.0f}", f"{r['registry_curl_mib_s']:.0f}",
                    f"{r['registry_pull_mib_s'] / r['registry_curl_mib_s']:.2f}x")  # fmt: skip
    trips = [k for k in r if k.startswith("round_trip_")]
    for key in sorted(
        trips, key=lambda k: int(k.removeprefix("round_trip_").removesuffix("mib_s"))
    ):
        mib = int(key.removeprefix("round_trip_").removesuffix("mib_s"))
        table.print_row(f"(3) {mib} MiB directory in, copied, out, downloaded (s)",
                        f"{r[key]:.2f}", "", tail=f"{mib / r[key]:>7.1f} MiB/s")  # fmt: skip
    print(
        f"(the image is {r['image_mib']:.0f} MiB; (1) includes fetching, verifying and "
        "unpacking it; the host with it runs the same rollout, its median)"
    )
    if args.json:
        print_json(r, 3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
