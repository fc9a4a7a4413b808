"""A small PNG line chart, written with the standard library only (zlib + struct).

Panels stacked top to bottom, each with its own y scale, a shared x axis, light gridlines at
quarters and one polyline per panel. Labels are left to the text that accompanies the chart.
"""

from __future__ import annotations

import itertools
import struct
import zlib
from pathlib import Path

Color = tuple[int, int, int]
WHITE: Color = (255, 255, 255)
GRID: Color = (225, 225, 225)
AXIS: Color = (90, 90, 90)
COLORS: tuple[Color, ...] = ((31, 119, 180), (214, 39, 40), (44, 160, 44))


class Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(WHITE * (width * height))

    def dot(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i : i + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, thick: int = 1) -> None:
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for ox in range(thick):
                for oy in range(thick):
                    self.dot(x0 + ox, y0 + oy, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def png(self) -> bytes:
        raw = b"".join(
            b"\x00" + bytes(self.pixels[3 * y * self.width : 3 * (y + 1) * self.width])
            for y in range(self.height)
        )

        def chunk(kind: bytes, data: bytes) -> bytes:
            body = kind + data
            return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
        )  # fmt: skip


def line_chart(
    path: Path,
    panels: list[list[tuple[float, float]]],
    width: int = 900,
    panel_height: int = 220,
) -> None:
    """One panel per series of (x, y) points; x shared, y from 0 to each series' maximum."""
    margin = 30
    canvas = Canvas(width, margin + len(panels) * (panel_height + margin))
    xs = [x for series in panels for x, _ in series] or [0.0, 1.0]
    x_lo, x_hi = min(xs), max(xs)
    span = (x_hi - x_lo) or 1.0
    for index, series in enumerate(panels):
        top = margin + index * (panel_height + margin)
        bottom = top + panel_height
        left, right = margin + 20, width - margin
        for q in range(5):
            y = bottom - q * panel_height // 4
            canvas.line(left, y, right, y, GRID)
            x = left + q * (right - left) // 4
            canvas.line(x, top, x, bottom, GRID)
        canvas.line(left, top, left, bottom, AXIS)
        canvas.line(left, bottom, right, bottom, AXIS)
        y_hi = max((y for _, y in series), default=1.0) or 1.0
        points = [
            (
                left + round((x - x_lo) / span * (right - left)),
                bottom - round(y / y_hi * (panel_height - 4)),
            )
            for x, y in series
        ]
        color = COLORS[index % len(COLORS)]
        for (x0, y0), (x1, y1) in itertools.pairwise(points):
            canvas.line(x0, y0, x1, y1, color, thick=2)
    path.write_bytes(canvas.png())
