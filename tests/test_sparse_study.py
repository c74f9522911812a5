"""The sparse fine-tuning study (issue 15): the embedded study end to end at a tiny size (dense FedAvg + every
sparse_ft variant in the report, step 0's unfrozen start), the summary's paired verdicts on hand-made numbers,
the experiment files, and study-file errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

import run_pipeline
from models import list_encoders
from pipeline.experiment import load_experiment
from pipeline.studies.sparse_finetuning import SPARSE_COLUMNS, dense_lines, talos_lines
from pipeline.studies.grid.runs import study_runs
from utils.errors import TaskHetError
from utils.loaders import load_checkpoint

ROOT = Path(__file__).resolve().parent.parent
RULES = ["least_sensitive", "most_sensitive", "lowest_magnitude", "highest_magnitude", "random"]


def tiny_sparse_study() -> dict:
    """digits, small_cnn at 8 px, iid and Nc=1, fedavg + sparse_ft at sparsity 0.5 and 0.9, R=1, two rules."""
    return {
        "name": "tinysparse",
        "study": "sparse_finetuning",
        "data": {"source": "digits", "n_samples": 100, "test_fraction": 0.25},
        "task": "digit_class",
        "model": {"encoder": "small_cnn", "weights": "none", "image_size": 8, "freeze_encoder": True},
        "centralized": {"n_epochs": 1, "batch_size": 16},
        "federated": {"n_clients": 10, "client_fraction": 0.2, "rounds_x_local_steps": 2, "evaluations": 1,
                      "batch_size": 8, "init_lr": 0.05, "init_from": "head"},
        "grid": [{"partitions": [{"scheme": "iid"}, {"scheme": "nc_shards", "groups_per_client": 1}],
                  "local_steps": [2],
                  "algorithms": {"fedavg": {}, "sparse_ft": {"density": [0.5, 0.1], "calibration_rounds": 1,
                                                             "calibration_batches": 1, "input_key": "image",
                                                             "mask_rule": ["least_sensitive", "random"]}}}],
        "seeds": [0, 1],
        "use_accelerator": False,
    }


def write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_tiny_sparse_study_end_to_end(tmp_path, one_thread):
    run_pipeline.main([str(write(tmp_path, tiny_sparse_study())), "--results", str(tmp_path / "results"), "--no-run_plots"])
    out = tmp_path / "results" / "tinysparse"
    report = pd.read_csv(out / "report.csv", keep_default_na=False, na_values=[""])
    assert list(report.columns) == SPARSE_COLUMNS
    # Per partition: dense, then the 4 sparse variants (density × rule, sorted settings); then centralized.
    rows = list(zip(report.partition, report.mask_rule, report.sparsity.round(6)))
    variants = [("dense", 0.0), ("least_sensitive", 0.5), ("random", 0.5), ("least_sensitive", 0.9), ("random", 0.9)]
    assert rows[:-1] == [(partition, *variant) for partition in ("iid", "nc_shards-nc1") for variant in variants]
    assert report.partition.iloc[-1] == "centralized" and (report.n_seeds == 2).all()
    assert report.final_mean.between(0, 1).all() and report.best_val_mean.between(0, 1).all()
    text = (out / "report.md").read_text()
    for phrase in ("Best rule at each sparsity", "least_sensitive − random", "Sparse against dense FedAvg",
                   "Nc=1 (interference)", "Where the claims do not hold", "| nc_shards-nc1 | 1 | 2 | 1 | sparse_ft |"):
        assert phrase in text
    assert (out / "accuracy_vs_sparsity.png").stat().st_size > 0
    assert (out / "accuracy_vs_sparsity_best_val.png").stat().st_size > 0
    # Step 0: the federated runs start from step 2's head with the encoder unfrozen, every seed its own.
    heads = sorted(out.glob("head/s*/best.pt"))
    assert len(heads) == 2
    start = load_checkpoint(heads[0], keys=("model", "model_config"))
    assert start["model_config"]["freeze_encoder"] is False
    central = load_checkpoint(next(out.glob("centralized/*/best.pt")), keys=("model",))
    assert central["model_config"]["freeze_encoder"] is True


def runs_frame(cells: dict) -> pd.DataFrame:
    """Per-run rows as write_report makes them: {(partition, nc, rule, sparsity): [accuracy per seed]}."""
    rows = []
    for (partition, nc, rule, sparsity), values in cells.items():
        sparse = rule != "dense"
        for seed, value in enumerate(values):
            rows.append({"partition": partition, "scheme": "iid" if nc is None else "nc_shards", "nc": nc,
                         "local_steps": 4, "variant": f"{rule}-{sparsity}", "algorithm": "sparse_ft" if sparse else "fedavg",
                         "mask_rule": rule, "sparsity": sparsity, "calibration_rounds": 1 if sparse else None,
                         "extra": "", "seed": seed, "rounds": 10, "final": value, "best_val": float("nan")})
    return pd.DataFrame(rows)


def test_summary_verdicts_are_paired_by_seed_on_hand_made_numbers():
    runs = runs_frame({
        ("iid", None, "dense", 0.0): [0.90, 0.90, 0.90],
        ("iid", None, "least_sensitive", 0.9): [0.91, 0.92, 0.90],  # gain over dense +0.01, +0.02, 0.00
        ("iid", None, "random", 0.9): [0.80, 0.95, 0.70],  # TaLoS − random: +0.11, −0.03, +0.20: not noticeable
        ("nc_shards-nc1", 1, "dense", 0.0): [0.50, 0.52, 0.51],
        ("nc_shards-nc1", 1, "least_sensitive", 0.9): [0.60, 0.60, 0.60],  # gain +0.10, +0.08, +0.09
        ("nc_shards-nc1", 1, "random", 0.9): [0.70, 0.71, 0.69],  # above TaLoS by 0.10, 0.11, 0.09: noticeable
    })
    lines, exceptions = talos_lines(runs[runs.algorithm == "sparse_ft"], "final")
    # TaLoS − random per cell: iid (+0.11 − 0.03 + 0.20)/3 = +0.0933 (interval contains 0), nc1 −0.10 (noticeable);
    # their mean −0.0033.
    # One of two cells decided (half), all decided ones below: a direction. BH over 2: nc1's p = 0.0032 ≤ 0.025.
    assert lines == ["- least_sensitive − random: mean -0.003 over 2 cells; noticeably above in 0, below in 1, undecided "
                     "in 1 (0 with too few seeds, 0 with zero variance, 1 whose interval contains 0); after "
                     "Benjamini–Hochberg over the 2 cells: above in 0, below in 1: least_sensitive is below it."]
    assert len(exceptions) == 1 and "below random at nc_shards-nc1, J=4, R=1, sparsity 0.9 (-0.100" in exceptions[0]
    lines, exceptions = dense_lines(runs, "final")
    text = "\n".join(lines)
    assert "- nc_shards-nc1, J=4: dense 0.510; 2 of 2 sparse variants noticeably above it, 0 below" in text
    assert "least_sensitive beats dense FedAvg noticeably in 1 of 1 settings (sparsity × R): the claim holds." in text
    # Difference in differences: Nc=1 gain (+0.10, +0.08, +0.09) − iid gain (+0.01, +0.02, 0.00) = 0.09, 0.06, 0.09.
    assert "gain over dense at Nc=1 +0.090, on iid +0.010; Nc=1 − iid: +0.080 [" in text
    assert exceptions == []


def test_embedded_sparse_study_file_is_the_documented_grid():
    config = load_experiment(ROOT / "experiments" / "digits_sparse.yaml")
    runs = study_runs(config)
    assert len(runs) == 3 * (1 + 3 * 2 * 5) * 2
    sparse = [dict(run.variant.settings) for run in runs if run.variant.algorithm == "sparse_ft"]
    assert {item["density"] for item in sparse} == {0.5, 0.1, 0.01} and {item["calibration_rounds"] for item in sparse} == {1, 4}
    assert {item["mask_rule"] for item in sparse} == set(RULES)
    assert {run.partition.groups_per_client for run in runs} == {None, 1, 5}


def test_cifar100_sparse_study_file_is_valid(tmp_path):
    config = yaml.safe_load((ROOT / "experiments" / "cifar100_sparse.yaml").read_text())
    assert config["model"]["encoder"] == "vit_s16_dino" and config["model"]["image_size"] == 224
    if "vit_s16_dino" not in list_encoders():
        config["model"].update(encoder="small_cnn", weights="none")
    runs = study_runs(load_experiment(write(tmp_path, config)))
    assert len(runs) == 3 * (1 + 3 * 2 * 5) * 3
    assert {run.partition.groups_per_client for run in runs} == {None, 1, 10}


@pytest.mark.parametrize("change, key", [
    (lambda c: c["model"].update(freeze_encoder=False), "federated.init_from head needs model.freeze_encoder"),
    (lambda c: c["federated"].update(init_from="pretrained"), "federated.init_from"),
    (lambda c: c["federated"].update(calibration_fraction=1.0), "federated.calibration_fraction"),
    (lambda c: c.update(study="sparse"), "study: unknown study kind 'sparse'; choose one of: fed_lt, fedavg_sharding"),
    (lambda c: c["grid"][0]["algorithms"]["sparse_ft"].update(density=[0.5, 1.5]), "grid[0].algorithms.sparse_ft"),
    (lambda c: c["grid"][0]["algorithms"]["sparse_ft"].update(mask_rule=["talos"]), "grid[0].algorithms.sparse_ft"),
])
def test_sparse_study_file_errors_name_the_key(tmp_path, change, key):
    config = tiny_sparse_study()
    change(config)
    with pytest.raises(TaskHetError, match=key.replace("[", r"\[").replace("]", r"\]")):
        load_experiment(write(tmp_path, config))


def test_server_masks_calibrate_on_rows_no_client_holds(tmp_path, one_thread):
    config = tiny_sparse_study()
    config["federated"]["calibration_fraction"] = 0.1
    config["grid"] = [{"partitions": [{"scheme": "nc_shards", "groups_per_client": 1}], "local_steps": [2],
                       "algorithms": {"sparse_ft": {"density": 0.1, "calibration_rounds": 2, "calibration_batches": 1,
                                                    "mask_source": "server", "input_key": "image"}}}]
    config["seeds"] = [0]
    run_pipeline.main([str(write(tmp_path, config)), "--results", str(tmp_path / "results"), "--no-run_plots"])
    out = tmp_path / "results" / "tinysparse"
    full = pd.read_csv(next(out.glob("step1-*/manifest.csv")))
    clients = pd.read_csv(next(out.glob("calibration/s0-*/manifest.csv")))
    held_out = set(full.sample_id) - set(clients.sample_id)
    # 75 training digits, 10 of them validation rows: round(0.1 · 65) = 6 held out, all train and not val.
    assert len(held_out) == 6 and set(full[full.sample_id.isin(held_out)].split) == {"train"}
    assert not full[full.sample_id.isin(held_out)].val.any()
    assignments = pd.read_csv(next(out.glob("assignments/*/assignments.csv")))
    assert not held_out & set(assignments.sample_id)
    report = pd.read_csv(out / "report.csv", keep_default_na=False)
    assert list(report.mask_rule) == ["least_sensitive", ""] and list(report.algorithm) == ["sparse_ft", "centralized"]


def test_the_report_says_why_final_and_best_by_validation_disagree():
    from pipeline.studies.sparse_finetuning import criteria_lines

    runs = runs_frame({("nc_shards-nc1", 1, "dense", 0.0): [0.50, 0.52, 0.51],
                       ("nc_shards-nc1", 1, "least_sensitive", 0.9): [0.60, 0.61, 0.62]})
    dense, talos = runs.mask_rule == "dense", runs.mask_rule == "least_sensitive"
    runs.loc[dense, "best_val"], runs.loc[dense, "best_round"] = [0.878, 0.880, 0.879], 0  # dense's best: its start model
    runs.loc[talos, "best_val"], runs.loc[talos, "best_round"] = [0.879, 0.882, 0.878], [30, 35, 40]
    # Final: TaLoS − dense = +0.10, +0.09, +0.11 (decided above); best by validation: +0.001, +0.002, −0.001 (undecided).
    # Mean best − final: dense (0.378 + 0.360 + 0.369)/3 = 0.369, TaLoS (0.279 + 0.272 + 0.258)/3 = 0.270.
    assert criteria_lines(runs) == [
        "- nc_shards-nc1, J=4, least_sensitive: noticeably above dense in 1 of 1 settings by final accuracy but in 0 of 1 "
        "by best by validation. dense's best validation round is its start model (round 0) in 3 of 3 runs, so its "
        "best-by-validation accuracy is the start model's; it ends 0.369 below that best on average; least_sensitive's "
        "best validation round is round 35 (median over 3 runs); it ends 0.270 below that best on average."]
    runs.loc[talos, "best_val"] = [0.98, 0.99, 0.985]  # now above dense by both criteria: nothing to explain
    assert criteria_lines(runs) == []
