"""The main report's plots: final loss against α, loss per round, the partition heatmaps, clusters vs labels.

Inputs are pipeline/studies/main_job/report.py's tables. An algorithm whose result is its clients' own models
(column ``result_is_personal``, e.g. FedRep, whose global head is never trained) is drawn from those
models' loss on the clients' own test splits, never from its global loss: that loss measures an
untrained head, and on a shared axis it would squash every other curve.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pandas as pd

from partitioning.groupings import EMBEDDING_BASED, IID_REFERENCE, LABEL_BASED
from utils.plots import plt, save_figure
from utils.statistics import NONNEGATIVE, mean_interval

GROUPING_STYLE = {LABEL_BASED: ("-", "o", "C0"), EMBEDDING_BASED: ("--", "s", "C1"), IID_REFERENCE: (":", None, "grey")}
GROUPING_NAME = {LABEL_BASED: "label-based (solid)", EMBEDDING_BASED: "embedding-based (dashed)",
                 IID_REFERENCE: "iid reference (dotted)"}


def plot_loss_vs_alpha(finals: pd.DataFrame, path: Path) -> None:
    """One panel per task (rows) × algorithm (columns): final loss against α (``finals`` from report.results_finals:
    an algorithm with ``model`` "personal" is drawn from its clients' own models, and its axis says so), label-based solid, embedding-based dashed,
    the iid reference dotted (no α); bands are 95% intervals of the mean on the log scale (never below 0). The legend
    sits below the panels, off the data."""
    tasks, algorithms = sorted(finals.task.unique()), sorted(finals.algorithm.unique())
    figure, axes = plt.subplots(len(tasks), len(algorithms), figsize=(3.6 * len(algorithms), 3.0 * len(tasks) + 0.6),
                                squeeze=False, sharex=True, layout="constrained")
    for row, task in enumerate(tasks):
        for column, algorithm in enumerate(algorithms):
            axis = axes[row][column]
            rows = finals[(finals.task == task) & (finals.algorithm == algorithm)]
            for grouping, group in rows.groupby("grouping"):
                style, marker, color = GROUPING_STYLE.get(grouping, ("-.", None, "black"))
                cells = [(alpha, *mean_interval(list(cell.loss), NONNEGATIVE)) for alpha, cell in group.groupby("alpha")]
                alphas, means, lows, highs = (np.array(values, dtype=float) for values in zip(*cells))
                if grouping == IID_REFERENCE:
                    axis.axhline(means[0], color=color, linestyle=style, label=GROUPING_NAME[grouping])
                    continue
                axis.plot(alphas, means, color=color, linestyle=style, marker=marker,
                          label=GROUPING_NAME.get(grouping, grouping))
                axis.fill_between(alphas, lows, highs, color=color, alpha=0.15)
            axis.set_xscale("log")
            axis.set_title(f"{task} · {algorithm}", fontsize=9)
            axis.set_xlabel("Dirichlet α")
            personal = "model" in rows and (rows.model == "personal").any()
            axis.set_ylabel("final test loss, clients' own models" if personal else "final global test loss")
    handles = {}
    for axis in axes.flat:  # every grouping once, whichever panel has it
        for handle, label in zip(*axis.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    handles["95% interval (log scale)"] = plt.Rectangle((0, 0), 1, 1, color="C0", alpha=0.15)
    figure.legend(list(handles.values()), list(handles), loc="outside lower center", ncol=len(handles), fontsize=8)
    save_figure(figure, path, dpi=110)


def plot_round_curves(curves: pd.DataFrame, path: Path) -> None:
    """Mean test loss per round; rows = task, columns = α, colour = algorithm, line style = grouping (the legend, below
    the panels, names both). Rows of ``model`` "personal" are the clients' own models' loss (the legend says so)."""
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
                          linestyle=GROUPING_STYLE.get(grouping, ("-.",))[0])
            axis.set_title(f"{task}, {'iid reference' if np.isinf(alpha) else f'α={alpha:g}'}", fontsize=9)
            axis.set_xlabel("round")
            axis.set_ylabel("global test loss")
    # Two legends' worth in one: colour says the algorithm, line style the grouping.
    groupings = [grouping for grouping in GROUPING_STYLE if grouping in set(curves.grouping)]
    personal = set(curves[curves.model == "personal"].algorithm) if "model" in curves else set()
    handles = [plt.Line2D([], [], color=f"C{index}", label=f"{algorithm} (clients' own models)" if algorithm in personal
                          else algorithm) for index, algorithm in enumerate(algorithms)]
    handles += [plt.Line2D([], [], color="black", linestyle=GROUPING_STYLE[grouping][0], label=GROUPING_NAME[grouping])
                for grouping in groupings]
    figure.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 6), fontsize=8)
    save_figure(figure, path, dpi=100)


def plot_heatmaps(heatmaps: dict[tuple[str, str, float], Path], path: Path) -> None:
    """The seed-0 partition heatmaps, label-based beside embedding-based, one row per task × α."""
    keys = sorted({(task, alpha) for task, _, alpha in heatmaps})
    figure, axes = plt.subplots(len(keys), 2, figsize=(9, 3.4 * len(keys)), squeeze=False)
    for row, (task, alpha) in enumerate(keys):
        for column, grouping in enumerate((LABEL_BASED, EMBEDDING_BASED)):
            axis = axes[row][column]
            axis.axis("off")
            image_path = heatmaps.get((task, grouping, alpha))
            if image_path is not None and Path(image_path).is_file():
                axis.imshow(mpimg.imread(image_path))
            axis.set_title(f"{task}, {grouping}, α={alpha:g}", fontsize=9)
    save_figure(figure, path, dpi=100)


def plot_agreement(agreement: dict[str, dict[str, float]], path: Path) -> None:
    """NMI and ARI between embedding clusters and class labels per task (1 = same grouping)."""
    tasks = sorted(agreement)
    positions = np.arange(len(tasks))
    figure, axis = plt.subplots(figsize=(max(4.0, 1.3 * len(tasks)), 3.5))
    axis.bar(positions - 0.2, [agreement[task]["nmi"] for task in tasks], width=0.4, label="NMI")
    axis.bar(positions + 0.2, [agreement[task]["ari"] for task in tasks], width=0.4, label="ARI")
    axis.set_xticks(positions, tasks, rotation=30, ha="right")
    axis.set_ylim(0, 1)
    axis.set_ylabel("agreement with class labels")
    axis.legend()
    save_figure(figure, path, dpi=110)
