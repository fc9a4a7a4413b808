"""Models the gateway serves: checksum-verified loading and the torch runner.

The only module (with scripts/train_policy.py) that imports torch. A `Runner` runs one batch on
one device; the batcher and admission control see only that protocol, so another backend (a
vLLM server on a real GPU host, say) plugs in without touching them.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
import tomllib
from array import array
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import structlog
import torch
from torch import nn

from fleet.core.errors import FailedPrecondition, InvalidArgument, NotFound
from gateway.admission import MemoryModel, admissible
from gateway.nvml import UtilizationProbe
from gateway.settings import WEIGHTS_DIR

log = structlog.get_logger(__name__)

DTYPES = {"float32": (torch.float32, 4), "bfloat16": (torch.bfloat16, 2)}
"""Serving precisions: the torch dtype and bytes per number. Weights are stored in float32."""


class DeviceFault(Exception):
    """A batch failed on its device: out of memory, a device error, a failed probe."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class ModelSpec:
    """One shipped model, from `weights/models.toml`."""

    name: str
    revision: str
    file: str
    sha256: str
    input_dim: int
    hidden: tuple[int, ...]
    output_dim: int

    directory: Path = WEIGHTS_DIR
    dtype: str = "float32"
    """The precision it is served in (the manifest's `dtype`, or a gateway's override)."""

    @property
    def path(self) -> Path:
        return self.directory / self.file


def model_specs(manifest: Path = WEIGHTS_DIR / "models.toml") -> dict[str, ModelSpec]:
    """The models a manifest lists; weight files live next to it."""
    data = tomllib.loads(manifest.read_text())
    out = {}
    for name, entry in data.get("model", {}).items():
        out[name] = ModelSpec(
            directory=manifest.parent,
            name=name, revision=entry["revision"], file=entry["file"], sha256=entry["sha256"],
            input_dim=int(entry["input_dim"]), hidden=tuple(int(h) for h in entry["hidden"]),
            output_dim=int(entry["output_dim"]),
            dtype=checked_dtype(str(entry.get("dtype", "float32")), f"{manifest}: model.{name}"),
        )  # fmt: skip
    return out


def select_model(manifest: Path, name: str, dtype: str = "", where: str = "dtype") -> ModelSpec:
    """The manifest's model `name`, served in `dtype` when one is given (`where` names the
    setting in an error); NotFound, listing the manifest's models, when it has no such one."""
    specs = model_specs(manifest)
    if name not in specs:
        raise NotFound(f"no model {name!r}; shipped: {', '.join(sorted(specs))}")
    return replace(specs[name], dtype=checked_dtype(dtype, where)) if dtype else specs[name]


def checked_dtype(dtype: str, where: str) -> str:
    if dtype not in DTYPES:
        raise InvalidArgument(f"{where}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return dtype


def build_network(spec: ModelSpec) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = spec.input_dim
    for hidden in spec.hidden:
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, spec.output_dim))
    return nn.Sequential(*layers)


def load_network(spec: ModelSpec, path: Path | None = None) -> nn.Sequential:
    """The network with its weights, after checking the file's sha256 against the manifest."""
    path = path or spec.path
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise FailedPrecondition(f"model {spec.name}: cannot read weights {path}: {exc}") from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != spec.sha256:
        raise FailedPrecondition(
            f"model {spec.name}: weights {path.name} have sha256 {digest[:16]}…, the manifest "
            f"says {spec.sha256[:16]}…; refusing to serve corrupt or substituted weights"
        )
    net = build_network(spec)
    state = torch.load(path, map_location="cpu", weights_only=True)
    net.load_state_dict(state)
    net.eval()
    return net.to(DTYPES[spec.dtype][0])


def memory_model(spec: ModelSpec, headroom_bytes: int = 0) -> MemoryModel:
    """Bytes for weights and, per sample, for the input and every layer's output."""
    params = 0
    width = spec.input_dim
    activations = spec.input_dim
    for out in (*spec.hidden, spec.output_dim):
        params += width * out + out
        activations += out * (2 if out != spec.output_dim else 1)  # linear + relu outputs
        width = out
    size = DTYPES[spec.dtype][1]
    return MemoryModel(
        weights_bytes=params * size,
        activation_bytes_per_sample=activations * size,
        headroom_bytes=headroom_bytes,
    )


CACHED_READ_S = 0.5
"""How often a CUDA runner reads again what torch's caching allocator holds unused."""

PACK_SIZES = (1, 2, 4, 8, 16, 32, 64)
"""Batch sizes at which a packed network is timed against the plain one (`pack_for_cpu`)."""


class _PackedLinear(nn.Module):
    """A linear layer, and the ReLU after it if there is one, run by oneDNN's kernel from a
    weight reordered once into that kernel's own layout."""

    def __init__(self, layer: nn.Linear, relu: bool) -> None:
        super().__init__()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), None)
        self.bias = layer.bias.detach()
        self.attr = "relu" if relu else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(  # type: ignore[no-any-return]
            x, self.weight, self.bias, self.attr, [], ""
        )


def _packable(spec: ModelSpec) -> bool:
    """Whether this torch has oneDNN kernels for the precision `spec` is served in."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if spec.dtype == "bfloat16":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return spec.dtype == "float32"


def _packed_layers(layers: list[nn.Module]) -> list[nn.Module] | None:
    """Linear layers, each with the ReLU after it fused in; None for any other kind of layer."""
    out: list[nn.Module] = []
    i = 0
    while i < len(layers):
        layer = layers[i]
        if not isinstance(layer, nn.Linear):
            return None
        relu = i + 1 < len(layers) and isinstance(layers[i + 1], nn.ReLU)
        out.append(_PackedLinear(layer, relu))
        i += 2 if relu else 1
    return out


@dataclass
class Packed:
    """A network's copy whose linear layers hold their weights pre-packed for the CPU's oneDNN
    kernels, and the smallest batch it serves (smaller ones: the plain network)."""

    network: nn.Module
    from_rows: int
    timings_ms: dict[int, tuple[float, float]]
    """Per timed batch size: (plain, packed) ms per batch, the best of a few runs."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)  # type: ignore[no-any-return]


def pack_for_cpu(network: nn.Module, spec: ModelSpec, runs: int = 5) -> Packed | None:
    """The network with pre-packed weights, if it is faster than the plain one on this CPU.

    A plain linear layer's kernel packs the weight matrix into its own layout again on every
    call. In float32 (the BLAS), at batches of 4 to 64 rows through 4096x4096 layers, that copy
    is a quarter of the time, and some sizes take a slower kernel (measured here: 15 rows cost
    5x what 3 do). In bfloat16 on a CPU with AMX it is most of the time: 2.6 ms of a single
    row's 2.7, where the packed copy takes 1.6 ms, and 5.1 ms for 64 rows against 3.0 packed;
    batches of changing sizes, as a gateway under load runs, cost about twice as much plain.
    Packed once, at load (oneDNN's own layout, the ReLU after each layer fused into it), the
    kernels skip that copy. Whether and from what size packing wins depends on the model, the
    precision and the machine (a 128-wide policy is faster plain at every size), so both are
    timed here at PACK_SIZES and the packed copy serves from the smallest size past which it
    wins at every timed size; None when it never does, or when this torch has no oneDNN kernels
    for the precision. The copy doubles the weights held (admission counts it).
    """
    layers = list(network.children()) if isinstance(network, nn.Sequential) else []
    if not layers or not _packable(spec):
        return None
    try:
        packed_layers = _packed_layers(layers)
        if packed_layers is None:
            return None
        packed = Packed(nn.Sequential(*packed_layers).eval(), 0, {})
        _time_both(network, packed, spec, runs)
    except (RuntimeError, NotImplementedError) as exc:  # kernels this CPU's oneDNN lacks
        log.warning("model_packing_unavailable", model=spec.name, dtype=spec.dtype,
                    error=f"{type(exc).__name__}: {exc}", serving="plain")  # fmt: skip
        return None
    from_rows = packed_from(packed.timings_ms)
    log.info("model_packing", model=spec.name, dtype=spec.dtype, packed_from_rows=from_rows,
             plain_vs_packed_ms=packed.timings_ms)  # fmt: skip
    if from_rows is None:
        return None
    packed.from_rows = from_rows
    return packed


def _time_both(network: nn.Module, packed: Packed, spec: ModelSpec, runs: int) -> None:
    """Fills `packed.timings_ms`: the best of `runs` of each at every PACK_SIZES batch."""
    runs_of: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = (network, packed)
    dtype = DTYPES[spec.dtype][0]
    with torch.inference_mode():
        for rows in PACK_SIZES:
            x = torch.randn(rows, spec.input_dim).to(dtype)
            for run in runs_of:
                run(x)  # the first call of a size allocates its buffers
            best = [float("inf")] * len(runs_of)
            for _ in range(runs):  # in turn, so that a slow moment of the host slows both
                for i, run in enumerate(runs_of):
                    started = time.perf_counter()
                    run(x)
                    best[i] = min(best[i], (time.perf_counter() - started) * 1000)
            packed.timings_ms[rows] = (round(best[0], 3), round(best[1], 3))


def packed_from(timings_ms: dict[int, tuple[float, float]]) -> int | None:
    """From `{rows: (plain ms, packed ms)}`: the smallest timed size from which the packed copy
    was faster at every larger timed size, or None when it was not faster at the largest."""
    sizes = sorted(timings_ms)
    losing = [rows for rows in sizes if timings_ms[rows][1] >= timings_ms[rows][0]]
    if not losing:
        return sizes[0]
    if losing[-1] == sizes[-1]:
        return None
    return sizes[sizes.index(losing[-1]) + 1]


class Runner(Protocol):
    """Runs batches of one model on one device."""

    device: str
    spec: ModelSpec
    memory: MemoryModel
    capacity_bytes: int
    restarts: int
    """Times the device's process was started again after it was lost (0 for in-process)."""

    async def infer(self, inputs: list[list[float]]) -> list[list[float]]:
        """Outputs for `inputs`, in order; raises DeviceFault."""
        ...

    def observed_free_bytes(self) -> int | None:
        """What the device reports free (CUDA), or None where it cannot tell."""
        ...

    def utilization(self) -> float | None:
        """The share of the driver's last sample period the device computed (0 to 1; a CUDA
        GPU, through NVML), or None where there is no such figure."""
        ...

    def close(self) -> None:
        """Lets go of the device (the batcher has stopped)."""
        ...


class TorchRunner:
    """A torch model on one device, with a memory budget it enforces like a real device.

    On CUDA, allocation failures surface as DeviceFault("oom"). On the CPU there is no device
    limit to hit, so the runner holds the batch's activation bytes against `capacity_bytes` and
    fails the same way when a batch would not fit: that is what admission must prevent.
    `fault` (tests, benchmarks) is called before each batch and may raise DeviceFault.
    """

    def __init__(
        self,
        spec: ModelSpec,
        network: nn.Module,
        device: str,
        capacity_bytes: int,
        fault: Callable[[], None] | None = None,
        pack: bool = False,
        reserve_rows: int = 0,
    ) -> None:
        self.spec = spec
        self.device = device
        self.memory = memory_model(spec)
        self.capacity_bytes = capacity_bytes
        self.fault = fault
        self._network = network.to(device)
        self.packed = pack_for_cpu(self._network, spec) if pack and device == "cpu" else None
        """The pre-packed copy serving batches from `packed.from_rows` up, if it won."""
        if self.packed is not None:
            self.memory = replace(self.memory, weights_bytes=2 * self.memory.weights_bytes)
        self._held = 0
        self._lock = threading.Lock()
        self.restarts = 0
        self._cached_bytes = 0
        self._cached_read_at = float("-inf")
        self._utilization = UtilizationProbe(device, cuda_uuid(device))
        self.reserved_rows = self._reserve(reserve_rows) if device.startswith("cuda") else 0
        """On CUDA: the largest batch whose memory the runner took from the device at load
        (`_reserve`); 0 elsewhere."""

    def _reserve(self, rows: int) -> int:
        """Runs batches of 1, 2, 4, ... up to `rows` rows once, so that torch's caching
        allocator holds the blocks such batches need (and cuBLAS its workspace, and the driver
        the kernels they launch): later batches up to that size take no memory from the
        device, so another process that fills the GPU meanwhile cannot take it from them.
        `rows` is first cut to what the budget holds; where the device has not the memory now,
        the largest size tried that fitted is reserved, and the log says so. Returns the rows
        reserved."""
        rows = admissible(self.memory, self.capacity_bytes, 0, rows).admit if rows > 0 else 0
        sizes = [1 << i for i in range(rows.bit_length()) if 1 << i < rows] + [rows] * (rows > 0)
        reserved = 0
        for size in sizes:
            try:  # (run_flat waits for the device: it copies the outputs back)
                self.run_flat(array("f", bytes(4 * size * self.spec.input_dim)), size,
                              self.spec.input_dim)  # fmt: skip
            except DeviceFault as exc:
                log.warning("device_memory_reserved_short", device=self.device, wanted_rows=rows,
                            reserved_rows=reserved, error=str(exc))  # fmt: skip
                break
            reserved = size
        held = (
            torch.cuda.memory_reserved(torch.device(self.device))
            if self.device.startswith("cuda") else None
        )  # fmt: skip
        log.info("device_memory_reserved", device=self.device, rows=reserved, reserved_bytes=held)
        return reserved

    def observed_free_bytes(self) -> int | None:
        """On CUDA, what the driver reports free plus what torch's caching allocator holds
        for this process unused: both can serve a batch (the driver's figure alone counts
        blocks a finished batch left cached as taken, and would shrink batches that fit)."""
        if not self.device.startswith("cuda"):
            return None
        device = torch.device(self.device)
        free, _total = torch.cuda.mem_get_info(device)
        # The allocator's figures come from building its whole table of statistics: on an H200
        # host 68 us for memory_stats, 209 us for memory_reserved and memory_allocated (each
        # builds it), against 6 us for mem_get_info; read after every batch, they halved a
        # one-row-per-batch gateway's rate. They change only when the allocator takes or gives
        # back memory, so they are read again at most every CACHED_READ_S.
        now = time.monotonic()
        if now - self._cached_read_at >= CACHED_READ_S:
            stats = torch.cuda.memory_stats(device)
            held = stats.get("reserved_bytes.all.current", 0)
            self._cached_bytes = max(0, held - stats.get("allocated_bytes.all.current", 0))
            self._cached_read_at = now
        return int(free) + self._cached_bytes

    def utilization(self) -> float | None:
        return self._utilization.read()

    async def infer(self, inputs: list[list[float]]) -> list[list[float]]:
        return await asyncio.to_thread(self.run, inputs)

    def close(self) -> None:
        """Nothing to let go of but the driver's library: the model is this process's."""
        self._utilization.close()

    def run(self, inputs: list[list[float]]) -> list[list[float]]:
        if self.fault is not None:
            self.fault()
        if any(len(sample) != self.spec.input_dim for sample in inputs):
            raise InvalidArgument(
                f"model {self.spec.name} takes {self.spec.input_dim} inputs per sample"
            )
        flat = array("f")  # one copy into a packed buffer: far cheaper than nested lists
        for sample in inputs:
            flat.extend(sample)
        out = self.run_flat(flat, len(inputs), self.spec.input_dim)
        k = self.spec.output_dim
        return [out[i * k : (i + 1) * k].tolist() for i in range(len(inputs))]

    def run_flat(self, flat: bytearray | array[float], samples: int, width: int) -> array[float]:
        """The outputs (float32, row after row) of `samples` rows of `width` float32 numbers."""
        if width != self.spec.input_dim:
            raise InvalidArgument(
                f"model {self.spec.name} takes {self.spec.input_dim} inputs per sample, got {width}"
            )
        need = self.memory.batch_bytes(samples)
        with self._lock:
            if self.memory.weights_bytes + self._held + need > self.capacity_bytes:
                raise DeviceFault(
                    "oom",
                    f"{self.device}: out of memory: batch of {samples} needs {need} bytes, "
                    f"{self.capacity_bytes - self.memory.weights_bytes - self._held} free",
                )
            self._held += need
        try:
            x = torch.frombuffer(flat, dtype=torch.float32).view(samples, width)
            x = x.to(self.device, DTYPES[self.spec.dtype][0])
            packed = self.packed
            with torch.inference_mode():
                if packed is not None and samples >= packed.from_rows:
                    y = packed(x)
                else:
                    y = self._network(x)
            return array("f", y.float().cpu().flatten().tolist())
        except torch.cuda.OutOfMemoryError as exc:
            raise DeviceFault("oom", f"{self.device}: {exc}") from exc
        except RuntimeError as exc:
            raise DeviceFault("device_error", f"{self.device}: {exc}") from exc
        finally:
            with self._lock:
                self._held -= need


def cuda_uuid(device: str) -> str | None:
    """A CUDA device's UUID as its driver names it (`GPU-...`; `MIG-...` for a MIG instance),
    or None for any other device, or where torch cannot say (logged: only the utilization
    metric depends on it, never whether the model serves)."""
    if not device.startswith("cuda"):
        return None
    try:
        raw = str(torch.cuda.get_device_properties(torch.device(device)).uuid)
    except (AttributeError, RuntimeError, AssertionError) as exc:
        log.warning("cuda_uuid_unknown", device=device, error=f"{type(exc).__name__}: {exc}")
        return None
    return raw if raw.startswith(("GPU-", "MIG-")) else f"GPU-{raw}"


def device_capacity_bytes(device: str, mib: float) -> int:
    """A device's memory budget: `mib` when given, else the device's total (CUDA) or a quarter
    of this host's memory (the CPU has no device limit to read)."""
    if mib > 0:
        return int(mib * 1024 * 1024)
    if device.startswith("cuda"):
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
