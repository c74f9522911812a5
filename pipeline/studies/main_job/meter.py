"""The heterogeneity meter's part of the report: G² and B² by grouping and α, and their link to the loss gap.

Input ``meters``: one row per task and partition: task, grouping, alpha, seed, g2, b2 (step 3c at
the centralized model). If embedding-based partitions hurt federated training more, they should
show a larger G² at equal α; this part says whether they do, and how the G² difference tracks
the loss gap across cells (Spearman's ρ, which needs no linearity).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from partitioning.groupings import EMBEDDING_BASED, LABEL_BASED
from utils.plots import legend_outside, plt, save_figure

METER_COLUMNS = ["task", "alpha", "label_g2", "embedding_g2", "label_b2", "embedding_b2", "g2_ratio", "n_seeds"]


def meter_table(meters: pd.DataFrame) -> pd.DataFrame:
    """Mean G² and B² over seeds per task × α for both groupings; g2_ratio = embedding G² / label G²."""
    if meters.empty:
        return pd.DataFrame(columns=METER_COLUMNS)
    means = meters.groupby(["task", "alpha", "grouping"]).agg(g2=("g2", "mean"), b2=("b2", "mean"),
                                                              n_seeds=("seed", "nunique")).reset_index()
    sides = {grouping: means[means.grouping == grouping].drop(columns="grouping")
             for grouping in (LABEL_BASED, EMBEDDING_BASED)}
    table = sides[LABEL_BASED].merge(sides[EMBEDDING_BASED], on=["task", "alpha"], suffixes=("_label", "_embedding"))
    table = table.rename(columns={"g2_label": "label_g2", "g2_embedding": "embedding_g2", "b2_label": "label_b2",
                                  "b2_embedding": "embedding_b2"})
    table["g2_ratio"] = table.embedding_g2 / table.label_g2
    table["n_seeds"] = table[["n_seeds_label", "n_seeds_embedding"]].min(axis=1)
    return table[METER_COLUMNS].sort_values(["task", "alpha"]).reset_index(drop=True)


def gap_correlation(meter: pd.DataFrame, gaps: pd.DataFrame) -> tuple[float, float, int]:
    """Spearman's ρ (and its p-value) between log(G² ratio) of a task × α and the loss gap % of its algorithm cells."""
    cells = gaps.merge(meter, on=["task", "alpha"])[["g2_ratio", "gap_percent"]].dropna()
    if len(cells) < 3 or cells.g2_ratio.nunique() < 2 or cells.gap_percent.nunique() < 2:
        return float("nan"), float("nan"), len(cells)
    from scipy import stats  # here, as in utils/statistics.py: 0.8 s of every run_pipeline.py start

    rho, p_value = stats.spearmanr(np.log(cells.g2_ratio), cells.gap_percent)
    return float(rho), float(p_value), len(cells)


def meter_sentence(meter: pd.DataFrame, gaps: pd.DataFrame) -> str:
    """Whether embedding-based partitions show a larger G² at equal α, and how that tracks the loss gap."""
    larger = int((meter.g2_ratio > 1).sum())
    rho, p_value, n = gap_correlation(meter, gaps)
    link = (f"too few cells to correlate with the loss gap ({n})" if np.isnan(rho) else
            f"across {n} task × algorithm × α cells the G² ratio and the loss gap correlate with Spearman "
            f"ρ = {rho:+.2f} (p = {p_value:.2g})")
    return (f"Heterogeneity meter: embedding-based partitions have the larger gradient dissimilarity G² in {larger} of "
            f"{len(meter)} task × α cells (median ratio embedding/label {meter.g2_ratio.median():.2f}); {link}.")


def meter_markdown(meter: pd.DataFrame) -> str:
    lines = ["| task | α | label G² | embedding G² | ratio | label B² | embedding B² | seeds |", "|" + "---|" * 8]
    for row in meter.itertuples():
        lines.append(f"| {row.task} | {row.alpha:g} | {row.label_g2:.4g} | {row.embedding_g2:.4g} | {row.g2_ratio:.2f} "
                     f"| {row.label_b2:.3f} | {row.embedding_b2:.3f} | {row.n_seeds} |")
    return "\n".join(lines)


def plot_meter(meters: pd.DataFrame, path: Path) -> None:
    """G² vs α per task (mean over seeds, min–max band), label-based solid, embedding-based dashed."""
    tasks = sorted(meters.task.unique())
    figure, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks) + 2.6, 3.8), squeeze=False, layout="constrained")
    for axis, task in zip(axes[0], tasks):
        for index, grouping in enumerate((LABEL_BASED, EMBEDDING_BASED)):
            rows = meters[(meters.task == task) & (meters.grouping == grouping)]
            summary = rows.groupby("alpha").g2.agg(["mean", "min", "max"]).reset_index()
            axis.plot(summary.alpha, summary["mean"], color=f"C{index}", linestyle="-" if index == 0 else "--",
                      marker="o", label=grouping)
            axis.fill_between(summary.alpha, summary["min"], summary["max"], color=f"C{index}", alpha=0.15,
                              label=f"{grouping} min–max over seeds")
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_title(task)
        axis.set_xlabel("Dirichlet α")
        axis.set_ylabel("gradient dissimilarity G²")
    legend_outside(figure, *axes[0][-1].get_legend_handles_labels())  # beside the panels, off the data
    save_figure(figure, path, dpi=110)


# ----- partition distances (step 3b), beside G² and B² -----
DISTANCE_COLUMNS = ["task", "alpha", "grouping", "label_js", "label_hellinger", "cluster_js", "cluster_hellinger",
                    "js_gap", "n_seeds"]


def partition_distances_row(assignments_dir: Path, clusters_csv: Path) -> dict[str, float]:
    """One partition's mean Jensen–Shannon and Hellinger distances of its clients' mixtures to the pooled one, over
    the scene labels and over the task's embedding clusters.

    Step 3b records both spaces of an embedding-based partition in assignments.json; a label-based (or iid) one
    knows no clusters there, since it is shared by every task, so its cluster-space distances are computed here
    from its assignments.csv (the train rows, as step 3b does) and the task's clusters.csv, by the same function.
    """
    from partitioning.partition_stats import partition_distances
    from utils.loaders import load_json, read_csv

    record = load_json(assignments_dir / "assignments.json", "step-3b sidecar", finished=True)["distances"]
    row = {}
    for space in ("label", "cluster"):
        block = record.get(space)
        if block is None:
            rows = read_csv(assignments_dir / "assignments.csv", "assignments", ["sample_id", "client_id", "subset"],
                            dtype={"sample_id": str})
            rows = rows[rows.subset == "train"]
            clusters = read_csv(clusters_csv, "step-3 clusters", ["sample_id", "cluster"], dtype={"sample_id": str})
            groups = rows.sample_id.map(clusters.set_index("sample_id").cluster).to_numpy()
            client_of = rows.client_id.to_numpy(dtype=int)
            table = partition_distances(client_of, groups, int(client_of.max()) + 1, space)
            block = {"mean_js_distance": float(table[f"{space}_js_distance"].mean()),
                     "mean_hellinger": float(table[f"{space}_hellinger"].mean())}
        row[f"{space}_js"], row[f"{space}_hellinger"] = block["mean_js_distance"], block["mean_hellinger"]
    return row


def distance_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Mean over seeds per task × α × grouping of :func:`partition_distances_row`'s four numbers."""
    if rows.empty:
        return pd.DataFrame(columns=DISTANCE_COLUMNS)
    values = [column for column in DISTANCE_COLUMNS if column.endswith(("_js", "_hellinger"))]
    table = rows.groupby(["task", "alpha", "grouping"]).agg(
        **{column: (column, "mean") for column in values}, n_seeds=("seed", "nunique")).reset_index()
    table["js_gap"] = table.cluster_js - table.label_js  # > 0: the labels under-state the clusters' skew
    return table[DISTANCE_COLUMNS].sort_values(["task", "alpha", "grouping"]).reset_index(drop=True)


def distance_markdown(table: pd.DataFrame) -> str:
    lines = ["| task | α | partition | labels: JS | labels: Hellinger | clusters: JS | clusters: Hellinger "
             "| JS gap (clusters − labels) | seeds |", "|" + "---|" * 9]
    for row in table.itertuples():
        lines.append(f"| {row.task} | {row.alpha:g} | {row.grouping} | {row.label_js:.3f} | {row.label_hellinger:.3f} "
                     f"| {row.cluster_js:.3f} | {row.cluster_hellinger:.3f} | {row.js_gap:+.3f} | {row.n_seeds} |")
    return "\n".join(lines)


def understatement_sentence(table: pd.DataFrame) -> str:
    """Whether label-space distances under-state the embedding-based partitions' skew (the paper's claim in one
    number per partition: its JS gap, cluster-space minus label-space distance, mean over seeds)."""
    embedding = table[table.grouping == EMBEDDING_BASED]
    if embedding.empty:
        return "Partition distances: no embedding-based partition to compare."
    understated = int((embedding.js_gap > 0).sum())
    return (f"Partition distances: for {understated} of {len(embedding)} embedding-based partitions (task × α) the "
            f"label-space JS distance under-states the cluster-space one (JS gap, clusters − labels: mean "
            f"{embedding.js_gap.mean():+.3f}, from {embedding.js_gap.min():+.3f} to {embedding.js_gap.max():+.3f}); "
            "label statistics miss that skew.")
