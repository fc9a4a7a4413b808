"""The demo's PNG chart: a valid PNG whose panels carry their titles and scales."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from fleet.demo.chart import TEXT, Canvas, line_chart


def pixels(png: bytes) -> tuple[int, int, bytes]:
    """(width, height, RGB rows without filter bytes) of a PNG this module wrote."""
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    width, height = struct.unpack(">II", png[16:24])
    start = png.index(b"IDAT") + 4
    length = struct.unpack(">I", png[start - 8 : start - 4])[0]
    raw = zlib.decompress(png[start : start + length])
    rows = b"".join(raw[y * (3 * width + 1) + 1 : (y + 1) * (3 * width + 1)] for y in range(height))
    return width, height, rows


def test_text_is_drawn_glyph_by_glyph_and_unknown_characters_are_refused() -> None:
    canvas = Canvas(40, 20)
    assert canvas.text(0, 0, "a1") == 24  # two glyphs, 12 pixels each at scale 2
    lit = {(i // 3) % 40 for i in range(0, len(canvas.pixels), 3)
           if bytes(canvas.pixels[i : i + 3]) == bytes(TEXT)}  # fmt: skip
    assert lit and max(lit) < 24
    with pytest.raises(ValueError, match="no glyph for '€'"):
        canvas.text(0, 0, "5 €")


def test_chart_has_a_title_and_a_scale_per_panel(tmp_path: Path) -> None:
    path = tmp_path / "chart.png"
    series = [[(0.0, 0.0), (1.0, 4.0), (2.0, 2.0)], [(0.0, 1.0), (2.0, 0.0)]]
    line_chart(path, series, titles=["first", "second"], x_label="seconds")
    width, height, rows = pixels(path.read_bytes())
    assert (width, height) == (900, 14 + 2 * (22 + 220 + 14) + 40)

    def colored(y0: int, y1: int, x0: int, x1: int) -> bool:
        for y in range(y0, y1):
            for x in range(x0, x1):
                if rows[3 * (y * width + x) : 3 * (y * width + x) + 3] != b"\xff\xff\xff":
                    return True
        return False

    assert colored(14, 36, 76, 200)  # the first panel's title
    assert colored(14 + 256, 36 + 256, 76, 200)  # the second's
    assert colored(36, 260, 0, 70)  # y scale labels left of the axis
    assert not colored(36, 260, 0, 10)  # inside the margin, nothing spills to the edge
