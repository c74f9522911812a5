"""Model selection for step 2: which rows train, which select the best epoch, and what a run selected.

A manifest whose ``val`` column marks training rows (every family's step 1 writes one by default)
trains on the other training rows, selects best.pt and stops early on the ``val`` rows, and
evaluates the test split every epoch only for the curves and the final numbers. The test split
never selects: a manifest without validation rows is refused by step 2 unless ``--last_epoch``
asks it to keep the last epoch (no selection, no early stopping), and :func:`selected_test_metrics`
says which rule chose (``val`` or ``last``), so a report can say so.

The readers below take step 2's ``metrics.csv`` (``epoch, split, metric, value``) and
answer with what ``training.fit.fit`` selected, so a report never recomputes the rule.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from datasets.family import VAL_COLUMN
from training.loop import LAST_EPOCH, METRICS_COLUMNS, TEST_SPLIT, TRAIN_SPLIT, VAL_SPLIT
from utils.errors import TaskHetError
from utils.loaders import read_csv


def centralized_splits(manifest: pd.DataFrame, source: str = "manifest") -> dict[str, pd.DataFrame]:
    """The rows of each split step 2 uses: ``{"train", "val", "test"}``, or ``{"train", "test"}`` without validation rows.

    Args:
        manifest: a family's validated manifest (``split`` train/test, an optional ``val`` 0/1 column).
        source: names the manifest in errors.

    Raises:
        TaskHetError: a split is empty, or every training row is a validation row.
    """
    train = manifest["split"] == TRAIN_SPLIT
    val = train & (manifest[VAL_COLUMN] == 1) if VAL_COLUMN in manifest.columns else train & False
    splits = {TRAIN_SPLIT: manifest[train & ~val], VAL_SPLIT: manifest[val], TEST_SPLIT: manifest[manifest["split"] == TEST_SPLIT]}
    if splits[VAL_SPLIT].empty:
        del splits[VAL_SPLIT]
    for split, rows in splits.items():
        if rows.empty:
            what = "training rows outside the validation part (val = 0)" if split == TRAIN_SPLIT and val.any() else f"rows with split {split!r}"
            raise TaskHetError(f"{source}: no {what}")
    return splits


def selection_split(splits: dict) -> str:
    """What selects best.pt: the ``val`` split when there is one, else :data:`~training.loop.LAST_EPOCH` (no split
    selects; ``splits``: any mapping keyed by split)."""
    return VAL_SPLIT if VAL_SPLIT in splits else LAST_EPOCH


def read_metrics(metrics_csv: Path) -> pd.DataFrame:
    """A finished step-2 ``metrics.csv`` (a TaskHetError naming the file otherwise)."""
    return read_csv(metrics_csv, "step-2 metrics", METRICS_COLUMNS, finished=True)


def curve(metrics: pd.DataFrame, split: str, metric: str) -> pd.Series:
    """``metric`` on ``split`` per epoch (index ``epoch``, sorted); empty when the run never wrote it."""
    rows = metrics[(metrics["split"] == split) & (metrics["metric"] == metric)]
    return rows.set_index("epoch")["value"].astype(float).sort_index()


def selected_epoch(metrics: pd.DataFrame) -> int:
    """The epoch of best.pt: the first lowest validation loss, or the last epoch of a run without validation rows."""
    select = selection_split(set(metrics["split"]))
    losses = curve(metrics, TEST_SPLIT if select == LAST_EPOCH else select, "loss")
    if losses.empty:
        raise TaskHetError(f"step-2 metrics have no loss rows of the {'test' if select == LAST_EPOCH else select} split")
    # idxmin: the first of equal minima, as fit keeps the earlier epoch on a tie
    return int(losses.index.max() if select == LAST_EPOCH else losses.idxmin())


def selected_test_metrics(metrics_csv: Path) -> dict[str, float | str]:
    """The test-split metrics of the epoch best.pt holds (``{"epoch", "selected_on", "loss", ...}``).

    With a validation part this is the test loss of the epoch validation chose, never the test
    split's own minimum; ``selected_on`` is ``val``. A run made with ``--last_epoch`` has none: then it is the last
    epoch's test metrics and ``selected_on`` is ``last``, which a report must say.
    """
    metrics = read_metrics(metrics_csv)
    epoch = selected_epoch(metrics)
    rows = metrics[(metrics["split"] == TEST_SPLIT) & (metrics["epoch"] == epoch)]
    return {"epoch": epoch, "selected_on": selection_split(set(metrics["split"])),
            **dict(zip(rows["metric"], rows["value"].astype(float)))}


def epochs_to_within(values: pd.Series, tolerance: float, higher_is_better: bool = True) -> int:
    """The first epoch (>= 1) whose value is within ``tolerance`` of the best epoch's: at least ``(1 - tolerance)``
    times the highest, or, when lower is better (a loss), at most ``(1 + tolerance)`` times the lowest.

    Args:
        values: a metric per epoch, e.g. :func:`curve` of ``val`` ``top1``; epoch 0 (untrained) is ignored.
        tolerance: relative, e.g. 0.01 for "within 1% of the best".
        higher_is_better: True for an accuracy, False for a loss.
    """
    trained = values[values.index >= 1]
    if trained.empty:
        raise TaskHetError("no trained epoch to measure")
    if higher_is_better:
        reached = trained >= (1.0 - tolerance) * trained.max()
    else:
        reached = trained <= (1.0 + tolerance) * trained.min()
    return int(trained.index[reached.to_numpy()][0])
