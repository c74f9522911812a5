"""Experiment and study files: grid limits, duplicate values and every check made before step 0. Each refused file
must leave the results folder without a single step folder, and its one line names the YAML key (not a step's
command-line flag)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

import run_pipeline
from pipeline.experiment import load_experiment
from pipeline.sections import MAX_RUNS
from pipeline.studies.grid.runs import study_runs
from tests.test_study import tiny_study, write
from utils.errors import TaskHetError

FEDAVG_FLOATS = ("server_lr", "server_momentum", "server_beta1", "server_beta2", "server_tau")


def tiny_experiment(tmp_path: Path) -> dict:
    """A digits main-job file (the shape of tests/test_digits.py's), never run to the end here."""
    return {"name": "tinyexp", "data": {"source": "digits", "n_samples": 60, "test_fraction": 0.25},
            "tasks": ["digit_class"], "model": {"encoder": "small_cnn", "weights": "none", "image_size": 8},
            "centralized": {"n_epochs": 1, "batch_size": 16},
            "embeddings": {"n_clusters": 3},
            "partition": {"alphas": [1.0], "n_clients": 3},
            "federated": {"algorithms": {"fedavg": {}}, "n_rounds": 1, "local_steps": 1, "batch_size": 8},
            "seeds": [0], "use_accelerator": False}


def refused(tmp_path: Path, config: dict, message: str) -> None:
    """run_pipeline.py refuses the file with ``message`` and writes nothing under --results."""
    path = write(tmp_path, config, "refused.yaml")
    results = tmp_path / "results"
    with pytest.raises(TaskHetError, match=message):
        run_pipeline.main([str(path), "--results", str(results)])
    written = sorted(str(item.relative_to(results)) for item in results.rglob("*")) if results.exists() else []
    assert written == [], f"a refused file still wrote {written}"


# ----- item 9: the grid is counted before it is expanded
def test_a_huge_study_grid_is_refused_with_its_count_before_anything_expands_it(tmp_path):
    config = tiny_study(tmp_path)
    sixty = [round(0.01 * (index + 1), 2) for index in range(60)]
    config["grid"] = [{"partitions": [{"scheme": "iid"}], "local_steps": [1],
                       "algorithms": {"fedavg": {name: list(sixty) for name in FEDAVG_FLOATS}}}]
    start = time.perf_counter()
    # 60^5 variants × 2 seeds, counted from the list lengths
    refused(tmp_path, config, f"asks for 1,555,200,000 federated runs .* above the limit of {MAX_RUNS:,} runs per file")
    assert time.perf_counter() - start < 30  # nothing was expanded (expanding took a MemoryError)


@pytest.mark.slow
def test_the_study_limit_admits_exactly_max_runs(tmp_path):
    config = tiny_study(tmp_path)
    config["seeds"] = [0, 1]
    lrs = [round(0.001 * (index + 1), 3) for index in range(100)]
    momenta = [round(0.01 * index, 2) for index in range(MAX_RUNS // 200)]  # 100 × 50 × 2 seeds = MAX_RUNS
    config["grid"] = [{"partitions": [{"scheme": "iid"}], "local_steps": [1],
                       "algorithms": {"fedavg": {"server_lr": lrs, "server_momentum": momenta}}}]
    assert len(study_runs(load_experiment(write(tmp_path, config)))) == MAX_RUNS
    config["grid"][0]["algorithms"]["fedprox"] = {}  # one variant more per seed: 10,002
    with pytest.raises(TaskHetError, match=f"asks for {MAX_RUNS + 2:,} federated runs"):
        load_experiment(write(tmp_path, config))


def test_a_huge_experiment_grid_is_refused_with_its_count(tmp_path):
    config = tiny_experiment(tmp_path)
    config["partition"]["alphas"] = [round(0.01 * (index + 1), 2) for index in range(60)]
    config["seeds"] = list(range(60))
    config["federated"]["algorithms"] = {"fedavg": {}, "fedprox": {}, "scaffold": {}}
    # 1 task × 2 groupings × 60 α × 3 algorithms × 60 seeds = 21,600
    refused(tmp_path, config, "asks for 21,600 federated runs")


@pytest.mark.parametrize("values, shown", [(["0.1", 0.1], "0.1"), ([1, "1.0", 2], "1.0"), (["1e-3", 0.001], "0.001")])
def test_a_setting_list_with_one_value_spelled_twice_is_refused_naming_the_key(tmp_path, values, shown):
    config = tiny_study(tmp_path)
    config["grid"][0]["algorithms"] = {"fedavg": {"server_lr": values}}
    refused(tmp_path, config, rf"grid\[0\].algorithms.fedavg.server_lr lists the value {shown} twice")


def test_a_bool_or_int_setting_spelled_twice_is_refused(tmp_path):
    config = tiny_study(tmp_path)
    config["grid"][0]["algorithms"] = {"ifca": {"n_cluster_models": [2, 2.0]}}
    refused(tmp_path, config, r"grid\[0\].algorithms.ifca.n_cluster_models lists the value 2 twice")
    config["grid"][0]["algorithms"] = {"sparse_ft": {"keep_local_models": [True, "true"]}}
    refused(tmp_path, config, r"grid\[0\].algorithms.sparse_ft.keep_local_models lists the value True twice")


def test_seeds_or_partitions_listed_twice_are_refused(tmp_path):
    config = tiny_study(tmp_path)
    config["seeds"] = [0, 1, 0]
    refused(tmp_path, config, r"seeds lists an item twice")
    config = tiny_study(tmp_path)
    config["grid"][0]["partitions"] = [{"scheme": "dirichlet_split", "alpha": "0.5"},
                                       {"scheme": "dirichlet_split", "alpha": 0.5}]
    refused(tmp_path, config, r"grid\[0\].partitions lists an item twice")
    config = tiny_experiment(tmp_path)
    config["seeds"] = [3, 3]
    refused(tmp_path, config, r"seeds lists an item twice")


# ----- item 12 and issue 24: every check a step would make from its arguments runs before step 0
def experiment_with(tmp_path, change) -> dict:
    config = tiny_experiment(tmp_path)
    change(config)
    return config


def study_with(tmp_path, change) -> dict:
    config = tiny_study(tmp_path)
    change(config)
    return config


LATE_CHECKS = {
    # step 2: the encoder's weights
    "weights name": (lambda c: c["model"].update(weights="imagenet"),
                     r"model.weights imagenet: encoder small_cnn has no imagenet weights"),
    "weights file": (lambda c: c["model"].update(encoder="resnet18", weights="no/such/weights.safetensors"),
                     r"model.weights: no/such/weights.safetensors is not a file"),
    # step 2: its schedule and feature cache
    "warmup": (lambda c: c["centralized"].update(n_epochs=2, warmup_epochs=2),
               r"centralized.warmup_epochs 2 must be below centralized.n_epochs 2"),
    "cache without freeze": (lambda c: c["model"].update(cache_features=True),
                             r"model.cache_features needs model.freeze_encoder: true"),
    # step 1: digits' subsample
    "digits size": (lambda c: c["data"].update(n_samples=5000), r"data.n_samples must be between 20 and 1797"),
}
EXPERIMENT_ONLY = {
    # step 3b: the scheme's own parameters and the family's natural owners
    "size skew": (lambda c: c["partition"].update(scheme="nc_shards", size_skew="lognormal:1"),
                  r"partition: nc_shards: client sizes are equal by construction; partition.size_skew cannot be combined"),
    "natural on digits": (lambda c: c["partition"].update(scheme="natural"),
                          r"partition: scheme natural needs each sample's natural owner, which data family digits"),
    # step 4: the algorithm against the clients and the calibration split
    "ifca clusters": (lambda c: c["federated"].update(algorithms={"ifca": {"n_cluster_models": 4}}),
                      r"federated.algorithms.ifca: ifca setting n_cluster_models must be <= the number of clients "
                      r"\(3\), got 4 \(partition.n_clients\)"),
    "server masks": (lambda c: c["federated"].update(algorithms={"sparse_ft": {"mask_source": "server"}}),
                     r"federated.algorithms.sparse_ft: mask_source server calibrates on held-out train rows; an "
                     r"experiment file has no calibration split"),
    # folder names: two α printed alike
    "alpha labels": (lambda c: c["partition"].update(alphas=[0.1, 0.1000001]),
                     r"partition.alphas 0.1 and 0.1000001 both print as α=0.1"),
}
STUDY_ONLY = {
    "groups per client": (lambda c: c["grid"][1]["partitions"][1].update(groups_per_client=11),
                          r"grid\[1\].partitions\[1\]: nc_shards groups_per_client 11 exceeds the 10 labels data.source "
                          r"digits can have"),
    "natural on digits": (lambda c: c["grid"][0].update(partitions=[{"scheme": "natural"}]),
                          r"grid\[0\].partitions\[0\]: scheme natural needs each sample's natural owner"),
    "ifca clusters": (lambda c: c["grid"][0].update(algorithms={"ifca": {"n_cluster_models": [2, 11]}}),
                      r"grid\[0\].algorithms.ifca: ifca setting n_cluster_models must be <= the number of clients "
                      r"\(10\), got 11 \(federated.n_clients\)"),
    "server masks": (lambda c: c["grid"][0].update(algorithms={"sparse_ft": {"mask_source": "server"}}),
                     r"grid\[0\].algorithms.sparse_ft: mask_source server calibrates on held-out train rows; set "
                     r"federated.calibration_fraction"),
}


# Steps 3b and 4 check these from their arguments only when they run, after steps 1-3: the pipeline runs the steps'
# own checks on every partition and run before step 0, and names the key of the file.
def first_partition(change):
    return lambda c: c["grid"][0]["partitions"][0].update(change)


STAGE_CHECKS_STUDY = {
    "feature noise nan": (first_partition({"feature_noise": float("nan")}),
                          r"grid\[0\].partitions\[0\].feature_noise: .*must be a number in \[0, 10\]"),
    "temporal without rounds per phase": (first_partition({"scheme": "dirichlet_mixture", "alpha": 0.5,
                                                           "temporal": "rotate:3"}),
                                          r": grid\[0\].partitions\[0\].temporal 'rotate:3': use "),
    "label swap of a class with itself": (first_partition({"label_swap": "0-0"}),
                                          r": grid\[0\].partitions\[0\].label_swap"),
    "label swap of a class digits lacks": (first_partition({"label_swap": "3-12"}),
                                           r": grid\[0\].partitions\[0\].label_swap must be an integer in \[0, 9\], got 12"),
    "target variant the family lacks": (first_partition({"target_variant": "depth_euclidean:depth_zbuffer"}),
                                        r": grid\[0\].partitions\[0\].target_variant: 'depth_euclidean' is not a task of data family 'digits'"),
    "blur beyond its limit": (first_partition({"feature_shift": "blur=99"}),
                              r": grid\[0\].partitions\[0\].feature_shift .*blur"),
    "fedem components": (lambda c: c["grid"][0].update(algorithms={"fedem": {"n_components": 100000000}}),
                         r"grid\[0\].algorithms.fedem.n_components: fedem setting n_components must be at most 64"),
    "capped below 1/N": (lambda c: c["grid"][0].update(algorithms={"fedavg": {"weighting": "capped", "cap": 0.05}}),
                         r"grid\[0\].algorithms.fedavg: .*cap"),
    "schedule longer than the runs": (first_partition({"scheme": "dirichlet_mixture", "alpha": 0.5,
                                                       "temporal": "rotate:2:3", "n_rounds": 6}),
                                      r"grid\[0\] \(dirichlet_mixture.*J=1\): temporal schedule 'rotate:2:3' runs from "
                                      r"round 1 to round 6 .* federated.rounds_x_local_steps / J gives the federated runs 2 "
                                      r"rounds"),
}
STAGE_CHECKS_EXPERIMENT = {
    "feature noise nan": (lambda c: c["partition"].update(skews={"feature_noise": ".nan"}),
                          r": partition.skews.feature_noise: must be a number in \[0, 10\], got '.nan'$"),
    "blur beyond its limit": (lambda c: c["partition"].update(skews={"feature_shift": "blur=99"}),
                              r": partition.skews.feature_shift blur must be a finite number in \[0, 10\], got 99.0"),
    "capped below 1/N": (lambda c: c["federated"].update(algorithms={"fedavg": {"weighting": "capped", "cap": 0.2}}),
                         r"federated \(digit_class, fedavg\): .*cap"),
    "a task's rounds shorter than its schedule": (
        lambda c: (c["partition"].update(temporal="rotate:2:1"), c["federated"].update(n_rounds=2),
                   c["federated"].update(per_task={"digit_class": {"n_rounds": 1}})),
        r"partition.temporal: temporal schedule 'rotate:2:1' .* but federated.per_task.digit_class.n_rounds gives the "
        r"federated runs 1 rounds"),
}


@pytest.mark.parametrize("name", list(STAGE_CHECKS_STUDY))
def test_a_study_partition_or_algorithm_the_steps_would_refuse_is_refused_before_step_0(tmp_path, name):
    change, message = STAGE_CHECKS_STUDY[name]
    refused(tmp_path, study_with(tmp_path, change), message)


@pytest.mark.parametrize("name", list(STAGE_CHECKS_EXPERIMENT))
def test_an_experiment_partition_or_run_the_steps_would_refuse_is_refused_before_step_0(tmp_path, name):
    change, message = STAGE_CHECKS_EXPERIMENT[name]
    refused(tmp_path, experiment_with(tmp_path, change), message)


@pytest.mark.parametrize("key, value, message", [
    ("federated.n_rounds", 10**20, r"federated.n_rounds must be an integer >= 1 <= 10000"),
    ("centralized.n_epochs", 10**9, r"centralized.n_epochs must be an integer >= 1 <= 10000"),
    ("partition.alphas", [1e200], r"partition.alphas\[0\] must be a finite number > 0 and <= 1e\+06"),
    ("federated.momentum", 1.0, r"federated.momentum must be a finite number >= 0 and < 1"),
    ("seeds", [2**64], r"seeds\[0\] must be an integer >= 0 <= 9223372036854775807"),
])
def test_every_number_of_an_experiment_file_has_a_finite_range(tmp_path, key, value, message):
    config = tiny_experiment(tmp_path)
    section, _, leaf = key.rpartition(".")
    (config[section] if section else config)[leaf] = value
    refused(tmp_path, config, message)


@pytest.mark.parametrize("name", [*LATE_CHECKS, *EXPERIMENT_ONLY])
def test_an_experiment_file_is_refused_before_step_0(tmp_path, name):
    change, message = {**LATE_CHECKS, **EXPERIMENT_ONLY}[name]
    refused(tmp_path, experiment_with(tmp_path, change), message)


@pytest.mark.parametrize("name", [*LATE_CHECKS, *STUDY_ONLY])
def test_a_study_file_is_refused_before_step_0(tmp_path, name):
    change, message = {**LATE_CHECKS, **STUDY_ONLY}[name]
    refused(tmp_path, study_with(tmp_path, change), message)


@pytest.mark.parametrize("make", [tiny_experiment, tiny_study])
def test_missing_cifar_files_are_refused_before_step_0(tmp_path, make):
    config = make(tmp_path)
    config["data"] = {"source": "cifar10", "root": str(tmp_path / "no_cifar")}
    config["tasks" if "tasks" in config else "task"] = ["cifar_class"] if "tasks" in config else "cifar_class"
    refused(tmp_path, config, r"data.root .*no_cifar: cifar10 files missing: .*data_batch_1.*make download-cifar")


def test_the_checks_pass_a_valid_file_and_the_shipped_ones(tmp_path):
    load_experiment(write(tmp_path, tiny_experiment(tmp_path)))
    load_experiment(write(tmp_path, tiny_study(tmp_path)))
    for path in sorted((Path(__file__).resolve().parent.parent / "experiments").glob("*.yaml")):
        load_experiment(path)


def test_two_learning_rates_that_share_a_search_folder_are_refused():
    from training.search import grid

    with pytest.raises(TaskHetError, match=r"lr 0.1, weight decay 0.0001 and lr 0.1000001, weight decay 0.0001 both "
                                           r"map to the run folder lr0.1-wd0.0001-cosine"):
        grid([0.1, 0.1000001], [1e-4], ["cosine"])
    with pytest.raises(TaskHetError, match=r"both map to the run folder lr0.01-wd1e-05-cosine"):
        grid([0.01], [1e-5, 1.0000001e-5], ["cosine"])
    assert [config.name for config in grid([0.1, 0.11], [0.0], ["cosine"])] == ["lr0.1-wd0-cosine", "lr0.11-wd0-cosine"]


# ----- item 13: a study honours --jobs with the main job's worker pool
@pytest.mark.slow
def test_a_study_runs_its_federated_grid_jobs_at_a_time_with_the_sequential_result(tmp_path, capsys):
    import pandas as pd

    config = tiny_study(tmp_path)
    config["grid"] = [{"partitions": [{"scheme": "iid"}], "local_steps": [1], "algorithms": {"fedavg": {}}}]
    study = write(tmp_path, config)
    run_pipeline.main([str(study), "--results", str(tmp_path / "sequential"), "--threads", "1", "--no-run_plots"])
    assert "2 at a time" not in capsys.readouterr().out
    # Steps 1-3b from the sequential run (a moved results folder redoes nothing): only step 4 goes to the pool.
    shutil.copytree(tmp_path / "sequential", tmp_path / "parallel")
    shutil.rmtree(tmp_path / "parallel" / "tinystudy" / "federated")
    for report in (tmp_path / "parallel" / "tinystudy").glob("report*"):
        report.unlink()
    run_pipeline.main([str(study), "--results", str(tmp_path / "parallel"), "--threads", "1", "--jobs", "2", "--no-run_plots"])
    assert "step 4: 2 runs, 2 at a time" in capsys.readouterr().out  # the worker pool ran them, not this process
    sequential, parallel = (pd.read_csv(tmp_path / kind / "tinystudy" / "report.csv") for kind in ("sequential", "parallel"))
    pd.testing.assert_frame_equal(sequential, parallel)
    runs = sorted(path.relative_to(tmp_path / "parallel") for path in (tmp_path / "parallel").rglob("federated/**/stage.json"))
    assert len(runs) == 2
