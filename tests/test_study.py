"""Studies (pipeline/studies/grid/runner.py): the embedded FedAvg study end to end at a tiny size, its report's numbers, the
validation split that "best by validation" reads, the cifar wiring, and study-file errors that name the key."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

import run_pipeline
from datasets.family import load_manifest
from models import list_encoders
from pipeline.experiment import load_experiment
from pipeline.studies.grid.runs import rounds_for, study_runs
from pipeline.studies.fedavg_sharding import STUDY_COLUMNS
from pipeline.studies.grid.results import run_accuracy
from steps import assign as step3b
from tests.fixtures import write_tiny_cifar
from utils.errors import TaskHetError

ROOT = Path(__file__).resolve().parent.parent


def tiny_study(tmp_path: Path) -> dict:
    """The digits study at a tiny size: iid J=1, Nc ∈ {1, 2} × J ∈ {1, 2} at rounds × J = 2, two seeds."""
    return {
        "name": "tinystudy",
        "study": "fedavg_sharding",
        "data": {"source": "digits", "n_samples": 100, "test_fraction": 0.25},
        "task": "digit_class",
        "model": {"encoder": "small_cnn", "weights": "none", "image_size": 8},
        "centralized": {"n_epochs": 1, "batch_size": 16},
        "federated": {"n_clients": 10, "client_fraction": 0.3, "rounds_x_local_steps": 2, "evaluations": 2,
                      "batch_size": 8, "init_lr": 0.05},
        "grid": [{"partitions": [{"scheme": "iid"}], "local_steps": [1], "algorithms": {"fedavg": {}}},
                 {"partitions": [{"scheme": "nc_shards", "groups_per_client": 1},
                                 {"scheme": "nc_shards", "groups_per_client": 2}],
                  "local_steps": [1, 2], "algorithms": {"fedavg": {}}}],
        "seeds": [0, 1],
        "use_accelerator": False,
    }


def write(tmp_path: Path, config: dict, name: str = "study.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


def stage_times(out: Path) -> dict[str, int]:
    return {str(path.parent.relative_to(out)): path.stat().st_mtime_ns for path in out.rglob("stage.json")}


@pytest.fixture
def one_thread():
    """Tiny tensors: more threads only add contention on a shared machine (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_tiny_digits_study_end_to_end_and_rerun_skips(tmp_path, one_thread):
    study = write(tmp_path, tiny_study(tmp_path))
    run_pipeline.main([str(study), "--results", str(tmp_path / "results"), "--no-run_plots"])
    out = tmp_path / "results" / "tinystudy"
    report = pd.read_csv(out / "report.csv")
    assert list(report.columns) == STUDY_COLUMNS
    expected = [("iid", 1, 2), ("nc_shards-nc1", 1, 2), ("nc_shards-nc1", 2, 1), ("nc_shards-nc2", 1, 2),
                ("nc_shards-nc2", 2, 1)]
    assert list(zip(report.partition[:-1], report.local_steps[:-1], report.rounds[:-1])) == expected
    assert report.partition.iloc[-1] == "centralized" and (report.n_seeds == 2).all()
    assert report.final_mean.between(0, 1).all() and report.best_val_mean.between(0, 1).all()  # digits has a val part
    assert (report.final_low <= report.final_mean).all()
    text = (out / "report.md").read_text()
    assert "## Summary" in text and "Nc=2 − Nc=1" in text and "effect of J=2 over J=1" in text
    for name in ("accuracy_vs_nc.png", "accuracy_curves.png"):
        assert (out / name).stat().st_size > 0
    # The Nc=1 partition: 75 training digits over 10 clients, one digit each, sizes within 1.
    for assignments in out.glob("assignments/nc_shards-nc1-s*/assignments.csv"):
        table = pd.read_csv(assignments)
        assert (table.groupby("client_id")["group"].nunique() == 1).all()
        assert np.ptp(table.groupby("client_id").size()) <= 1
    before = stage_times(out)
    run_pipeline.main([str(study), "--results", str(tmp_path / "results"), "--no-run_plots"])
    assert stage_times(out) == before  # a rerun redoes nothing


def test_best_by_validation_is_the_test_value_at_the_best_validation_round(tmp_path):
    rows = [(0, "test", 0.10), (0, "val", 0.10), (5, "test", 0.50), (5, "val", 0.70), (10, "test", 0.60),
            (10, "val", 0.70), (15, "test", 0.40), (15, "val", 0.65)]
    frame = pd.DataFrame([{"round": r, "split": split, "client": "global", "metric": "top1", "value": value}
                          for r, split, value in rows])
    frame.to_csv(tmp_path / "metrics.csv", index=False)
    result = run_accuracy(tmp_path / "metrics.csv", "top1")
    # Final: round 15's test value; best by validation: round 5 (the earliest of the two 0.70s), test 0.50.
    assert result["final"] == 0.40 and result["best_val"] == 0.50 and result["rounds"] == 15
    frame[frame.split == "test"].to_csv(tmp_path / "metrics.csv", index=False)
    assert math.isnan(run_accuracy(tmp_path / "metrics.csv", "top1")["best_val"])


def test_engine_evaluates_the_global_model_on_the_validation_rows(tmp_path):
    from tests.test_engine import global_test, make_engine

    engine = make_engine(tmp_path / "run", name="fedavg", rounds=2)
    engine.val_loader = global_test()[:1]  # one batch of the test data stands in for validation rows
    engine.run()
    metrics = pd.read_csv(tmp_path / "run" / "metrics.csv")
    val = metrics[(metrics.split == "val") & (metrics.client == "global")]
    test = metrics[(metrics.split == "test") & (metrics.client == "global")]
    assert sorted(val["round"].unique()) == sorted(test["round"].unique()) == [0, 2]
    assert set(val.metric) == set(test.metric)


def test_cifar_source_makes_a_manifest_with_validation_rows_that_no_client_holds(tmp_path):
    from pipeline.runner import Pipeline

    data = write_tiny_cifar(tmp_path / "cifar", "cifar10", [10] * 10)
    config = tiny_study(tmp_path)
    config.update(task="cifar_class", data={"source": "cifar10", "root": str(data), "val_fraction": 0.2,
                                            "verify_checksums": False})
    loaded = load_experiment(write(tmp_path, config))
    manifest = Pipeline(loaded, tmp_path / "out", "test").manifest(Path(loaded["data"]["root"]))
    _, rows = load_manifest(manifest)
    assert int(rows["val"].sum()) == 20  # 2 of each class's 10 training images
    assignments = step3b.main(["--manifest", str(manifest), "--scheme", "nc_shards", "--groups_per_client", "2",
                               "--n_clients", "8", "--client_test_fraction", "0", "--out", str(tmp_path / "a")])
    table = pd.read_csv(assignments)
    val_ids = set(rows.loc[rows["val"] == 1, "sample_id"])
    assert len(table) == 80 and not val_ids & set(table.sample_id)  # every other training image, no validation one
    assert (table.groupby("client_id").size() == 10).all()


@pytest.mark.parametrize("change, key", [
    (lambda c: c["grid"][1].update(local_steps=[1, 3]), "grid[1].local_steps[1] = 3 does not divide"),
    (lambda c: c["grid"][0]["partitions"][0].update(scheme="shard"), "grid[0].partitions[0].scheme 'shard'"),
    (lambda c: c["grid"][0]["partitions"][0].update(groups_per_client=2), "grid[0].partitions[0].groups_per_client"),
    (lambda c: c["grid"][0].update(algorithms={"fedprox": {"mu": -1}}), "grid[0].algorithms.fedprox"),
    (lambda c: c["grid"][0].update(algorithms={"fedavgg": {}}), "grid[0].algorithms: 'fedavgg'"),
    (lambda c: c["grid"][0].pop("local_steps"), "grid[0] must be a mapping with exactly the keys"),
    (lambda c: c["federated"].update(n_round=3), "unknown key 'federated.n_round'"),
    (lambda c: c["federated"].update(client_fraction=0), "federated.client_fraction"),
    (lambda c: c.update(task="depth_euclidean"), "task 'depth_euclidean' must be a registered classification task"),
    (lambda c: c.update(study="fedprox_sweep"), "study: unknown study kind 'fedprox_sweep'; choose one of: fed_lt, fedavg_sharding"),
    (lambda c: c["data"].update(val_fraction=1.5), "data.val_fraction"),  # every family has a validation part
    (lambda c: c.update(grid=[]), "grid must list at least one block"),
])
def test_study_file_errors_name_the_key(tmp_path, change, key):
    config = tiny_study(tmp_path)
    change(config)
    with pytest.raises(TaskHetError, match=key.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        load_experiment(write(tmp_path, config))


def test_embedded_study_file_is_the_documented_grid():
    config = load_experiment(ROOT / "experiments" / "digits_fedavg.yaml")
    runs = study_runs(config)
    assert len(runs) == (1 + 3 * 3) * 3
    assert {run.local_steps * rounds_for(config, run.local_steps) for run in runs} == {240}
    assert sorted({run.partition.groups_per_client for run in runs if run.partition.scheme == "nc_shards"}) == [1, 2, 5]


@pytest.mark.skipif("vit_s16_dino" not in list_encoders(), reason="the DINO ViT-S/16 encoder is not registered on this branch")
def test_cifar100_study_file_parses():
    config = load_experiment(ROOT / "experiments" / "cifar100_fedavg.yaml")
    runs = study_runs(config)
    assert len(runs) == (1 + 4 * 3) * 3 and config["federated"]["n_clients"] == 100
    assert {run.partition.groups_per_client for run in runs} == {None, 1, 5, 10, 50}


def test_cifar100_study_file_is_valid_but_for_the_encoder_name(tmp_path):
    # Whatever the branch, every other key of the GPU file must pass: swap in a registered encoder.
    config = yaml.safe_load((ROOT / "experiments" / "cifar100_fedavg.yaml").read_text())
    config["model"].update(encoder="small_cnn", weights="none")
    loaded = load_experiment(write(tmp_path, config))
    assert len(study_runs(loaded)) == 39
