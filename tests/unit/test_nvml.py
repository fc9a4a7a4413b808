"""The NVML binding (`pynvml`) against a stand-in for the driver's library, built here from C
under the driver's file name: the real one exists only where an NVIDIA driver is installed, and
its C interface is what `pynvml` loads. Each case runs in its own process, whose loader finds
the stand-in on LD_LIBRARY_PATH (a process loads NVML once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

STAND_IN = r"""
#include <string.h>
typedef struct { unsigned int gpu; unsigned int memory; } rates_t;
static int inits = 0, reads = 0, lost_after = 2;
int nvmlInitWithFlags(unsigned int flags) { inits++; return 0; }
int nvmlInit_v2(void) { inits++; return 0; }
int nvmlShutdown(void) { inits--; return 0; }
const char *nvmlErrorString(int code) { return code == 6 ? "Not Found" : "Unknown Error"; }
int nvmlDeviceGetHandleByUUID(const char *uuid, void **handle) {
    if (strcmp(uuid, "GPU-0b5e4c5e-test") != 0) return 6;
    *handle = (void *)0x5eed; return 0;
}
int nvmlDeviceGetUtilizationRates(void *handle, rates_t *rates) {
    if (handle != (void *)0x5eed) return 999;
    if (++reads > lost_after) return 15;  /* the GPU is lost */
    rates->gpu = reads == 1 ? 37 : 100; rates->memory = 12; return 0;
}
int stand_in_inits(void) { return inits; }
void stand_in_lose_after(int n) { reads = 0; lost_after = n; }
"""


@pytest.fixture(scope="module")
def library_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("nvml")
    (where / "nvml.c").write_text(STAND_IN)
    built = where / "libnvidia-ml.so.1"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(built), str(where / "nvml.c")], check=True)
    return where


def run(code: str, library_dir: Path | None) -> dict[str, object]:
    """Runs `code` (which sets `out`) in a fresh process whose loader finds the stand-in (or,
    given None, no NVML at all); returns `out`."""
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    if library_dir is not None:
        env["LD_LIBRARY_PATH"] = str(library_dir)
    prelude = (
        "import ctypes, json\n"
        "from structlog.testing import capture_logs\n"
        "from gateway.nvml import GpuUtilization, NvmlError, UtilizationProbe\n"
        "stand_in = lambda: ctypes.CDLL('libnvidia-ml.so.1')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", prelude + code + "\nprint(json.dumps(out))"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_reads_a_gpus_utilization_by_its_uuid_and_says_why_it_cannot(library_dir: Path) -> None:
    out = run(
        """
out = {}
stand_in().stand_in_lose_after(2)
gpu = GpuUtilization("GPU-0b5e4c5e-test")
out["reads"] = [gpu.read(), gpu.read()]
try:
    gpu.read()
except NvmlError as exc:
    out["lost"] = str(exc)
gpu.close()
out["inits_after_close"] = stand_in().stand_in_inits()
try:
    GpuUtilization("GPU-other")
except NvmlError as exc:
    out["unknown"] = str(exc)
out["inits_after_unknown"] = stand_in().stand_in_inits()
""",
        library_dir,
    )
    assert out["reads"] == [0.37, 1.0]
    assert "nvmlDeviceGetUtilizationRates failed with code 15" in str(out["lost"])
    assert out["inits_after_close"] == 0  # every init shut down again
    assert "GetHandleByUUID('GPU-other') failed with code 6: Not Found" in str(out["unknown"])
    assert out["inits_after_unknown"] == 0


def test_without_the_driver_nvml_cannot_be_loaded_and_says_so() -> None:
    out = run(
        """
out = {}
try:
    GpuUtilization("GPU-0b5e4c5e-test")
except NvmlError as exc:
    out["error"] = str(exc)
""",
        None,
    )
    assert "NVML (libnvidia-ml.so.1) cannot be loaded" in str(out["error"])


def test_the_probe_gives_up_once_saying_why_and_is_none_on_a_cpu(library_dir: Path) -> None:
    out = run(
        """
out = {"cpu": UtilizationProbe("cpu", None).read()}
stand_in().stand_in_lose_after(1)
probe = UtilizationProbe("cuda:0", "GPU-0b5e4c5e-test")
with capture_logs() as logs:
    out["reads"] = [probe.read(), probe.read(), probe.read()]  # lost: said once, not asked again
out["said"] = [e for e in logs if e["event"] == "gpu_utilization_unavailable"]
""",
        library_dir,
    )
    assert out["cpu"] is None
    assert out["reads"] == [0.37, None, None]
    [event] = out["said"]  # type: ignore[misc]
    assert event["device"] == "cuda:0" and "code 15" in event["error"]
    missing = run(
        """
with capture_logs() as logs:
    out = {"read": UtilizationProbe("cuda:1", "GPU-x").read(), "said": logs}
""",
        None,
    )
    assert missing["read"] is None
    assert "cannot be loaded" in missing["said"][0]["error"]  # type: ignore[index]


def test_a_cuda_devices_uuid_is_the_drivers_name_or_none_saying_why() -> None:
    """Where torch cannot describe a CUDA device (a CPU build), the answer is None, logged,
    and a gateway still starts: only its utilization metric depends on the UUID."""
    import torch

    from gateway.model import cuda_uuid

    assert cuda_uuid("cpu") is None
    if torch.cuda.is_available():
        assert (cuda_uuid("cuda:0") or "").startswith(("GPU-", "MIG-"))
        return
    with capture_logs() as logs:
        assert cuda_uuid("cuda:0") is None
    assert logs[0]["event"] == "cuda_uuid_unknown" and logs[0]["device"] == "cuda:0"
