"""The digits family: its step 1 (stratified, seeded, exact sizes), its dataset and a whole pipeline run."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

import run_pipeline
from datasets.digits import DigitsDataset, load_arrays, select_digits
from datasets.family import load_manifest
from pipeline.experiment import load_experiment
from steps import select
from utils.errors import TaskHetError
from tests.test_run_logs import open_run_logs, run_loggers


@pytest.mark.parametrize("test_fraction, n_samples", [(0.2, None), (0.25, 200), (0.1, 100)])
def test_split_is_stratified_with_exact_sizes(test_fraction, n_samples):
    manifest = select_digits(test_fraction, seed=3, n_samples=n_samples)
    kept = n_samples or 1797
    assert len(manifest) == kept and manifest["sample_id"].is_unique and manifest["image_index"].is_monotonic_increasing
    num_test = int((manifest["split"] == "test").sum())
    assert num_test == math.ceil(test_fraction * kept)
    _, labels = load_arrays()
    assert (manifest["label"].to_numpy() == labels[manifest["image_index"]]).all()
    # Stratified: each digit's share of a split is within one sample of its overall share.
    counts = pd.crosstab(manifest["label"], manifest["split"])
    expected = counts.sum(axis=1) * num_test / kept
    assert (counts["test"] - expected).abs().max() <= 1.0 and (counts.sum(axis=0) > 0).all()


def test_split_is_seeded():
    pd.testing.assert_frame_equal(select_digits(0.2, seed=1, n_samples=300), select_digits(0.2, seed=1, n_samples=300))
    assert not select_digits(0.2, seed=1).equals(select_digits(0.2, seed=2))


def test_validation_part_is_stratified_seeded_and_leaves_the_split_alone():
    manifest = select_digits(0.2, seed=5, n_samples=300)
    train = manifest[manifest["split"] == "train"]
    # round half up of 10% of each digit's train rows (23..25 rows: 2, 28: 3); never on test rows
    per_digit = train.groupby("label")["val"].agg(["size", "sum"])
    assert (per_digit["sum"] == (0.1 * per_digit["size"] + 0.5).astype(int)).all() and per_digit["sum"].min() >= 2
    assert (manifest.loc[manifest["split"] == "test", "val"] == 0).all()
    pd.testing.assert_frame_equal(manifest.drop(columns="val"), select_digits(0.2, seed=5, n_samples=300, val_fraction=0.5).drop(columns="val"))
    pd.testing.assert_series_equal(manifest["val"], select_digits(0.2, seed=5, n_samples=300)["val"])
    assert select_digits(0.2, seed=5, n_samples=300, val_fraction=0.0)["val"].sum() == 0
    with pytest.raises(TaskHetError, match="--val_fraction must be in"):
        select_digits(0.2, seed=5, val_fraction=1.0)


def test_a_manifest_without_the_val_column_reads_as_no_validation_part(tmp_path):
    path = tmp_path / "manifest.csv"
    select_digits(0.2, seed=0, n_samples=50).drop(columns="val").to_csv(path, index=False)
    _, manifest = load_manifest(path)
    assert (manifest["val"] == 0).all()
    bad = select_digits(0.2, seed=0, n_samples=50)
    bad.loc[bad["split"] == "test", "val"] = 1
    bad.to_csv(path, index=False)
    first_test = int((bad["split"] == "test").to_numpy().argmax()) + 2
    with pytest.raises(TaskHetError, match=f"row {first_test} has val 1, expected 0 or 1 \\(1 only on train rows\\)"):
        load_manifest(path)


@pytest.mark.parametrize("kwargs, flag", [({"test_fraction": 1.0}, "--test_fraction"), ({"test_fraction": 0.01, "n_samples": 40}, "--test_fraction"),
                                          ({"test_fraction": 0.2, "n_samples": 5}, "--n_samples"), ({"test_fraction": 0.2, "n_samples": 5000}, "--n_samples")])
def test_bad_step1_arguments_name_the_flag(kwargs, flag):
    with pytest.raises(TaskHetError, match=flag):
        select_digits(seed=0, **kwargs)


def test_step1_command_writes_a_digits_manifest(tmp_path):
    path = select.main(["--family", "digits", "--test_fraction", "0.3", "--n_samples", "50", "--seed", "4", "--out", str(tmp_path)])
    family, manifest = load_manifest(path)
    assert family.name == "digits" and len(manifest) == 50 and int((manifest["split"] == "test").sum()) == 15
    assert (tmp_path / "class_counts.csv").is_file() and (tmp_path / "config.json").is_file()
    with pytest.raises(TaskHetError, match="unrecognized arguments: --top_k_classes"):  # a Taskonomy flag is not a digits flag
        select.main(["--family", "digits", "--top_k_classes", "3", "--out", str(tmp_path)])
    with pytest.raises(TaskHetError, match="--family: unknown data family 'digitz'"):
        select.main(["--family", "digitz"])


def test_the_arrays_are_scikit_learns_digits_read_only():
    """load_arrays reads the bundled file without scikit-learn's loader; it must give that loader's arrays."""
    from sklearn.datasets import load_digits

    images, labels = load_arrays()
    bunch = load_digits()
    assert images.dtype == np.float64 and labels.dtype == np.int64
    np.testing.assert_array_equal(images, bunch.images)
    np.testing.assert_array_equal(labels, bunch.target)
    assert load_arrays()[0] is images  # read once per process
    with pytest.raises(ValueError, match="read-only"):  # so no caller can change the next one's digits
        images[0, 0, 0] = 1.0


def test_images_are_scaled_resized_and_grey(tmp_path):
    manifest = select_digits(0.2, seed=0, n_samples=50)
    item = DigitsDataset(manifest, 32)[0]
    images, _ = load_arrays()
    image = item["image"]
    assert torch.equal(image[0], image[1]) and torch.equal(image[0], image[2])
    small = torch.nn.functional.interpolate(image[None, :1], size=8, mode="area")[0, 0].numpy()
    assert np.abs(small - images[manifest.at[0, "image_index"]] / 16).mean() < 0.1


def test_an_edited_label_is_rejected():
    manifest = select_digits(0.2, seed=0, n_samples=50)
    manifest.loc[4, "label"] = (manifest.at[4, "label"] + 1) % 10
    with pytest.raises(TaskHetError, match=r"row 6 \(digit_\d+\): label"):
        DigitsDataset(manifest, 8)


def tiny_digits_experiment(tmp_path) -> dict:
    return {
        "name": "tinydigits",
        "data": {"source": "digits", "n_samples": 160, "test_fraction": 0.25},
        "tasks": ["digit_class"],
        "model": {"encoder": "small_cnn", "weights": "none", "image_size": 16},
        "centralized": {"n_epochs": 1, "batch_size": 16},
        "embeddings": {"n_clusters": 4},
        "partition": {"alphas": [1.0], "n_clients": 3},
        "federated": {"algorithms": {"fedavg": {}}, "n_rounds": 2, "local_steps": 2, "batch_size": 8},
        "seeds": [0],
        "use_accelerator": False,
        "run_plots": False,  # no test of it opens a run's own pictures (tests/test_pipeline.py draws them)
    }


@pytest.mark.slow
def test_digits_pipeline_end_to_end(tmp_path):
    experiment = tmp_path / "digits.yaml"
    experiment.write_text(yaml.safe_dump(tiny_digits_experiment(tmp_path)))
    held = open_run_logs(), run_loggers()
    # --run_plots wins over the file's run_plots: false, as --tensorboard over its key
    run_pipeline.main([str(experiment), "--results", str(tmp_path / "results"), "--run_plots"])
    # every stage ran in this process (--jobs 1) and closed its run.log when it ended
    assert (open_run_logs(), run_loggers()) == held
    out = tmp_path / "results" / "tinydigits"
    assert (out / "report.md").stat().st_size > 0
    runs = list(out.glob("federated/**/metrics.csv"))
    assert runs and all((run.parent / "curves.png").is_file() for run in runs)
    assert len(list(out.glob("centralized/*/curves.png"))) == 1
    report = pd.read_csv(out / "report.csv")
    assert set(report.task) == {"digit_class"} and report.drop(columns=["diff_ci_low", "diff_ci_high", "p_value"]).notna().all(axis=None)
    assert (report.reason == "too few seeds").all() and not report.decided_after_bh.any()  # one seed: no verdict
    runs = pd.concat([pd.read_csv(path) for path in out.rglob("federated/**/metrics.csv")])
    assert {"top1", "top5"} <= set(runs.metric)
    groupings = {path.parts[-5] for path in out.rglob("federated/**/metrics.csv")}
    assert groupings == {"label_based", "embedding_based"}


def test_digits_experiment_rejects_a_taskonomy_task(tmp_path):
    config = tiny_digits_experiment(tmp_path)
    config["tasks"] = ["digit_class", "normal"]
    experiment = tmp_path / "bad.yaml"
    experiment.write_text(yaml.safe_dump(config))
    with pytest.raises(TaskHetError, match=r"bad.yaml: tasks \(data.source digits\): task 'normal' is not a task of data family 'digits'"):
        load_experiment(experiment)


def test_step4_refuses_a_task_of_another_family_naming_flag_and_manifest(tmp_path, capsys):
    from steps import assign, federated
    from utils.cli import run_main

    manifest = tmp_path / "manifest.csv"
    select_digits(0.2, seed=0, n_samples=100).to_csv(manifest, index=False)
    assign.main(["--manifest", str(manifest), "--n_clients", "2", "--out", str(tmp_path / "a")])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_main(federated.main, ["--task", "depth_euclidean", "--manifest", str(manifest), "--assignments",
                                  str(tmp_path / "a" / "assignments.csv"), "--encoder", "small_cnn", "--n_rounds", "1",
                                  "--no-use_accelerator", "--no-progress", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err == [
        f"error: --task (manifest {manifest}): task 'depth_euclidean' is not a task of data family 'digits'; "
        "its tasks: digit_class"], err
    assert not (tmp_path / "run" / "metrics.csv").exists()


def test_step4_class_groups_count_a_digit_without_training_rows_as_tail_and_few():
    """Step 4's head/middle/tail and many/medium/few groups are over all ten digits (the family's K), from the train
    rows without the validation rows: a digit with no training row (here 9) is a tail and a few-shot class, so the
    tail metrics count its test images."""
    from datasets.family import get_family
    from network.run_inputs import train_class_groups

    manifest = select_digits(0.2, seed=0, n_samples=600)
    manifest = manifest[~((manifest["label"] == 9) & (manifest["split"] == "train"))]
    train = manifest[(manifest["split"] == "train") & (manifest["val"] == 0)]
    counts = np.bincount(train["label"], minlength=10)
    assert counts[9] == 0 and counts[:9].min() > 20 and counts.max() <= 100  # all medium but 9
    order = np.argsort(-counts, kind="stable")  # by hand: each class's cumulative share where it starts
    start = dict(zip(order.tolist(), np.concatenate([[0], np.cumsum(counts[order])[:-1]]) / counts.sum()))
    groups = train_class_groups(get_family("digits"), manifest)
    assert groups["few"] == [9] and groups["medium"] == list(range(9)) and "many" not in groups
    assert groups["tail"] == sorted(c for c in range(10) if start[c] >= 0.95) and 9 in groups["tail"]
    assert sorted(groups["head"] + groups["middle"] + groups["tail"]) == list(range(10))


def test_step4_num_workers_reaches_every_loader(tmp_path):
    """--num_workers is the worker count of every loader step 4 builds: clients' train and test loaders, the global
    test split and the manifest's validation rows."""
    from types import SimpleNamespace

    from models import get_task
    from network.client_data import global_test_loader, global_val_loader, make_clients
    from steps import assign

    manifest_path = tmp_path / "manifest.csv"
    select_digits(0.2, seed=0, n_samples=100).to_csv(manifest_path, index=False)
    assign.main(["--manifest", str(manifest_path), "--n_clients", "2", "--client_test_fraction", "0.25", "--out",
                 str(tmp_path / "a")])
    manifest, task = load_manifest(manifest_path)[1], get_task("digit_class")
    assert manifest["val"].sum() > 0
    args = SimpleNamespace(data_path=tmp_path, image_size=8, cache_dir=None, batch_size=8, num_workers=2, rand_seed=0,
                           assignments=tmp_path / "a" / "assignments.csv", local_test="assigned", cache_features=False)
    clients = make_clients(args, manifest, pd.read_csv(args.assignments), task)
    loaders = [global_test_loader(args, manifest, task), global_val_loader(args, manifest, task)]
    loaders += [loader for client in clients for loader in (client.train_loader(0), client.test_loader)]
    assert len(loaders) == 2 + 2 * len(clients) and all(loader is not None for loader in loaders)
    assert [loader.num_workers for loader in loaders] == [2] * len(loaders)


def test_shipped_digits_experiment_is_valid():
    config = load_experiment(Path(__file__).resolve().parent.parent / "experiments" / "digits.yaml")
    assert config["data"]["source"] == "digits" and config["tasks"] == ["digit_class"]
    assert set(config["partition"]["groupings"]) == {"label_based", "embedding_based"} and len(config["seeds"]) == 2


def test_digits_lt_keeps_the_cifar_lt_profile_on_train_and_a_balanced_test_split():
    import numpy as np

    from datasets.digits import select_digits
    from datasets.long_tail import long_tail_counts

    full = select_digits(0.2, seed=0)
    manifest = select_digits(0.2, seed=0, imbalance_factor=0.1)
    full_train = np.bincount(full.loc[full.split == "train", "label"], minlength=10)
    counts = np.bincount(manifest.loc[manifest.split == "train", "label"], minlength=10)
    assert counts.tolist() == long_tail_counts(int(full_train.min()), 10, 0.1).tolist()  # ⌊n_max·0.1^{c/9}⌋
    assert manifest.loc[manifest.split == "test", "sample_id"].tolist() == \
        full.loc[full.split == "test", "sample_id"].tolist()  # the same balanced test split
    with pytest.raises(TaskHetError, match=r"--imbalance_factor must be in \(0, 1\], got 0"):
        select_digits(0.2, seed=0, imbalance_factor=0)
