"""What a step-4 run writes besides its checkpoints: metrics.csv's names and rows, and the per-run plot.

Every engine (sequential, vectorised, Flower) and every report reads the same names, so they live
here, apart from the round loop of network.engine_sequential.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from network.aggregation import client_summary
from network.algorithms.base import TRAIN_LOSS
from network.client import (CLIENT_TEST_SPLIT, FINETUNED_TEST_SPLIT, GLOBAL_TEST_SPLIT, MASKED_SUFFIX,
                            PERSONAL_TEST_SPLIT)
from models.metrics import HIGHER_IS_BETTER

# Names in metrics.csv, shared with every engine and with the report.
TRAIN_SPLIT = "train"  # the clients' local training metrics
GLOBAL_CLIENT = "global"  # the global model's rows of the global test split
# The global model on the manifest's validation rows (when it has them): model selection, never final numbers.
GLOBAL_VAL_SPLIT = "val"
MODEL_CLIENT_PREFIX = "model:"  # rows of each server model, when an algorithm has several
SKIPPED_CLIENT = "skipped"  # personal split: clients without a personal model (metric "clients")
# Per-client splits: summary rows of every metric (network.aggregation.client_summary; jain only when defined).
SUMMARY_CLIENTS = ("mean", "std", "variance", "worst", "best", "worst_decile", "best_decile", "jain")
CLIENT_SPLITS = tuple(split + suffix for split in (CLIENT_TEST_SPLIT, PERSONAL_TEST_SPLIT, FINETUNED_TEST_SPLIT)
                      for suffix in ("", MASKED_SUFFIX))
METRICS_COLUMNS = ("round", "split", "client", "metric", "value")
METRICS_FILE, CURVES_FILE = "metrics.csv", "curves.png"


def metric_row(round_index: int, split: str, client: str, metric: str, value: float) -> dict[str, Any]:
    return {"round": round_index, "split": split, "client": client, "metric": metric, "value": float(value)}


def client_rows(round_index: int, split: str, per_client: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Per-client rows plus each metric's summary over clients: mean, spread and fairness (``SUMMARY_CLIENTS``)."""
    rows = [metric_row(round_index, split, client_id, metric, value)
            for client_id, metrics in per_client.items() for metric, value in metrics.items()]
    for metric in dict.fromkeys(metric for metrics in per_client.values() for metric in metrics):
        summary = client_summary([metrics[metric] for metrics in per_client.values() if metric in metrics],
                                 higher_is_better=metric in HIGHER_IS_BETTER)
        rows += [metric_row(round_index, split, name, metric, summary[name]) for name in SUMMARY_CLIENTS if name in summary]
    return rows


def mean_train_loss(rows: list[dict[str, Any]]) -> float:
    return next((row["value"] for row in rows if row["split"] == TRAIN_SPLIT and row["client"] == "mean"
                 and row["metric"] == TRAIN_LOSS), math.nan)


ROUND_LINE = "round_line"  # log-record attribute of the per-round lines (kept off the console by round_lines=False)
LOG_ONLY = "log_only"  # log-record attribute of lines for run.log alone (a round without an evaluation)


def not_a_round_line(record: logging.LogRecord) -> bool:
    return not getattr(record, ROUND_LINE, False)


def not_log_only(record: logging.LogRecord) -> bool:
    return not getattr(record, LOG_ONLY, False)


def run_title(algorithm: str, out_dir: Path) -> str:
    """What a run compares and which run it is: ``normal · label-based dirichlet_mixture, α=0.1 · fedavg · seed 0``
    (task, grouping, scheme and α of its partition, method, seed), read from the run folder's config.json and its
    assignments' sidecar; an iid partition is ``iid``. Without config.json (an engine a test builds): the algorithm
    and the folder's last three names."""
    from partitioning.assignments import read_meta
    from utils.errors import TaskHetError
    from utils.loaders import load_json

    config_path = Path(out_dir) / "config.json"
    if not config_path.is_file():
        return f"{algorithm}: {'/'.join(Path(out_dir).resolve().parts[-3:])}"
    args = load_json(config_path, "run config").get("args", {})
    try:
        scheme = read_meta(Path(args["assignments"])).get("scheme") if args.get("assignments") else None
    except TaskHetError:  # the sidecar moved or was edited since the run: the title goes without its scheme
        scheme = None
    if scheme == "iid":
        partition = "iid"
    else:
        grouping = str(args.get("type") or "").replace("_", "-")
        alpha = args.get("alpha")
        partition = " ".join(part for part in (grouping, scheme) if part) + ("" if alpha is None else f", α={alpha:g}")
    return " · ".join(str(part) for part in (args.get("task"), partition, args.get("method", algorithm),
                                             f"seed {args.get('rand_seed')}") if part)


# Curves of curves.png: the split, the client row of its curve, its name. Per-client splits are drawn as their mean
# over clients with a band of the clients' spread (utils.plots.BAND_QUANTILES of the per-client rows).
CURVES = ((GLOBAL_TEST_SPLIT, GLOBAL_CLIENT, "global test"), (CLIENT_TEST_SPLIT, "mean", "client test (global model)"),
          (PERSONAL_TEST_SPLIT, "mean", "client test (personal models)"),
          (FINETUNED_TEST_SPLIT, "mean", "client test (after local fine-tuning)"))


def plot_curves(metrics_csv: Path, out_png: Path, title: str | None = None) -> None:
    """Loss per round: global test, the clients' test splits (their mean, with a band from the clients' 10th to 90th
    percentile, which never leaves the losses' range), the mean local train loss; a curve equal to another is drawn
    once under both names; the legend below the axis; ``title`` names the run (:func:`run_title`)."""
    # Imported here, not at the top: training never needs matplotlib. utils.plots selects Agg first.
    from matplotlib.ticker import MaxNLocator
    import pandas as pd

    from utils.plots import BAND_NAME, BAND_QUANTILES, CurvesOnce, legend_outside, metric_label, plt, save_figure

    metrics = pd.read_csv(metrics_csv, dtype={"client": str})
    loss = metrics[metrics.metric == "loss"]
    figure, axis = plt.subplots(figsize=(7.5, 5), layout="constrained")
    curves, bands = CurvesOnce(axis), {}
    for split, client, label in CURVES:
        curve = loss[(loss.split == split) & (loss.client == client)].sort_values("round")
        if curve.empty:
            continue
        line = curves.plot(curve["round"], curve["value"], label, marker="o", markersize=3)
        per_client = loss[(loss.split == split) & ~loss.client.isin((*SUMMARY_CLIENTS, SKIPPED_CLIENT))]
        if client != GLOBAL_CLIENT and not per_client.empty:
            spread = per_client.groupby("round")["value"].quantile(list(BAND_QUANTILES)).unstack()
            bands[line] = axis.fill_between(spread.index, spread[BAND_QUANTILES[0]], spread[BAND_QUANTILES[1]],
                                            color=line.get_color(), alpha=0.2, linewidth=0)
    train = metrics[(metrics.split == TRAIN_SPLIT) & (metrics.client == "mean") & (metrics.metric == TRAIN_LOSS)]
    if not train.empty:
        curves.plot(train["round"], train["value"], "local train loss (mean)", linestyle="--")
    axis.set_xlabel(round_axis_label(loss[loss.split == GLOBAL_TEST_SPLIT]["round"]))
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set_ylabel(metric_label("loss"))
    if title:
        axis.set_title(title, fontsize=9, wrap=True)
    lines = [line for _, _, line in curves.drawn]
    handles = [(bands[line], line) if line in bands else line for line in lines]
    labels = [line.get_label() + (f"; band: {BAND_NAME}" if line in bands else "") for line in lines]
    legend_outside(figure, handles, labels, where="lower")  # below: long names, and the axis keeps the width
    save_figure(figure, out_png, dpi=120)


def round_axis_label(evaluated: "pd.Series") -> str:
    """``round``, naming the evaluated rounds when there are few (``round (evaluated at 0, 20, 40, 55)``): a test
    curve of 4 points is then read as 4 measurements, not as a straight trend."""
    rounds = sorted({int(value) for value in evaluated})
    return f"round (evaluated at {', '.join(map(str, rounds))})" if 1 < len(rounds) <= 8 else "round"


def validation_loss(rows: list[dict[str, Any]]) -> float | None:
    """The global model's loss on the validation rows among an evaluation's metric ``rows`` (None: no such row)."""
    return next((float(row["value"]) for row in rows if row["split"] == GLOBAL_VAL_SPLIT
                 and row["client"] == GLOBAL_CLIENT and row["metric"] == "loss"), None)
