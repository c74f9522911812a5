"""Shared plotting: curves from a long-format metrics CSV, the one way figures are saved, and the conventions every
plot follows (a legend outside the data, a unit on every axis, a curve equal to another drawn once).

``plot_curves`` works for any long-format file with a numeric x column, a ``metric`` and a ``value``
column: step 2's ``epoch, split, metric, value`` and the federated runs' ``round, split, client,
metric, value`` alike (``where`` selects rows, e.g. ``{"client": "global"}``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # files only; never a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from utils.errors import TaskHetError  # noqa: E402

# What each metric is measured in (models/metrics.py), for axis labels. A loss is each task's own (losses.py).
METRIC_UNITS = {
    "loss": "task loss, no unit", "train_loss": "task loss, no unit", "lr": "learning rate",
    "mean_angle": "degrees", "median_angle": "degrees", "within_11_25": "share of pixels, 0–1",
    "delta1": "share of pixels, 0–1", "abs_rel": "share of the true depth", "rmse": "target units (depth: metres)",
    "l1": "target units (depth: metres)", "miou": "mean IoU, 0–1", "pixel_acc": "share of pixels, 0–1",
    "top1": "share of samples, 0–1", "top5": "share of samples, 0–1",
}
# The clients' spread drawn around a curve: these quantiles of the per-client values (never outside their range).
BAND_QUANTILES = (0.1, 0.9)
BAND_NAME = "clients' 10–90% range"


def metric_unit(metric: str) -> str:
    """The unit of ``metric`` (``top1_head`` is top-1's), or ``value`` for one this table does not know."""
    return METRIC_UNITS.get("top1" if metric.startswith("top1_") else metric, "value")


def metric_label(metric: str) -> str:
    """An axis label with its unit: ``mean_angle (degrees)``."""
    return f"{metric} ({metric_unit(metric)})"


def legend_outside(figure: plt.Figure, handles: Sequence, labels: Sequence[str], where: str = "right",
                   **options) -> matplotlib.legend.Legend | None:
    """One figure legend beside the panels (``where``: right or lower), never over the data; the figure must be
    made with ``layout="constrained"``, which makes room for it. None when there is nothing to name."""
    if not handles:
        return None
    if where == "right":
        # centred: at the top it would run into a figure title (suptitle), which spans the whole width
        return figure.legend(list(handles), list(labels), loc="outside right center", fontsize="small", **options)
    # Below: as many entries a row as fit the figure's width (about 11 small characters an inch, a swatch ≈ 4).
    fit = int(figure.get_figwidth() * 11 // (max(len(label) for label in labels) + 4))
    return figure.legend(list(handles), list(labels), loc="outside lower center", fontsize="small",
                         ncol=max(1, min(len(handles), 4, fit)), **options)


def figure_handles(figure: plt.Figure) -> tuple[list, list[str]]:
    """Every labelled artist of the figure's axes, each label once (the first artist that has it)."""
    found: dict[str, object] = {}
    for axis in figure.axes:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            found.setdefault(label, handle)
    return list(found.values()), list(found)


# Curves closer than this (relative to their values) are one line on a plot: no reader can tell them apart.
SAME_CURVE_RTOL = 5e-3


class CurvesOnce:
    """Draws curves on one axis, a curve that equals one already drawn (same x, y within ``SAME_CURVE_RTOL``) not
    again: the drawn one's label becomes ``first = second`` (equal numbers) or ``first ≈ second``, so two names for
    the same rows show as one line, not one hidden under the other (e.g. the global model's test loss and the mean
    of its clients' losses when the clients' test rows are the test split)."""

    def __init__(self, axis: plt.Axes) -> None:
        self.axis, self.drawn = axis, []

    def plot(self, x: np.ndarray, y: np.ndarray, label: str, **style) -> matplotlib.lines.Line2D:
        x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
        for seen_x, seen_y, line in self.drawn:
            if seen_x.shape == x.shape and np.array_equal(seen_x, x) and np.allclose(seen_y, y, rtol=SAME_CURVE_RTOL,
                                                                                       atol=0):
                line.set_label(f"{line.get_label()} {'=' if np.array_equal(seen_y, y) else '≈'} {label}")
                return line
        line, = self.axis.plot(x, y, label=label, **style)
        self.drawn.append((x, y, line))
        return line


def plot_curves(metrics_csv: Path, out_png: Path, x: str = "epoch", hue: str = "split",
                where: dict[str, object] | None = None, title: str | None = None) -> Path | None:
    """Plot every metric of a long-format CSV against ``x``, one line per ``hue`` value, one panel per metric (its
    unit on the axis) and one legend for all, beside the panels.

    Args:
        metrics_csv: CSV with columns ``x``, ``hue`` (optional), ``metric``, ``value``.
        out_png: where to write the PNG (parent folders are created).
        x: the column on the horizontal axis (``epoch``, ``round``).
        hue: the column whose values get one line each; ignored if absent.
        where: keep only rows whose columns equal these values.
        title: figure title.

    Returns:
        ``out_png``, or None when no row is left to plot.

    Raises:
        TaskHetError: the CSV lacks ``x``, ``metric`` or ``value``.
    """
    frame = pd.read_csv(metrics_csv)
    missing = [column for column in (x, "metric", "value") if column not in frame.columns]
    if missing:
        raise TaskHetError(f"{metrics_csv}: missing column(s) {', '.join(missing)} needed for the curves")
    for column, value in (where or {}).items():
        frame = frame[frame[column].astype(str) == str(value)]
    frame = frame.assign(value=pd.to_numeric(frame["value"], errors="coerce")).dropna(subset=["value"])
    if frame.empty:
        return None
    metric_names = list(dict.fromkeys(frame["metric"]))
    columns = min(3, len(metric_names))
    rows = math.ceil(len(metric_names) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns + 1.6, 3.2 * rows + 0.4), squeeze=False,
                                layout="constrained")
    for axis, metric in zip(axes.flat, metric_names):
        subset = frame[frame["metric"] == metric]
        groups = subset.groupby(hue, sort=True) if hue in subset.columns else [(None, subset)]
        for label, group in groups:
            group = group.sort_values(x)
            axis.plot(group[x], group["value"], marker="o", markersize=3, label=None if label is None else str(label))
        axis.set_title(metric)
        axis.set_xlabel(x)
        axis.set_ylabel(metric_unit(metric))
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(metric_names):]:
        axis.set_visible(False)
    if hue in frame.columns:
        legend_outside(figure, *figure_handles(figure), title=hue)
    if title:
        figure.suptitle(title, wrap=True)  # wrapped to the figure's width: a one-panel figure is narrower than a long title
    save_figure(figure, out_png)
    return Path(out_png)


def save_figure(figure: plt.Figure, path: Path, dpi: int = 120) -> None:
    """Lay out, write atomically (an interrupted save never leaves a truncated PNG) and close ``figure``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if figure.get_layout_engine() is None:  # a figure made with layout="constrained" (legend outside) lays itself out
        figure.tight_layout()
    partial = path.with_name(path.stem + ".partial" + path.suffix)  # keeps the suffix: matplotlib picks the format by it
    figure.savefig(partial, dpi=dpi)
    plt.close(figure)
    partial.replace(path)
