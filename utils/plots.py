"""Curves from a long-format metrics CSV (one PNG, one panel per metric), and the one way figures are saved.

Works for any long-format file with a numeric x column, a ``metric`` and a
``value`` column: step 2's ``epoch, split, metric, value`` and the federated
runs' ``round, split, client, metric, value`` alike (``where`` selects rows,
e.g. ``{"client": "global"}``).
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a display
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from utils.errors import TaskHetError  # noqa: E402


def plot_curves(metrics_csv: Path, out_png: Path, x: str = "epoch", hue: str = "split",
                where: dict[str, object] | None = None, title: str | None = None) -> Path | None:
    """Plot every metric of a long-format CSV against ``x``, one line per ``hue`` value.

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
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
    for axis, metric in zip(axes.flat, metric_names):
        subset = frame[frame["metric"] == metric]
        groups = subset.groupby(hue, sort=True) if hue in subset.columns else [(None, subset)]
        for label, group in groups:
            group = group.sort_values(x)
            axis.plot(group[x], group["value"], marker="o", markersize=3, label=None if label is None else str(label))
        axis.set_title(metric)
        axis.set_xlabel(x)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
        if hue in subset.columns:
            axis.legend(fontsize="small")
    for axis in list(axes.flat)[len(metric_names):]:
        axis.set_visible(False)
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
