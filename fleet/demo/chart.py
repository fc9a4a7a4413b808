"""Line charts as PNG files, drawn with matplotlib (the `demo` extra): panels stacked top to
bottom sharing the x axis, each with its title, its y axis' label and units, and gridlines.

matplotlib is imported when a chart is drawn, not before: a fleet without the extra runs, and
only a chart refuses, saying what to install.
"""

from __future__ import annotations

from pathlib import Path

from fleet.core.errors import FailedPrecondition


def require_matplotlib() -> None:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise FailedPrecondition(
            "charts are drawn with matplotlib, which this installation lacks: "
            "pip install 'fleet[demo]'"
        )


def line_chart(
    path: Path,
    panels: list[list[tuple[float, float]]],
    titles: list[str] | None = None,
    x_label: str = "",
    y_labels: list[str] | None = None,
    width_in: float = 9.0,
    panel_height_in: float = 2.6,
) -> None:
    """One panel per series of (x, y) points, x shared, y from 0; written to `path`."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, whatever the environment says
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(
        len(panels), 1, sharex=True, squeeze=False,
        figsize=(width_in, panel_height_in * len(panels) + 0.6), layout="constrained",
    )  # fmt: skip
    try:
        for index, (ax, series) in enumerate(zip(axes[:, 0], panels, strict=True)):
            xs = [x for x, _ in series]
            ys = [y for _, y in series]
            ax.plot(xs, ys, color=f"C{index}", linewidth=1.8, drawstyle="default")
            ax.set_ylim(bottom=0, top=max(ys, default=0) * 1.08 or 1.0)
            ax.grid(True, color="#dddddd", linewidth=0.8)
            if titles and index < len(titles):
                ax.set_title(titles[index], loc="left", fontsize=11)
            if y_labels and index < len(y_labels):
                ax.set_ylabel(y_labels[index])
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
        if x_label:
            axes[-1, 0].set_xlabel(x_label)
        figure.savefig(path, dpi=100)
    finally:
        pyplot.close(figure)
