"""Step 2's best epoch and early stopping at their boundaries, on scripted validation losses.

training.fit's evaluation is replaced by a script of losses per epoch (training itself still runs), so every
expected best epoch, epoch count and stop is read off the script by hand. What the code promises
(training/fit.py): best.pt is the *first* epoch of the lowest selection loss (epoch 0, the untrained model,
included; a later equal loss does not replace it, and training.selection reads the same epoch back);
patience P stops the run after P epochs in a row without a strictly lower loss, unless that is the last epoch
anyway; a best.pt of epoch 0 is said in one log line.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest

from datasets.digits import select_digits
from steps import train_centralized as step2
from training.selection import read_metrics, selected_epoch, selected_test_metrics
from tests.fixtures import script_evaluation
from utils.run_dir import load_checkpoint

UNTRAINED_WORDS = "best.pt is the untrained model (epoch 0)"


@pytest.fixture(scope="module")
def digits60(tmp_path_factory):
    """60 digits: 40 train, 5 validation, 15 test rows (the data root is unused: the family ships its data)."""
    folder = tmp_path_factory.mktemp("digits60")
    manifest = folder / "manifest.csv"
    select_digits(0.25, seed=0, n_samples=60).to_csv(manifest, index=False)
    return folder, manifest


def script_losses(monkeypatch, val: list[float] | None, test: list[float] | None = None) -> None:
    """fit's evaluation returns ``val[e]`` and ``test[e]`` (default: a flat 2.0) as the losses of epoch e."""
    script_evaluation(monkeypatch, {"val": val, "test": test or [2.0] * len(val or [])})


def run(data, out, n_epochs: int, patience: int = 0, *extra: str) -> dict:
    folder, manifest = data
    return step2.main(["--task", "digit_class", "--encoder", "small_cnn", "--weights", "none", "--data_path", str(folder),
                       "--manifest", str(manifest), "--image_size", "8", "--batch_size", "8", "--scheduler", "none",
                       "--no-use_accelerator", "--no-plots", "--no-progress", "--n_epochs", str(n_epochs),
                       "--early_stopping_patience", str(patience), "--out", str(out), *extra])


def assert_selected(out, epoch: int) -> None:
    """best.pt and the metrics.csv reader agree on ``epoch``."""
    assert load_checkpoint(out / "best.pt")["epoch"] == epoch
    assert selected_epoch(read_metrics(out / "metrics.csv")) == epoch


# ----- ties -----
def test_on_a_tie_the_first_epoch_of_the_lowest_loss_stays_best(digits60, tmp_path, monkeypatch):
    """val 2.0, 1.0, 1.0, 1.5: epochs 1 and 2 tie at the lowest loss; epoch 1, the first, is best.pt."""
    script_losses(monkeypatch, [2.0, 1.0, 1.0, 1.5], test=[2.0, 1.9, 1.8, 1.7])
    summary = run(digits60, tmp_path / "run", 3)
    assert (summary["best_epoch"], summary["best_val_loss"], summary["epochs_done"]) == (1, 1.0, 3)
    assert_selected(tmp_path / "run", 1)
    # the report's number is epoch 1's test loss, not the tied epoch 2's
    assert selected_test_metrics(tmp_path / "run" / "metrics.csv")["loss"] == 1.9


def test_a_trained_epoch_that_only_ties_the_untrained_one_leaves_epoch_0_best_and_says_so(digits60, tmp_path,
                                                                                          monkeypatch):
    """val 1.0, 1.0 (one epoch): the trained epoch only ties epoch 0, so best.pt is the untrained model, and the
    log says so in one line."""
    script_losses(monkeypatch, [1.0, 1.0])
    summary = run(digits60, tmp_path / "run", 1)
    assert (summary["best_epoch"], summary["epochs_done"], summary["stopped_early"]) == (0, 1, False)
    assert_selected(tmp_path / "run", 0)
    untrained = [line for line in (tmp_path / "run" / "run.log").read_text().splitlines() if UNTRAINED_WORDS in line]
    assert len(untrained) == 1 and " WARNING " in untrained[0] and "--allow_untrained" in untrained[0]


def test_one_epoch_that_lowers_the_loss_is_best_and_no_untrained_line(digits60, tmp_path, monkeypatch):
    script_losses(monkeypatch, [2.0, 1.0])
    summary = run(digits60, tmp_path / "run", 1)
    assert (summary["best_epoch"], summary["best_val_loss"], summary["epochs_done"]) == (1, 1.0, 1)
    assert_selected(tmp_path / "run", 1)
    assert UNTRAINED_WORDS not in (tmp_path / "run" / "run.log").read_text()


# ----- patience -----
@pytest.mark.parametrize("patience, val, best, done, stopped", [
    # best at epoch 1; epochs 2 and 3 are not lower: patience 2 is reached after epoch 3, epoch 4 never runs
    (2, [2.0, 1.0, 1.5, 1.5, 0.5], 1, 3, True),
    # an equal loss is no improvement: epochs 2 and 3 tie epoch 1, the same stop
    (2, [2.0, 1.0, 1.0, 1.0, 0.5], 1, 3, True),
    # patience 3 is one short after epoch 3 (2 epochs without a lower loss): epoch 4 runs and becomes best
    (3, [2.0, 1.0, 1.5, 1.5, 0.5], 4, 4, False),
    # patience 1: the first epoch without a lower loss stops the run
    (1, [2.0, 1.0, 1.5, 0.5, 0.4], 1, 2, True),
    # an improvement resets the count: 1 (epoch 2), 0 (epoch 3), 1 (epoch 4), 2 (epoch 5): stop after epoch 5
    (2, [2.0, 1.0, 1.5, 0.9, 1.2, 1.3, 0.1], 3, 5, True),
])
def test_patience_stops_exactly_when_reached(digits60, tmp_path, monkeypatch, patience, val, best, done, stopped):
    script_losses(monkeypatch, val)
    summary = run(digits60, tmp_path / "run", len(val) - 1, patience)
    assert (summary["best_epoch"], summary["epochs_done"], summary["stopped_early"]) == (best, done, stopped)
    assert_selected(tmp_path / "run", best)
    assert read_metrics(tmp_path / "run" / "metrics.csv")["epoch"].max() == done  # no row of an epoch that never ran


def test_patience_reached_at_the_last_epoch_is_no_early_stop(digits60, tmp_path, monkeypatch):
    """patience 2, best at epoch 1, 3 epochs: the count reaches 2 at epoch 3, the last epoch anyway: nothing was cut
    short."""
    script_losses(monkeypatch, [2.0, 1.0, 1.5, 1.5])
    summary = run(digits60, tmp_path / "run", 3, 2)
    assert (summary["best_epoch"], summary["epochs_done"], summary["stopped_early"]) == (1, 3, False)
    assert "early stopping" not in (tmp_path / "run" / "run.log").read_text()


def test_patience_counts_from_an_untrained_best_at_epoch_0(digits60, tmp_path, monkeypatch):
    """val 1.0 at epoch 0, then 1.5 and 1.2: no trained epoch beats the untrained one, so patience 2 stops the run
    after epoch 2 of 5 (epoch 3's 0.5 never happens) with best.pt the untrained epoch 0, said in the log."""
    script_losses(monkeypatch, [1.0, 1.5, 1.2, 0.5, 0.4, 0.3])
    summary = run(digits60, tmp_path / "run", 5, 2)
    assert (summary["best_epoch"], summary["best_val_loss"]) == (0, 1.0)
    assert (summary["epochs_done"], summary["stopped_early"]) == (2, True)
    assert_selected(tmp_path / "run", 0)
    log = (tmp_path / "run" / "run.log").read_text()
    assert "early stopping: no lower val loss in 2 epochs" in log and log.count(UNTRAINED_WORDS) == 1


# ----- no validation rows -----
def test_without_validation_rows_one_epoch_keeps_epoch_1_never_the_untrained_one(digits60, tmp_path, monkeypatch):
    """--last_epoch: no split selects; after one epoch best.pt is epoch 1 though its test loss is higher than epoch
    0's, and no untrained line is written (nothing was selected)."""
    script_losses(monkeypatch, None, test=[1.0, 3.0])
    manifest = tmp_path / "manifest.csv"
    pd.read_csv(digits60[1]).drop(columns="val").to_csv(manifest, index=False)
    summary = run((digits60[0], manifest), tmp_path / "run", 1, 0, "--last_epoch")
    assert (summary["best_epoch"], summary["selected_on"], summary["epochs_done"]) == (1, "last", 1)
    assert math.isnan(summary["best_val_loss"])  # no validation loss to report
    assert_selected(tmp_path / "run", 1)
    assert UNTRAINED_WORDS not in (tmp_path / "run" / "run.log").read_text()
