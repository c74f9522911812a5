"""The report of a Fed-LT study (``study: fed_lt``, issue 20): FedLoGe against its baselines under one protocol.

Per partition (e.g. ``dirichlet_per_class`` at each α) and method, over seeds (mean and 95% t
interval), at the final round:

* global accuracy on the balanced test split: overall top-1 and top-1 of the head/middle/tail classes
  by cumulative mass (75/95%, FedLoGe's convention) and of the many/medium/few-shot classes (OLTR's);
  FedLoGe's global model is its GLA-FR realigned one, and its universal SSE-C model is a row of its own;
* local accuracy on the clients' test sets: each method's *local model* (its personal model when it
  has one, FedBABU's and the local fine-tuning baseline's fine-tuned model, else the global model),
  the mean over clients, the std and the worst 10% of clients, without and with the absent-class mask
  (the ``_masked`` rows every method gets from ``network.client.evaluate_client``).

The local fine-tuning baseline is FedAvg's model after ``--finetune_steps`` (``fedavg+ft``). The
summary, computed from the table: for each partition, whether FedLoGe beats every baseline on global
and on local accuracy (paired by seed: the 95% interval of the difference above 0), and where not.

Plots: ``accuracy_by_class_group.png`` (global top-1 overall and of the head, middle and tail classes, per
method and partition, with the 95% intervals of the table) and ``accuracy_vs_round.png`` (the global
model's top-1 on the test split per round, per method and partition: mean over seeds, band from the
lowest to the highest seed).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from network.run_outputs import SKIPPED_CLIENT, SUMMARY_CLIENTS
from pipeline.studies.grid.kind import register_grid_kind
from pipeline.studies.toolbox_runs import personalised_by_finetuning
from utils.statistics import UNIT, mean_interval, paired_difference
from utils.run_dir import atomic_write_text

FEDLOGE = "fedloge"
GROUPS_PLOT, ROUNDS_PLOT = "accuracy_by_class_group.png", "accuracy_vs_round.png"
# The bars of the class-group plot: the table's column and its name on the axis.
BAR_GROUPS = (("global", "overall"), ("global_head", "head"), ("global_middle", "middle"), ("global_tail", "tail"))
GROUPS = ("head", "middle", "tail", "many", "medium", "few")
GLOBAL_COLUMNS = ("global", *(f"global_{group}" for group in GROUPS))
LOCAL_COLUMNS = ("local", "local_std", "local_worst10", "local_masked", "local_masked_std", "local_masked_worst10")
FINETUNED = "client_test_finetuned"
PERSONAL = "client_test_personal"
FINETUNE_BASELINE = "fedavg"  # its fine-tuned model is the local fine-tuning baseline, reported as fedavg+ft
CLAIMS = (("global", "global accuracy"), ("local", "local accuracy (no mask)"), ("local_masked", "local accuracy (masked)"))


def final_rows(metrics_csv: Path) -> pd.DataFrame:
    metrics = pd.read_csv(metrics_csv, dtype={"client": str})
    return metrics[metrics["round"] == metrics["round"].max()]


def global_accuracy(final: pd.DataFrame, client: str) -> dict[str, float]:
    rows = final[(final.split == "test") & (final.client == client)].set_index("metric")["value"]
    return {column: float(rows.get("top1" if column == "global" else f"top1_{column[7:]}", math.nan))
            for column in GLOBAL_COLUMNS}


def local_accuracy(final: pd.DataFrame, split: str) -> dict[str, float]:
    """Mean, std and worst-10% (mean of the lowest ⌈10%⌉ clients) top-1 of ``split`` and of its masked twin."""
    result = {}
    for suffix, name in (("", "local"), ("_masked", "local_masked")):
        rows = final[(final.split == split + suffix) & (final.metric == "top1")]
        per_client = rows[~rows.client.isin((*SUMMARY_CLIENTS, SKIPPED_CLIENT))]["value"].sort_values()
        worst = per_client.iloc[:max(1, math.ceil(len(per_client) / 10))] if len(per_client) else per_client
        result[name] = float(per_client.mean()) if len(per_client) else math.nan
        result[f"{name}_std"] = float(per_client.std(ddof=0)) if len(per_client) else math.nan
        result[f"{name}_worst10"] = float(worst.mean()) if len(worst) else math.nan
    return result


def local_split(algorithm: str, final: pd.DataFrame) -> str:
    """The fine-tuned model of a method personalised by fine-tuning (FedBABU); else the personal models when the run
    has them (personalised algorithms); else the global model."""
    if personalised_by_finetuning(algorithm):
        return FINETUNED
    return PERSONAL if (final.split == PERSONAL).any() else "client_test"


def run_rows(run, run_dir: Path) -> list[dict[str, Any]]:
    """The report rows of one run: its method, plus FedLoGe's universal model and FedAvg's fine-tuned model."""
    final = final_rows(run_dir / "metrics.csv")
    base = {"partition": run.partition.label, "seed": run.seed}
    algorithm = run.variant.algorithm
    rows = [{**base, "method": run.variant.label, **global_accuracy(final, "global"),
             **local_accuracy(final, local_split(algorithm, final))}]
    if algorithm == FEDLOGE:
        rows.append({**base, "method": f"{run.variant.label} (universal)",
                     **global_accuracy(final, "model:universal"), **local_accuracy(final, "none")})
    if algorithm == FINETUNE_BASELINE and (final.split == FINETUNED).any():
        rows.append({**base, "method": f"{run.variant.label}+ft", **global_accuracy(final, "global"),
                     **local_accuracy(final, FINETUNED)})
    return rows


def report_table(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per partition × method: mean and 95% interval over seeds of every column."""
    rows = []
    for (partition, method), group in runs.groupby(["partition", "method"], sort=False):
        row = {"partition": partition, "method": method, "seeds": len(group)}
        for column in (*GLOBAL_COLUMNS, *LOCAL_COLUMNS):
            values = group[column].dropna().tolist()
            mean, low, high = mean_interval(values, UNIT) if values else (math.nan, math.nan, math.nan)
            row.update({f"{column}_mean": mean, f"{column}_low": low, f"{column}_high": high})
        rows.append(row)
    return pd.DataFrame(rows)


def _cell(row: pd.Series, column: str) -> str:
    mean, low, high = (row[f"{column}_{part}"] for part in ("mean", "low", "high"))
    if math.isnan(mean):
        return "–"
    return f"{100 * mean:.1f}" + ("" if math.isnan(low) else f" [{100 * low:.1f}, {100 * high:.1f}]")


def claim_lines(runs: pd.DataFrame) -> list[str]:
    """Per partition and claim: FedLoGe against every baseline, paired by seed."""
    lines = []
    fedloge = [method for method in runs.method.unique() if method.split("-")[0] == FEDLOGE and "(" not in method]
    for partition, group in runs.groupby("partition", sort=False):
        for method in fedloge:
            ours = group[group.method == method].set_index("seed")
            for column, what in CLAIMS:
                beaten, lost, unclear = [], [], []
                for baseline in group.method.unique():
                    if baseline.split("-")[0] == FEDLOGE:
                        continue
                    theirs = group[group.method == baseline].set_index("seed")
                    seeds = sorted(set(ours.index) & set(theirs.index))
                    pairs = [(theirs.loc[s, column], ours.loc[s, column]) for s in seeds
                             if not (math.isnan(theirs.loc[s, column]) or math.isnan(ours.loc[s, column]))]
                    if not pairs:
                        continue
                    difference = paired_difference([b for b, _ in pairs], [o for _, o in pairs], scale=UNIT)
                    text = f"{baseline} ({100 * difference.mean:+.1f} pts"
                    text += "" if math.isnan(difference.low) else f", [{100 * difference.low:+.1f}, {100 * difference.high:+.1f}]"
                    text += ")" if difference.testable else f"; {difference.explain()})"
                    (beaten if difference.sign > 0 else lost if difference.sign < 0 else unclear).append(text)
                if not (lost or unclear):
                    verdict = "**holds**: better than every baseline"
                elif lost:
                    verdict = "**does not hold**: worse than " + ", ".join(lost)
                else:
                    verdict = "**not shown**: no clear difference from " + ", ".join(unclear)
                details = f" (better than {', '.join(beaten)})" if beaten and (lost or unclear) else ""
                lines.append(f"- {partition}, {method}, {what}: {verdict}{details}.")
    return lines


def plot_class_groups(table: pd.DataFrame, name: str, path: Path) -> None:
    """Global top-1 overall and of the head, middle and tail classes (cumulative mass 75/95%), one bar per method
    at its mean over seeds with the table's 95% interval, one panel per partition; the legend beside the panels."""
    from utils.plots import legend_outside, metric_label, plt, save_figure

    partitions, methods = list(dict.fromkeys(table.partition)), list(dict.fromkeys(table.method))
    panel_width = max(4.0, 0.3 * len(methods) * len(BAR_GROUPS))
    figure, axes = plt.subplots(1, len(partitions), figsize=(panel_width * len(partitions) + 2.4, 3.6), squeeze=False,
                                sharey=True, layout="constrained")
    width = 0.8 / len(methods)
    for axis, partition in zip(axes[0], partitions):
        rows = table[table.partition == partition].set_index("method")
        for index, method in enumerate(methods):
            if method not in rows.index:
                continue
            row = rows.loc[method]
            means = np.array([row[f"{column}_mean"] for column, _ in BAR_GROUPS], dtype=float)
            lows = np.array([row[f"{column}_low"] for column, _ in BAR_GROUPS], dtype=float)
            highs = np.array([row[f"{column}_high"] for column, _ in BAR_GROUPS], dtype=float)
            errors = np.nan_to_num(np.vstack([means - lows, highs - means]))  # no interval (one seed): no bar
            axis.bar(np.arange(len(BAR_GROUPS)) + (index - (len(methods) - 1) / 2) * width, means, width,
                     yerr=errors, capsize=2, color=f"C{index}", label=method)
        axis.set_xticks(range(len(BAR_GROUPS)), [label for _, label in BAR_GROUPS])
        axis.set_title(partition, fontsize=9)
        axis.set_ylim(0, 1)
    axes[0][0].set_ylabel(f"global {metric_label('top1')}")
    figure.supxlabel("test classes (head, middle, tail: the classes of the first 75%, the next 20% and the last 5% "
                     "of the training samples)", fontsize=9)
    legend_outside(figure, *axes[0][0].get_legend_handles_labels(), title="method (bars: 95% interval over seeds)")
    figure.suptitle(f"{name}: global top-1 by class group, mean over seeds", fontsize=10)
    save_figure(figure, path, dpi=110)


def round_accuracy(run_dirs: dict) -> pd.DataFrame:
    """``partition, method, seed, round, top1``: the global model's test top-1 of every run at every evaluated round."""
    frames = []
    for run, run_dir in run_dirs.items():
        metrics = pd.read_csv(Path(run_dir) / "metrics.csv", dtype={"client": str})
        rows = metrics[(metrics.split == "test") & (metrics.client == "global") & (metrics.metric == "top1")]
        frames.append(pd.DataFrame({"partition": run.partition.label, "method": run.variant.label, "seed": run.seed,
                                    "round": rows["round"].to_numpy(), "top1": rows["value"].to_numpy(dtype=float)}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
        columns=["partition", "method", "seed", "round", "top1"])


def plot_accuracy_vs_round(curves: pd.DataFrame, name: str, path: Path) -> None:
    """The global model's test top-1 per round, one line per method (mean over seeds, band from the lowest to the
    highest seed, so never outside [0, 1]), one panel per partition; the legend beside the panels."""
    from utils.plots import legend_outside, metric_label, plt, save_figure

    partitions, methods = list(dict.fromkeys(curves.partition)), list(dict.fromkeys(curves.method))
    figure, axes = plt.subplots(1, len(partitions), figsize=(4.2 * len(partitions) + 2.4, 3.6), squeeze=False,
                                sharey=True, layout="constrained")
    entries = {}
    for axis, partition in zip(axes[0], partitions):
        for index, method in enumerate(methods):
            rows = curves[(curves.partition == partition) & (curves.method == method)]
            if rows.empty:
                continue
            spread = rows.groupby("round")["top1"].agg(["mean", "min", "max"])
            line, = axis.plot(spread.index, spread["mean"], color=f"C{index}", marker="o", markersize=3)
            band = axis.fill_between(spread.index, spread["min"], spread["max"], color=f"C{index}", alpha=0.15,
                                     linewidth=0)
            entries.setdefault(method, (band, line))
        axis.set_title(partition, fontsize=9)
        axis.set_xlabel("round")
        axis.set_ylim(0, 1)
    axes[0][0].set_ylabel(f"global test {metric_label('top1')}")
    legend_outside(figure, list(entries.values()), list(entries), title="method (band: lowest to highest seed)")
    figure.suptitle(f"{name}: global top-1 per round, mean over seeds", fontsize=10)
    save_figure(figure, path, dpi=110)


def write_report(config: dict[str, Any], out_dir: Path, run_dirs: dict, centralized: dict[int, Path],
                 command: str) -> pd.DataFrame:
    """Collect every run, write report.csv (the table) and report.md (tables and the computed summary)."""
    runs = pd.DataFrame([row for run, run_dir in run_dirs.items() for row in run_rows(run, run_dir)])
    runs.to_csv(out_dir / "runs.csv", index=False)
    table = report_table(runs)
    table.to_csv(out_dir / "report.csv", index=False)
    plot_class_groups(table, config["name"], out_dir / GROUPS_PLOT)
    plot_accuracy_vs_round(round_accuracy(run_dirs), config["name"], out_dir / ROUNDS_PLOT)
    federated = config["federated"]
    lines = [f"# {config['name']}: Fed-LT study (FedLoGe and its baselines under one protocol)", "",
             f"Command: `{command}`", "",
             f"Data: {config['data']['source']} (imbalance factor {config['data'].get('imbalance_factor') or 1.0}), "
             f"task {config['task']}, {federated['n_clients']} clients, {100 * federated['client_fraction']:g}% per round, "
             f"local test sets: {federated['local_test']}, evaluation-time fine-tuning: {federated['finetune_steps']} "
             f"steps; seeds {config['seeds']}. Numbers are top-1 in % at the final round, mean [95% interval, t on the logit scale (utils/statistics.py)] over "
             "seeds.", "",
             "## Summary (computed: FedLoGe against every baseline, paired by seed)", "", *claim_lines(runs), "",
             f"Plots: [{GROUPS_PLOT}]({GROUPS_PLOT}) (global top-1 by class group), [{ROUNDS_PLOT}]({ROUNDS_PLOT}) "
             "(global top-1 per round).", "",
             "## Global accuracy (balanced test split)", "",
             "| partition | method | overall | head | middle | tail | many | medium | few |",
             "|---|---|---|---|---|---|---|---|---|"]
    for _, row in table.iterrows():
        lines.append(f"| {row.partition} | {row.method} | " + " | ".join(_cell(row, column) for column in GLOBAL_COLUMNS)
                     + " |")
    lines += ["", "## Local accuracy (clients' test sets; each method's local model)", "",
              "| partition | method | mean | std | worst 10% | mean, masked | std, masked | worst 10%, masked |",
              "|---|---|---|---|---|---|---|---|"]
    for _, row in table.iterrows():
        lines.append(f"| {row.partition} | {row.method} | " + " | ".join(_cell(row, column) for column in LOCAL_COLUMNS)
                     + " |")
    atomic_write_text(out_dir / "report.md", "\n".join(lines) + "\n")
    return table


register_grid_kind("fed_lt", "long-tailed federated learning: global accuracy by head/middle/tail classes and local "
                   "accuracy, FedLoGe against its baselines", write_report, report_unit="partition × method rows")
