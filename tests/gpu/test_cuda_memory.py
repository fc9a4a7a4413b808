"""On a CUDA device: the primary's memory, reserved at load, holds while another process fills
the GPU. Needs no fixture of tests/conftest.py, so that it runs where only torch and this
repository's few requirements are (`python -m pytest --noconftest tests/gpu`); skipped where
there is no CUDA device."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gateway.engine import EngineRunner
from gateway.model import (
    ModelSpec,
    TorchRunner,
    build_network,
    device_capacity_bytes,
    load_network,
    model_specs,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda:0"
# Takes the device's free memory in plain allocations, halving down to 2 MiB, then says how
# many MiB the driver reports free and holds it all until its stdin closes.
BALLAST = """
import sys, torch
dev = torch.device(sys.argv[1])
held, chunk = [], 1 << 30
while chunk >= 2 << 20:
    try:
        held.append(torch.empty(chunk, dtype=torch.uint8, device=dev))
    except torch.cuda.OutOfMemoryError:
        chunk //= 2
print(torch.cuda.mem_get_info(dev)[0] / 2**20, flush=True)
sys.stdin.read()
"""


def wide_model(directory: Path) -> ModelSpec:
    """A model whose batches of 256 rows take the allocator's large blocks (2 MiB a layer)."""
    torch.manual_seed(0)
    spec = ModelSpec(name="wide", revision="t", file="wide.pt", sha256="", input_dim=147,
                     hidden=(2048, 2048), output_dim=4, directory=directory)  # fmt: skip
    buffer = io.BytesIO()
    torch.save(build_network(spec).state_dict(), buffer)
    (directory / spec.file).write_bytes(buffer.getvalue())
    digest = hashlib.sha256(buffer.getvalue()).hexdigest()
    (directory / "models.toml").write_text(
        f'[model.wide]\nrevision = "t"\nfile = "wide.pt"\nsha256 = "{digest}"\n'
        "input_dim = 147\nhidden = [2048, 2048]\noutput_dim = 4\n"
    )
    return model_specs(directory / "models.toml")["wide"]


@contextlib.contextmanager
def gpu_filled() -> Iterator[float]:
    """Another process holding all the memory the GPU has free; yields the MiB left."""
    proc = subprocess.Popen([sys.executable, "-c", BALLAST, DEVICE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdin is not None
    try:
        line = proc.stdout.readline()
        assert line, f"the process filling the GPU ended with {proc.wait(30)}"
        yield float(line)
    finally:
        proc.stdin.close()
        proc.wait(60)


def test_a_reserved_runner_serves_every_batch_size_while_the_gpu_is_full(tmp_path: Path) -> None:
    spec = wide_model(tmp_path)
    network = load_network(spec)
    reference = build_network(spec)
    reference.load_state_dict(network.state_dict())
    runner = TorchRunner(spec, network, DEVICE, device_capacity_bytes(DEVICE, 0.0),
                         reserve_rows=256)  # fmt: skip
    assert runner.reserved_rows == 256
    try:
        with gpu_filled() as left_mib:
            assert left_mib < 64, f"the GPU still has {left_mib} MiB free: nothing is tested"
            # What admission sees: the allocator's unused blocks count, so a full batch fits.
            free = runner.observed_free_bytes()
            assert free is not None and free >= runner.memory.batch_bytes(256)
            rng = random.Random(0)
            for rows in (1, 3, 37, 100, 129, 200, 255, 256, *rng.sample(range(1, 257), 24)):
                inputs = [[rng.uniform(-1, 1) for _ in range(147)] for _ in range(rows)]
                outputs = runner.run(inputs)
                with torch.inference_mode():
                    want = reference(torch.tensor(inputs))
                assert len(outputs) == rows
                assert torch.allclose(torch.tensor(outputs), want, atol=1e-3), rows
    finally:
        runner.close()


def test_the_engine_reports_what_it_reserved() -> None:
    spec = model_specs()["gridworld-policy"]
    manifest = spec.directory / "models.toml"
    reserving = EngineRunner(spec, manifest, DEVICE, reserve_rows=64)
    plain = EngineRunner(spec, manifest, DEVICE)
    try:
        reserving.start()
        plain.start()
        assert (reserving.reserved_rows, plain.reserved_rows) == (64, 0)

        async def five(runner: EngineRunner) -> list[list[float]]:
            return await runner.infer([[0.5] * spec.input_dim] * 5)

        assert torch.allclose(
            torch.tensor(asyncio.run(five(reserving))), torch.tensor(asyncio.run(five(plain)))
        )
    finally:
        reserving.close()
        plain.close()
