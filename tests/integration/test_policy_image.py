"""The policy image (minimal + torch): built from its recipe, booted by the namespace runtime,
and used as a warm parent whose children find torch and the model already loaded."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from fleet.core.smolfile import parse_smolfile
from fleet.image.store import ImageStore
from fleet.runtime.base import MachineSpec
from fleet.runtime.namespace import NamespaceRuntime
from fleet.runtime.warm import NamespaceParent

pytestmark = pytest.mark.sandbox

WARMUP = """
import time
started = time.monotonic()
import torch
torch.manual_seed(0)
NET = torch.nn.Sequential(torch.nn.Linear(147, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
WARMUP_S = time.monotonic() - started
"""
STEP = """
import sys, time
already = "torch" in sys.modules
started = time.monotonic()
import torch
with torch.inference_mode():
    out = NET(torch.zeros(2, 147))
print(torch.__version__, already, tuple(out.shape), time.monotonic() - started < WARMUP_S)
"""


@pytest.fixture(scope="module")
def policy_rootfs(images: ImageStore) -> Path:
    record, _ = images.build("policy")  # cached by recipe digest after the first build
    return images.rootfs(record.digest)


async def test_policy_image_serves_a_warm_torch_parent(policy_rootfs: Path, tmp_path: Path) -> None:
    """torch 2.13.0 in the image; children use the parent's loaded model without importing."""

    runtime = NamespaceRuntime(tmp_path / "machines")
    spec = MachineSpec(
        name=f"pol-{uuid.uuid4().hex[:6]}",
        smolfile=parse_smolfile('image = "policy"\n').spec,
        image_digest="sha256:policy",
        rootfs=policy_rootfs,
        labels={"host": "policy-test"},
    )
    plain = await runtime.create(spec)
    try:
        cold = await plain.exec(
            ["python3", "-c", "import torch; print(torch.__version__)"], timeout_s=120
        )
    finally:
        await plain.delete()
    parent = await NamespaceParent.create(runtime, await runtime.create(spec), WARMUP)
    try:
        child = await parent.branch("policy-child")
        warm = await child.exec(["python3", "-c", STEP], timeout_s=120)
        assert warm.exit_code == 0, warm.stderr.decode()
    finally:
        await parent.delete()
    cold, warm = cold.stdout, warm.stdout

    assert cold.startswith(b"2.13.0")
    assert warm.startswith(b"2.13.0") and warm.endswith(b" True (2, 4) True\n")
