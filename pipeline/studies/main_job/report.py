"""The label-vs-embedding gap report: report.csv, report.md and its plots.

Inputs are plain tables the pipeline collects from the run folders:

- ``finals``: one row per federated run: task, grouping (label_based |
  embedding_based), alpha, algorithm, seed, loss (final global test loss),
  metric (name of the task's primary metric), metric_value, and optionally
  personal_loss (mean client-test loss of the clients' own models, e.g. FedRep's
  heads; NaN for algorithms without personal models), personal_metric_value (their primary metric) and
  result_is_personal (True for an algorithm whose result is its clients' own models: FedRep, FedPer).
- ``curves``: one row per evaluated round: the same keys plus round, loss (for a result_is_personal
  algorithm, its clients' own models' loss).
- ``centralized``: task -> the centralized model's test loss (reference), at the epoch its validation rows chose.
- ``selected_on``: task -> what chose that epoch (``val``; ``last`` for a step-2 run made with ``--last_epoch`` on
  data without validation rows, which the report then says).
- ``agreement``: task -> {"nmi": ..., "ari": ...} between clusters and the data family's class labels.
- ``heatmaps``: (task, grouping, alpha) -> PNG of the seed-0 partition.
- ``meters`` (optional): one row per partition and task: task, grouping, alpha, seed, g2, b2
  (step 3c's heterogeneity meter at the centralized model).

Runs with grouping ``iid`` (the iid reference partition) are reported in their own table
(pipeline/studies/main_job/iid.py); the plots are drawn by pipeline/studies/main_job/plots.py. An algorithm whose global
model is not its result (``result_is_personal``: FedRep's global head is never trained, so its global
loss measures an untrained head) enters the gap table, the summary's counts and the plots with its
clients' own models' loss on their own test splits (:func:`results_finals`).
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

import numpy as np
import pandas as pd

from partitioning.groupings import EMBEDDING_BASED, LABEL_BASED
from pipeline.studies.main_job.iid import iid_clause, iid_section, iid_table
from pipeline.studies.main_job.learned import best_constant, learning_failures, trivial_section
from pipeline.studies.main_job.control import control_markdown, control_sentence, control_table
from pipeline.studies.main_job.paper import VERDICT_NOTE, headline_sentence, paper_markdown, paper_table
from pipeline.studies.main_job.plots import plot_agreement, plot_heatmaps, plot_loss_vs_alpha, round_curves
from utils.statistics import (CONTAINS_ZERO, TOO_FEW, ZERO_VARIANCE, Counts, adjusted_decided, direction,
                              paired_difference)
from utils.run_dir import atomic_write_text

KEYS = ["task", "algorithm", "alpha"]
REPORT_COLUMNS = [
    "task", "algorithm", "alpha", "metric",
    "label_loss_mean", "label_loss_std", "embedding_loss_mean", "embedding_loss_std",
    "label_metric_mean", "label_metric_std", "embedding_metric_mean", "embedding_metric_std",
    "centralized_loss", "trivial_zero_loss", "trivial_constant_loss", "gap_percent", "diff_mean", "diff_ci_low", "diff_ci_high", "p_value", "verdict", "reason",
    "decided_after_bh", "n_seeds",
]
EMBEDDING_WORSE, LABEL_WORSE = "embedding worse", "label worse"
SIGNIFICANT = (EMBEDDING_WORSE, LABEL_WORSE)


def results_finals(finals: pd.DataFrame) -> pd.DataFrame:
    """``finals`` with each run's result: the personal models' loss and metric where ``result_is_personal``,
    the global model's elsewhere; column ``model`` says which ("personal" | "global")."""
    personal = finals.get("result_is_personal", pd.Series(False, index=finals.index)).fillna(False).astype(bool)
    results = finals.assign(model=np.where(personal, "personal", "global"))
    if personal.any():
        results.loc[personal, "loss"] = finals.loc[personal, "personal_loss"]
        results.loc[personal, "metric_value"] = finals.loc[personal].get("personal_metric_value", np.nan)
    return results


def gap_table(finals: pd.DataFrame, centralized: dict[str, float],
              trivial: dict[str, dict[str, float]] | None = None) -> pd.DataFrame:
    """Per task × algorithm × α: mean ± std over seeds of each side, the paired embedding − label difference, and the
    task's trivial predictors on the test split (``trivial``: task -> {"zero": loss, "median" or "prior": loss};
    NaN where step 2 wrote none)."""
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
    trivial = trivial or {}
    table["trivial_zero_loss"] = table.task.map(lambda task: trivial.get(task, {}).get("zero", np.nan)).astype(float)
    table["trivial_constant_loss"] = table.task.map(lambda task: best_constant(trivial.get(task, {}))).astype(float)
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
            f"{iid_clause(iid, task)}."
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


def markdown_table(table: pd.DataFrame, personal: frozenset[str] = frozenset()) -> str:
    """The report table as GitHub Markdown; algorithms in ``personal`` (read from their clients' models) marked ‡."""
    header = ("| task | algorithm | α | label loss | embedding loss | gap % | embedding − label [95% CI] | verdict "
              "| after BH | label metric | embedding metric | centralized loss |")
    lines = [header, "|" + "---|" * 12]
    for row in table.itertuples():
        lines.append(
            f"| {row.task} | {row.algorithm}{'‡' if row.algorithm in personal else ''} | {row.alpha:g} "
            f"| {row.label_loss_mean:.4f} ± {row.label_loss_std:.4f} "
            f"| {row.embedding_loss_mean:.4f} ± {row.embedding_loss_std:.4f} "
            f"| {row.gap_percent:+.1f}{'*' if row.verdict in SIGNIFICANT else ''} "
            f"| {_interval_text(row.diff_mean, row.diff_ci_low, row.diff_ci_high)} | {row.verdict} "
            f"| {'decided' if row.decided_after_bh else '–'} "
            f"| {row.metric} {row.label_metric_mean:.3f} ± {row.label_metric_std:.3f} "
            f"| {row.embedding_metric_mean:.3f} ± {row.embedding_metric_std:.3f} | {row.centralized_loss:.4f} |"
        )
    return "\n".join(lines)


def _personal_note(finals: pd.DataFrame) -> str:
    """Which algorithms the report reads from their clients' own models instead of the global model, and why."""
    names = sorted(finals[finals.model == "personal"].algorithm.unique())
    if not names:
        return ""
    return (f" (except {', '.join(names)}: the global head is never trained, so the global loss measures nothing; "
            "these rows, the summary's counts and the plots use the mean loss of the clients' own models on their own "
            "client-test splits instead, marked ‡)")


def _interval_text(mean: float, low: float, high: float) -> str:
    """``+0.3000 [+0.0516, +0.5484]``, or the mean alone when there is no interval (one seed, zero variance)."""
    if np.isnan(low):
        return f"{mean:+.4f} [no interval]"
    return f"{mean:+.4f} [{low:+.4f}, {high:+.4f}]"


IID_NOTE = ("*iid check*: under an iid partition the same algorithm ends within 10% of the centralized loss either way "
            "(yes: its whole interval; mean only: its mean), i.e. it trained enough to compare partitions; no: more "
            "than 10% above; reference under-trained: more than 10% below, so the centralized model is no mark.")
RANDOMNESS_NOTE = (
    "*What the intervals cover*: each seed draws its own centralized model (initialisation and data order), its own "
    "KMeans start on that model's embeddings, its own partitions and its own federated runs (initial model, client "
    "sampling, batches), so the intervals over seeds cover every random choice the comparison depends on except the "
    "data itself: the rendered scenes and their train/validation/test split are fixed by the experiment file.")


def selection_note(selected_on: dict[str, str]) -> str:
    """What chose every number of the report: the federated runs' last round, and the centralized reference's epoch."""
    on_last = sorted(task for task, split in selected_on.items() if split != "val")
    reference = ("the centralized reference is the test loss at the epoch its **validation** rows chose" if not on_last else
                 f"the centralized reference is the test loss at the epoch chosen on its validation rows, except for "
                 f"{', '.join(on_last)}: its **last epoch** (its data has no validation rows; step 2 ran with "
                 "--last_epoch, so nothing was selected)")
    return ("Every federated number is the **last round**'s (no round is chosen on any split); " + reference + ".")


def write_report(
    out_dir: Path,
    finals: pd.DataFrame,
    curves: pd.DataFrame,
    centralized: dict[str, float],
    agreement: dict[str, dict[str, float]],
    heatmaps: dict[tuple[str, str, float], Path],
    command: str,
    meters: pd.DataFrame | None = None,
    selected_on: dict[str, str] | None = None,
    distances: pd.DataFrame | None = None,
    trivial: dict[str, dict[str, float]] | None = None,
    fingerprint: str | None = None,
) -> pd.DataFrame:
    """Write report.csv, report_paper.csv, report.md and the PNG plots into ``out_dir``; returns the gap table.

    ``distances`` (optional): one row per partition (task, grouping, alpha, seed) with its mean label- and
    cluster-space distances (``meter.partition_distances_row``), shown beside G² and B². ``fingerprint`` (optional):
    the line naming the code and experiment that made the numbers (pipeline/fingerprint.py), under the title, so a
    paste of the report's answer carries it.
    """
    from pipeline.studies.main_job.meter import (distance_markdown, distance_table, meter_markdown, meter_sentence,
                                                 meter_table, plot_meter, understatement_sentence)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    personal = personal_gap_table(finals)
    finals = results_finals(finals)
    trivial = trivial or {}
    table = gap_table(finals, centralized, trivial)
    iid = iid_table(finals, centralized)
    failures = learning_failures(finals, centralized, trivial)
    answer = paper_table(finals, iid, did_not_learn=failures)
    control = control_table(finals)
    meter = meter_table(meters if meters is not None else pd.DataFrame())
    spread = distance_table(distances if distances is not None else pd.DataFrame())
    plot_loss_vs_alpha(finals, out_dir / "loss_vs_alpha.png")
    curve_lines = round_curves(curves, out_dir / "round_curves.png")
    plot_heatmaps(heatmaps, out_dir / "partition_heatmaps.png")
    plot_agreement(agreement, out_dir / "cluster_label_agreement.png")
    sentences = summary_sentences(table, agreement, iid)
    if not meter.empty:
        plot_meter(meters, out_dir / "heterogeneity_meter.png")
        sentences.insert(-1, meter_sentence(meter, table))
    if not spread.empty:
        sentences.insert(-1, understatement_sentence(spread))
    sections = trivial_section(centralized, trivial, failures) + iid_section(iid)
    if not meter.empty:
        sections += ["## Heterogeneity meter", "",
                     "Gradient dissimilarity G² = Σ_k p_k ‖∇F_k − ∇F‖² and FedProx's B² = Σ_k p_k ‖∇F_k‖² / ‖∇F‖² "
                     "of each partition's clients at the centralized model (mean over seeds).", "",
                     meter_markdown(meter), "", "![heterogeneity meter](heterogeneity_meter.png)", ""]
    if not spread.empty:
        sections += ["## Partition distances", "",
                     "How far each client's mixture lies from the pooled one (step 3b; mean over clients, then over "
                     "seeds), measured over the scene labels and over the task's embedding clusters: Jensen–Shannon "
                     "distance (the square root of the base-2 divergence) and Hellinger distance, both in [0, 1]. A "
                     "label-based partition that looks far from iid in label space may be near it in cluster space, "
                     "and an embedding-based one the other way round; G² and B² above say what that does to the "
                     "gradients. *JS gap*: the cluster-space minus the label-space JS distance; > 0 where the labels "
                     "under-state the skew in embedding space.", "", understatement_sentence(spread), "",
                     distance_markdown(spread), ""]
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
        *([fingerprint, ""] if fingerprint else []),
        "## The answer per task",
        "",
        headline_sentence(answer),
        "",
        *([control_sentence(control), ""] if not control.empty else []),
        paper_markdown(answer),
        "",
        "*TaskHet*: the relative change of the final loss, embedding- vs label-based, paired by seed and α, mean over "
        "seeds of each seed's mean over α, with the 95% t interval over seeds. *trend in α*: each seed's slope of that "
        "change against log10 α, tested over seeds (the paper: the change grows as α falls). " + VERDICT_NOTE
        + " " + IID_NOTE + " " + selection_note(selected_on or {}),
        "",
        RANDOMNESS_NOTE,
        "",
        *control_markdown(control),
        f"Produced by `{command}`. Losses are the final global model's loss on the global test split{_personal_note(finals)}, "
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
        markdown_table(table, frozenset(finals[finals.model == "personal"].algorithm)),
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
        "",
        *curve_lines,
        "",
        "![partition heatmaps](partition_heatmaps.png)",
        "![cluster-label agreement](cluster_label_agreement.png)",
        "",
    ])
    for frame, name in ((table, "report.csv"), (answer, "report_paper.csv"), (control, "report_control.csv"),
                        (personal, "report_personal.csv"),
                        (iid, "report_iid.csv"), (meter, "report_heterogeneity.csv"),
                        (spread, "report_distances.csv")):
        frame.to_csv(out_dir / f"{name}.tmp", index=False)
        Path(out_dir / f"{name}.tmp").replace(out_dir / name)
    atomic_write_text(out_dir / "report.md", text)
    return table
