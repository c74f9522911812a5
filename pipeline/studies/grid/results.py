"""Reading a grid study's finished runs: the accuracy numbers every grid study report shares, and how they are
printed (so a run's numbers mean the same in every report)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from network.client import GLOBAL_TEST_SPLIT
from network.run_outputs import GLOBAL_CLIENT, GLOBAL_VAL_SPLIT, METRICS_COLUMNS
from utils.loaders import read_csv
from utils.statistics import UNIT, count, mean_interval, paired_difference

CENTRALIZED = "centralized"

def run_accuracy(metrics_csv: Path, metric: str) -> dict[str, Any]:
    """Final and best-by-validation test ``metric`` of one step-4 run, and its test curve.

    Returns:
        ``{"final", "best_val" (NaN without validation rows), "rounds", "best_round" (the round best_val comes
        from; 0 is the start model; NaN without validation rows), "curve": DataFrame(round, value)}``.
    """
    metrics = read_csv(metrics_csv, "step-4 metrics", METRICS_COLUMNS, finished=True)
    global_rows = metrics[(metrics.client == GLOBAL_CLIENT) & (metrics.metric == metric)]
    test = global_rows[global_rows.split == GLOBAL_TEST_SPLIT].set_index("round")["value"]
    val = global_rows[global_rows.split == GLOBAL_VAL_SPLIT].set_index("round")["value"]
    best_val = float(test.loc[val.idxmax()]) if len(val) else math.nan  # idxmax: the earliest best round
    return {"final": float(test.loc[test.index.max()]), "best_val": best_val, "rounds": int(test.index.max()),
            "best_round": int(val.idxmax()) if len(val) else math.nan, "curve": test.reset_index()}


def centralized_accuracy(metrics_csv: Path, metric: str) -> dict[str, float]:
    """Last-epoch test ``metric`` of a step-2 run and, when it logged a ``val`` split, the test value at its best val epoch."""
    metrics = read_csv(metrics_csv, "step-2 metrics", ("epoch", "split", "metric", "value"), finished=True)
    rows = metrics[metrics.metric == metric]
    test = rows[rows.split == "test"].set_index("epoch")["value"]
    val = rows[rows.split == "val"].set_index("epoch")["value"]
    best_val = float(test.loc[val.idxmax()]) if len(val) and val.idxmax() in test.index else math.nan
    return {"final": float(test.loc[test.index.max()]), "best_val": best_val}


def summarize(values: list[float], scale: str = UNIT) -> tuple[float, float, float]:
    """Mean and 95% t interval inside ``scale``'s range (default: accuracies, [0, 1]), NaN throughout when every
    value is NaN."""
    finite = [value for value in values if not math.isnan(value)]
    return mean_interval(finite, scale) if finite else (math.nan, math.nan, math.nan)


def interval_cell(mean: float, low: float, high: float) -> str:
    if math.isnan(mean):
        return "–"
    return f"{mean:.3f}" if math.isnan(low) else f"{mean:.3f} [{low:.3f}, {high:.3f}]"


def difference_text(a: list[float], b: list[float], ledger: list | None = None) -> str:
    """``b − a`` paired by seed, with its interval and whether it is noticeable (decided) or why not; the
    comparison is appended to ``ledger`` (the report's list, for the adjusted count)."""
    difference = paired_difference(a, b)
    if ledger is not None:
        ledger.append(difference)
    interval = "" if math.isnan(difference.low) else f" [{difference.low:+.3f}, {difference.high:+.3f}]"
    return f"{difference.mean:+.3f}{interval}, {'noticeable' if difference.decided else difference.explain()}"


def ledger_line(ledger: list, what: str) -> str:
    """How many of the summary's paired comparisons are noticeable, raw and after Benjamini–Hochberg over them all."""
    counts = count(ledger)
    return (f"- {what}: {counts.decided} of {counts.cells} paired comparisons above are noticeable; after "
            f"Benjamini–Hochberg at 5% over the {counts.cells}: {counts.above_adjusted + counts.below_adjusted}. "
            f"Undecided: {counts.too_few} with too few seeds, {counts.zero_variance} with zero variance, "
            f"{counts.contains_zero} whose interval contains 0.")
