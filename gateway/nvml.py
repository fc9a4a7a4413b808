"""A GPU's utilization as its driver reports it, through NVML over ctypes.

NVML is the NVIDIA driver's management library (`libnvidia-ml.so.1`, installed with the
driver, not with CUDA or torch): no package to install, and nothing to load on a host without
the driver. `nvmlDeviceGetUtilizationRates` gives the share of the driver's last sample period
(between 1/6 s and 1 s, by product) during which one or more kernels ran on the GPU: what
`nvidia-smi` shows as GPU-Util.

A GPU is named here by its UUID (`GPU-...`), which the process holding the device reads from
torch (`gateway.model.cuda_uuid`): NVML numbers GPUs in PCI order over the whole host, and a
CUDA ordinal is not that number under `CUDA_VISIBLE_DEVICES` or CUDA's default ordering.
"""

from __future__ import annotations

import ctypes
import threading

import structlog

log = structlog.get_logger(__name__)

LIBRARY = "libnvidia-ml.so.1"
SUCCESS = 0


class NvmlError(Exception):
    """NVML is missing, or refused a call; the message says which and why."""


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


_init_lock = threading.Lock()


class GpuUtilization:
    """Reads one GPU's utilization (0 to 1). Raises NvmlError when NVML cannot be loaded or
    does not know the GPU."""

    def __init__(self, uuid: str, library: str = LIBRARY) -> None:
        try:
            self._lib = ctypes.CDLL(library)
        except OSError as exc:
            raise NvmlError(f"NVML ({library}) cannot be loaded: {exc}") from exc
        self._lib.nvmlErrorString.restype = ctypes.c_char_p
        with _init_lock:  # (reference-counted by NVML: one init per reader, one shutdown)
            self._check(self._lib.nvmlInit_v2(), "nvmlInit_v2")
        self._handle = ctypes.c_void_p()
        try:
            self._check(
                self._lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(self._handle)),
                f"nvmlDeviceGetHandleByUUID({uuid!r})",
            )
        except NvmlError:
            self.close()
            raise
        self.uuid = uuid

    def _check(self, code: int, call: str) -> None:
        if code != SUCCESS:
            why = self._lib.nvmlErrorString(code)
            text = why.decode(errors="replace") if why else "unknown error"
            raise NvmlError(f"NVML {call} failed with code {code}: {text}")

    def read(self) -> float:
        rates = _Utilization()
        self._check(
            self._lib.nvmlDeviceGetUtilizationRates(self._handle, ctypes.byref(rates)),
            "nvmlDeviceGetUtilizationRates",
        )
        return min(100, int(rates.gpu)) / 100

    def close(self) -> None:
        with _init_lock:
            self._lib.nvmlShutdown()


class UtilizationProbe:
    """A device's utilization for the gateway's metrics: NVML's for a GPU named by `uuid`,
    opened on the first read; None for a CPU, or where NVML cannot tell (said once, in the
    log, with NVML's reason; the metric is then left out, never shown as 0)."""

    def __init__(self, device: str, uuid: str | None, library: str = LIBRARY) -> None:
        self.device = device
        self.uuid = uuid
        self._library = library
        self._reader: GpuUtilization | None = None
        self._given_up = uuid is None

    def read(self) -> float | None:
        if self._given_up:
            return None
        try:
            if self._reader is None:
                assert self.uuid is not None
                self._reader = GpuUtilization(self.uuid, self._library)
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
