"""A small PNG line chart, written with the standard library only (zlib + struct).

Panels stacked top to bottom, each with its own title and y scale (labelled at 0, half and the
maximum), a shared x axis labelled at quarters, light gridlines and one polyline per panel.
Text is drawn with a built-in 5x7 pixel font (upper case, digits and a little punctuation).
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
TEXT: Color = (40, 40, 40)

# 5x7 glyphs, one string of 7 rows of 5 pixels each ('#' on, '.' off).
_GLYPHS = {
    "A": ".###.#...##...#######...##...##...#",
    "B": "####.#...##...#####.#...##...#####.",
    "C": ".###.#...##....#....#....#...#.###.",
    "D": "####.#...##...##...##...##...#####.",
    "E": "######....#....####.#....#....#####",
    "F": "######....#....####.#....#....#....",
    "G": ".###.#...##....#.####...##...#.####",
    "H": "#...##...##...#######...##...##...#",
    "I": ".###...#....#....#....#....#...###.",
    "J": "..###...#....#....#....#.#..#..##..",
    "K": "#...##..#.#.#..##...#.#..#..#.#...#",
    "L": "#....#....#....#....#....#....#####",
    "M": "#...###.###.#.##.#.##...##...##...#",
    "N": "#...##...###..##.#.##..###...##...#",
    "O": ".###.#...##...##...##...##...#.###.",
    "P": "####.#...##...#####.#....#....#....",
    "Q": ".###.#...##...##...##.#.##..#..##.#",
    "R": "####.#...##...#####.#.#..#..#.#...#",
    "S": ".#####....#.....###.....#....#####.",
    "T": "#####..#....#....#....#....#....#..",
    "U": "#...##...##...##...##...##...#.###.",
    "V": "#...##...##...##...##...#.#.#...#..",
    "W": "#...##...##...##.#.##.#.##.#.#.#.#.",
    "X": "#...##...#.#.#...#...#.#.#...##...#",
    "Y": "#...##...#.#.#...#....#....#....#..",
    "Z": "#####....#...#...#...#...#....#####",
    "0": ".###.#...##..###.#.###..##...#.###.",
    "1": "..#...##....#....#....#....#...###.",
    "2": ".###.#...#....#...#...#...#...#####",
    "3": "#####...#...#.....#.....##...#.###.",
    "4": "...#...##..#.#.#..#.#####...#....#.",
    "5": "######....####.....#....##...#.###.",
    "6": "..##..#...#....####.#...##...#.###.",
    "7": "#####....#...#...#...#....#....#...",
    "8": ".###.#...##...#.###.#...##...#.###.",
    "9": ".###.#...##...#.####....#...#..##..",
    " ": "." * 35,
    ".": "." * 25 + ".##...##..",
    "-": "." * 15 + "#####" + "." * 15,
    "/": ".........#...#...#...#...#.........",
    ",": "." * 20 + ".##....#...#...",
    ":": "......##...##........##...##.......",
    "(": "...#...#...#....#....#.....#.....#.",
    ")": ".#.....#.....#....#....#...#...#...",
}


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

    def text(self, x: int, y: int, words: str, color: Color = TEXT, scale: int = 2) -> int:
        """Draws `words` with its top left corner at (x, y); returns the width it took."""
        left = x
        for char in words.upper():
            glyph = _GLYPHS.get(char)
            if glyph is None:
                raise ValueError(f"chart text {words!r}: no glyph for {char!r}")
            for row in range(7):
                for col in range(5):
                    if glyph[row * 5 + col] == "#":
                        for oy in range(scale):
                            for ox in range(scale):
                                self.dot(x + col * scale + ox, y + row * scale + oy, color)
            x += 6 * scale
        return x - left

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


def printable(words: str) -> str:
    """`words` with each character the font lacks drawn as '-'."""
    return "".join(c if c.upper() in _GLYPHS else "-" for c in words)


def _tick(value: float) -> str:
    return f"{value:.3g}"


def line_chart(
    path: Path,
    panels: list[list[tuple[float, float]]],
    width: int = 900,
    panel_height: int = 220,
    titles: list[str] | None = None,
    x_label: str = "",
) -> None:
    """One panel per series of (x, y) points; x shared, y from 0 to each series' maximum."""
    gap, title_h, left = 14, 22, 76
    right = width - 24
    height = gap + len(panels) * (title_h + panel_height + gap) + 40
    canvas = Canvas(width, height)
    xs = [x for series in panels for x, _ in series] or [0.0, 1.0]
    x_lo, x_hi = min(xs), max(xs)
    span = (x_hi - x_lo) or 1.0
    bottom = 0
    for index, series in enumerate(panels):
        top = gap + index * (title_h + panel_height + gap) + title_h
        bottom = top + panel_height
        color = COLORS[index % len(COLORS)]
        if titles and index < len(titles):
            canvas.text(left, top - title_h + 2, titles[index], color)
        for q in range(5):
            y = bottom - q * panel_height // 4
            canvas.line(left, y, right, y, GRID)
            x = left + q * (right - left) // 4
            canvas.line(x, top, x, bottom, GRID)
        canvas.line(left, top, left, bottom, AXIS)
        canvas.line(left, bottom, right, bottom, AXIS)
        y_hi = max((y for _, y in series), default=1.0) or 1.0
        for fraction in (0.0, 0.5, 1.0):
            label = _tick(y_hi * fraction)
            y = bottom - round(fraction * (panel_height - 4))
            canvas.text(left - 8 - 12 * len(label), y - 7, label)
        points = [
            (
                left + round((x - x_lo) / span * (right - left)),
                bottom - round(y / y_hi * (panel_height - 4)),
            )
            for x, y in series
        ]
        for (x0, y0), (x1, y1) in itertools.pairwise(points):
            canvas.line(x0, y0, x1, y1, color, thick=2)
    for q in range(5):
        label = _tick(x_lo + q * span / 4)
        x = left + q * (right - left) // 4
        canvas.text(max(left, min(x - 6 * len(label), right - 12 * len(label))), bottom + 8, label)
    if x_label:
        canvas.text(left + (right - left) // 2 - 6 * len(x_label), bottom + 26, x_label, AXIS)
    path.write_bytes(canvas.png())
