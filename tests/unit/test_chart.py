"""Charts drawn with matplotlib: a PNG of the size asked, one panel per series with its title,
its y label and the shared x label; without matplotlib, a refusal that says what to install."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from fleet.core.errors import FailedPrecondition
from fleet.demo.chart import line_chart, require_matplotlib


def test_a_chart_is_a_png_with_a_panel_per_series(tmp_path: Path) -> None:
    import matplotlib.image

    path = tmp_path / "chart.png"
    series = [[(0.0, 0.0), (1.0, 4.0), (2.0, 2.0)], [(0.0, 1.2e-5), (2.0, 0.0)]]
    line_chart(path, series, titles=["first", "second"], x_label="seconds",
               y_labels=["traj / s", "cost per min"])  # fmt: skip
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (900, int(2.6 * 2 * 100 + 60))
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[:2] == (height, width)
    # Something was drawn in each half (a panel each), not a blank page.
    top, bottom = pixels[: height // 2], pixels[height // 2 :]
    assert (top[..., :3] < 0.5).any() and (bottom[..., :3] < 0.5).any()


def test_an_empty_series_still_draws_and_a_missing_library_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    line_chart(tmp_path / "empty.png", [[]], titles=["nothing yet"])
    assert (tmp_path / "empty.png").stat().st_size > 0
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a)
    )
    with pytest.raises(FailedPrecondition, match=r"pip install 'fleet\[demo\]'"):
        require_matplotlib()
