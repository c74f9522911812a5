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
    """``fedavg: label_based/fedavg/s0-1a2b3c``: the algorithm and the run folder's last three names (in a pipeline,
    grouping or partition, algorithm, run)."""
    return f"{algorithm}: {'/'.join(Path(out_dir).resolve().parts[-3:])}"


def plot_curves(metrics_csv: Path, out_png: Path, title: str | None = None) -> None:
    """Loss per round: global test, client-test mean ± std (global and personal models), mean train loss; ``title``
    names the run."""
    # Imported here, not at the top: training never needs matplotlib. utils.plots selects Agg first.
    from utils.plots import plt, save_figure
    import pandas as pd

    metrics = pd.read_csv(metrics_csv, dtype={"client": str})
    figure, axis = plt.subplots(figsize=(7, 4))
    for split, label in ((GLOBAL_TEST_SPLIT, "global test"), (CLIENT_TEST_SPLIT, "client test (global model)"),
                         (PERSONAL_TEST_SPLIT, "client test (personal models)"),
                         (FINETUNED_TEST_SPLIT, "client test (after local fine-tuning)")):
        client = GLOBAL_CLIENT if split == GLOBAL_TEST_SPLIT else "mean"
        curve = metrics[(metrics.split == split) & (metrics.client == client) & (metrics.metric == "loss")]
        if curve.empty:
            continue
        line, = axis.plot(curve["round"], curve["value"], marker="o", markersize=3, label=label)
        spread = metrics[(metrics.split == split) & (metrics.client == "std") & (metrics.metric == "loss")]
        if not spread.empty:
            axis.fill_between(curve["round"], curve["value"].to_numpy() - spread["value"].to_numpy(),
                              curve["value"].to_numpy() + spread["value"].to_numpy(), color=line.get_color(), alpha=0.2)
    train = metrics[(metrics.split == TRAIN_SPLIT) & (metrics.client == "mean") & (metrics.metric == TRAIN_LOSS)]
    if not train.empty:
        axis.plot(train["round"], train["value"], linestyle="--", label="local train loss (mean)")
    axis.set_xlabel("round")
    axis.set_ylabel("loss")
    if title:
        axis.set_title(title, fontsize=9, wrap=True)
    axis.legend()
    save_figure(figure, out_png, dpi=120)
