"""The grid's disk projection before step 0 (pipeline/disk_projection.py, pipeline/disk_sizes.py): its arithmetic by
hand, against the bytes a tiny real grid writes, and run_pipeline.py's refusal on a disk too small for the grid."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
from pathlib import Path

import pytest
import yaml

import run_pipeline
from pipeline.argv import flags
from pipeline.command import disk_check, experiment_projection
from pipeline.disk_plans import STAGE_FILES
from pipeline.disk_projection import (MARGIN_FLOOR, Bytes, DiskPlan, PlannedCache, PlannedStage, existing_parent,
                                      project)
from pipeline.disk_probe import run_bytes
from pipeline.disk_sizes import AlgorithmShape, Footprint, ModelCells, ModelSpec, run_files
from pipeline.experiment import load_experiment
from steps import federated as step4
from utils.cli import run_main
from utils.errors import TaskHetError
from utils.stages import run_stage

BODY, HEAD, STATS, FIXED = (False, True, False, False), (True, True, False, False), (False, False, True, False), \
    (False, True, False, True)
# A hand-made model: body parameters 1,000 bytes in 10 tensors, head parameters 100 in 2, BatchNorm statistics 40 in 4.
CELLS = ModelCells({BODY: 1000, HEAD: 100, STATS: 40}, {BODY: 10, HEAD: 2, STATS: 4})
PROBED = frozenset(CELLS.bytes)
RECORD = 10.0  # torch.save's bytes per tensor beyond its data


def shares(body: float, head: float, stats: float) -> Footprint:
    return Footprint({BODY: body, HEAD: head, STATS: stats}, {BODY: body, HEAD: head, STATS: stats}, PROBED)


def fedavg_like() -> AlgorithmShape:
    server = dataclasses.replace(shares(1, 1, 1), other_bytes=20, other_count=1)  # the model and the RNG state
    return AlgorithmShape(server, (shares(1, 1, 1),), shares(1, 1, 1), Footprint(probed=PROBED), (2,), RECORD)


def scaffold_like() -> AlgorithmShape:
    """The model and c (parameters only) on the server; c_i (parameters) per client."""
    server = dataclasses.replace(shares(2, 2, 1), other_bytes=20, other_count=1)
    return AlgorithmShape(server, (shares(2, 2, 1),), shares(1, 1, 1), shares(1, 1, 0), (3,), RECORD)


def test_a_run_files_by_hand_with_and_without_the_client_states():
    fedavg = run_files(fedavg_like(), CELLS, 3, keep_client_state=False, strip_fixed=False)
    # server: 1,140 + 20 bytes of data, 16 + 1 tensors at 10 bytes; best.pt: 1,140 + 160; no client state
    assert (fedavg.finished, fedavg.best, fedavg.during, fedavg.client) == (1330, 1300, 1330, 0)
    assert fedavg.kept() == 2630 and fedavg.peak(3, 10**9) == 2 * 1330 - 1330
    scaffold = run_files(scaffold_like(), CELLS, 3, keep_client_state=False, strip_fixed=False)
    # server: 2,000 + 200 + 40 + 20 bytes, 20 + 4 + 4 + 1 tensors -> 2,550; a client: 1,100 bytes + 12 tensors -> 1,220
    assert (scaffold.finished, scaffold.during, scaffold.client) == (2550, 2550 + 3 * 1220, 1100)
    assert scaffold.kept() == 2550 + 1300
    kept = run_files(scaffold_like(), CELLS, 3, keep_client_state=True, strip_fixed=False)
    assert kept.finished == kept.during == 6210 and kept.kept() == 7510
    # peak: the last checkpoint and its temporary copy, less what the finished run keeps; with 2,200 bytes of memory
    # for states, two of the three stay in memory and one (1,100 bytes) is spilled to disk
    assert scaffold.peak(3, 10**9) == 2 * 6210 - 2550
    assert scaffold.spilled(3, 2200) == 1100 and scaffold.peak(3, 2200) == 2 * 6210 - 2550 + 1100


def test_a_server_that_keeps_a_model_per_client_is_extended_to_the_federation():
    # FedAMP-like: init_server makes 3 models at 2 clients and 4 at 3, so each client adds one model of 1,300 bytes;
    # after the probe's rounds at 2 clients the server holds 3: at 5 clients, 6 models
    at_two, at_three = shares(3, 3, 3), shares(4, 4, 4)
    shape = AlgorithmShape(at_two, (at_two, at_three), shares(1, 1, 1), Footprint(probed=PROBED), (2, 3), RECORD)
    assert run_files(shape, CELLS, 5, False, False).finished == 6 * 1300


def test_a_cell_the_probe_lacks_takes_the_part_share_and_a_frozen_encoder_is_left_out():
    cells = ModelCells({**CELLS.bytes, FIXED: 500}, {**CELLS.counts, FIXED: 5})
    whole = dataclasses.replace(shares(1, 1, 1), overall=1.0, overall_count=1.0)
    assert cells.charge(whole, RECORD) == 1640 + 21 * 10  # the fixed cell at the part's overall share, 1.0
    assert cells.charge(whole, RECORD, strip_fixed=True) == 1140 + 16 * 10


def hand_plan(samples: int | None) -> DiskPlan:
    stages = [PlannedStage("step 2", "centralized/t-*", {"task": "t", "seed": 0, "manifest": "m"}, Bytes(500), 400),
              PlannedStage("step 3", "embeddings/t-*", {"seed": 0}, Bytes(100, 8)),
              PlannedStage("step 4", "federated/t/fedavg/s0-*", {"method": "fedavg", "rand_seed": 0}, Bytes(2630),
                           1330),
              PlannedStage("step 4", "federated/t/scaffold/s0-*", {"method": "scaffold", "rand_seed": 0}, Bytes(3850),
                           9870)]
    return DiskPlan(stages, [PlannedCache("decoded-sample cache", "decoded_", Bytes(per_sample=50))], samples, "hand")


def finish(folder: Path, params: dict) -> None:
    run_stage(folder, params, lambda: (folder / "checkpoint.pt").write_bytes(b"x" * 10))


def test_the_projection_by_hand_leaves_out_a_finished_run(tmp_path):
    out = tmp_path / "exp"
    # FedAvg finished (its manifest elsewhere: paths are not compared); SCAFFOLD started, not finished; a finished
    # stage of another seed in SCAFFOLD's folder is not this one
    finish(out / "federated/t/fedavg/s0-aaa", {"method": "fedavg", "rand_seed": 0, "manifest": "/old/manifest.csv"})
    (out / "federated/t/scaffold/s0-bbb").mkdir(parents=True)
    (out / "federated/t/scaffold/s0-bbb/checkpoint.pt").write_bytes(b"x" * 10)
    finish(out / "federated/t/scaffold/s0-ccc", {"method": "scaffold", "rand_seed": 1})
    (out / "cache/decoded_1").mkdir(parents=True)
    (out / "cache/decoded_1/rgb.npy").write_bytes(b"x" * 120)
    projection = project(hand_plan(samples=10), out, runs_in_flight=2)
    # step 3: 100 + 10 samples × 8; the cache: 10 × 50 less the 120 bytes already there; in flight: SCAFFOLD's peak
    # twice (the largest of the two stages still to run with a peak, at --jobs 2)
    assert projection.parts == {"step 2": 500, "step 3": 180, "step 4": 3850, "decoded-sample cache": 380}
    assert (projection.in_flight, projection.runs_in_flight) == (19740, 2)
    assert (projection.pending, projection.finished) == (3, 1)
    assert projection.total == 500 + 180 + 3850 + 380 + 19740
    assert project(hand_plan(10), out, runs_in_flight=1).in_flight == 9870
    assert project(hand_plan(10), out, runs_in_flight=None).in_flight == 2 * 9870  # Ray without --jobs: every one
    unknown = project(hand_plan(None), out, runs_in_flight=1)
    assert unknown.parts["step 3"] == 100 and unknown.unknown_per_sample == 8 + 50
    assert "not counted: 0.1 KiB per sample" in unknown.line()  # 58 bytes


def test_the_margin_decides_and_the_refusal_names_the_figures(tmp_path):
    projection = project(hand_plan(10), tmp_path / "exp", runs_in_flight=2)
    assert projection.total == 500 + 180 + 2630 + 3850 + 500 + 19740  # nothing done yet: 27,400 bytes, 26.8 KiB
    needed = projection.total + MARGIN_FLOOR  # 10% of a few kilobytes is less than the floor
    dataclasses.replace(projection, free=needed).check(tmp_path / "exp")
    with pytest.raises(TaskHetError, match=r"needs about 26\.8 KiB more in .*exp \(with a margin of 64\.0 MiB: "
                                           r"64\.0 MiB\) but .* has 64\.0 MiB free; .*--no-disk_check"):
        dataclasses.replace(projection, free=needed - 1).check(tmp_path / "exp")


def test_a_results_folder_not_made_yet_is_measured_at_its_nearest_parent(tmp_path):
    assert existing_parent(tmp_path / "new" / "deeper") == tmp_path
    projection = project(DiskPlan([]), tmp_path / "new" / "deeper", runs_in_flight=1)
    assert projection.where == tmp_path and projection.total == 0 and not (tmp_path / "new").exists()


def tiny_config(tmp_path: Path, algorithms: dict) -> dict:
    return {"name": "tiny",
            "data": {"source": "synthetic", "root": str(tmp_path / "data"),
                     "synthetic": {"n_buildings": 4, "n_views": 8, "image_size": 32, "seed": 0},
                     "top_k_classes": 3, "test_fraction": 0.25, "split_by": "sample"},
            "tasks": ["depth_euclidean"], "model": {"encoder": "small_cnn", "weights": "none", "image_size": 32},
            "centralized": {"n_epochs": 1, "batch_size": 8}, "embeddings": {"n_clusters": 3},
            "partition": {"alphas": [1.0], "n_clients": 2}, "heterogeneity_meter": False,
            "federated": {"algorithms": algorithms, "n_rounds": 2, "local_steps": 2, "batch_size": 4},
            "seeds": [0], "use_accelerator": False, "run_plots": False}


def write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def within(real: int, projected: int, tolerance: float = 0.01) -> bool:
    return abs(projected - real) <= tolerance * real


@pytest.mark.slow  # a whole tiny grid and one more step-4 run: 8 s alone, 12 s beside another pytest worker
def test_the_projection_matches_what_a_tiny_grid_writes(tmp_path):
    # Two algorithms of unequal size (SCAFFOLD keeps its c beside the model) on two partitions, one seed.
    experiment = write(tmp_path, tiny_config(tmp_path, {"fedavg": {}, "scaffold": {}}))
    config = load_experiment(experiment)
    before = experiment_projection(config, tmp_path / "results" / "tiny", runs_in_flight=1)
    run_pipeline.main([str(experiment), "--results", str(tmp_path / "results"), "--threads", "1"])
    out = tmp_path / "results" / "tiny"
    spec = ModelSpec("depth_euclidean", "small_cnn", "none", False, None, 32)
    probes: dict = {}
    for algorithm in ("fedavg", "scaffold"):
        size = run_bytes(spec, algorithm, {}, 2, keep_client_state=False, shapes=probes)
        for run in out.glob(f"federated/depth_euclidean/*/a1/{algorithm}/s0-*"):
            # within 1%: the checkpoint's small entries (the run's fingerprint, the model config) are not charged
            assert within((run / "checkpoint.pt").stat().st_size, size.finished), (run, size)
            assert within((run / "best.pt").stat().st_size, size.best), (run, size)
    step2 = next(out.glob("centralized/depth_euclidean-*"))
    real_step2 = sum((step2 / name).stat().st_size for name in ("best.pt", "last.pt"))
    assert within(real_step2, before.parts["step 2"] - STAGE_FILES)
    written = sum(path.stat().st_size for path in out.rglob("*") if path.is_file())
    assert written <= before.total  # an upper bound: 1 MiB of small files is charged per stage
    after = experiment_projection(load_experiment(experiment), out, runs_in_flight=1)
    assert (after.pending, after.total) == (0, 0)  # every stage done: nothing more to write

    # SCAFFOLD's clients' states: the same run again, keeping them (the finished checkpoint is then the one written
    # during the run, with both clients' c_i)
    run = next(out.glob("federated/depth_euclidean/label_based/a1/scaffold/s0-*"))
    params = yaml.safe_load((run / "stage.json").read_text())["params"]
    step4.main(["--out", str(tmp_path / "kept"), *flags(params), "--keep_client_state", "--no-progress", "--no-plots",
                "--threads", "1"])
    kept = run_bytes(spec, "scaffold", {}, 2, keep_client_state=True, shapes=probes)
    assert kept.finished == kept.during > size.finished
    assert within((tmp_path / "kept" / "checkpoint.pt").stat().st_size, kept.finished)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (root may mount one; skipped where it may not), unmounted whatever the test does."""
    disk = tmp_path / "small"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip() or mounted.returncode}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_grid_that_cannot_fit_is_refused_before_anything_is_written(tmp_path, small_disk, capsys):
    experiment = write(tmp_path, tiny_config(tmp_path, {"fedavg": {}, "scaffold": {}}))
    with pytest.raises(SystemExit) as exit_info:
        run_main(run_pipeline.main, [str(experiment), "--results", str(small_disk), "--threads", "1"])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --results: the grid needs about "), err
    assert f"but {small_disk} has 4.0 MiB free" in err[0] and "MiB more in" in err[0]
    assert list(small_disk.iterdir()) == [] and not (tmp_path / "data").exists()  # not even the render


def test_no_disk_check_projects_nothing(tmp_path):
    args = argparse.Namespace(disk_check=False, shard=None)
    assert disk_check(args, None, {}, tmp_path) == {"line": "disk: not checked (--no-disk_check)"}


def test_a_study_kind_without_a_plan_says_so_in_one_line(tmp_path, capsys):
    """The mechanism kind has no disk plan (and no data section): one line, not a KeyError from the input checks."""
    import argparse

    from pipeline.command import disk_check
    from pipeline.executors import ExecutorSettings

    args = argparse.Namespace(disk_check=True, shard=None)
    record = disk_check(args, ExecutorSettings(), {"study": "mechanism"}, tmp_path / "out")
    assert record == {"line": "disk: not projected for study kind 'mechanism'"}
    assert capsys.readouterr().out.strip() == record["line"]
