"""Charts drawn on the server as SVG geometry: a template places the numbers this module
computes into <svg> elements (presentation attributes only, no script and no inline style, so
the console's Content-Security-Policy holds and nothing is fetched from elsewhere).

Pure: numbers in, coordinates out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WIDTH = 640.0
HEIGHT = 180.0
PAD = 28.0
"""Room left of and under the plot for its axis labels."""


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    title: str
    """What the bar stands for (its tooltip)."""


@dataclass(frozen=True)
class Chart:
    """One chart: a step line (`points`, an SVG polyline) or bars, with its axes' ends."""

    points: str
    bars: list[Bar]
    marks: list[tuple[float, str]]
    """(x, title) of events drawn as vertical ticks (a pause, a resume)."""
    y_max: float
    x_from: float
    x_to: float
    width: float = WIDTH
    height: float = HEIGHT
    pad: float = PAD

    @property
    def empty(self) -> bool:
        return not self.points and not self.bars


def _scale(value: float, low: float, high: float, out_low: float, out_high: float) -> float:
    if high <= low:
        return out_low
    return out_low + (value - low) * (out_high - out_low) / (high - low)


def step_line(
    samples: Sequence[tuple[float, float]], start: float, end: float,
    marks: Sequence[tuple[float, str]] = (),
) -> Chart:  # fmt: skip
    """A value that holds until it changes (a pool's cap) over [start, end]: `samples` are
    (time, value) in order; the line runs level from each to the next, and on to `end`."""
    y_max = max([v for _, v in samples] + [1.0])
    inside = [(t, v) for t, v in samples if t <= end]
    coords: list[tuple[float, float]] = []
    for i, (t, v) in enumerate(inside):
        x = _scale(max(t, start), start, end, PAD, WIDTH)
        y = _scale(v, 0.0, y_max, HEIGHT - PAD, 4.0)
        if i:
            coords.append((x, coords[-1][1]))  # (level until this change)
        coords.append((x, y))
    if coords:
        coords.append((WIDTH, coords[-1][1]))
    return Chart(
        points=" ".join(f"{x:.1f},{y:.1f}" for x, y in coords), bars=[],
        marks=[(_scale(t, start, end, PAD, WIDTH), title) for t, title in marks
               if start <= t <= end],
        y_max=y_max, x_from=start, x_to=end,
    )  # fmt: skip


def bars(values: Sequence[tuple[str, float]], start: float, end: float) -> Chart:
    """One bar per value (a slice of a window), side by side over the plot, in order."""
    y_max = max([v for _, v in values] + [0.0]) or 1.0
    width = (WIDTH - PAD) / max(len(values), 1)
    out = []
    for i, (title, value) in enumerate(values):
        top = _scale(value, 0.0, y_max, HEIGHT - PAD, 4.0)
        out.append(Bar(PAD + i * width + 1, top, max(width - 2, 1.0), HEIGHT - PAD - top, title))
    return Chart(points="", bars=out, marks=[], y_max=y_max, x_from=start, x_to=end)
