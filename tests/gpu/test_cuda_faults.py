"""On a CUDA device: a real sticky error (a device-side assert) in the engine's process ends
that engine, and a fresh one serves on the GPU again. Runs with `--noconftest` like the rest
of tests/gpu; skipped where there is no CUDA device."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from tests import faulty_device

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_sticky_cuda_error_ends_the_engine_and_a_fresh_one_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = faulty_device.install(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (hook, os.getenv("PYTHONPATH")))))
    seen = asyncio.run(faulty_device.device_error_then_fresh_engine("cuda:0"))
    fault = seen["fault"]
    assert fault is not None and fault.kind == "device_error"
    assert "device-side assert" in str(fault), str(fault)
    assert seen["restarts"] == 1 and seen["pid"] != seen["first_pid"]
    assert torch.allclose(torch.tensor(seen["after"]), torch.tensor(seen["before"]), atol=1e-5)
