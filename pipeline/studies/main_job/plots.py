"""The main report's plots: final loss against α, loss per round, the partition heatmaps, clusters vs labels.

Inputs are pipeline/studies/main_job/report.py's tables. An algorithm whose result is its clients' own models
(column ``result_is_personal``, e.g. FedRep, whose global head is never trained) is drawn from those
models' loss on the clients' own test splits, never from its global loss: that loss measures an
untrained head, and on a shared axis it would squash every other curve. Every legend sits beside or below
the panels (utils.plots.legend_outside) and every axis names its unit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from partitioning.groupings import EMBEDDING_BASED, IID_REFERENCE, LABEL_BASED, PROPERTY_BASED
from utils.errors import TaskHetError
from utils.loaders import read_csv
from utils.plots import legend_outside, metric_unit, plt, save_figure
from utils.statistics import NONNEGATIVE, mean_interval

GROUPING_STYLE = {LABEL_BASED: ("-", "o", "C0"), EMBEDDING_BASED: ("--", "s", "C1"),
                  PROPERTY_BASED: ("-.", "^", "C2"), IID_REFERENCE: (":", None, "grey")}
GROUPING_NAME = {LABEL_BASED: "label-based (solid)", EMBEDDING_BASED: "embedding-based (dashed)",
                 PROPERTY_BASED: "property-based control (dash-dot)", IID_REFERENCE: "iid reference (dotted)"}
BAND_NOTE = "; band: 95% interval of the mean (log scale)"
MIN_CURVE_ROUNDS = 3  # fewer evaluated rounds draw a straight line between two points, not a curve
LOSS_UNIT = f"({metric_unit('loss')})"


def plot_loss_vs_alpha(finals: pd.DataFrame, path: Path) -> None:
    """One panel per task (rows) × algorithm (columns): final loss against α (``finals`` from report.results_finals:
    an algorithm with ``model`` "personal" is drawn from its clients' own models, and its axis says so), label-based solid, embedding-based dashed,
    the iid reference dotted (no α); bands are 95% intervals of the mean on the log scale (never below 0). The legend
    sits below the panels, off the data, and shows each grouping's band with its line."""
    tasks, algorithms = sorted(finals.task.unique()), sorted(finals.algorithm.unique())
    figure, axes = plt.subplots(len(tasks), len(algorithms), figsize=(3.6 * len(algorithms), 3.0 * len(tasks) + 0.6),
                                squeeze=False, sharex=True, layout="constrained")
    entries = {}  # legend label -> its artists: every grouping once, a banded line with its own band's swatch
    for row, task in enumerate(tasks):
        for column, algorithm in enumerate(algorithms):
            axis = axes[row][column]
            rows = finals[(finals.task == task) & (finals.algorithm == algorithm)]
            for grouping, group in rows.groupby("grouping"):
                style, marker, color = GROUPING_STYLE.get(grouping, ("-.", None, "black"))
                cells = [(alpha, *mean_interval(list(cell.loss), NONNEGATIVE)) for alpha, cell in group.groupby("alpha")]
                alphas, means, lows, highs = (np.array(values, dtype=float) for values in zip(*cells))
                name = GROUPING_NAME.get(grouping, grouping)
                if grouping == IID_REFERENCE:
                    entries.setdefault(name, axis.axhline(means[0], color=color, linestyle=style))
                    continue
                line, = axis.plot(alphas, means, color=color, linestyle=style, marker=marker)
                band = axis.fill_between(alphas, lows, highs, color=color, alpha=0.15, linewidth=0)
                entries.setdefault(name + BAND_NOTE, (band, line))
            axis.set_xscale("log")
            axis.set_title(f"{task} · {algorithm}", fontsize=9)
            axis.set_xlabel("Dirichlet α (log scale)")
            personal = "model" in rows and (rows.model == "personal").any()
            axis.set_ylabel(("final test loss, clients' own models" if personal else "final global test loss")
                            + f"\n{LOSS_UNIT}")
    legend_outside(figure, list(entries.values()), list(entries), where="lower")
    save_figure(figure, path, dpi=110)


def evaluated_rounds(curves: pd.DataFrame) -> dict[str, list[int]]:
    """Each task's evaluated rounds (those of any of its runs), ascending; the round curves' points."""
    if curves.empty:
        return {}
    return {task: sorted(int(value) for value in rows["round"].unique()) for task, rows in curves.groupby("task")}


def plot_round_curves(curves: pd.DataFrame, path: Path) -> None:
    """Mean test loss per round; rows = task, columns = α, colour = algorithm, line style = grouping (the legend, below
    the panels, names both), a marker at each evaluated round (so few of them show as few). Rows of ``model``
    "personal" are the clients' own models' loss (the legend says so)."""
    tasks, alphas = sorted(curves.task.unique()), sorted(curves.alpha.unique())
    figure, axes = plt.subplots(len(tasks), len(alphas), figsize=(4.2 * len(alphas), 3.2 * len(tasks) + 0.8),
                                squeeze=False, layout="constrained")
    mean = curves.groupby(["task", "alpha", "algorithm", "grouping", "round"]).loss.mean().reset_index()
    algorithms = sorted(curves.algorithm.unique())
    for row, task in enumerate(tasks):
        for column, alpha in enumerate(alphas):
            axis = axes[row][column]
            for (algorithm, grouping), group in mean[(mean.task == task) & (mean.alpha == alpha)].groupby(["algorithm", "grouping"]):
                axis.plot(group["round"], group.loss, color=f"C{algorithms.index(algorithm)}",
                          linestyle=GROUPING_STYLE.get(grouping, ("-.",))[0], marker="o", markersize=3)
            axis.set_title(f"{task}, {'iid reference' if np.isinf(alpha) else f'α={alpha:g}'}", fontsize=9)
            axis.set_xlabel("round")
            axis.set_ylabel(f"global test loss\n{LOSS_UNIT}")
    # Two legends' worth in one: colour says the algorithm, line style the grouping.
    groupings = [grouping for grouping in GROUPING_STYLE if grouping in set(curves.grouping)]
    personal = set(curves[curves.model == "personal"].algorithm) if "model" in curves else set()
    handles = [plt.Line2D([], [], color=f"C{index}", label=f"{algorithm} (clients' own models)" if algorithm in personal
                          else algorithm) for index, algorithm in enumerate(algorithms)]
    handles += [plt.Line2D([], [], color="black", linestyle=GROUPING_STYLE[grouping][0], label=GROUPING_NAME[grouping])
                for grouping in groupings]
    legend_outside(figure, handles, [handle.get_label() for handle in handles], where="lower")
    save_figure(figure, path, dpi=100)


def plot_heatmaps(heatmaps: dict[tuple[str, str, float], Path], path: Path) -> None:
    """The seed-0 partitions, label-based beside embedding-based, one row per task × α: each client's share of every
    group, drawn from the client_stats.csv beside step 3b's heatmap (one title per panel, not the heatmap's own)."""
    keys = sorted({(task, alpha) for task, _, alpha in heatmaps})
    figure, axes = plt.subplots(len(keys), 2, figsize=(10, 3.4 * len(keys) + 0.4), squeeze=False, layout="constrained")
    image = None
    for row, (task, alpha) in enumerate(keys):
        for column, grouping in enumerate((LABEL_BASED, EMBEDDING_BASED)):
            axis = axes[row][column]
            axis.set_title(f"{task} · {grouping.replace('_', '-')} · α={alpha:g}", fontsize=9)
            shares = client_shares(heatmaps.get((task, grouping, alpha)))
            if shares is None:
                axis.axis("off")
                continue
            image = axis.imshow(shares, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, vmax=1)
            axis.set_xlabel("group (class or embedding cluster)" if column else "group (class)")
            axis.set_ylabel("client")
    if image is not None:
        figure.colorbar(image, ax=axes, label="share of the client's samples (0–1)", shrink=0.8)
    save_figure(figure, path, dpi=100)


def client_shares(heatmap_png: Path | None) -> np.ndarray | None:
    """[clients, groups] share of each group in each client's samples, from the ``client_stats.csv`` step 3b wrote
    beside ``heatmap_png``; None when there is none (no such partition)."""
    if heatmap_png is None:
        return None
    stats_path = Path(heatmap_png).with_name("client_stats.csv")
    try:
        stats = read_csv(stats_path, "step-3b client stats")
    except TaskHetError:
        return None
    counts = stats[[column for column in stats.columns if column.startswith("count_")]].to_numpy(dtype=float)
    return counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)


def plot_agreement(agreement: dict[str, dict[str, float]], path: Path) -> None:
    """NMI and ARI between embedding clusters and class labels per task (1 = same grouping)."""
    tasks = sorted(agreement)
    positions = np.arange(len(tasks))
    figure, axis = plt.subplots(figsize=(max(4.0, 1.3 * len(tasks)) + 1.2, 3.5), layout="constrained")
    axis.bar(positions - 0.2, [agreement[task]["nmi"] for task in tasks], width=0.4, label="NMI")
    axis.bar(positions + 0.2, [agreement[task]["ari"] for task in tasks], width=0.4, label="ARI")
    axis.set_xticks(positions, tasks, rotation=30, ha="right")
    axis.set_ylim(0, 1)
    axis.set_ylabel("agreement with class labels\n(1 = the same grouping)")
    axis.set_title("embedding clusters vs class labels", fontsize=9)
    legend_outside(figure, *axis.get_legend_handles_labels())
    save_figure(figure, path, dpi=110)


def round_curves(curves: pd.DataFrame, path: Path) -> list[str]:
    """Draw the round curves of the tasks evaluated at :data:`MIN_CURVE_ROUNDS` rounds or more into ``path`` (none:
    no figure, and a stale one of an earlier report removed); returns the report's lines about them, which say how
    many rounds each drawn task has and which tasks are not drawn and why."""
    rounds = evaluated_rounds(curves)
    drawn = {task: values for task, values in rounds.items() if len(values) >= MIN_CURVE_ROUNDS}
    lines = []
    if drawn:
        plot_round_curves(curves[curves.task.isin(drawn)], path)
        counts = ", ".join(f"{task} {len(values)} rounds ({values[0]} to {values[-1]})" for task, values in drawn.items())
        lines += ["![round curves](round_curves.png)", "",
                  f"*Round curves*: the mean over seeds at each evaluated round, a marker each: {counts}."]
    else:
        Path(path).unlink(missing_ok=True)  # a figure of an earlier report must not stand in for this one
    left_out = [f"{task} (evaluated at {rounds_text(values)})" for task, values in rounds.items() if task not in drawn]
    if left_out:
        lines += ([""] if lines else []) + [
            f"No round curves for {', '.join(left_out)}: a line through fewer than {MIN_CURVE_ROUNDS} evaluated rounds "
            "is not a curve; a lower `federated.eval_every` draws them (each evaluation is a pass over the test split)."]
    return lines


def rounds_text(values: list[int]) -> str:
    """``round 3 only`` or ``rounds 0 and 22 only``: the few evaluated rounds of a task left out of the curves."""
    if len(values) == 1:
        return f"round {values[0]} only"
    return f"rounds {', '.join(str(value) for value in values[:-1])} and {values[-1]} only"
