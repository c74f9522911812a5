"""run_pipeline.py end to end on a tiny experiment, interrupted and resumed, and its validation."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

import run_pipeline
from models import build_task_model, load_task_model
from pipeline.experiment import load_experiment
from pipeline.fingerprint import fingerprint_line
from pipeline.studies.main_job.report import REPORT_COLUMNS
from utils.errors import TaskHetError

ROOT = Path(__file__).resolve().parent.parent


def tiny_experiment(tmp_path: Path) -> dict:
    return {
        "name": "tiny",
        "data": {"source": "synthetic", "root": str(tmp_path / "data"),
                 "synthetic": {"n_buildings": 4, "n_views": 8, "image_size": 32, "seed": 0},
                 "top_k_classes": 3, "test_fraction": 0.25, "split_by": "sample"},
        "tasks": ["depth_euclidean"],
        "model": {"encoder": "small_cnn", "weights": "none", "image_size": 32},
        "centralized": {"n_epochs": 1, "batch_size": 8},
        "embeddings": {"n_clusters": 3},
        "partition": {"alphas": [1.0], "n_clients": 2},
        "federated": {"algorithms": {"fedavg": {}}, "n_rounds": 2, "local_steps": 2, "batch_size": 4},
        "seeds": [0],
        "use_accelerator": False,
        "run_plots": False,  # each run's own pictures: only test_tiny_experiment_end_to_end draws them
    }


def three_seed_edges(tmp_path: Path) -> dict:
    """The tiny experiment on edges (a task of the paper's answer) with 3 seeds, the fewest a row is decided with, at
    16 px and without the meter (its table has no verdict)."""
    config = tiny_experiment(tmp_path)
    config["tasks"] = ["edge_texture"]
    config["seeds"] = [0, 1, 2]
    config["data"]["synthetic"]["image_size"] = config["model"]["image_size"] = 16
    config["heterogeneity_meter"] = False
    return config


def write_experiment(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def finished_stages(results: Path) -> dict[str, float]:
    return {str(path.parent.relative_to(results)): path.stat().st_mtime_ns for path in results.rglob("stage.json")}


@pytest.mark.slow
def test_tiny_experiment_end_to_end(tmp_path):
    config = tiny_experiment(tmp_path)
    config["federated"]["algorithms"]["fedrep"] = {}
    config["partition"]["iid_reference"] = True
    # A frozen encoder whose maps are cached: steps 2, 3c and 4 share one feature store.
    config["model"].update(freeze_encoder=True, cache_features=True, decoder_width=8)
    config["federated"]["task_init_lr"] = {"depth_euclidean": 0.0123}
    config["federated"]["per_task"] = {"depth_euclidean": {"local_steps": 3, "lr_schedule": "cosine"}}
    config["run_plots"] = True
    experiment = write_experiment(tmp_path, config)
    run_pipeline.main([str(experiment), "--results", str(tmp_path / "results")])
    out = tmp_path / "results" / "tiny"
    for run in (*out.glob("centralized/*/metrics.csv"), *out.glob("federated/**/metrics.csv")):
        assert (run.parent / "curves.png").stat().st_size > 0, run  # each run's own pictures (run_plots)
    assert len(list((out / "cache").glob("encoded_*"))) == 1
    for run_config in out.glob("federated/**/config.json"):
        args = json.loads(run_config.read_text())["args"]
        assert (args["weights"], args["decoder_width"], args["cache_features"]) == ("none", 8, True), run_config
        assert args["init_lr"] == 0.0123, run_config  # the task's own rate, not federated.init_lr
        assert (args["local_steps"], args["lr_schedule"]) == (3, "cosine"), run_config  # federated.per_task
    federated = load_task_model(next(out.glob("federated/**/best.pt")))
    narrow, default = (build_task_model("depth_euclidean", "small_cnn", decoder_width=width) for width in (8, None))
    assert federated.config["decoder_width"] == 8 and federated.decoder.out_channels == narrow.decoder.out_channels
    assert sum(p.numel() for p in narrow.decoder.parameters()) < sum(p.numel() for p in default.decoder.parameters())
    for name in ("report.md", "report.csv", "report_personal.csv", "report_iid.csv", "report_heterogeneity.csv",
                 "loss_vs_alpha.png", "round_curves.png", "partition_heatmaps.png", "cluster_label_agreement.png",
                 "heterogeneity_meter.png"):
        assert (out / name).stat().st_size > 0, name
    iid = pd.read_csv(out / "report_iid.csv")
    assert list(iid.algorithm) == ["fedavg", "fedrep"] and iid.iid_loss_mean.gt(0).all()
    meter = pd.read_csv(out / "report_heterogeneity.csv")
    assert len(meter) == 1 and (meter[["label_g2", "embedding_g2"]] > 0).all(axis=None)
    assert len(list(out.glob("heterogeneity/depth_euclidean/*/meter.json"))) == 2  # label and embedding
    assert "## IID reference" in (out / "report.md").read_text()
    report = pd.read_csv(out / "report.csv")
    assert list(report.columns) == REPORT_COLUMNS
    assert list(report.algorithm) == ["fedavg", "fedrep"] and set(report.task) == {"depth_euclidean"}
    personal = pd.read_csv(out / "report_personal.csv")  # FedRep's own models, from its metrics.csv
    assert list(personal.algorithm) == ["fedrep"] and personal.label_loss_mean.gt(0).all()
    before = finished_stages(out)
    # A rerun redoes nothing, even in a moved results folder (stage keys name no absolute path): one rerun checks both
    (tmp_path / "results").rename(tmp_path / "moved")
    run_pipeline.main([str(experiment), "--results", str(tmp_path / "moved")])
    assert finished_stages(tmp_path / "moved" / "tiny") == before


@pytest.fixture(scope="module")
def sequential_run(tmp_path_factory) -> tuple[Path, Path]:
    """ONE uninterrupted tiny pipeline in this process (fedavg and fedprox, 3 rounds, one torch thread): the
    killed-and-resumed run and the parallel runs are compared with its report, and start from a copy of it.

    Returns (its experiment file, its results folder); both are read-only (tests copy before changing anything).
    """
    base = tmp_path_factory.mktemp("sequential")
    config = tiny_experiment(base)
    config["federated"]["algorithms"]["fedprox"] = {"mu": 0.01}
    config["federated"]["n_rounds"] = 3  # 4 runs x 3 rounds: step 4 outlives its first checkpoint by 11 rounds
    experiment = write_experiment(base, config)
    run_pipeline.main([str(experiment), "--results", str(base / "results"), "--threads", "1"])
    return experiment, base / "results"


def copy_results(sequential_run: tuple[Path, Path], to: Path, *without: str) -> Path:
    """A copy of the shared run's results folder (a moved folder redoes nothing) without the folders ``without`` of
    its experiment and its report; returns the experiment's folder in the copy."""
    shutil.copytree(sequential_run[1], to)
    out = to / "tiny"
    for name in without:
        shutil.rmtree(out / name)
    for report in out.glob("report*"):
        report.unlink()
    return out


@pytest.mark.slow
def test_killed_during_step4_resumes_to_the_same_report(sequential_run, tmp_path):
    experiment, clean = sequential_run
    killed = tmp_path / "killed"
    # A real process killed with SIGKILL in step 4; the rerun may run here. Steps 1-3 are the shared run's (a moved
    # folder redoes nothing), so the process spends its time in steps 3c and 4.
    copy_results(sequential_run, killed, "heterogeneity", "federated")
    command = [sys.executable, "run_pipeline.py", str(experiment), "--results", str(killed), "--threads", "1"]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not list(killed.rglob("federated/**/checkpoint.pt")) and time.time() < deadline and process.poll() is None:
        time.sleep(0.05)
    assert process.poll() is None, "pipeline finished before it could be killed in step 4"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    stages_before = {k: v for k, v in finished_stages(killed / "tiny").items() if "federated" not in k}
    assert not (killed / "tiny" / "report.csv").exists()
    run_pipeline.main([str(experiment), "--results", str(killed), "--threads", "1"])
    stages_after = finished_stages(killed / "tiny")
    assert all(stages_after[name] == mtime for name, mtime in stages_before.items())
    pd.testing.assert_frame_equal(pd.read_csv(killed / "tiny" / "report.csv"), pd.read_csv(clean / "tiny" / "report.csv"))


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda c: c["federated"].update(n_round=3), "federated.n_round"),
        (lambda c: c.update(taks=["normal"]), "taks"),
        (lambda c: c.update(tasks=["depth_metric"]), "depth_metric"),
        (lambda c: c["federated"].update(algorithms={"fedsgdx": {}}), "fedsgdx"),
        (lambda c: c["partition"].update(scheme="dirichlet_mix"), "dirichlet_mix"),
        (lambda c: c.setdefault("model", {}).update(cache_features=True), "model.cache_features needs model.freeze_encoder"),
        (lambda c: c["federated"].update(task_init_lr={"normal": 0.1}), "task_init_lr names task 'normal'"),
        (lambda c: c["federated"].update(task_init_lr={"depth_euclidean": -1}), "task_init_lr.depth_euclidean"),
        (lambda c: c["federated"].update(per_task={"normal": {"local_steps": 3}}), "federated.per_task.normal names task 'normal'"),
        (lambda c: c["federated"].update(per_task={"depth_euclidean": {"batch_size": 0}}),
         "federated.per_task.depth_euclidean.batch_size must be an integer >= 1"),
        (lambda c: c["federated"].update(per_task={"depth_euclidean": {"algorithms": {}}}),
         "federated.per_task.depth_euclidean.algorithms is not a federated key a task may change"),
        (lambda c: c["federated"].update(per_task={"depth_euclidean": {"lr_schedule": "cosin"}}),
         "federated.per_task.depth_euclidean.lr_schedule 'cosin' is not one of"),
        (lambda c: c["federated"].update(per_task={"depth_euclidean": 3}), "federated.per_task.depth_euclidean must map"),
    ],
)
def test_bad_experiment_rejected_before_any_work(tmp_path, edit, named):
    config = tiny_experiment(tmp_path)
    edit(config)
    experiment = write_experiment(tmp_path, config)
    with pytest.raises(TaskHetError, match=named):
        load_experiment(experiment)
    with pytest.raises(TaskHetError):
        run_pipeline.main([str(experiment), "--results", str(tmp_path / "results")])
    assert not (tmp_path / "results").exists() and not (tmp_path / "data").exists()


def test_shipped_experiment_files_are_valid():
    for name in ("demo.yaml", "paper.yaml", "mechanism.yaml", "paper_mechanism.yaml"):
        config = load_experiment(ROOT / "experiments" / name)
        assert json.dumps(config)


@pytest.mark.slow
def test_the_answer_does_not_depend_on_the_thread_count(tmp_path):
    """Floating-point sums differ with the number of threads, and training carries the last bits into another
    model; the pipeline trains on one thread whatever --threads says, so its reports are the same to the last bit."""
    import torch

    config = three_seed_edges(tmp_path)  # sums of any size differ with the thread count
    experiment = write_experiment(tmp_path, config)
    previous = torch.get_num_threads()
    try:
        reports, answers = {}, {}
        for threads in (1, 2):
            run_pipeline.main([str(experiment), "--results", str(tmp_path / f"threads{threads}"), "--threads", str(threads)])
            reports[threads] = pd.read_csv(tmp_path / f"threads{threads}" / "tiny" / "report.csv")
            answers[threads] = pd.read_csv(tmp_path / f"threads{threads}" / "tiny" / "report_paper.csv")
    finally:
        torch.set_num_threads(previous)
    pd.testing.assert_frame_equal(reports[1], reports[2], check_exact=True)
    pd.testing.assert_frame_equal(answers[1], answers[2], check_exact=True)
    assert len(answers[1]) > 0  # the paper's table too
    # The steps that sum gradients ran one thread at --threads 2; step 3 (embeddings and clusters) took the two.
    ran_with = {folder: {json.loads(path.read_text())["args"]["threads"] for path in
                         (tmp_path / "threads2" / "tiny" / folder).glob("*/**/config.json")}
                for folder in ("centralized", "embeddings", "federated")}
    assert ran_with == {"centralized": {1}, "embeddings": {2}, "federated": {1}}
    assert_every_seed_draws_its_own_reference_and_clusters(tmp_path / "threads1" / "tiny", seeds=[0, 1, 2])
    # The report names the code and the experiment that made it, as the check of pasted results recomputes them.
    report = (tmp_path / "threads1" / "tiny" / "report.md").read_text().splitlines()
    assert report[2] == fingerprint_line(load_experiment(experiment))


def nudge_by_one_ulp(checkpoint: Path) -> None:
    """Every float weight of a step-2 checkpoint moved to the next float up (a different CPU's last bits)."""
    import torch

    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    state["model"] = {name: torch.nextafter(value, torch.full_like(value, float("inf"))) if value.is_floating_point()
                      else value for name, value in state["model"].items()}
    torch.save(state, checkpoint)


@pytest.mark.slow
def test_verdicts_survive_a_one_ulp_change_of_every_centralized_model(tmp_path):
    """Another CPU trains a centralized model that differs in the last bits; the verdicts must not follow them."""
    config = three_seed_edges(tmp_path)
    experiment = write_experiment(tmp_path, config)
    run_pipeline.main([str(experiment), "--results", str(tmp_path / "results")])
    out = tmp_path / "results" / "tiny"
    before = {name: pd.read_csv(out / name) for name in ("report.csv", "report_paper.csv")}
    embeddings_before = {path.parent.name: np.load(path) for path in out.glob("embeddings/*/embeddings.npy")}
    for checkpoint in out.glob("centralized/*/best.pt"):
        nudge_by_one_ulp(checkpoint)
    run_pipeline.main([str(experiment), "--results", str(tmp_path / "results")])
    after = {name: pd.read_csv(out / name) for name in ("report.csv", "report_paper.csv")}
    # Step 3 ran again on the nudged weights (its key hashes best.pt) and its embeddings moved.
    embeddings_after = {path.parent.name: np.load(path) for path in out.glob("embeddings/*/embeddings.npy")}
    fresh = [name for name in embeddings_after if name not in embeddings_before]
    assert len(fresh) == 3
    assert all(not np.array_equal(embeddings_after[name], old) for name in fresh for old in embeddings_before.values()
               if old.shape == embeddings_after[name].shape)
    assert len(after["report_paper.csv"]) > 0
    for name in before:
        assert list(before[name].verdict) == list(after[name].verdict), name


def assert_every_seed_draws_its_own_reference_and_clusters(out: Path, seeds: list[int]) -> None:
    """One step-2 model and one clustering per seed, and each seed's embedding-based partitions built from the
    clusters of that seed's model (so the intervals over seeds cover the centralized model and KMeans too)."""
    def args(folder: Path) -> dict:
        return json.loads((folder / "config.json").read_text())["args"]

    models = {args(folder)["seed"]: folder for folder in (out / "centralized").iterdir()}
    clusters = {args(folder)["seed"]: folder for folder in (out / "embeddings").iterdir()}
    assert sorted(models) == sorted(clusters) == seeds
    for seed, folder in clusters.items():
        assert Path(args(folder)["checkpoint"]) == models[seed] / "best.pt"
    partitions = [folder for folder in (out / "assignments").rglob("embedding_based-*") if folder.is_dir()]
    assert partitions
    for folder in partitions:
        assert Path(args(folder)["groups"]).parent == clusters[args(folder)["seed"]]


@pytest.mark.slow
def test_parallel_federated_runs_give_the_report_of_sequential_ones(sequential_run, tmp_path, capsys):
    experiment, sequential = sequential_run
    # Steps 1-3 come from the sequential run (only steps 3c and 4 go to the worker pool): they are redone in parallel.
    copy_results(sequential_run, tmp_path / "parallel", "heterogeneity", "federated")
    capsys.readouterr()
    run_pipeline.main([str(experiment), "--results", str(tmp_path / "parallel"), "--threads", "1", "--jobs", "2"])
    # The meter's readings went through the worker pool too (before the federated runs).
    assert "step 3c: 2 readings; step 4: 4 runs, 2 at a time in worker processes" in capsys.readouterr().out
    for report in ("report.csv", "report_heterogeneity.csv"):
        reports = [pd.read_csv(path / "tiny" / report) for path in (sequential, tmp_path / "parallel")]
        pd.testing.assert_frame_equal(*reports)  # one thread each: the same arithmetic in either process
    assert len(list((tmp_path / "parallel" / "tiny").glob("federated/**/stage.json"))) == 4  # 2 groupings x 2 algorithms
    # run_plots: false: no stage drew its own pictures, in this process (steps 2, 3b) or in a worker (step 4)
    assert not list((tmp_path / "parallel" / "tiny").glob("centralized/*/*.png"))
    assert not list((tmp_path / "parallel" / "tiny").glob("federated/**/*.png"))
    assert not list((tmp_path / "parallel" / "tiny").glob("assignments/**/*.png"))  # step 3b, in this process


@pytest.mark.slow
def test_a_failing_parallel_run_stops_the_pipeline_with_its_error(sequential_run, tmp_path):
    experiment, _ = sequential_run
    config = yaml.safe_load(experiment.read_text())  # the shared run's data and steps 1-3
    config["federated"]["init_from"] = "centralized"
    config["heterogeneity_meter"] = False
    experiment = write_experiment(tmp_path, config)
    results = tmp_path / "results"
    out = copy_results(sequential_run, results, "federated")
    # Steps 1-3 stay done; only step 4, in a worker process, reads the now unfinished step-2 checkpoint.
    (next(out.glob("centralized/*/best.pt")).parent / "INCOMPLETE").write_text("step 2")
    with pytest.raises(TaskHetError, match="INCOMPLETE|unfinished|did not finish"):
        run_pipeline.main([str(experiment), "--results", str(results), "--jobs", "2", "--threads", "1"])
    assert not (out / "report.csv").exists()
    assert not list(out.glob("federated/**/stage.json"))  # the steps 1-3 skipped: no run of the new setting finished


def test_no_report_value_is_selected_on_the_test_split(sequential_run, tmp_path):
    """The centralized reference is the test loss at the epoch the validation rows chose (never the test split's
    own minimum), and every federated number is its run's last round; a crafted step-2 curve whose validation and
    test minima fall in different epochs tells the two apart."""
    from pipeline.run_results import centralized_reference

    out = sequential_run[1] / "tiny"
    report = pd.read_csv(out / "report.csv")
    (step2,) = out.glob("centralized/*/metrics.csv")
    metrics = pd.read_csv(step2)
    loss = metrics[metrics.metric == "loss"].pivot_table(index="epoch", columns="split", values="value")
    assert {"val", "test"} <= set(loss.columns)
    assert (report.centralized_loss == loss.test[loss.val.idxmin()]).all()
    for run in out.glob("federated/*/*/*/*/s*/metrics.csv"):
        task, grouping, alpha, algorithm = run.parts[-6:-2]
        rows = pd.read_csv(run)
        test = rows[(rows.split == "test") & (rows.metric == "loss")]
        last = test[test["round"] == test["round"].max()].value.item()
        if grouping == "iid":
            continue  # the iid reference has its own table, read from the same last round
        row = report[(report.task == task) & (report.algorithm == algorithm) & (report.alpha == float(alpha[1:]))]
        assert row[f"{grouping.split('_')[0]}_loss_mean"].item() == pytest.approx(last, rel=1e-12)
    crafted = tmp_path / "metrics.csv"
    pd.DataFrame([{"epoch": epoch, "split": split, "metric": "loss", "value": value}
                  for epoch, values in enumerate([(1.0, 1.0), (0.5, 0.9), (0.7, 0.4)])
                  for split, value in zip(("val", "test"), values)]).to_csv(crafted, index=False)
    assert centralized_reference(crafted) == (0.9, "val")  # epoch 1 by validation, not epoch 2's lower test loss


def test_embeddings_allow_untrained_reaches_step_3_as_a_flag_not_a_stage_key(tmp_path):
    """embeddings.allow_untrained: true adds step 3's --allow_untrained (a best.pt of epoch 0 is refused otherwise),
    and changes neither the stage folder nor its parameters: it decides whether step 3 runs, not what it writes."""
    from pipeline.runner import Pipeline
    from pipeline.studies.main_job.runner import MainJob

    (tmp_path / "s2").mkdir()
    for name in ("manifest.csv", "s2/best.pt"):  # the stage key hashes step 3's input files
        (tmp_path / name).write_text(name)
    called = {}
    for allowed in (False, True):
        config = tiny_experiment(tmp_path)
        config["embeddings"]["allow_untrained"] = allowed
        job = MainJob(Pipeline(load_experiment(write_experiment(tmp_path, config)), tmp_path / "results", "c"))
        job.pipeline.step = lambda name, stage_dir, params, script, argv: (stage_dir, params, argv)
        called[allowed] = job.clusters("depth_euclidean", 0, tmp_path / "data", tmp_path / "manifest.csv",
                                       tmp_path / "s2")
    (off_dir, off_params, off_argv), (on_dir, on_params, on_argv) = called[False], called[True]
    assert (on_dir, on_params) == (off_dir, off_params) and "allow_untrained" not in on_params
    assert "--allow_untrained" not in off_argv and on_argv == [*off_argv, "--allow_untrained"]


@pytest.mark.slow
def test_the_positive_control_partitions_by_the_target_property_and_reports_apart(tmp_path):
    config = three_seed_edges(tmp_path)
    config["partition"]["groupings"] = ["label_based", "embedding_based", "property_based"]
    experiment = write_experiment(tmp_path, config)
    run_pipeline.main([str(experiment), "--results", str(tmp_path / "results")])
    out = tmp_path / "results" / "tiny"
    property_dirs = list(out.glob("property/edge_texture-*"))
    assert len(property_dirs) == 1  # the data's own property: one binning per task, no seed
    groups = property_dirs[0] / "groups.csv"
    partitions = sorted(out.glob("assignments/edge_texture/property_based-*"))
    assert len(partitions) == 3  # one α, three seeds
    for folder in partitions:
        assert Path(json.loads((folder / "config.json").read_text())["args"]["groups"]) == groups
    control = pd.read_csv(out / "report_control.csv")
    assert list(control.task) == ["edge_texture"] and list(control.algorithm) == ["fedavg"]
    assert control.n_seeds.tolist() == [3] and control.verdict.isin(["detected", "not detected"]).all()
    report = (out / "report.md").read_text()
    assert "## Positive control" in report and "Positive control (clients drawn from quantile bins" in report
    # The answer's own table still compares embedding- with label-based partitions only.
    assert set(pd.read_csv(out / "report_paper.csv").task) == {"edge_texture"}
    assert len(pd.read_csv(out / "report.csv")) == 1


def test_the_positive_control_needs_dense_tasks(tmp_path):
    config = tiny_experiment(tmp_path)
    config["tasks"] = ["class_scene"]
    config["partition"]["groupings"] = ["label_based", "embedding_based", "property_based"]
    with pytest.raises(TaskHetError, match="property_based.*class_scene.*classification task"):
        load_experiment(write_experiment(tmp_path, config))
