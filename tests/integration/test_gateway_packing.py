"""Pre-packed weights on a CPU primary: the same answers as the plain network, served from the
batch size the load-time timing chose, and counted by admission."""

from __future__ import annotations

import asyncio
import hashlib
import io
import random
from array import array
from pathlib import Path
from typing import Any

import pytest
import torch

import gateway.model
from gateway.engine import EngineRunner
from gateway.model import (
    PACK_SIZES,
    ModelSpec,
    TorchRunner,
    build_network,
    load_network,
    memory_model,
    model_specs,
)

WIDE = 1024


def wide_model(directory: Path) -> Path:
    """A 147-1024-1024-4 network's weights and manifest (wide enough for packing to matter)."""
    torch.manual_seed(1)
    spec = ModelSpec(name="wide", revision="t", file="wide.pt", sha256="", input_dim=147,
                     hidden=(WIDE, WIDE), output_dim=4)  # fmt: skip
    buffer = io.BytesIO()
    torch.save(build_network(spec).state_dict(), buffer)
    (directory / spec.file).write_bytes(buffer.getvalue())
    manifest = directory / "models.toml"
    manifest.write_text(
        f'[model.wide]\nrevision = "t"\nfile = "wide.pt"\n'
        f'sha256 = "{hashlib.sha256(buffer.getvalue()).hexdigest()}"\n'
        f"input_dim = 147\nhidden = [{WIDE}, {WIDE}]\noutput_dim = 4\n"
    )
    return manifest


def rows(n: int, seed: int = 0) -> list[list[float]]:
    rnd = random.Random(seed)
    return [[rnd.uniform(-1, 1) for _ in range(147)] for _ in range(n)]


def reference(net: torch.nn.Module, samples: list[list[float]]) -> list[list[float]]:
    with torch.inference_mode():
        out: list[list[float]] = net(torch.tensor(samples)).tolist()
    return out


def close(
    got: list[list[float]], want: list[list[float]], rel: float = 1e-5, abs_: float = 1e-5
) -> bool:
    # Other kernels sum in other orders: the precision's rounding apart (float32's by default).
    return all(g == pytest.approx(w, rel=rel, abs=abs_) for g, w in zip(got, want, strict=True))


def test_a_packed_runner_answers_like_the_plain_network_at_every_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packing forced from 4 rows (the timing's choice replaced): smaller batches run plain,
    larger ones packed, all to the plain network's answers; the weights count twice."""
    spec = model_specs(wide_model(tmp_path))["wide"]
    net = load_network(spec)
    monkeypatch.setattr(gateway.model, "packed_from", lambda timings: 4)
    runner = TorchRunner(spec, load_network(spec), "cpu", 1 << 34, pack=True)
    assert runner.packed is not None and runner.packed.from_rows == 4
    assert sorted(runner.packed.timings_ms) == list(PACK_SIZES)
    assert runner.memory.weights_bytes == 2 * memory_model(spec).weights_bytes

    calls: list[int] = []
    packed_forward = runner.packed.network.forward

    def counted(x: torch.Tensor) -> Any:
        calls.append(x.size(0))
        return packed_forward(x)

    runner.packed.network.forward = counted  # type: ignore[method-assign]
    for n in (1, 2, 3, 4, 5, 16, 37, 64, 100):
        samples = rows(n, seed=n)
        assert close(runner.run(samples), reference(net, samples)), n
    assert calls == [4, 5, 16, 37, 64, 100]


def test_packing_is_for_the_cpu_only_where_asked(tmp_path: Path) -> None:
    spec = model_specs(wide_model(tmp_path))["wide"]
    plain = TorchRunner(spec, load_network(spec), "cpu", 1 << 34, pack=False)
    assert plain.packed is None
    assert plain.memory == memory_model(spec)


def test_a_cpu_without_the_packed_kernels_serves_plain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where oneDNN cannot pack (its kernels refuse the layer), the runner serves the plain
    network and counts its weights once."""
    spec = model_specs(wide_model(tmp_path))["wide"]

    def refuse(self: Any, layer: Any, relu: bool) -> None:
        raise RuntimeError("no kernel for this layout")

    monkeypatch.setattr(gateway.model._PackedLinear, "__init__", refuse)
    runner = TorchRunner(spec, load_network(spec), "cpu", 1 << 34, pack=True)
    assert runner.packed is None
    assert runner.memory == memory_model(spec)
    samples = rows(5, seed=3)
    assert close(runner.run(samples), reference(load_network(spec), samples))


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU has no bfloat16 kernels"
)
def test_bfloat16_packs_and_answers_as_the_plain_bfloat16_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Served in bfloat16, the packed copy (forced from 2 rows) gives the plain bfloat16
    network's answers at every size (bit for bit on the CPUs measured; another CPU's kernels may
    sum in another order, so within bfloat16's rounding), and counts twice at 2 bytes a
    number."""
    stored = model_specs(wide_model(tmp_path))["wide"]
    spec = ModelSpec(**{**stored.__dict__, "dtype": "bfloat16"})
    monkeypatch.setattr(gateway.model, "packed_from", lambda timings: 2)
    packed = TorchRunner(spec, load_network(spec), "cpu", 1 << 34, pack=True)
    plain = TorchRunner(spec, load_network(spec), "cpu", 1 << 34, pack=False)
    assert packed.packed is not None and packed.packed.from_rows == 2
    assert packed.memory.weights_bytes == 2 * memory_model(spec).weights_bytes
    assert memory_model(spec).weights_bytes * 2 == memory_model(stored).weights_bytes
    for n in (1, 2, 7, 33, 64):
        samples = rows(n, seed=200 + n)
        assert close(packed.run(samples), plain.run(samples), rel=2**-7, abs_=1e-3), n


def test_the_engine_reports_what_it_holds_and_answers_like_the_plain_network(
    tmp_path: Path,
) -> None:
    """Whatever the engine's timing chose, admission counts the weights it holds (twice when it
    packed them), and every batch size gets the plain network's answers."""
    manifest = wide_model(tmp_path)
    spec = model_specs(manifest)["wide"]
    net = load_network(spec)
    for pack in (True, False):
        runner = EngineRunner(spec, manifest, "cpu", threads=1, pack=pack)
        runner.start()
        try:
            engine = runner._engine
            assert engine is not None
            from_rows = engine.ready["packed_from_rows"]
            if not pack:
                assert from_rows is None
            held = memory_model(spec).weights_bytes * (1 if from_rows is None else 2)
            assert engine.ready["weights_bytes"] == held == runner.memory.weights_bytes

            for got, samples in asyncio.run(batches(runner)):
                assert close(got, reference(net, samples)), len(samples)
        finally:
            runner.close()


async def batches(runner: EngineRunner) -> list[tuple[list[list[float]], list[list[float]]]]:
    out = []
    for n in (1, 3, 8, 33, 64):
        samples = rows(n, seed=100 + n)
        out.append((await runner.infer(samples), samples))
    return out


def test_run_flat_takes_packed_float32_rows(tmp_path: Path) -> None:
    """The engine's entry point: rows of float32 bytes in, rows of float32 out."""
    spec = model_specs(wide_model(tmp_path))["wide"]
    runner = TorchRunner(spec, load_network(spec), "cpu", 1 << 34, pack=True)
    samples = rows(6, seed=7)
    flat = array("f", [v for s in samples for v in s])
    out = runner.run_flat(bytearray(flat.tobytes()), 6, 147)
    got = [out[i * 4 : (i + 1) * 4].tolist() for i in range(6)]
    assert close(got, reference(load_network(spec), samples))
