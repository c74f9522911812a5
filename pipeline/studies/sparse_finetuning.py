"""The sparse fine-tuning study's report (issue 15): dense FedAvg against ``sparse_ft`` per sparsity, rounds and rule.

Every run's numbers come from step 4's ``metrics.csv`` exactly as in the FedAvg study
(pipeline/studies/fedavg_sharding.py: the global model's test accuracy at the last round, *final*, and at
the earliest round of the highest validation accuracy, *best by validation*). A ``sparse_ft``
variant is described by its settings (defaults filled in from its ``Settings``): sparsity
1 − density, calibration rounds R, mask rule, and any other setting it varies (``extra``, e.g.
``mask_source``); every other algorithm of the grid is a dense reference (normally ``fedavg``).

Comparisons pair runs by seed (the same seed gives the same partition, initial model and client
sampling) and use Student's t 95% intervals (utils/statistics.py); a difference counts only when
it is decided (at least 3 paired seeds, nonzero variance, an interval excluding 0), and every count
of decided cells comes with its count after Benjamini–Hochberg over the cells counted. Means get
logit-scale intervals inside [0, 1]. The summary says, from the numbers:

* the best rule at each sparsity (per partition, J, R) and its margin over the runner-up;
* whether least-sensitive (TaLoS) beats each other rule: noticeable wins and losses over cells;
* whether sparse fine-tuning beats dense FedAvg, on the most skewed partition (interference) and
  on iid, and whether its gain over dense is larger on the skewed one (difference in differences);
* where those claims do not hold;
* where final accuracy and best by validation disagree about sparse against dense, and why (where
  each side's best validation round lies, the start model being round 0, and how far each ends
  below its best).

Outputs: ``report.csv`` (:data:`SPARSE_COLUMNS`: one row per partition × J × variant plus the
centralized row), ``report.md``, ``accuracy_vs_sparsity.png`` (and
``accuracy_vs_sparsity_best_val.png`` when the data has validation rows).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from models.tasks import get_task
from pipeline.studies.grid.kind import register_grid_kind
from pipeline.studies.grid.results import (CENTRALIZED, centralized_accuracy, difference_text, interval_cell,
                                           ledger_line, run_accuracy, summarize)
from utils.statistics import UNIT, count, direction, metric_scale, paired_difference
from utils.run_dir import atomic_write_text

SPARSE = "sparse_ft"
TALOS = "least_sensitive"
DENSE_RULE = "dense"  # the mask_rule column of a dense reference row
SPARSE_COLUMNS = ["partition", "scheme", "nc", "local_steps", "rounds", "variant", "algorithm", "mask_rule", "sparsity",
                  "calibration_rounds", "extra", "n_seeds", "final_mean", "final_low", "final_high", "best_val_mean",
                  "best_val_low", "best_val_high", "seeds"]
CELL = ["partition", "local_steps", "calibration_rounds", "extra", "sparsity"]  # the rules compete within a cell
VARIED = ("density", "calibration_rounds", "mask_rule")  # the settings with their own columns
START = {"head": "The centralized row is step 0, the head trained on the frozen encoder's features: every federated run "
                 "starts from that model with the encoder unfrozen.",
         "centralized": "Every federated run starts from the centralized model.",
         "scratch": "The centralized row is step 2; the federated runs start from the untrained model."}


def describe_variant(variant, varying: set[str]) -> dict[str, Any]:
    """The report columns of one algorithm variant: sparsity, R, rule and (``extra``) the other settings among
    ``varying``, those whose value differs between the grid's sparse variants."""
    if variant.algorithm != SPARSE:
        return {"algorithm": variant.algorithm, "mask_rule": DENSE_RULE, "sparsity": 0.0, "calibration_rounds": None,
                "extra": ""}
    from network.algorithms.base import get_settings_class
    from network.settings import build_settings

    given = dict(variant.settings)
    settings = build_settings(get_settings_class(SPARSE), given, SPARSE)
    extra = " ".join(f"{key}={value}" for key, value in sorted(given.items()) if key in varying and key not in VARIED)
    return {"algorithm": SPARSE, "mask_rule": settings.mask_rule, "sparsity": round(1 - settings.density, 6),
            "calibration_rounds": settings.calibration_rounds, "extra": extra}


def write_report(config: dict[str, Any], out_dir: Path, run_dirs: dict, centralized: dict[int, Path],
                 command: str) -> pd.DataFrame:
    """Collect every run, write report.csv, report.md and the plots; returns the report table."""
    metric = get_task(config["task"]).primary_metric
    per_run = []
    settings = [dict(run.variant.settings) for run in run_dirs if run.variant.algorithm == SPARSE]
    varying = {key for key in set().union(*settings) if len({repr(item.get(key)) for item in settings}) > 1} if settings else set()
    for run, run_dir in run_dirs.items():
        result = run_accuracy(run_dir / "metrics.csv", metric)
        per_run.append({"partition": run.partition.label, "scheme": run.partition.scheme,
                        "nc": run.partition.groups_per_client, "local_steps": run.local_steps,
                        "variant": run.variant.label, **describe_variant(run.variant, varying), "seed": run.seed,
                        "rounds": result["rounds"], "final": result["final"], "best_val": result["best_val"],
                        "best_round": result["best_round"]})
    runs = pd.DataFrame(per_run)
    central = pd.DataFrame([{"seed": seed, **centralized_accuracy(path / "metrics.csv", metric)}
                            for seed, path in centralized.items()])
    table = sparse_table(runs, central, metric_scale(metric))
    table.to_csv(out_dir / "report.csv", index=False)
    pngs = []
    for column, suffix in (("final", ""), ("best_val", "_best_val")):
        if table[f"{column}_mean"].notna().any():
            pngs.append(f"accuracy_vs_sparsity{suffix}.png")
            plot_accuracy_vs_sparsity(table, out_dir / pngs[-1], column, metric)
    lines = report_lines(config, table, runs, command, metric, pngs)
    atomic_write_text(out_dir / "report.md", "\n".join(lines) + "\n")
    return table


def sparse_table(runs: pd.DataFrame, central: pd.DataFrame, scale: str = UNIT) -> pd.DataFrame:
    """One row per partition × J × variant (mean and 95% interval over seeds, inside ``scale``'s range), then the
    centralized row."""
    rows = []
    for (partition, local_steps, variant), group in runs.groupby(["partition", "local_steps", "variant"], sort=False):
        group = group.sort_values("seed")
        first = group.iloc[0]
        final, best = summarize(group["final"].tolist(), scale), summarize(group["best_val"].tolist(), scale)
        rows.append({"partition": partition, "scheme": first["scheme"], "nc": first["nc"], "local_steps": local_steps,
                     "rounds": int(first["rounds"]), "variant": variant, "algorithm": first["algorithm"],
                     "mask_rule": first["mask_rule"], "sparsity": first["sparsity"],
                     "calibration_rounds": first["calibration_rounds"], "extra": first["extra"],
                     "n_seeds": len(group), "final_mean": final[0], "final_low": final[1], "final_high": final[2],
                     "best_val_mean": best[0], "best_val_low": best[1], "best_val_high": best[2],
                     "seeds": " ".join(str(seed) for seed in group["seed"])})
    final, best = summarize(central["final"].tolist(), scale), summarize(central["best_val"].tolist(), scale)
    rows.append({"partition": CENTRALIZED, "scheme": CENTRALIZED, "variant": CENTRALIZED, "algorithm": CENTRALIZED,
                 "mask_rule": "", "extra": "", "n_seeds": len(central), "final_mean": final[0], "final_low": final[1],
                 "final_high": final[2], "best_val_mean": best[0], "best_val_low": best[1], "best_val_high": best[2],
                 "seeds": " ".join(str(seed) for seed in central["seed"])})
    return pd.DataFrame(rows, columns=SPARSE_COLUMNS).astype({"nc": "Int64", "local_steps": "Int64", "rounds": "Int64",
                                                               "calibration_rounds": "Int64"})


# ----- the generated summary -----
def _by_seed(rows: pd.DataFrame, column: str) -> pd.Series:
    return rows.set_index("seed")[column].sort_index()


def _pair(a: pd.Series, b: pd.Series):
    """``b − a`` over the seeds both have (None when they share none)."""
    common = a.index.intersection(b.index)
    return paired_difference(a[common].tolist(), b[common].tolist()) if len(common) else None


def _sign(difference) -> int:
    """+1 / −1 when decided above / below 0, else 0 (no pairs, too few seeds, zero variance, interval contains 0)."""
    return 0 if difference is None else difference.sign


def _cell_name(key: tuple) -> str:
    partition, local_steps, rounds, extra, sparsity = key
    return f"{partition}, J={local_steps}, R={rounds:g}{' ' + extra if extra else ''}, sparsity {sparsity:g}"


def best_rule_lines(sparse: pd.DataFrame, column: str, ledger: list | None = None) -> list[str]:
    """The best rule of each cell and its paired margin over the runner-up."""
    lines = []
    for key, cell in sparse.groupby(CELL, sort=True):
        means = cell.groupby("mask_rule")[column].mean().sort_values(ascending=False)
        if means.isna().all():
            continue
        line = f"- {_cell_name(key)}: best {means.index[0]} {means.iloc[0]:.3f}"
        if len(means) > 1:
            first, second = (_by_seed(cell[cell.mask_rule == rule], column) for rule in means.index[:2])
            common = first.index.intersection(second.index)
            line += (f"; over {means.index[1]}: {difference_text(second[common].tolist(), first[common].tolist(), ledger)}"
                     if len(common) else "")
        lines.append(line + ".")
    return lines


def talos_lines(sparse: pd.DataFrame, column: str) -> tuple[list[str], list[str]]:
    """Least-sensitive against each other rule over every cell; returns (summary lines, cells where it loses)."""
    lines, exceptions = [], []
    rules = [rule for rule in sorted(sparse.mask_rule.unique()) if rule != TALOS]
    if TALOS not in set(sparse.mask_rule):
        return ["- no least_sensitive variant in the grid: nothing to compare."], []
    for rule in rules:
        differences, means = [], []
        for key, cell in sparse.groupby(CELL, sort=True):
            talos, other = cell[cell.mask_rule == TALOS], cell[cell.mask_rule == rule]
            if not len(talos) or not len(other):
                continue
            difference = _pair(_by_seed(other, column), _by_seed(talos, column))
            if difference is None:
                continue
            differences.append(difference)
            means.append(difference.mean)
            if difference.sign < 0:
                exceptions.append(f"- least_sensitive is noticeably below {rule} at {_cell_name(key)} "
                                  f"({difference.mean:+.3f} [{difference.low:+.3f}, {difference.high:+.3f}]).")
        if differences:
            counts = count(differences)
            verdict = {1: "is above it", -1: "is below it",
                       0: "shows no clear direction against it (that needs half of the cells decided and two thirds "
                          "of those agreeing)"}[direction(counts)]
            lines.append(f"- least_sensitive − {rule}: mean {np.mean(means):+.3f} over {counts.cells} cells; noticeably "
                         f"above in {counts.above}, below in {counts.below}, undecided in {counts.cells - counts.decided} "
                         f"({counts.too_few} with too few seeds, {counts.zero_variance} with zero variance, "
                         f"{counts.contains_zero} whose interval contains 0); after Benjamini–Hochberg over the "
                         f"{counts.cells} cells: above in {counts.above_adjusted}, below in {counts.below_adjusted}: "
                         f"least_sensitive {verdict}.")
    return lines, exceptions


def dense_lines(runs: pd.DataFrame, column: str, ledger: list | None = None) -> tuple[list[str], list[str]]:
    """Sparse against dense per partition and J; on the most skewed partition against iid (interference)."""
    lines, exceptions, gains = [], [], {}
    dense_runs, sparse = runs[runs.mask_rule == DENSE_RULE], runs[runs.algorithm == SPARSE]
    for (partition, local_steps), dense in dense_runs.groupby(["partition", "local_steps"], sort=True):
        mine = sparse[(sparse.partition == partition) & (sparse.local_steps == local_steps)]
        if not len(mine):
            continue
        reference = _by_seed(dense, column)
        differences = {variant: _pair(reference, _by_seed(rows, column)) for variant, rows in mine.groupby("variant")}
        differences = {variant: difference for variant, difference in differences.items() if difference is not None}
        gains[(partition, local_steps)] = {variant: (difference, mine[mine.variant == variant].iloc[0])
                                           for variant, difference in differences.items()}
        counts = count(list(differences.values()))
        best = max(differences, key=lambda variant: differences[variant].mean)
        lines.append(f"- {partition}, J={local_steps}: dense {reference.mean():.3f}; {counts.above} of {counts.cells} "
                     f"sparse variants noticeably above it, {counts.below} below (after Benjamini–Hochberg over the "
                     f"{counts.cells}: {counts.above_adjusted} above, {counts.below_adjusted} below); the best, "
                     f"{_short(mine[mine.variant == best].iloc[0])}: "
                     f"{difference_text(reference.tolist(), _by_seed(mine[mine.variant == best], column).tolist(), ledger)}.")
    lines += interference_lines(runs, gains, column, exceptions, ledger)
    return lines, exceptions


def _short(row) -> str:
    extra = f", {row.extra}" if row.extra else ""
    return f"{row.mask_rule} at sparsity {row.sparsity:g}, R={row.calibration_rounds:g}{extra}"


def interference_lines(runs: pd.DataFrame, gains: dict, column: str, exceptions: list[str],
                       ledger: list | None = None) -> list[str]:
    """Does least-sensitive beat dense on the most skewed partition, and is its gain over dense larger there than
    on iid (the interference claim)? ``gains``: (partition, J) -> {variant: (sparse − dense, variant row)}."""
    skewed = runs[runs.nc.notna()]
    if not len(skewed):
        return []
    nc_min = skewed.nc.min()
    worst = skewed[skewed.nc == nc_min].partition.iloc[0]
    iid = runs[runs.scheme == "iid"].partition.iloc[0] if (runs.scheme == "iid").any() else None
    lines = []
    for (partition, local_steps), variants in gains.items():
        if partition != worst:
            continue
        talos = {variant: item for variant, item in variants.items() if item[1].mask_rule == TALOS}
        above = [variant for variant, (difference, _) in talos.items() if _sign(difference) > 0]
        claim = "holds" if talos and len(above) == len(talos) else "holds in part" if above else "does not hold"
        lines.append(f"- Nc={nc_min:g} (interference), J={local_steps}: least_sensitive beats dense FedAvg noticeably in "
                     f"{len(above)} of {len(talos)} settings (sparsity × R): the claim {claim}.")
        if claim != "holds":
            exceptions.append(f"- Nc={nc_min:g}, J={local_steps}: least_sensitive is not noticeably above dense in "
                              f"{len(talos) - len(above)} of {len(talos)} settings.")
        if iid is None or (iid, local_steps) not in gains:
            continue
        for variant, (_, row) in sorted(talos.items(), key=lambda item: (item[1][1].sparsity, item[1][1].calibration_rounds)):
            # Difference in differences, paired by seed: (sparse − dense at Nc_min) − (sparse − dense on iid).
            skewed_gain, iid_gain = (_gain(runs, name, local_steps, variant, column) for name in (partition, iid))
            common = skewed_gain.index.intersection(iid_gain.index)
            if len(common):
                lines.append(f"  - sparsity {row.sparsity:g}, R={row.calibration_rounds:g}{', ' + row.extra if row.extra else ''}: gain over dense at "
                             f"Nc={nc_min:g} {skewed_gain.mean():+.3f}, on iid {iid_gain.mean():+.3f}; "
                             f"Nc={nc_min:g} − iid: {difference_text(iid_gain[common].tolist(), skewed_gain[common].tolist(), ledger)}.")
    return lines


def _gain(runs: pd.DataFrame, partition: str, local_steps: int, variant: str, column: str) -> pd.Series:
    """sparse − dense per seed."""
    here = runs[(runs.partition == partition) & (runs.local_steps == local_steps)]
    sparse, dense = _by_seed(here[here.variant == variant], column), _by_seed(here[here.mask_rule == DENSE_RULE], column)
    common = sparse.index.intersection(dense.index)
    return sparse[common] - dense[common]


def summary_lines(runs: pd.DataFrame, column: str, what: str) -> list[str]:
    sparse = runs[runs.algorithm == SPARSE]
    ledger: list = []
    talos, talos_exceptions = talos_lines(sparse, column)
    dense, dense_exceptions = dense_lines(runs, column, ledger)
    lines = [f"### {what}", "", "Best rule at each sparsity:", ""] + best_rule_lines(sparse, column, ledger)
    lines += ["", "Least-sensitive (TaLoS) against each rule, paired by seed within each cell:", ""] + talos
    lines += ["", "Sparse against dense FedAvg:", ""] + dense
    lines += ["", "Where the claims do not hold:", ""] + (talos_exceptions + dense_exceptions or ["- nowhere in this grid."])
    if ledger:
        lines += ["", ledger_line(ledger, f"{what}, the differences quoted with an interval")]
    return lines + [""]


def criteria_lines(runs: pd.DataFrame) -> list[str]:
    """Where final accuracy and best by validation disagree about a rule against dense, and the numbers that explain
    it: each side's best validation round (round 0 is the start model) and how far each ends below its best."""
    lines = []
    dense_runs, sparse = runs[runs.mask_rule == DENSE_RULE], runs[runs.algorithm == SPARSE]
    for (partition, local_steps), dense in dense_runs.groupby(["partition", "local_steps"], sort=True):
        mine = sparse[(sparse.partition == partition) & (sparse.local_steps == local_steps)]
        for rule, rule_runs in mine.groupby("mask_rule", sort=True):
            above = {column: sum(_sign(_pair(_by_seed(dense, column), _by_seed(rows, column))) > 0
                                 for _, rows in rule_runs.groupby("variant"))
                     for column in ("final", "best_val")}
            if above["final"] == above["best_val"]:
                continue
            settings = rule_runs.variant.nunique()
            lines.append(f"- {partition}, J={local_steps}, {rule}: noticeably above dense in {above['final']} of "
                         f"{settings} settings by final accuracy but in {above['best_val']} of {settings} by best by "
                         f"validation. {_best_round_clause('dense', dense)}; {_best_round_clause(rule, rule_runs)}.")
    return lines


def _best_round_clause(name: str, rows: pd.DataFrame) -> str:
    """``dense's best validation round is its start model (round 0) in 3 of 3 runs; it ends 0.050 below that best``."""
    rounds = rows.best_round.dropna()
    drop = float((rows.best_val - rows.final).mean())
    at_start = int((rounds == 0).sum())
    where = (f"{name}'s best validation round is its start model (round 0) in {at_start} of {len(rounds)} runs, so its "
             "best-by-validation accuracy is the start model's" if at_start
             else f"{name}'s best validation round is round {rounds.median():g} (median over {len(rounds)} runs)")
    return f"{where}; it ends {drop:.3f} below that best on average"


def report_lines(config: dict[str, Any], table: pd.DataFrame, runs: pd.DataFrame, command: str, metric: str,
                 pngs: list[str]) -> list[str]:
    federated = config["federated"]
    lines = [f"# Sparse fine-tuning study: {config['name']}", "", f"`{command}`", "",
             f"Task {config['task']} ({metric}), data {config['data']['source']}, {config['model']['encoder']} at "
             f"{config['model']['image_size']} px; K = {federated['n_clients']} clients, C = {federated['client_fraction']}, "
             f"rounds × J = {federated['rounds_x_local_steps']}, start: {federated['init_from']}, seeds "
             f"{', '.join(map(str, config['seeds']))}. Dense FedAvg against sparse fine-tuning (sparse_ft, SparseSGDM on a "
             "calibrated mask; sparsity = 1 − density, R = calibration rounds). Accuracy of the global model on the test "
             "split: *final* at the last round, *best by validation* at the round of the highest validation accuracy "
             "(– without validation rows). Intervals: 95% Student t over seeds on the logit scale (inside [0, 1]); "
             "differences are paired by seed and *noticeable* only with at least 3 paired seeds, nonzero variance and "
             "an interval excluding 0. " + START[federated["init_from"]],
             "", "## Summary", ""]
    lines += summary_lines(runs, "final", "Final accuracy")
    if runs["best_val"].notna().any():
        lines += summary_lines(runs, "best_val", "Best-by-validation accuracy")
        disagreements = criteria_lines(runs)
        lines += ["### Where the two criteria disagree", ""] + (disagreements or ["- nowhere: final accuracy and best by "
                                                                                   "validation give the same counts."]) + [""]
    lines += ["## Accuracy", "", "| partition | Nc | J | rounds | algorithm | rule | sparsity | R | other | final [95% CI] "
              "| best by validation [95% CI] | seeds |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in table.itertuples(index=False):
        def text(value, form="{:g}"):
            return "" if value is None or pd.isna(value) else form.format(value)
        lines.append(f"| {row.partition} | {text(row.nc)} | {text(row.local_steps)} | {text(row.rounds)} | {row.algorithm} "
                     f"| {row.mask_rule} | {text(row.sparsity) if row.algorithm == SPARSE else ''} "
                     f"| {text(row.calibration_rounds)} | {row.extra} | {interval_cell(row.final_mean, row.final_low, row.final_high)} "
                     f"| {interval_cell(row.best_val_mean, row.best_val_low, row.best_val_high)} | {row.seeds} |")
    lines += [""] + [f"![accuracy against sparsity]({png})" for png in pngs]
    return lines


def plot_accuracy_vs_sparsity(table: pd.DataFrame, out_png: Path, column: str, metric: str) -> None:
    """One panel per partition (rows) and J × R × other settings (columns): one line per rule with its interval
    against sparsity (evenly spaced ticks), dense variants and centralized as horizontal lines."""
    from utils.plots import plt, save_figure

    sparse = table[table.algorithm == SPARSE]
    partitions = list(dict.fromkeys(table.loc[table.partition != CENTRALIZED, "partition"]))
    columns = list(dict.fromkeys(zip(sparse.local_steps, sparse.calibration_rounds, sparse.extra))) or [(None, None, "")]
    levels = sorted(sparse.sparsity.unique())
    position = {level: index for index, level in enumerate(levels)}
    rules = sorted(sparse.mask_rule.unique())
    colors = dict(zip(rules, plt.rcParams["axes.prop_cycle"].by_key()["color"] * len(rules)))
    figure, axes = plt.subplots(len(partitions), len(columns), figsize=(4.2 * len(columns), 3.2 * len(partitions)),
                                sharey=True, squeeze=False)
    central = table[table.partition == CENTRALIZED][f"{column}_mean"]
    for row_axes, partition in zip(axes, partitions):
        for axis, (local_steps, rounds, extra) in zip(row_axes, columns):
            cell = sparse[(sparse.partition == partition) & (sparse.local_steps == local_steps)
                          & (sparse.calibration_rounds == rounds) & (sparse.extra == extra)]
            for rule, rows in cell.groupby("mask_rule"):
                rows = rows.sort_values("sparsity")
                low, high = rows[f"{column}_low"], rows[f"{column}_high"]  # logit-scale intervals: inside [0, 1]
                error = np.nan_to_num(np.vstack([rows[f"{column}_mean"] - low, high - rows[f"{column}_mean"]]).astype(float))
                axis.errorbar([position[level] for level in rows.sparsity], rows[f"{column}_mean"].to_numpy(dtype=float),
                              yerr=error, marker="o", capsize=3, label=rule, color=colors[rule])
            dense = table[(table.partition == partition) & (table.mask_rule == DENSE_RULE)
                          & ((table.local_steps == local_steps) if local_steps is not None else True)]
            for reference in dense.itertuples(index=False):
                axis.axhline(getattr(reference, f"{column}_mean"), color="black", linestyle="--",
                             label=f"dense {reference.algorithm}")
            if len(central) and not math.isnan(central.iloc[0]):
                axis.axhline(central.iloc[0], color="grey", linestyle=":", label="centralized")
            axis.set_xticks(range(len(levels)), [f"{level:g}" for level in levels])
            axis.set_ylim(-0.02, 1.02)
            axis.set_title(f"{partition}" + (f" · J={int(local_steps)} · R={int(rounds)}" if local_steps is not None else "")
                           + (f" · {extra}" if extra else ""), fontsize=9)
            axis.set_xlabel("sparsity (1 − density)")
        row_axes[0].set_ylabel(f"test {metric}" + (" (best by val)" if column == "best_val" else ""))
    axes[0][0].legend(fontsize=7)
    save_figure(figure, out_png, dpi=110)


register_grid_kind("sparse_finetuning", "dense FedAvg against sparse fine-tuning (TaLoS) per sparsity, calibration "
                   "rounds and mask rule", write_report, report_unit="partition × J × variant rows")
