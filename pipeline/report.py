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
- ``meters`` (optional): one row per partition and task: task, grouping, alpha, seed, g2, b2
  (step 3c's heterogeneity meter at the centralized model).

Runs with grouping ``iid`` (the iid reference partition) are reported in their own table.
The label-vs-embedding gap of a cell is the paired difference over seeds (the same seed gives
the same initial model and client sampling on both sides) with a 95% t interval
(utils/statistics.py): a cell is decided only with at least 3 paired seeds, nonzero variance and
an interval excluding 0, and otherwise says why it is undecided. Counts of decided cells come
with the count after Benjamini–Hochberg over all cells of the report; a headline claims a
direction only when half of its cells are decided and two thirds of those agree. Means of losses
get intervals on the log scale (never below 0). Every sentence of the summary is computed from
these numbers.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from partitioning.groupings import EMBEDDING_BASED, IID_REFERENCE, LABEL_BASED  # noqa: E402
from utils.statistics import (CONTAINS_ZERO, NONNEGATIVE, TOO_FEW, ZERO_VARIANCE, Counts, adjusted_decided,  # noqa: E402
                              direction, mean_interval, paired_difference)
from utils.plots import save_figure  # noqa: E402
from utils.run_dir import atomic_write_text  # noqa: E402

KEYS = ["task", "algorithm", "alpha"]
REPORT_COLUMNS = [
    "task", "algorithm", "alpha", "metric",
    "label_loss_mean", "label_loss_std", "embedding_loss_mean", "embedding_loss_std",
    "label_metric_mean", "label_metric_std", "embedding_metric_mean", "embedding_metric_std",
    "centralized_loss", "gap_percent", "diff_mean", "diff_ci_low", "diff_ci_high", "p_value", "verdict", "reason",
    "decided_after_bh", "n_seeds",
]
EMBEDDING_WORSE, LABEL_WORSE = "embedding worse", "label worse"
SIGNIFICANT = (EMBEDDING_WORSE, LABEL_WORSE)
IID_COLUMNS = ["task", "algorithm", "iid_loss_mean", "iid_loss_ci_low", "iid_loss_ci_high", "centralized_loss",
               "above_centralized_percent", "within_10_percent", "n_seeds"]
WITHIN = 10.0  # % above the centralized loss that counts as "trained enough" under the iid partition


def gap_table(finals: pd.DataFrame, centralized: dict[str, float]) -> pd.DataFrame:
    """Per task × algorithm × α: mean ± std over seeds of each side, and the paired embedding − label difference."""
    finals = finals[finals.grouping.isin([LABEL_BASED, EMBEDDING_BASED])]
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
    table["centralized_loss"] = table.task.map(centralized).astype(float)
    cells = [(group, _paired(group)) for _, group in finals.groupby(KEYS)]
    kept = adjusted_decided([difference for _, difference in cells])  # over every cell of the report
    paired = pd.DataFrame([_paired_row(group, difference, keep) for (group, difference), keep in zip(cells, kept)])
    table = table.merge(paired, on=KEYS).drop(columns=["n_seeds_label", "n_seeds_embedding"])
    return table[REPORT_COLUMNS].sort_values(KEYS).reset_index(drop=True)


def _paired(group: pd.DataFrame):
    """The paired difference embedding − label of one cell over the seeds both groupings ran (None: no pairs)."""
    sides = group.pivot_table(index="seed", columns="grouping", values="loss").dropna()
    if sides.empty or LABEL_BASED not in sides or EMBEDDING_BASED not in sides:
        return None
    return paired_difference(list(sides[LABEL_BASED]), list(sides[EMBEDDING_BASED]))


def _paired_row(group: pd.DataFrame, difference, decided_after_bh: bool) -> dict:
    first = group.iloc[0]
    keys = {key: first[key] for key in KEYS}
    if difference is None:
        return {**keys, "gap_percent": np.nan, "diff_mean": np.nan, "diff_ci_low": np.nan, "diff_ci_high": np.nan,
                "p_value": np.nan, "verdict": "undecided: no seed ran under both partitions", "reason": TOO_FEW,
                "decided_after_bh": False, "n_seeds": 0}
    verdict = {1: EMBEDDING_WORSE, -1: LABEL_WORSE}.get(difference.sign, difference.explain())
    return {**keys, "gap_percent": difference.relative, "diff_mean": difference.mean, "diff_ci_low": difference.low,
            "diff_ci_high": difference.high, "p_value": difference.p_value, "verdict": verdict,
            "reason": difference.reason, "decided_after_bh": decided_after_bh, "n_seeds": difference.n}


def cell_counts(rows: pd.DataFrame, adjusted_over: int) -> Counts:
    """How the cells of ``rows`` (gap-table rows) came out; ``adjusted_over``: the report's number of cells."""
    worse, better = rows.verdict == EMBEDDING_WORSE, rows.verdict == LABEL_WORSE
    return Counts(len(rows), int(worse.sum()), int(better.sum()), int((rows.reason == TOO_FEW).sum()),
                  int((rows.reason == ZERO_VARIANCE).sum()), int((rows.reason == CONTAINS_ZERO).sum()),
                  int((worse & rows.decided_after_bh).sum()), int((better & rows.decided_after_bh).sum()), adjusted_over)


def iid_table(finals: pd.DataFrame, centralized: dict[str, float]) -> pd.DataFrame:
    """The iid reference runs per task × algorithm: final loss with its 95% interval against the centralized loss."""
    iid = finals[finals.grouping == IID_REFERENCE]
    rows = []
    for (task, algorithm), group in iid.groupby(["task", "algorithm"]):
        mean, low, high = mean_interval(list(group.loss), NONNEGATIVE)
        reference = float(centralized.get(task, np.nan))
        above = 100.0 * (mean / reference - 1.0) if reference else np.nan
        rows.append({"task": task, "algorithm": algorithm, "iid_loss_mean": mean, "iid_loss_ci_low": low,
                     "iid_loss_ci_high": high, "centralized_loss": reference, "above_centralized_percent": above,
                     "within_10_percent": bool(above <= WITHIN), "n_seeds": group.seed.nunique()})
    return pd.DataFrame(rows, columns=IID_COLUMNS)


def summary_sentences(table: pd.DataFrame, agreement: dict[str, dict[str, float]],
                      iid: pd.DataFrame | None = None) -> list[str]:
    """Plain-language findings, one per task and one overall, derived from the table."""
    sentences = []
    for task, rows in table.groupby("task"):
        counts = cell_counts(rows, len(table))
        larger = int((rows.gap_percent > 0).sum())
        nmi = agreement.get(task, {}).get("nmi")
        nmi_text = f"; clusters vs class labels NMI = {nmi:.2f}" if nmi is not None else ""
        worst = rows.loc[rows.gap_percent.idxmax()] if rows.gap_percent.notna().any() else rows.iloc[0]
        best = rows.loc[rows.gap_percent.idxmin()] if rows.gap_percent.notna().any() else rows.iloc[0]
        headline = {1: "embedding-based heterogeneity hurts more", -1: "label-based heterogeneity hurts more",
                    0: "no clear direction"}[direction(counts)]
        sentences.append(
            f"**{task}**: {headline}: over its {len(rows)} algorithm × α cells, the paired embedding − label loss is "
            f"{counts.text('embedding worse', 'label worse')}; larger mean loss under embedding-based in {larger}; "
            f"mean gap {rows.gap_percent.mean():+.1f}%, largest {worst.gap_percent:+.1f}% ({worst.algorithm}, "
            f"α={worst.alpha:g}), smallest {best.gap_percent:+.1f}% ({best.algorithm}, α={best.alpha:g}){nmi_text}"
            f"{_iid_clause(iid, task)}."
        )
    counts = cell_counts(table, len(table))
    claim = {1: "holds", -1: "is contradicted (label-based partitions give the larger loss)",
             0: "is neither supported nor contradicted"}[direction(counts)]
    sentences.append(
        f"Overall the paper's claim (embedding-based partitions give a larger federated loss) {claim} on this data: "
        f"over {len(table)} task × algorithm × α cells the paired difference is "
        f"{counts.text('embedding worse', 'label worse')} (median gap {table.gap_percent.median():+.1f}%). "
        "A direction is claimed only when at least half of the cells are decided and two thirds of those agree."
    )
    return sentences


def _iid_clause(iid: pd.DataFrame | None, task: str) -> str:
    """'; under the iid partition ... of the centralized loss' for one task (empty without iid runs)."""
    if iid is None or iid.empty or task not in set(iid.task):
        return ""
    rows = iid[iid.task == task]
    far = rows[~rows.within_10_percent]
    status = (f"all within {WITHIN:.0f}%" if far.empty else
              f"NOT within {WITHIN:.0f}% for {', '.join(f'{row.algorithm} ({row.above_centralized_percent:+.0f}%)' for row in far.itertuples())}")
    low, high = rows.above_centralized_percent.min(), rows.above_centralized_percent.max()
    span = f"{low:+.0f}%" if round(low) == round(high) else f"{low:+.0f}% to {high:+.0f}%"
    return f"; under the iid partition the federated loss is {span} off the centralized loss ({status})"


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
    lines = ["| task | algorithm | α | label loss | embedding loss | gap % | verdict |", "|" + "---|" * 7]
    for row in table.itertuples():
        lines.append(
            f"| {row.task} | {row.algorithm} | {row.alpha:g} | {row.label_loss_mean:.4f} ± {row.label_loss_std:.4f} "
            f"| {row.embedding_loss_mean:.4f} ± {row.embedding_loss_std:.4f} "
            f"| {row.gap_percent:+.1f}{'*' if row.verdict in SIGNIFICANT else ''} | {row.verdict} |"
        )
    return "\n".join(lines)


def markdown_table(table: pd.DataFrame) -> str:
    """The report table as GitHub Markdown."""
    header = ("| task | algorithm | α | label loss | embedding loss | gap % | embedding − label [95% CI] | verdict "
              "| after BH | label metric | embedding metric | centralized loss |")
    lines = [header, "|" + "---|" * 12]
    for row in table.itertuples():
        lines.append(
            f"| {row.task} | {row.algorithm} | {row.alpha:g} "
            f"| {row.label_loss_mean:.4f} ± {row.label_loss_std:.4f} "
            f"| {row.embedding_loss_mean:.4f} ± {row.embedding_loss_std:.4f} "
            f"| {row.gap_percent:+.1f}{'*' if row.verdict in SIGNIFICANT else ''} "
            f"| {_interval_text(row.diff_mean, row.diff_ci_low, row.diff_ci_high)} | {row.verdict} "
            f"| {'decided' if row.decided_after_bh else '–'} "
            f"| {row.metric} {row.label_metric_mean:.3f} ± {row.label_metric_std:.3f} "
            f"| {row.embedding_metric_mean:.3f} ± {row.embedding_metric_std:.3f} | {row.centralized_loss:.4f} |"
        )
    return "\n".join(lines)


def _interval_text(mean: float, low: float, high: float) -> str:
    """``+0.3000 [+0.0516, +0.5484]``, or the mean alone when there is no interval (one seed, zero variance)."""
    if np.isnan(low):
        return f"{mean:+.4f} [no interval]"
    return f"{mean:+.4f} [{low:+.4f}, {high:+.4f}]"


GROUPING_STYLE = {LABEL_BASED: ("-", "o", "C0"), EMBEDDING_BASED: ("--", "s", "C1"), IID_REFERENCE: (":", None, "grey")}
GROUPING_NAME = {LABEL_BASED: "label-based (solid)", EMBEDDING_BASED: "embedding-based (dashed)",
                 IID_REFERENCE: "iid reference (dotted)"}


def plot_loss_vs_alpha(finals: pd.DataFrame, path: Path) -> None:
    """One panel per task (rows) × algorithm (columns): final loss against α, label-based solid, embedding-based dashed,
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
            axis.set_ylabel("final global test loss")
    handles = {}
    for axis in axes.flat:  # every grouping once, whichever panel has it
        for handle, label in zip(*axis.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    handles["95% interval (log scale)"] = plt.Rectangle((0, 0), 1, 1, color="C0", alpha=0.15)
    figure.legend(list(handles.values()), list(handles), loc="outside lower center", ncol=len(handles), fontsize=8)
    save_figure(figure, path, dpi=110)


def plot_round_curves(curves: pd.DataFrame, path: Path) -> None:
    """Mean test loss per round; rows = task, columns = α, colour = algorithm, line style = grouping (the legend, below
    the panels, names both)."""
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
    handles = [plt.Line2D([], [], color=f"C{index}", label=algorithm) for index, algorithm in enumerate(algorithms)]
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


def iid_markdown(iid: pd.DataFrame) -> str:
    lines = ["| task | algorithm | iid loss [95% CI] | centralized loss | above centralized | within 10% |", "|" + "---|" * 6]
    for row in iid.itertuples():
        lines.append(f"| {row.task} | {row.algorithm} | {row.iid_loss_mean:.4f} [{row.iid_loss_ci_low:.4f}, "
                     f"{row.iid_loss_ci_high:.4f}] | {row.centralized_loss:.4f} | {row.above_centralized_percent:+.1f}% "
                     f"| {'yes' if row.within_10_percent else '**no**'} |")
    return "\n".join(lines)


def write_report(
    out_dir: Path,
    finals: pd.DataFrame,
    curves: pd.DataFrame,
    centralized: dict[str, float],
    agreement: dict[str, dict[str, float]],
    heatmaps: dict[tuple[str, str, float], Path],
    command: str,
    meters: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Write report.csv, report.md and the PNG plots into ``out_dir``; returns the gap table."""
    from pipeline.heterogeneity_report import meter_markdown, meter_sentence, meter_table, plot_meter

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = gap_table(finals, centralized)
    iid = iid_table(finals, centralized)
    meter = meter_table(meters if meters is not None else pd.DataFrame())
    plot_loss_vs_alpha(finals, out_dir / "loss_vs_alpha.png")
    plot_round_curves(curves, out_dir / "round_curves.png")
    plot_heatmaps(heatmaps, out_dir / "partition_heatmaps.png")
    plot_agreement(agreement, out_dir / "cluster_label_agreement.png")
    personal = personal_gap_table(finals)
    sentences = summary_sentences(table, agreement, iid)
    if not meter.empty:
        plot_meter(meters, out_dir / "heterogeneity_meter.png")
        sentences.insert(-1, meter_sentence(meter, table))
    sections = []
    if not iid.empty:
        sections += ["## IID reference", "",
                     f"The same algorithms on an iid partition: is the federated model trained enough (within "
                     f"{WITHIN:.0f}% of the centralized loss)? Mean over seeds with its 95% interval.", "",
                     iid_markdown(iid), ""]
    if not meter.empty:
        sections += ["## Heterogeneity meter", "",
                     "Gradient dissimilarity G² = Σ_k p_k ‖∇F_k − ∇F‖² and FedProx's B² = Σ_k p_k ‖∇F_k‖² / ‖∇F‖² "
                     "of each partition's clients at the centralized model (mean over seeds).", "",
                     meter_markdown(meter), "", "![heterogeneity meter](heterogeneity_meter.png)", ""]
    if not personal.empty:
        sections += [
            "## Personalised models", "",
            "Mean loss of each client's own model on its client-test split (last round; FedRep's global head is "
            "never trained, so for FedRep this, not the global loss above, is the result). Each partition has its "
            "own client-test splits: a client holding one group has an easy local task, so this measures how well "
            "clients' own models fit their own data, not one shared test set.", "",
            personal_markdown_table(personal), ""]
    agreement_lines = [f"| {task} | {values['nmi']:.3f} | {values['ari']:.3f} |" for task, values in sorted(agreement.items())]
    text = "\n".join([
        "# Label-based vs embedding-based heterogeneity",
        "",
        f"Produced by `{command}`. Losses are the final global model's loss on the global test split, "
        "mean ± std over seeds; gap % = (embedding − label) / label, from the seeds run under both partitions; "
        "the interval is the 95% paired t interval of embedding − label over seeds. A cell is *decided* (and its gap "
        "marked *) only with at least 3 paired seeds, nonzero variance and an interval excluding 0; otherwise its "
        "verdict says why it is undecided. *after BH*: still decided after Benjamini–Hochberg at 5% over all cells of "
        "this report. Intervals of mean losses are t intervals on the log scale, so they never go below 0.",
        "",
        "## Summary",
        "",
        *[f"- {sentence}" for sentence in sentences],
        "",
        "## Results",
        "",
        markdown_table(table),
        "",
        *sections,
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
    for frame, name in ((table, "report.csv"), (personal, "report_personal.csv"), (iid, "report_iid.csv"),
                        (meter, "report_heterogeneity.csv")):
        frame.to_csv(out_dir / f"{name}.tmp", index=False)
        Path(out_dir / f"{name}.tmp").replace(out_dir / name)
    atomic_write_text(out_dir / "report.md", text)
    return table
