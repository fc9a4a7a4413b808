"""A GPU's utilization as its driver reports it, through NVML (`nvidia-ml-py`'s `pynvml`).

NVML is the NVIDIA driver's management library (`libnvidia-ml.so.1`, installed with the
driver, not with CUDA or torch): `pynvml` binds it and loads it on the first init, so a host
without the driver loads nothing. `nvmlDeviceGetUtilizationRates` gives the share of the
driver's last sample period (between 1/6 s and 1 s, by product) during which one or more
kernels ran on the GPU: what `nvidia-smi` shows as GPU-Util.

A GPU is named here by its UUID (`GPU-...`), which the process holding the device reads from
torch (`gateway.model.cuda_uuid`): NVML numbers GPUs in PCI order over the whole host, and a
CUDA ordinal is not that number under `CUDA_VISIBLE_DEVICES` or CUDA's default ordering.
"""

from __future__ import annotations

from typing import Any

import pynvml
import structlog

log = structlog.get_logger(__name__)


class NvmlError(Exception):
    """NVML is missing, or refused a call; the message says which and why."""


def _failed(call: str, exc: pynvml.NVMLError) -> NvmlError:
    return NvmlError(f"NVML {call} failed with code {exc.value}: {exc}")


class GpuUtilization:
    """Reads one GPU's utilization (0 to 1). Raises NvmlError when NVML cannot be loaded or
    does not know the GPU."""

    def __init__(self, uuid: str) -> None:
        try:
            pynvml.nvmlInit()  # (reference-counted by NVML: one init per reader, one shutdown)
        except pynvml.NVMLError_LibraryNotFound as exc:
            raise NvmlError(f"NVML (libnvidia-ml.so.1) cannot be loaded: {exc}") from exc
        except pynvml.NVMLError as exc:
            raise _failed("nvmlInit", exc) from exc
        try:
            self._handle: Any = pynvml.nvmlDeviceGetHandleByUUID(uuid.encode())
        except pynvml.NVMLError as exc:
            self.close()
            raise _failed(f"nvmlDeviceGetHandleByUUID({uuid!r})", exc) from exc
        self.uuid = uuid

    def read(self) -> float:
        try:
            rates = pynvml.nvmlDeviceGetUtilizationRates(self._handle)
        except pynvml.NVMLError as exc:
            raise _failed("nvmlDeviceGetUtilizationRates", exc) from exc
        return min(100, int(rates.gpu)) / 100

    def close(self) -> None:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.warning("nvml_shutdown_failed", error=str(exc))


class UtilizationProbe:
    """A device's utilization for the gateway's metrics: NVML's for a GPU named by `uuid`,
    opened on the first read; None for a CPU, or where NVML cannot tell (said once, in the
    log, with NVML's reason; the metric is then left out, never shown as 0)."""

    def __init__(self, device: str, uuid: str | None) -> None:
        self.device = device
        self.uuid = uuid
        self._reader: GpuUtilization | None = None
        self._given_up = uuid is None

    def read(self) -> float | None:
        if self._given_up:
            return None
        try:
            if self._reader is None:
                assert self.uuid is not None
                self._reader = GpuUtilization(self.uuid)
            return self._reader.read()
        except NvmlError as exc:
            self._given_up = True
            log.warning("gpu_utilization_unavailable", device=self.device, uuid=self.uuid,
                        error=str(exc))  # fmt: skip
            self.close()
            return None

    def close(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()
