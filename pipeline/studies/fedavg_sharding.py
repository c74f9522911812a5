"""The FedAvg sharding study's report: accuracy against Nc for each J, beside iid and centralized, with 95% intervals.

For every run it reads step 4's ``metrics.csv``: the global model's test accuracy (the task's
primary metric, top-1) at the last round (*final*) and at the round of the highest validation
accuracy (*best by validation*; the earliest such round; NaN when the manifest has no validation
rows). The centralized baseline (one step-2 run per seed) gives its last epoch's test accuracy and,
when step 2 logged a ``val`` split, the test accuracy of its best validation epoch. Means over seeds
come with Student's t 95% intervals on the logit scale, so they stay inside [0, 1]
(utils/statistics.py); comparisons pair runs by seed (the same seed gives the same initial model
and client sampling), and a difference counts as noticeable only when it is decided: at least 3
paired seeds, nonzero variance and an interval excluding 0 (otherwise it says why not). Each
summary ends with how many of its paired comparisons are noticeable, raw and after
Benjamini–Hochberg over all of them.

Outputs: ``report.csv`` (:data:`STUDY_COLUMNS`, one row per partition × J × algorithm variant plus
the centralized row), ``report.md`` (summary, table, plots), ``accuracy_vs_nc.png`` and
``accuracy_curves.png``.
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
from utils.run_dir import atomic_write_text
from utils.statistics import UNIT, metric_scale, paired_difference

STUDY_COLUMNS = ["partition", "scheme", "nc", "local_steps", "rounds", "algorithm", "n_seeds", "final_mean", "final_low",
                 "final_high", "best_val_mean", "best_val_low", "best_val_high", "seeds"]


def write_report(config: dict[str, Any], out_dir: Path, run_dirs: dict, centralized: dict[int, Path],
                       command: str) -> pd.DataFrame:
    """Collect every run, write report.csv, report.md and the plots; returns the report table."""
    metric = get_task(config["task"]).primary_metric
    per_run, curves = [], []
    for run, run_dir in run_dirs.items():
        result = run_accuracy(run_dir / "metrics.csv", metric)
        keys = {"partition": run.partition.label, "scheme": run.partition.scheme,
                "nc": run.partition.groups_per_client, "local_steps": run.local_steps, "algorithm": run.variant.label,
                "seed": run.seed}
        per_run.append({**keys, "rounds": result["rounds"], "final": result["final"], "best_val": result["best_val"],
                        "best_round": result["best_round"]})
        curve = result["curve"].assign(**keys)
        curves.append(curve.assign(local_work=curve["round"] * run.local_steps))
    runs = pd.DataFrame(per_run)
    central = pd.DataFrame([{"seed": seed, **centralized_accuracy(path / "metrics.csv", metric)}
                            for seed, path in centralized.items()])
    table = study_table(runs, central, metric_scale(metric))
    table.to_csv(out_dir / "report.csv", index=False)
    plot_accuracy_vs_nc(table, out_dir / "accuracy_vs_nc.png", metric)
    plot_curves(pd.concat(curves, ignore_index=True), out_dir / "accuracy_curves.png", metric)
    lines = report_lines(config, table, runs, central, command, metric)
    atomic_write_text(out_dir / "report.md", "\n".join(lines) + "\n")
    return table


def study_table(runs: pd.DataFrame, central: pd.DataFrame, scale: str = UNIT) -> pd.DataFrame:
    """One row per partition × J × variant (mean and interval over seeds, inside ``scale``'s range), then the
    centralized row."""
    rows = []
    for (partition, local_steps, algorithm), group in runs.groupby(["partition", "local_steps", "algorithm"], sort=False):
        group = group.sort_values("seed")
        final, best = summarize(group["final"].tolist(), scale), summarize(group["best_val"].tolist(), scale)
        rows.append({"partition": partition, "scheme": group["scheme"].iloc[0], "nc": group["nc"].iloc[0],
                     "local_steps": local_steps, "rounds": int(group["rounds"].iloc[0]), "algorithm": algorithm,
                     "n_seeds": len(group), "final_mean": final[0], "final_low": final[1], "final_high": final[2],
                     "best_val_mean": best[0], "best_val_low": best[1], "best_val_high": best[2],
                     "seeds": " ".join(str(seed) for seed in group["seed"])})
    final, best = summarize(central["final"].tolist(), scale), summarize(central["best_val"].tolist(), scale)
    rows.append({"partition": CENTRALIZED, "scheme": CENTRALIZED, "nc": None, "local_steps": None, "rounds": None,
                 "algorithm": CENTRALIZED, "n_seeds": len(central), "final_mean": final[0], "final_low": final[1],
                 "final_high": final[2], "best_val_mean": best[0], "best_val_low": best[1], "best_val_high": best[2],
                 "seeds": " ".join(str(seed) for seed in central["seed"])})
    return pd.DataFrame(rows, columns=STUDY_COLUMNS).astype({"nc": "Int64", "local_steps": "Int64", "rounds": "Int64"})


def _paired(runs: pd.DataFrame, column: str, **where: Any) -> pd.Series:
    selected = runs
    for key, value in where.items():
        selected = selected[selected[key] == value]
    return selected.set_index("seed")[column].sort_index()


def summary_lines(runs: pd.DataFrame, central: pd.DataFrame, column: str, what: str) -> list[str]:
    """The generated summary for ``column`` (final or best_val) of the Nc-sharded runs, iid and centralized."""
    lines, ledger = [], []
    sharded = runs[runs.nc.notna()]
    for algorithm in runs["algorithm"].unique():
        mine = sharded[sharded.algorithm == algorithm]
        ncs, steps = sorted(mine["nc"].unique()), sorted(mine["local_steps"].unique())
        for local_steps in steps:
            at_j = mine[mine.local_steps == local_steps]
            means = ", ".join(f"Nc={nc:g}: {at_j[at_j.nc == nc][column].mean():.3f}" for nc in ncs)
            line = f"- {what}, {algorithm}, J={local_steps}: {means}."
            if len(ncs) > 1:
                low, high = _paired(at_j, column, nc=ncs[0]), _paired(at_j, column, nc=ncs[-1])
                common = low.index.intersection(high.index)
                line += (f" Nc={ncs[-1]:g} − Nc={ncs[0]:g}: "
                         f"{difference_text(low[common].tolist(), high[common].tolist(), ledger)}.")
            iid = runs[(runs.scheme == "iid") & (runs.algorithm == algorithm) & (runs.local_steps == local_steps)]
            if len(iid) and len(ncs):
                skewed = _paired(at_j, column, nc=ncs[0])
                common = skewed.index.intersection(iid.set_index("seed").index)
                line += (f" iid {iid[column].mean():.3f}; Nc={ncs[0]:g} − iid: "
                         f"{difference_text(_paired(iid, column)[common].tolist(), skewed[common].tolist(), ledger)}.")
            lines.append(line)
        if len(steps) > 1 and len(ncs) > 1:
            lines += interaction_lines(mine, column, what, algorithm, ncs, steps, ledger)
    centralized = summarize(central["final" if column == "final" else "best_val"].tolist())
    if not math.isnan(centralized[0]):
        best = runs.groupby(["partition", "local_steps", "algorithm"])[column].mean()
        partition, local_steps, algorithm = best.idxmax()
        lines.append(f"- {what}: centralized {interval_cell(*centralized)}; the best federated cell "
                     f"({partition}, J={local_steps}, {algorithm}) reaches {best.max():.3f}.")
    if ledger:
        lines.append(ledger_line(ledger, what))
    return lines


def interaction_lines(runs: pd.DataFrame, column: str, what: str, algorithm: str, ncs: list, steps: list,
                      ledger: list | None = None) -> list[str]:
    """How J's effect (J_max − J_min) changes with Nc: per Nc, and Nc_min against Nc_max (difference in differences)."""
    effects = {}
    for nc in ncs:
        short, long = _paired(runs, column, nc=nc, local_steps=steps[0]), _paired(runs, column, nc=nc, local_steps=steps[-1])
        common = short.index.intersection(long.index)
        effects[nc] = (long[common] - short[common])
    parts = [f"Nc={nc:g}: {effect.mean():+.3f}" for nc, effect in effects.items()]
    line = (f"- {what}, {algorithm}: effect of J={steps[-1]} over J={steps[0]} at equal rounds × J: "
            f"{', '.join(parts)}.")
    first, last = effects[ncs[0]], effects[ncs[-1]]
    common = first.index.intersection(last.index)
    if len(common):
        line += (f" Interaction (J effect at Nc={ncs[0]:g} − at Nc={ncs[-1]:g}): "
                 f"{difference_text(last[common].tolist(), first[common].tolist(), ledger)}")
        smaller = (first[common] - last[common]).mean() < 0
        line += (f"; J's effect is {'smaller' if smaller else 'larger'} at Nc={ncs[0]:g} "
                 f"({'more local steps help less or hurt more' if smaller else 'more local steps help more or hurt less'} "
                 "on the most skewed partition).")
    return [line]


def report_lines(config: dict[str, Any], table: pd.DataFrame, runs: pd.DataFrame, central: pd.DataFrame, command: str,
                 metric: str) -> list[str]:
    federated = config["federated"]
    lines = [f"# FedAvg study: {config['name']}", "", f"`{command}`", "",
             f"Task {config['task']} ({metric}), data {config['data']['source']}, {config['model']['encoder']} at "
             f"{config['model']['image_size']} px; K = {federated['n_clients']} clients, C = {federated['client_fraction']}, "
             f"rounds × J = {federated['rounds_x_local_steps']}, seeds {', '.join(map(str, config['seeds']))}. "
             "Accuracy of the global model on the test split: *final* at the last round, *best by validation* at the "
             "round of the highest validation accuracy (– without validation rows). Intervals: 95% Student t over seeds "
             "on the logit scale (inside [0, 1]); differences are paired by seed and *noticeable* only with at least 3 "
             "paired seeds, nonzero variance and an interval excluding 0.", "", "## Summary", ""]
    lines += summary_lines(runs, central, "final", "final accuracy")
    if runs["best_val"].notna().any():
        lines += summary_lines(runs, central, "best_val", "best-by-validation accuracy")
    lines += ["", "## Accuracy", "", "| partition | Nc | J | rounds | algorithm | final [95% CI] | best by validation [95% CI] | seeds |",
              "|---|---|---|---|---|---|---|---|"]
    for row in table.itertuples(index=False):
        nc = "" if pd.isna(row.nc) else f"{row.nc:g}"
        steps = "" if pd.isna(row.local_steps) else f"{row.local_steps:g}"
        rounds = "" if pd.isna(row.rounds) else f"{row.rounds:g}"
        lines.append(f"| {row.partition} | {nc} | {steps} | {rounds} | {row.algorithm} | "
                     f"{interval_cell(row.final_mean, row.final_low, row.final_high)} | "
                     f"{interval_cell(row.best_val_mean, row.best_val_low, row.best_val_high)} | {row.seeds} |")
    lines += ["", "![accuracy against Nc](accuracy_vs_nc.png)", "", "![test accuracy per round](accuracy_curves.png)"]
    return lines


def plot_accuracy_vs_nc(table: pd.DataFrame, out_png: Path, metric: str) -> None:
    """Accuracy against Nc, one line per J and variant, iid and centralized as horizontal lines; a second panel
    for best by validation when there are validation numbers."""
    from utils.plots import plt, save_figure

    panels = [("final", "final")] + ([("best_val", "best by validation")] if table.best_val_mean.notna().any() else [])
    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), sharey=True, squeeze=False)
    axes = axes[0]
    sharded = table[table.nc.notna()]
    ticks = sorted(sharded["nc"].astype(int).unique())
    for axis, (column, title) in zip(axes, panels):
        for (local_steps, algorithm), rows in sharded.groupby(["local_steps", "algorithm"]):
            rows = rows.sort_values("nc")
            error = np.nan_to_num(np.vstack([rows[f"{column}_mean"] - rows[f"{column}_low"],
                                             rows[f"{column}_high"] - rows[f"{column}_mean"]]))
            label = f"J={local_steps:g}" + ("" if sharded.algorithm.nunique() == 1 else f" · {algorithm}")
            axis.errorbar(rows["nc"].to_numpy(dtype=float), rows[f"{column}_mean"].to_numpy(dtype=float), yerr=error,
                          marker="o", capsize=3, label=label)
        for row in table[table.nc.isna()].itertuples(index=False):
            value = getattr(row, f"{column}_mean")
            if not math.isnan(value):
                name = row.partition if row.partition == CENTRALIZED else f"{row.partition} J={row.local_steps:g}"
                axis.axhline(value, linestyle="--" if row.partition == CENTRALIZED else ":", color="grey", label=name)
        axis.set_xscale("log")
        axis.set_xticks(ticks, [str(tick) for tick in ticks])
        axis.minorticks_off()
        axis.set_xlabel("Nc (classes per client)")
        axis.set_title(title)
    axes[0].set_ylabel(f"test {metric}")
    axes[0].legend(fontsize=8)
    save_figure(figure, out_png, dpi=120)


def plot_curves(curves: pd.DataFrame, out_png: Path, metric: str) -> None:
    """Test accuracy (seed mean) against local work rounds × J, one panel per J, one line per partition."""
    from utils.plots import plt, save_figure

    steps = sorted(curves["local_steps"].unique())
    lines = list(dict.fromkeys(zip(curves["partition"], curves["algorithm"])))
    colors = dict(zip(lines, plt.rcParams["axes.prop_cycle"].by_key()["color"] * len(lines)))  # one colour per line, every panel
    figure, axes = plt.subplots(1, len(steps), figsize=(4.5 * len(steps), 3.6), sharey=True, squeeze=False)
    for axis, local_steps in zip(axes[0], steps):
        rows = curves[curves.local_steps == local_steps]
        for (partition, algorithm), group in rows.groupby(["partition", "algorithm"], sort=False):
            mean = group.groupby("local_work")["value"].mean()
            label = partition + ("" if curves.algorithm.nunique() == 1 else f" · {algorithm}")
            axis.plot(mean.index, mean.to_numpy(), marker=".", label=label, color=colors[(partition, algorithm)])
        axis.set_title(f"J={local_steps:g}")
        axis.set_xlabel("rounds × J")
    axes[0][0].set_ylabel(f"test {metric}")
    handles: dict[str, Any] = {}
    for axis in axes[0]:  # every line once, whichever panel has it (iid only at some J)
        for handle, label in zip(*axis.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    axes[0][0].legend(list(handles.values()), list(handles), fontsize=7)
    save_figure(figure, out_png, dpi=120)


register_grid_kind("fedavg_sharding", "FedAvg's accuracy against classes per client (Nc) for each number of local steps J, "
                   "beside iid and centralized", write_report, report_unit="partition × J × algorithm rows")
