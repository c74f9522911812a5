"""The label-vs-embedding gap report: report.csv, report.md and its plots.

Inputs are plain tables the pipeline collects from the run folders:

- ``finals``: one row per federated run: task, grouping (label_based |
  embedding_based), alpha, algorithm, seed, loss (final global test loss),
  metric (name of the task's primary metric), metric_value, and optionally
  personal_loss (mean client-test loss of the clients' own models, e.g. FedRep's
  heads; NaN for algorithms without personal models).
- ``curves``: one row per evaluated round: the same keys plus round, loss.
- ``centralized``: task -> the centralized model's test loss (reference).
- ``agreement``: task -> {"nmi": ..., "ari": ...} between clusters and the data family's class labels.
- ``heatmaps``: (task, grouping, alpha) -> PNG of the seed-0 partition.

Every sentence of the summary is computed from these numbers.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from partitioning.groupings import EMBEDDING_BASED, LABEL_BASED  # noqa: E402
from utils.plots import save_figure  # noqa: E402
from utils.run_dir import atomic_write_text  # noqa: E402

KEYS = ["task", "algorithm", "alpha"]
REPORT_COLUMNS = [
    "task", "algorithm", "alpha", "metric",
    "label_loss_mean", "label_loss_std", "embedding_loss_mean", "embedding_loss_std",
    "label_metric_mean", "label_metric_std", "embedding_metric_mean", "embedding_metric_std",
    "centralized_loss", "gap_percent", "gap_exceeds_seed_std", "n_seeds",
]


def gap_table(finals: pd.DataFrame, centralized: dict[str, float]) -> pd.DataFrame:
    """Mean ± std over seeds per task × algorithm × α, label vs embedding, and the relative gap in %."""
    stats = (
        finals.groupby(KEYS + ["metric", "grouping"])
        .agg(loss_mean=("loss", "mean"), loss_std=("loss", "std"), metric_mean=("metric_value", "mean"),
             metric_std=("metric_value", "std"), n_seeds=("seed", "nunique"))
        .reset_index()
    )
    stats[["loss_std", "metric_std"]] = stats[["loss_std", "metric_std"]].fillna(0.0)
    label = stats[stats.grouping == LABEL_BASED].drop(columns="grouping")
    embedding = stats[stats.grouping == EMBEDDING_BASED].drop(columns="grouping")
    table = label.merge(embedding, on=KEYS + ["metric"], suffixes=("_label", "_embedding"))
    renamed = {}
    for side in ("label", "embedding"):
        for quantity in ("loss", "metric"):
            for stat in ("mean", "std"):
                renamed[f"{quantity}_{stat}_{side}"] = f"{side}_{quantity}_{stat}"
    table = table.rename(columns=renamed)
    table["n_seeds"] = table[["n_seeds_label", "n_seeds_embedding"]].min(axis=1)
    table["centralized_loss"] = table.task.map(centralized).astype(float)
    table["gap_percent"] = 100.0 * (table.embedding_loss_mean - table.label_loss_mean) / table.label_loss_mean
    # A transparent noise rule rather than a test statistic (2-3 seeds give no usable p-value):
    # the gap counts only when it is larger than the two seed spreads added together.
    spread = table.label_loss_std + table.embedding_loss_std
    gap = (table.embedding_loss_mean - table.label_loss_mean).abs()
    table["gap_exceeds_seed_std"] = (table.n_seeds >= 2) & (gap > spread)
    return table[REPORT_COLUMNS].sort_values(KEYS).reset_index(drop=True)


def summary_sentences(table: pd.DataFrame, agreement: dict[str, dict[str, float]]) -> list[str]:
    """Plain-language findings, one per task and one overall, derived from the table."""
    sentences = []
    for task, rows in table.groupby("task"):
        larger = int((rows.gap_percent > 0).sum())
        nmi = agreement.get(task, {}).get("nmi")
        nmi_text = f"; clusters vs class labels NMI = {nmi:.2f}" if nmi is not None else ""
        worst = rows.loc[rows.gap_percent.idxmax()]
        best = rows.loc[rows.gap_percent.idxmin()]
        verdict = "hurts more" if rows.gap_percent.mean() > 0 else "does not hurt more"
        beyond = int(rows.gap_exceeds_seed_std.sum())
        above_centralized = 100.0 * (rows.label_loss_mean / rows.centralized_loss - 1.0).median()
        reference = ""
        if np.isfinite(above_centralized):
            reference = f"; federated (label) vs centralized loss: median {above_centralized:+.0f}%"
        sentences.append(
            f"**{task}**: embedding-based heterogeneity {verdict} on average "
            f"(mean gap {rows.gap_percent.mean():+.1f}%, larger loss in {larger} of {len(rows)} "
            f"algorithm × α cells, {beyond} of {len(rows)} gaps beyond the seed spread); largest gap "
            f"{worst.gap_percent:+.1f}% ({worst.algorithm}, α={worst.alpha:g}), "
            f"smallest {best.gap_percent:+.1f}% ({best.algorithm}, α={best.alpha:g}){nmi_text}{reference}."
        )
    positive = int((table.gap_percent > 0).sum())
    claim = "holds" if positive > len(table) / 2 else "does not hold"
    sentences.append(
        f"Overall the paper's claim (embedding-based partitions give a larger federated loss) {claim} on this data: "
        f"{positive} of {len(table)} task × algorithm × α cells show a larger loss under embedding-based "
        f"partitions (median gap {table.gap_percent.median():+.1f}%); "
        f"{int(table.gap_exceeds_seed_std.sum())} of {len(table)} gaps are larger than the seed spread "
        f"(label std + embedding std)."
    )
    return sentences


def personal_gap_table(finals: pd.DataFrame) -> pd.DataFrame:
    """The gap table of the personal models' client-test loss, for runs that have one (empty otherwise).

    For FedRep the global model keeps its initial head, so its global test loss is
    not what FedRep delivers; its clients' own models are.
    """
    if "personal_loss" not in finals or finals.personal_loss.isna().all():
        return pd.DataFrame(columns=REPORT_COLUMNS)
    personal = finals.dropna(subset=["personal_loss"]).assign(loss=lambda frame: frame.personal_loss)
    return gap_table(personal, {})


def personal_markdown_table(table: pd.DataFrame) -> str:
    lines = ["| task | algorithm | α | label loss | embedding loss | gap % |", "|" + "---|" * 6]
    for row in table.itertuples():
        lines.append(
            f"| {row.task} | {row.algorithm} | {row.alpha:g} | {row.label_loss_mean:.4f} ± {row.label_loss_std:.4f} "
            f"| {row.embedding_loss_mean:.4f} ± {row.embedding_loss_std:.4f} "
            f"| {row.gap_percent:+.1f}{'*' if row.gap_exceeds_seed_std else ''} |"
        )
    return "\n".join(lines)


def markdown_table(table: pd.DataFrame) -> str:
    """The report table as GitHub Markdown."""
    header = "| task | algorithm | α | label loss | embedding loss | gap % | label metric | embedding metric | centralized loss |"
    lines = [header, "|" + "---|" * 9]
    for row in table.itertuples():
        lines.append(
            f"| {row.task} | {row.algorithm} | {row.alpha:g} "
            f"| {row.label_loss_mean:.4f} ± {row.label_loss_std:.4f} "
            f"| {row.embedding_loss_mean:.4f} ± {row.embedding_loss_std:.4f} "
            f"| {row.gap_percent:+.1f}{'*' if row.gap_exceeds_seed_std else ''} "
            f"| {row.metric} {row.label_metric_mean:.3f} ± {row.label_metric_std:.3f} "
            f"| {row.embedding_metric_mean:.3f} ± {row.embedding_metric_std:.3f} | {row.centralized_loss:.4f} |"
        )
    return "\n".join(lines)


def plot_loss_vs_alpha(table: pd.DataFrame, path: Path) -> None:
    """One panel per task: final loss vs α, solid = label-based, dashed = embedding-based."""
    tasks = sorted(table.task.unique())
    figure, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.8), squeeze=False)
    for axis, task in zip(axes[0], tasks):
        rows = table[table.task == task]
        for index, (algorithm, group) in enumerate(rows.groupby("algorithm")):
            color = f"C{index}"
            group = group.sort_values("alpha")
            axis.errorbar(group.alpha, group.label_loss_mean, group.label_loss_std, color=color, marker="o",
                          label=f"{algorithm} label")
            axis.errorbar(group.alpha, group.embedding_loss_mean, group.embedding_loss_std, color=color,
                          marker="s", linestyle="--", label=f"{algorithm} embedding")
        axis.set_xscale("log")
        axis.set_title(task)
        axis.set_xlabel("Dirichlet α")
        axis.set_ylabel("final global test loss")
    axes[0][-1].legend(fontsize=7)
    save_figure(figure, path, dpi=110)


def plot_round_curves(curves: pd.DataFrame, path: Path) -> None:
    """Mean test loss per round; rows = task, columns = α, colour = algorithm, style = grouping."""
    tasks, alphas = sorted(curves.task.unique()), sorted(curves.alpha.unique())
    figure, axes = plt.subplots(len(tasks), len(alphas), figsize=(4.2 * len(alphas), 3.2 * len(tasks)), squeeze=False)
    mean = curves.groupby(["task", "alpha", "algorithm", "grouping", "round"]).loss.mean().reset_index()
    algorithms = sorted(curves.algorithm.unique())
    for row, task in enumerate(tasks):
        for column, alpha in enumerate(alphas):
            axis = axes[row][column]
            for (algorithm, grouping), group in mean[(mean.task == task) & (mean.alpha == alpha)].groupby(["algorithm", "grouping"]):
                axis.plot(group["round"], group.loss, color=f"C{algorithms.index(algorithm)}",
                          linestyle="-" if grouping == LABEL_BASED else "--", label=f"{algorithm} {grouping}")
            axis.set_title(f"{task}, α={alpha:g}", fontsize=9)
            axis.set_xlabel("round")
            axis.set_ylabel("global test loss")
    axes[0][-1].legend(fontsize=6)
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


def write_report(
    out_dir: Path,
    finals: pd.DataFrame,
    curves: pd.DataFrame,
    centralized: dict[str, float],
    agreement: dict[str, dict[str, float]],
    heatmaps: dict[tuple[str, str, float], Path],
    command: str,
) -> pd.DataFrame:
    """Write report.csv, report.md and the four PNG plots into ``out_dir``; returns the table."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = gap_table(finals, centralized)
    plot_loss_vs_alpha(table, out_dir / "loss_vs_alpha.png")
    plot_round_curves(curves, out_dir / "round_curves.png")
    plot_heatmaps(heatmaps, out_dir / "partition_heatmaps.png")
    plot_agreement(agreement, out_dir / "cluster_label_agreement.png")
    personal = personal_gap_table(finals)
    personal_section = [] if personal.empty else [
        "## Personalised models",
        "",
        "Mean loss of each client's own model on its client-test split (last round; FedRep's global head is never "
        "trained, so for FedRep this, not the global loss above, is the result). Each partition has its own "
        "client-test splits: a client holding one group has an easy local task, so this measures how well "
        "clients' own models fit their own data, not one shared test set.",
        "",
        personal_markdown_table(personal),
        "",
    ]
    agreement_lines = [f"| {task} | {values['nmi']:.3f} | {values['ari']:.3f} |" for task, values in sorted(agreement.items())]
    text = "\n".join([
        "# Label-based vs embedding-based heterogeneity",
        "",
        f"Produced by `{command}`. Losses are the final global model's loss on the global test split, "
        "mean ± std over seeds; gap % = (embedding − label) / label; * marks a gap larger than the two "
        "seed spreads added together.",
        "",
        "## Summary",
        "",
        *[f"- {sentence}" for sentence in summary_sentences(table, agreement)],
        "",
        "## Results",
        "",
        markdown_table(table),
        "",
        *personal_section,
        "## Clusters vs class labels",
        "",
        "| task | NMI | ARI |",
        "|---|---|---|",
        *agreement_lines,
        "",
        "## Plots",
        "",
        "![loss vs alpha](loss_vs_alpha.png)",
        "![round curves](round_curves.png)",
        "![partition heatmaps](partition_heatmaps.png)",
        "![cluster-label agreement](cluster_label_agreement.png)",
        "",
    ])
    for frame, name in ((table, "report.csv"), (personal, "report_personal.csv")):
        frame.to_csv(out_dir / f"{name}.tmp", index=False)
        Path(out_dir / f"{name}.tmp").replace(out_dir / name)
    atomic_write_text(out_dir / "report.md", text)
    return table
