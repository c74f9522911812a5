"""The heterogeneity study's runs as rows (pipeline/studies/heterogeneity_toolbox.py): each run's final-round
accuracies read from its metrics.csv, step 3c's readings, and the paired difference of two methods by seed.
Shared by the report's tables and its private-weighting comparison (pipeline/studies/toolbox_weightings.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd

from network.client import (CLIENT_TEST_SPLIT, FINETUNED_TEST_SPLIT, GLOBAL_TEST_SPLIT, PERSONAL_TEST_SPLIT,
                            UNSEEN_SPLIT_OF)
from network.run_outputs import GLOBAL_CLIENT, METRICS_COLUMNS
from utils.loaders import load_json, read_csv
from utils.statistics import UNIT, PairedDifference, paired_difference

BASELINE = "fedavg"
FINETUNED_SUFFIX = "+ft"  # FedAvg's fine-tuned model: the local fine-tuning method
METRICS = {"global": "global accuracy", "personal": "personalised accuracy", "worst10": "worst 10% of clients",
           "unseen": "accuracy on unseen clients"}
HEADERS = {"global": "global", "personal": "personalised", "worst10": "worst 10%", "unseen": "unseen clients"}


# ----- reading runs -----
def final_rows(metrics_csv: Path) -> pd.DataFrame:
    """metrics.csv's rows of the last evaluated round (the last round with global test rows)."""
    metrics = read_csv(metrics_csv, "step-4 metrics", METRICS_COLUMNS, finished=True, dtype={"client": str})
    evaluated = metrics[(metrics.split == GLOBAL_TEST_SPLIT) & (metrics.client == GLOBAL_CLIENT)]
    return metrics[metrics["round"] == evaluated["round"].max()]


def _value(final: pd.DataFrame, split: str, client: str) -> float:
    rows = final[(final.split == split) & (final.client == client) & (final.metric == "top1")]["value"]
    return float(rows.iloc[0]) if len(rows) else math.nan


def accuracies(final: pd.DataFrame, split: str) -> dict[str, float]:
    """Global top-1, the mean and worst-decile top-1 over the seen clients of ``split``, and the mean over the unseen
    clients of ``split``'s unseen twin (the same model after the method's own adaptation; NaN without unseen clients)."""
    return {"global": _value(final, GLOBAL_TEST_SPLIT, GLOBAL_CLIENT), "personal": _value(final, split, "mean"),
            "worst10": _value(final, split, "worst_decile"), "unseen": _value(final, UNSEEN_SPLIT_OF[split], "mean")}


def personalised_by_finetuning(algorithm: str) -> bool:
    """Whether ``algorithm``'s personal models are its global model fine-tuned at evaluation (its class says so)."""
    from network.algorithms.base import ALGORITHMS

    return ALGORITHMS.get(algorithm).personalised_by_finetuning


def run_rows(run, run_dir: Path) -> list[dict[str, Any]]:
    """The method rows of one run: its algorithm on its personal split (or the global model's), plus ``fedavg+ft``
    (FedAvg's fine-tuned models) from FedAvg's runs when they were fine-tuned."""
    final = final_rows(run_dir / "metrics.csv")
    base = {"situation": run.partition.label, "seed": run.seed}
    split = PERSONAL_TEST_SPLIT if (final.split == PERSONAL_TEST_SPLIT).any() else CLIENT_TEST_SPLIT
    if personalised_by_finetuning(run.variant.algorithm) and (final.split == FINETUNED_TEST_SPLIT).any():
        split = FINETUNED_TEST_SPLIT  # Per-FedAvg, FedBABU: their personal models are the fine-tuned ones
    rows = [{**base, "method": run.variant.label, "algorithm": run.variant.algorithm, "split": split,
             **accuracies(final, split)}]
    if run.variant.algorithm == BASELINE and (final.split == FINETUNED_TEST_SPLIT).any():
        rows.append({**base, "method": run.variant.label + FINETUNED_SUFFIX, "algorithm": BASELINE + FINETUNED_SUFFIX,
                     "split": FINETUNED_TEST_SPLIT, **accuracies(final, FINETUNED_TEST_SPLIT)})
    return rows


def meter_rows(meters: dict) -> pd.DataFrame:
    """G² and B² of every (partition, seed) step 3c measured."""
    rows = [{"situation": partition.label, "seed": seed,
             **{key: load_json(stage_dir / "meter.json", "step-3c meter", finished=True)[key] for key in ("g2", "b2")}}
            for (partition, seed), stage_dir in meters.items()]
    return pd.DataFrame(rows, columns=["situation", "seed", "g2", "b2"])


# ----- statistics -----
def paired(runs: pd.DataFrame, method_a: str, method_b: str, column: str) -> PairedDifference | None:
    """``b − a`` of ``column`` over the seeds both methods have a value for (None: no such seed)."""
    a = runs[runs.method == method_a].set_index("seed")[column].dropna()
    b = runs[runs.method == method_b].set_index("seed")[column].dropna()
    seeds = sorted(set(a.index) & set(b.index))
    return paired_difference(a[seeds].tolist(), b[seeds].tolist(), scale=UNIT) if seeds else None
