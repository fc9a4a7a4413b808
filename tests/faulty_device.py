"""A device that raises on one batch, inside a real engine process.

`install(directory)` writes a `sitecustomize.py` there; an engine started with that directory
first on its PYTHONPATH has a `TorchRunner.run_flat` that, for a batch whose first value is
`FAULT_MARK`, makes the device raise: on CUDA a real device-side assert (an index out of range
in a kernel), which poisons the process's CUDA context for good, as CUDA's sticky errors do; on
a CPU a RuntimeError. `device_error_then_fresh_engine` drives one engine through it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from gateway.engine import EngineRunner
from gateway.model import DeviceFault, model_specs

FAULT_MARK = 4242.0

SITECUSTOMIZE = f"""
import struct

from gateway import model

_run_flat = model.TorchRunner.run_flat


def run_flat(self, flat, samples, width):
    if samples and struct.unpack_from("<f", flat, 0)[0] == {FAULT_MARK}:
        try:
            if self.device.startswith("cuda"):
                import torch

                dev = torch.device(self.device)
                torch.zeros(1, device=dev)[torch.tensor([5], device=dev)].item()
            raise RuntimeError("injected device error")
        except Exception as exc:
            raise model.DeviceFault("device_error", f"{{self.device}}: {{exc}}") from exc
    return _run_flat(self, flat, samples, width)


model.TorchRunner.run_flat = run_flat
"""


def install(directory: Path) -> str:
    """Writes the hook into `directory`; returns it, to go first on the engine's PYTHONPATH."""
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return str(directory)


async def device_error_then_fresh_engine(device: str) -> dict[str, Any]:
    """An engine (the hook installed) answers a batch, faults on the marked one, and is started
    again: what each step gave, and the pids and restarts seen."""
    spec = model_specs()["gridworld-policy"]
    runner = EngineRunner(spec, spec.directory / "models.toml", device)
    batch = [[0.25 * (i % 4)] * spec.input_dim for i in range(4)]
    try:
        await asyncio.to_thread(runner.start)
        first_pid = runner.pid
        before = await runner.infer(batch)
        fault: DeviceFault | None = None
        try:
            await runner.infer([[FAULT_MARK] * spec.input_dim])
        except DeviceFault as exc:
            fault = exc
        deadline = time.monotonic() + 120
        while runner.restarts < 1 or runner.pid in (None, first_pid):
            assert time.monotonic() < deadline, "no fresh engine within 120 s"
            await asyncio.sleep(0.05)
        after = await runner.infer(batch)
        return {"before": before, "after": after, "fault": fault, "first_pid": first_pid,
                "pid": runner.pid, "restarts": runner.restarts}  # fmt: skip
    finally:
        runner.close()
