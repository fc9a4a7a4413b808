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
    label: str = ""
    """Text drawn on the bar itself ("": none)."""


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


LANE = 22.0
"""The height of one attempt's lane on a timeline."""


def timeline(spans: Sequence[tuple[float, float | None, str, str]], now: float) -> Chart:
    """One horizontal bar per span (start, end or None while it runs, label, tooltip), each in
    its own lane, over the time from the first start to the last end (`now` for a span still
    running): a rollout's attempts, where they ran and how each ended."""
    if not spans:
        return Chart(points="", bars=[], marks=[], y_max=0.0, x_from=now, x_to=now)
    start = min(s for s, _, _, _ in spans)
    end = max(max(s, e if e is not None else now) for s, e, _, _ in spans)
    if end <= start:
        end = start + 1.0
    out = []
    for i, (began, ended, label, title) in enumerate(spans):
        x = _scale(began, start, end, PAD, WIDTH)
        right = _scale(ended if ended is not None else now, start, end, PAD, WIDTH)
        out.append(Bar(x, 4.0 + i * LANE, max(right - x, 2.0), LANE - 4.0, title, label))
    return Chart(points="", bars=out, marks=[], y_max=float(len(spans)), x_from=start,
                 x_to=end, height=4.0 + len(spans) * LANE + PAD)  # fmt: skip
