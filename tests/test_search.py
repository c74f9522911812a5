"""The centralized hyperparameter search (steps/search_centralized.py, training/search.py) on tiny digits, on the CPU."""

import json
import math

import pandas as pd
import pytest

from datasets.digits import select_digits
from steps import search_centralized as search
from steps import train_centralized as step2
from training.search import (BY_LOSS, CLEAR, DIVERGED, DONE, NOT_CLEAR, RUN_COLUMNS, UNKNOWN, Config, aggregate, best_record,
                             epochs_to_within, grid, pick, rank, score_for, summarize, win_clarity, write_report)
from tests.fixtures import tiny_data_root, tiny_manifest  # noqa: F401  (session fixtures)
from utils.cli import run_main
from utils.errors import NonFiniteLossError, TaskHetError


@pytest.fixture(scope="module")
def digits400(tmp_path_factory):
    """400 digits: 320 train (30 of them validation) / 80 test."""
    manifest = tmp_path_factory.mktemp("digits400") / "manifest.csv"
    select_digits(0.2, seed=0, n_samples=400).to_csv(manifest, index=False)
    return manifest


def argv(manifest, out, lrs="0.000001,0.003", *extra):
    return ["--lrs", lrs, "--schedulers", "none", "--task", "digit_class", "--encoder", "small_cnn", "--weights", "none",
            "--manifest", str(manifest), "--image_size", "32", "--n_epochs", "2", "--batch_size", "16", "--optimizer", "adamw",
            "--no-use_accelerator", "--no-plots", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def searched(digits400, tmp_path_factory):
    """A search whose best lr is unambiguous: 1e-6 cannot move small_cnn off chance in 2 epochs, 3e-3 can; two seeds."""
    out = tmp_path_factory.mktemp("search") / "out"
    return out, search.main(argv(digits400, out, "0.000001,0.003", "--seeds", "0,1"))


@pytest.mark.slow
def test_search_picks_the_known_best_lr(searched):
    out, table = searched
    best = json.loads((out / "best.json").read_text())
    assert best["lr"] == 0.003 and best["scheduler"] == "none" and best["config"] == "lr0.003-wd0.0001-none"
    runs = pd.read_csv(out / "search_runs.csv")
    assert list(zip(runs["lr"], runs["seed"])) == [(1e-6, 0), (1e-6, 1), (0.003, 0), (0.003, 1)] and (runs["status"] == "done").all()
    rows = pd.read_csv(out / "search.csv").set_index("lr")
    assert list(rows.index) == [1e-6, 0.003] and (rows["n_seeds"] == 2).all() and (rows["status"] == "done").all()
    # search.csv's columns are the mean and the logit-scale t-interval of search_runs.csv's two seeds
    # (t_{0.975,1} = 12.706); the plain interval went below 0 here
    tuned = runs[runs["lr"] == 0.003]
    accuracy, epochs = list(tuned["best_val_top1"]), list(tuned["epochs_to_within"])
    logits = [math.log(value / (1 - value)) for value in accuracy]
    half = 12.7062047 * abs(logits[0] - logits[1]) / 2
    assert rows.loc[0.003, "best_val_top1"] == pytest.approx(sum(accuracy) / 2)
    low = min(sum(accuracy) / 2, 1 / (1 + math.exp(-(sum(logits) / 2 - half))))
    assert rows.loc[0.003, "best_val_top1_low"] == pytest.approx(low) and 0 <= low
    assert rows.loc[0.003, "epochs_to_within"] == pytest.approx(sum(epochs) / 2) and rows.loc[0.003, "epochs_to_within_max"] == max(epochs)
    # 30 validation digits: chance is ~3 of them; the tuned lr gets well above it in every seed, the tiny one in none
    assert min(accuracy) >= 0.3 > runs[runs["lr"] == 1e-6]["best_val_top1"].max()
    assert list(table["lr"]) == [0.003, 1e-6]  # returned best first
    for name in ("config.json", "run.log", "metrics.csv", "report.md", "val_top1.csv", "val_top1.png",
                 "runs/lr0.003-wd0.0001-none/seed0/best.pt", "runs/lr0.003-wd0.0001-none/seed1/best.pt"):
        assert (out / name).is_file(), name
    metrics = pd.read_csv(out / "metrics.csv")
    assert set(zip(metrics["config"], metrics["seed"])) == {(name, seed) for name in ("lr1e-06-wd0.0001-none", "lr0.003-wd0.0001-none")
                                                           for seed in (0, 1)}
    curves = pd.read_csv(out / "val_top1.csv").set_index(["config", "epoch"])["value"]
    val_top1 = metrics[(metrics.split == "val") & (metrics.metric == "top1") & (metrics.config == "lr0.003-wd0.0001-none")]
    assert curves["lr0.003-wd0.0001-none", 2] == pytest.approx(val_top1[val_top1.epoch == 2]["value"].mean())
    report = (out / "report.md").read_text()
    assert "**Scheduler that won:** none" in report and "2 seed(s) (0, 1)" in report
    assert f"**Epochs needed:** {sum(epochs) / 2:.4g} (95% interval" in report and f"the slowest seed needed {max(epochs)}" in report
    # the winner's test numbers are those of each seed's best.pt epoch, which validation chose
    for seed in (0, 1):
        run = pd.read_csv(out / f"runs/lr0.003-wd0.0001-none/seed{seed}/metrics.csv")
        val = run[(run.split == "val") & (run.metric == "loss")].set_index("epoch").value
        test = run[(run.split == "test") & (run.metric == "loss")].set_index("epoch").value
        assert best["test_at_selected_epoch"][str(seed)]["epoch"] == val.idxmin()
        assert best["test_at_selected_epoch"][str(seed)]["loss"] == pytest.approx(test[val.idxmin()])
    assert best["test"]["loss"]["mean"] == pytest.approx(sum(best["test_at_selected_epoch"][s]["loss"] for s in ("0", "1")) / 2)


def test_a_rerun_skips_finished_runs(searched, digits400):
    out, table = searched
    before = {path: path.stat().st_mtime_ns for path in out.glob("runs/*/seed*/last.pt")}
    again = search.main(argv(digits400, out, "0.000001,0.003", "--seeds", "0,1"))
    # a finished step-2 run trains no epoch again: no last.pt is rewritten, and the table is the same
    assert len(before) == 4 and {path: path.stat().st_mtime_ns for path in out.glob("runs/*/seed*/last.pt")} == before
    pd.testing.assert_frame_equal(again, table)


def run_rows(config: Config, values: list[tuple[int, float, float, int]]) -> list[dict]:
    """Stubbed search_runs.csv rows: (seed, best_val_top1, best_val_loss, epochs_to_within) each; None accuracy = diverged."""
    return [{**config.columns(), "seed": seed, "best_val_top1": math.nan if accuracy is None else accuracy,
             "best_val_loss": loss, "best_epoch": 5, "epochs_to_within": epochs, "epochs_done": 10,
             "status": DIVERGED if accuracy is None else DONE} for seed, accuracy, loss, epochs in values]


@pytest.fixture
def stubbed_table():
    """Three seeds per config; no training. Values chosen so that the sample standard deviations are round."""
    cosine, step, none, wild = (Config(0.1, 0.0, "cosine"), Config(0.1, 0.0, "step"), Config(0.01, 0.0, "none"),
                                Config(1.0, 0.0, "cosine"))
    rows = (run_rows(cosine, [(0, 0.80, 0.5, 4), (1, 0.82, 0.4, 5), (2, 0.84, 0.3, 6)])  # mean 0.82, sd 0.02; epochs 5, sd 1
            + run_rows(step, [(0, 0.50, 0.9, 2), (1, 0.60, 0.8, 3), (2, 0.70, 0.7, 4)])  # mean 0.60, sd 0.10; epochs 3, sd 1
            + run_rows(none, [(0, 0.60, 1.0, 3), (1, 0.70, 1.0, 3), (2, 0.80, 1.0, 3)])  # mean 0.70, sd 0.10; epochs 3, sd 0
            + run_rows(wild, [(0, 0.99, 0.1, 1), (1, None, 0.0, -1), (2, 0.99, 0.1, 1)]))  # one diverged seed: ranked last
    return aggregate(pd.DataFrame(rows, columns=list(RUN_COLUMNS)))


def _transformed_t(values, forward, back):
    """The 95% t interval of three values on a transformed scale, mapped back (t_{0.975, 2} = 4.30265273)."""
    z = [forward(value) for value in values]
    centre = sum(z) / 3
    half = 4.30265273 * math.sqrt(sum((value - centre) ** 2 for value in z) / 2) / math.sqrt(3)
    return back(centre - half), back(centre + half)


def _logit_t(values):
    return _transformed_t(values, lambda p: math.log(p / (1 - p)), lambda z: 1 / (1 + math.exp(-z)))


def test_intervals_and_ranking_by_hand(stubbed_table):
    table = stubbed_table.set_index("config")
    cosine, step, none = table.loc["lr0.1-wd0-cosine"], table.loc["lr0.1-wd0-step"], table.loc["lr0.01-wd0-none"]
    assert cosine["best_val_top1"] == pytest.approx(0.82) and cosine["best_val_loss"] == pytest.approx(0.4)
    # accuracies: t on the logit scale (inside [0, 1]); epochs: t on the log scale (never below 0)
    assert (cosine["best_val_top1_low"], cosine["best_val_top1_high"]) == pytest.approx(_logit_t([0.80, 0.82, 0.84]))
    assert (step["best_val_top1_low"], step["best_val_top1_high"]) == pytest.approx(_logit_t([0.5, 0.6, 0.7]))
    assert (cosine["epochs_to_within"], cosine["epochs_to_within_low"], cosine["epochs_to_within_high"]) == pytest.approx(
        (5, *_transformed_t([4, 5, 6], math.log, math.exp)))
    assert (none["epochs_to_within_low"], none["epochs_to_within_high"]) == pytest.approx((3, 3))
    assert cosine["epochs_to_within_max"] == 6
    wild = table.loc["lr1-wd0-cosine"]
    assert (wild["status"], wild["n_seeds"], wild["n_diverged"], wild["best_val_top1"]) == (DIVERGED, 3, 1, pytest.approx(0.99))
    # ranked by mean accuracy: cosine 0.82 > none 0.70 > step 0.60; the diverged config last despite its 0.99
    assert list(rank(stubbed_table)["config"]) == ["lr0.1-wd0-cosine", "lr0.01-wd0-none", "lr0.1-wd0-step", "lr1-wd0-cosine"]
    winner, runner_up = pick(stubbed_table)
    # cosine's interval [0.765, 0.865] lies inside none's [0.416, 0.891]: they overlap, so the win is not clear
    assert runner_up["config"] == "lr0.01-wd0-none" and win_clarity(winner, runner_up) == NOT_CLEAR


def test_win_clarity_by_hand():
    def row(low, high, n_seeds=3, n_diverged=0):
        return {"best_val_top1_low": low, "best_val_top1_high": high, "n_seeds": n_seeds, "n_diverged": n_diverged}
    assert win_clarity(row(0.80, 0.90), row(0.60, 0.79)) == CLEAR
    assert win_clarity(row(0.80, 0.90), row(0.60, 0.80)) == NOT_CLEAR  # touching intervals are not clear
    assert win_clarity(row(math.nan, math.nan, 1), row(0.6, 0.7)) == UNKNOWN  # one seed: no interval
    assert win_clarity(row(0.80, 0.90, 2), row(0.60, 0.70, 2)) == UNKNOWN  # two seeds: too few to judge
    assert win_clarity(row(0.80, 0.90), row(0.60, 0.70, 4, 2)) == UNKNOWN  # two of four seeds diverged
    assert win_clarity(row(0.90, 0.90), row(0.60, 0.70)) == UNKNOWN  # zero spread: every seed the same
    assert win_clarity(row(0.8, 0.9), None) == UNKNOWN


def test_report_from_stubbed_results(stubbed_table, tmp_path):
    tests = {0: {"epoch": 5, "loss": 0.5, "top1": 0.70}, 1: {"epoch": 6, "loss": 0.7, "top1": 0.80},
             2: {"epoch": 5, "loss": 0.6, "top1": 0.75}}
    best = best_record(stubbed_table, 0.01, {seed: tmp_path / f"seed{seed}" for seed in tests}, tests)
    assert best["config"] == "lr0.1-wd0-cosine" and best["runner_up"] == "lr0.01-wd0-none" and best["win"] == NOT_CLEAR
    # the best config of another scheduler is none's too; the step scheduler's [0.352, 0.848] also overlaps
    assert best["scheduler_runner_up"] == "lr0.01-wd0-none" and best["scheduler_win"] == NOT_CLEAR
    # test top1 0.70, 0.80, 0.75: mean 0.75, sd 0.05
    assert best["test"]["top1"]["mean"] == pytest.approx(0.75)
    assert (best["test"]["top1"]["low"], best["test"]["top1"]["high"]) == pytest.approx(_logit_t([0.70, 0.80, 0.75]))
    assert (best["test"]["loss"]["low"], best["test"]["loss"]["high"]) == pytest.approx(
        _transformed_t([0.5, 0.7, 0.6], math.log, math.exp))
    report = write_report(tmp_path, stubbed_table, best, {"task": "cifar_class", "manifest": "m.csv", "n_epochs": 10,
                                                          "seeds": [0, 1, 2]}).read_text()
    assert "scheduler **cosine**: validation top-1 0.82 (95% interval 0.7654 to 0.8651)" in report
    assert "**Epochs needed:** 5 (95% interval 2.978 to 8.169) epochs on average over 3 seeds" in report
    assert "the slowest seed needed 6" in report
    assert ("**Is the win clear?** not clear: its interval overlaps that of the runner-up lr0.01-wd0-none "
            "(winner [0.7654, 0.8651], runner-up [0.4157, 0.8909])") in report
    assert "**Scheduler that won:** cosine; not clear" in report
    assert "seed 0 epoch 5, seed 1 epoch 6, seed 2 epoch 5): loss 0.6 (95% interval" in report
    assert "top1 0.75 (95% interval 0.6084 to 0.8558)" in report
    # a clear win: make the runner-up's seeds agree far below the winner's interval
    clear_table = stubbed_table.copy()
    clear_table.loc[clear_table["config"] == "lr0.01-wd0-none", ["best_val_top1", "best_val_top1_low", "best_val_top1_high"]] = (
        0.70, 0.69, 0.71)
    clear = best_record(clear_table, 0.01, {}, tests)
    assert clear["win"] == CLEAR and clear["runner_up_interval"] == [0.69, 0.71]
    report = write_report(tmp_path, clear_table, clear, {"task": "t", "manifest": "m.csv", "n_epochs": 10, "seeds": [0, 1, 2]})
    assert ("**Is the win clear?** clear: its interval lies wholly above that of the runner-up lr0.01-wd0-none "
            "(winner [0.7654, 0.8651], runner-up [0.69, 0.71])") in report.read_text()


def test_a_diverged_config_is_ranked_last(digits400, tmp_path, monkeypatch):
    real_train = step2.train

    def diverge_at_high_lr(args):
        if args.init_lr > 1:
            raise NonFiniteLossError("epoch 1, batch 1: the training loss is nan")
        return real_train(args)

    monkeypatch.setattr(step2, "train", diverge_at_high_lr)
    table = search.main(argv(digits400, tmp_path / "out", "100,0.003", "--n_epochs", "1"))
    assert list(table["lr"]) == [0.003, 100.0] and list(table["status"]) == ["done", "diverged"]
    assert "(one seed: no interval)" in (tmp_path / "out" / "report.md").read_text()
    assert json.loads((tmp_path / "out" / "best.json").read_text())["lr"] == 0.003


def test_grid_and_epochs_to_within_by_hand():
    assert [config.name for config in grid([0.1, 0.01], [0.0], ["cosine", "step"])] == [
        "lr0.1-wd0-cosine", "lr0.1-wd0-step", "lr0.01-wd0-cosine", "lr0.01-wd0-step"]
    assert Config(1e-5, 1e-4, "none").name == "lr1e-05-wd0.0001-none"
    # best 0.80 at epoch 4; 0.99 * 0.80 = 0.792: epoch 3 (0.795) is the first within 1%; epoch 0 never counts
    accuracy = pd.Series([0.9, 0.5, 0.7, 0.795, 0.80], index=range(5))
    assert epochs_to_within(accuracy, 0.01) == 3 and epochs_to_within(accuracy, 0.2) == 2
    with pytest.raises(TaskHetError, match="--lrs repeats a value"):
        grid([0.1, 0.1], [0.0], ["none"])


@pytest.mark.parametrize("flags, message", [
    (("--lrs", "0.1,abc"), "argument --lrs: must be a number in (0, 1e+06], got 'abc'"),
    (("--schedulers", "cosine,cosinus"), "unknown scheduler 'cosinus'"),
    (("--init_lr", "0.1"), "unrecognized arguments: --init_lr 0.1"),
    (("--task", "normal"), "task 'normal' is not a task of data family 'digits'"),
    (("--seeds", "0,x"), "argument --seeds: must be an integer in [0, 2^63-1], got 'x'"),
    (("--seeds", "0,1,0"), "--seeds repeats a value: 0, 1, 0"),
    (("--seeds", "0,1", "--seed", "3"), "--seed and --seeds both given"),
])
def test_bad_flag_is_one_error_line(digits400, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        run_main(search.main, argv(digits400, tmp_path / "out") + list(flags))
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and error.startswith("error: ") and message in error and "\n" not in error
    assert not (tmp_path / "out").exists()


def test_a_manifest_without_validation_is_refused(digits400, tmp_path):
    manifest = tmp_path / "manifest.csv"
    pd.read_csv(digits400).drop(columns="val").to_csv(manifest, index=False)
    with pytest.raises(TaskHetError, match="has no validation part .* --val_fraction"):
        search.main(argv(manifest, tmp_path / "out"))


# ----- dense tasks: ranked by the lowest validation loss -----
def loss_rows(config: Config, values: list[tuple[int, float | None, int]]) -> list[dict]:
    """Stubbed search_runs.csv rows of a dense task: (seed, best_val_loss, epochs_to_within); None loss = diverged."""
    return [{**config.columns(), "seed": seed, "best_val_top1": math.nan, "best_val_loss": math.nan if loss is None else loss,
             "best_epoch": 5, "epochs_to_within": epochs, "epochs_done": 10, "status": DIVERGED if loss is None else DONE}
            for seed, loss, epochs in values]


@pytest.fixture
def stubbed_dense_table():
    """A dense task's search: three seeds per config, losses with round log-scale spreads; no training."""
    low, high, tie, wild = (Config(0.01, 0.0, "none"), Config(0.1, 0.0, "none"), Config(0.003, 0.0, "none"),
                            Config(1.0, 0.0, "none"))
    rows = (loss_rows(high, [(0, 0.040, 4), (1, 0.050, 5), (2, 0.060, 6)])  # grid order first, mean 0.05
            + loss_rows(low, [(0, 0.020, 4), (1, 0.030, 5), (2, 0.025, 6)])  # mean 0.025: the winner
            + loss_rows(tie, [(0, 0.030, 3), (1, 0.020, 3), (2, 0.025, 3)])  # the same mean; later in the grid
            + loss_rows(wild, [(0, 0.001, 1), (1, None, -1), (2, 0.001, 1)]))  # one diverged seed: ranked last
    return aggregate(pd.DataFrame(rows, columns=list(RUN_COLUMNS)))


def test_a_dense_task_is_ranked_by_its_lowest_validation_loss(stubbed_dense_table, tmp_path):
    assert score_for("classification").metric == "top1" and score_for("dense") is BY_LOSS
    table = stubbed_dense_table.set_index("config")
    winner = table.loc["lr0.01-wd0-none"]
    # losses: t on the log scale, so the interval never reaches below 0
    assert winner["best_val_loss"] == pytest.approx(0.025) and math.isnan(winner["best_val_top1"])
    assert (winner["best_val_loss_low"], winner["best_val_loss_high"]) == pytest.approx(
        _transformed_t([0.020, 0.030, 0.025], math.log, math.exp))
    # lowest mean first; the tie (0.025 both) keeps grid order; the diverged config last despite its 0.001
    assert list(rank(stubbed_dense_table, BY_LOSS)["config"]) == [
        "lr0.01-wd0-none", "lr0.003-wd0-none", "lr0.1-wd0-none", "lr1-wd0-none"]
    best = best_record(stubbed_dense_table, 0.01, {}, {0: {"epoch": 5, "loss": 0.03}}, BY_LOSS)
    assert best["ranked_by"] == "best_val_loss" and best["runner_up"] == "lr0.003-wd0-none" and best["win"] == NOT_CLEAR
    report = write_report(tmp_path, stubbed_dense_table, best, {"task": "edge_texture", "manifest": "m.csv", "n_epochs": 10,
                                                                "seeds": [0, 1, 2]}, BY_LOSS).read_text()
    low, high = _transformed_t([0.020, 0.030, 0.025], math.log, math.exp)
    assert f"scheduler **none**: validation loss 0.025 (95% interval {low:.4g} to {high:.4g})" in report
    assert "Ranked by the mean over seeds of the lowest validation loss over the epochs;" in report
    assert "best validation loss (loss <= 1.01 x best)" in report
    assert "val_loss.csv and val_loss.png" in report


def test_a_lower_loss_wins_clearly_only_below_the_other_interval():
    def row(low, high, n_seeds=3):
        return {"best_val_loss_low": low, "best_val_loss_high": high, "n_seeds": n_seeds, "n_diverged": 0}
    assert win_clarity(row(0.02, 0.03), row(0.031, 0.05), BY_LOSS) == CLEAR
    assert win_clarity(row(0.02, 0.03), row(0.03, 0.05), BY_LOSS) == NOT_CLEAR  # touching is not clear
    assert win_clarity(row(0.02, 0.03), row(0.01, 0.015), BY_LOSS) == NOT_CLEAR  # the other is lower
    assert win_clarity(row(0.02, 0.03, 2), row(0.04, 0.05), BY_LOSS) == UNKNOWN  # two seeds: too few


def test_epochs_to_within_a_loss_by_hand():
    # lowest 0.20 at epoch 4; 1.01 * 0.20 = 0.202: epoch 3 (0.201) is the first within 1%; epoch 0 never counts
    loss = pd.Series([0.1, 0.5, 0.3, 0.201, 0.20], index=range(5))
    assert epochs_to_within(loss, 0.01, higher_is_better=False) == 3
    assert epochs_to_within(loss, 0.5, higher_is_better=False) == 2  # 0.3 <= 1.5 * 0.2
    assert epochs_to_within(pd.Series([0.3, 0.2, 0.2], index=range(3)), 0.0, higher_is_better=False) == 1  # a tie: the first


def test_a_dense_run_is_summarized_by_its_lowest_validation_loss(tmp_path):
    """A step-2 metrics.csv written by hand: validation loss 0.9 (untrained), 0.302, 0.3, 0.31, 0.4 at epochs 0-4."""
    rows = [(epoch, "val", "loss", value) for epoch, value in enumerate([0.9, 0.302, 0.3, 0.31, 0.4])]
    rows += [(epoch, "test", "loss", 0.1) for epoch in range(5)]  # the test split plays no part
    pd.DataFrame(rows, columns=["epoch", "split", "metric", "value"]).to_csv(tmp_path / "metrics.csv", index=False)
    row = summarize(Config(0.01, 0.0, "none"), 0, tmp_path, 0.01, BY_LOSS)
    assert (row["best_val_loss"], row["best_epoch"], row["epochs_done"]) == (0.3, 2, 4)
    assert row["epochs_to_within"] == 1 and math.isnan(row["best_val_top1"])  # 0.302 <= 1.01 x 0.3 = 0.303


@pytest.mark.slow
def test_search_runs_on_a_dense_task(tiny_data_root, tiny_manifest, tmp_path):  # noqa: F811
    """A keypoint search on the tiny renders: 1e-7 cannot move the model in 2 epochs, 3e-3 can."""
    out = tmp_path / "dense"
    table = search.main(["--lrs", "0.0000001,0.003", "--schedulers", "none", "--task", "keypoints2d", "--encoder", "small_cnn",
                         "--weights", "none", "--data_path", str(tiny_data_root), "--manifest", str(tiny_manifest),
                         "--image_size", "32", "--n_epochs", "2", "--batch_size", "8", "--optimizer", "adamw",
                         "--no-use_accelerator", "--no-plots", "--out", str(out)])
    runs = pd.read_csv(out / "search_runs.csv").set_index("lr")
    assert runs["best_val_top1"].isna().all() and (runs["status"] == "done").all()
    assert runs.loc[0.003, "best_val_loss"] < runs.loc[1e-7, "best_val_loss"]
    assert list(table["lr"]) == [0.003, 1e-7]
    best = json.loads((out / "best.json").read_text())
    assert best["lr"] == 0.003 and best["ranked_by"] == "best_val_loss" and "loss" in best["test"]
    curves = pd.read_csv(out / "val_loss.csv")
    assert set(curves["metric"]) == {"loss"} and set(curves["config"]) == {"lr1e-07-wd0.0001-none", "lr0.003-wd0.0001-none"}
    assert (out / "val_loss.png").is_file() and not (out / "val_top1.csv").exists()
    assert "validation loss" in (out / "report.md").read_text()
