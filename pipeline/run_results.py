"""Reading finished run folders for the report: a step-4 run's global and personal test curves, the
centralized model's selected test loss, and the trivial predictors' losses step 2 wrote beside it."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from network.client import GLOBAL_TEST_SPLIT, PERSONAL_TEST_SPLIT
from network.run_outputs import GLOBAL_CLIENT
from training.loop import TEST_SPLIT, TRIVIAL_METRIC_SUFFIX, TRIVIAL_SPLIT_PREFIX
from training.selection import read_metrics, selected_test_metrics


def global_test_history(metrics: pd.DataFrame) -> pd.DataFrame:
    """The global model's metrics on the global test split, every evaluated round (``metrics``: a run's metrics.csv)."""
    return metrics[(metrics.split == GLOBAL_TEST_SPLIT) & (metrics.client == GLOBAL_CLIENT)]


def personal_test_history(metrics: pd.DataFrame) -> pd.DataFrame:
    """The clients' own models' mean metrics on their client-test splits, every evaluated round."""
    return metrics[(metrics.split == PERSONAL_TEST_SPLIT) & (metrics.client == "mean")]


def final_personal_loss(metrics: pd.DataFrame, metric: str = "loss") -> float:
    """Mean ``metric`` of the clients' own models on their client-test splits, last round (NaN without personal models)."""
    rows = personal_test_history(metrics)
    rows = rows[rows.metric == metric]
    return float(rows[rows["round"] == rows["round"].max()].value.iloc[0]) if len(rows) else float("nan")


def centralized_reference(metrics_csv: Path) -> tuple[float, str]:
    """The centralized model's test loss at the epoch best.pt holds, and what chose that epoch (``val``; ``last`` for a
    step-2 run made with ``--last_epoch`` on data without validation rows, which a report must say)."""
    selected = selected_test_metrics(metrics_csv)
    return float(selected["loss"]), str(selected["selected_on"])


def trivial_losses(metrics_csv: Path, split: str = TEST_SPLIT) -> dict[str, float]:
    """The losses on ``split`` of the trivial predictors step 2 wrote to ``metrics_csv`` (its rows of split
    ``trivial_<split>``), by predictor: ``{"zero": ..., "median": ...}`` for an L1 task, ``{"zero": ..., "prior": ...}``
    for a cross-entropy one (:func:`training.loop.trivial_predictors` says what each is). Empty for a run folder
    made before step 2 wrote them."""
    metrics = read_metrics(metrics_csv)
    rows = metrics[metrics.split == TRIVIAL_SPLIT_PREFIX + split]
    return {metric.removesuffix(TRIVIAL_METRIC_SUFFIX): float(value) for metric, value in zip(rows.metric, rows.value)}
