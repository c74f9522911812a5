"""The centralized hyperparameter search (steps/search_centralized.py, training/search.py) on tiny digits, on the CPU."""

import json

import pandas as pd
import pytest

from datasets.digits import select_digits
from steps import search_centralized as search
from steps import train_centralized as step2
from training.search import Config, epochs_to_within, grid
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
            "--no-use_accelerator", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def searched(digits400, tmp_path_factory):
    """A search whose best lr is unambiguous: 1e-6 cannot move small_cnn off chance in 2 epochs, 3e-3 can."""
    out = tmp_path_factory.mktemp("search") / "out"
    return out, search.main(argv(digits400, out))


def test_search_picks_the_known_best_lr(searched):
    out, table = searched
    best = json.loads((out / "best.json").read_text())
    assert best["lr"] == 0.003 and best["scheduler"] == "none" and best["config"] == "lr0.003-wd0.0001-none"
    rows = pd.read_csv(out / "search.csv").set_index("lr")
    assert list(rows.index) == [1e-6, 0.003] and (rows["status"] == "done").all()
    # 30 validation digits: chance is ~3 of them; the tuned lr gets well above it, the tiny one cannot
    assert rows.loc[0.003, "best_val_top1"] >= 0.3 > rows.loc[1e-6, "best_val_top1"]
    assert list(table["lr"]) == [0.003, 1e-6]  # returned best first
    for name in ("config.json", "run.log", "metrics.csv", "report.md", "val_top1.png", "runs/lr0.003-wd0.0001-none/best.pt"):
        assert (out / name).is_file(), name
    assert set(pd.read_csv(out / "metrics.csv")["config"]) == {"lr1e-06-wd0.0001-none", "lr0.003-wd0.0001-none"}
    report = (out / "report.md").read_text()
    assert "**Scheduler that won:** none" in report
    assert f"**Epochs needed:** {int(rows.loc[0.003, 'epochs_to_within'])} epochs reach within 1%" in report
    # the winner's test numbers are those of its best.pt epoch, which validation chose
    metrics = pd.read_csv(out / "runs/lr0.003-wd0.0001-none/metrics.csv")
    val = metrics[(metrics.split == "val") & (metrics.metric == "loss")].set_index("epoch").value
    test = metrics[(metrics.split == "test") & (metrics.metric == "loss")].set_index("epoch").value
    assert best["test_at_selected_epoch"]["epoch"] == val.idxmin()
    assert best["test_at_selected_epoch"]["loss"] == pytest.approx(test[val.idxmin()])


def test_a_rerun_skips_finished_configs(searched, digits400):
    out, table = searched
    before = {path: path.stat().st_mtime_ns for path in out.glob("runs/*/last.pt")}
    again = search.main(argv(digits400, out))
    # a finished step-2 run trains no epoch again: no last.pt is rewritten, and the table is the same
    assert len(before) == 2 and {path: path.stat().st_mtime_ns for path in out.glob("runs/*/last.pt")} == before
    pd.testing.assert_frame_equal(again, table)


def test_a_diverged_config_is_ranked_last(digits400, tmp_path, monkeypatch):
    real_train = step2.train

    def diverge_at_high_lr(args):
        if args.init_lr > 1:
            raise NonFiniteLossError("epoch 1, batch 1: the training loss is nan")
        return real_train(args)

    monkeypatch.setattr(step2, "train", diverge_at_high_lr)
    table = search.main(argv(digits400, tmp_path / "out", "100,0.003", "--n_epochs", "1"))
    assert list(table["lr"]) == [0.003, 100.0] and list(table["status"]) == ["done", "diverged"]
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
    (("--lrs", "0.1,abc"), "argument --lrs: must be a number, got 'abc'"),
    (("--schedulers", "cosine,cosinus"), "unknown scheduler 'cosinus'"),
    (("--init_lr", "0.1"), "unrecognized arguments: --init_lr 0.1"),
    (("--task", "normal"), "--task normal: the search ranks by validation accuracy"),
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
