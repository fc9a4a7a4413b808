"""The NVML binding against a stand-in for the driver's library, built here from C: the real
one exists only where an NVIDIA driver is installed, and its C interface is what is bound."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from gateway.nvml import GpuUtilization, NvmlError, UtilizationProbe

STAND_IN = r"""
#include <string.h>
typedef struct { unsigned int gpu; unsigned int memory; } rates_t;
static int inits = 0, reads = 0, lost_after = 2;
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
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("nvml")
    (where / "nvml.c").write_text(STAND_IN)
    built = where / "libnvidia-ml-stand-in.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(built), str(where / "nvml.c")], check=True)
    return built


def lose_after(library: Path, reads: int) -> None:
    """The stand-in answers `reads` reads, then reports the GPU lost (the library is loaded
    once per process: its state is shared by every handle)."""
    ctypes.CDLL(str(library)).stand_in_lose_after(reads)


def test_reads_a_gpus_utilization_by_its_uuid_and_says_why_it_cannot(library: Path) -> None:
    lose_after(library, 2)
    gpu = GpuUtilization("GPU-0b5e4c5e-test", str(library))
    assert gpu.read() == 0.37
    assert gpu.read() == 1.0
    with pytest.raises(NvmlError, match="nvmlDeviceGetUtilizationRates failed with code 15"):
        gpu.read()
    gpu.close()
    assert ctypes.CDLL(str(library)).stand_in_inits() == 0  # every init shut down again
    with pytest.raises(NvmlError, match=r"GetHandleByUUID\('GPU-other'\) failed .* Not Found"):
        GpuUtilization("GPU-other", str(library))
    assert ctypes.CDLL(str(library)).stand_in_inits() == 0
    with pytest.raises(NvmlError, match=r"NVML \(/nowhere/libnvidia-ml.so.1\) cannot be loaded"):
        GpuUtilization("GPU-0b5e4c5e-test", "/nowhere/libnvidia-ml.so.1")


def test_the_probe_gives_up_once_saying_why_and_is_none_on_a_cpu(library: Path) -> None:
    assert UtilizationProbe("cpu", None, str(library)).read() is None
    lose_after(library, 1)
    probe = UtilizationProbe("cuda:0", "GPU-0b5e4c5e-test", str(library))
    with capture_logs() as logs:
        assert probe.read() == 0.37
        assert probe.read() is None  # lost: said once, and not asked again
        assert probe.read() is None
    [event] = [e for e in logs if e["event"] == "gpu_utilization_unavailable"]
    assert event["device"] == "cuda:0" and "code 15" in event["error"]
    missing = UtilizationProbe("cuda:1", "GPU-x", "/nowhere/libnvidia-ml.so.1")
    with capture_logs() as logs:
        assert missing.read() is None
    assert "cannot be loaded" in logs[0]["error"]


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
