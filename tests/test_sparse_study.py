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
from pipeline.sparse_report import SPARSE_COLUMNS, dense_lines, talos_lines
from pipeline.study import study_runs
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


def test_tiny_sparse_study_end_to_end(tmp_path, one_thread):
    run_pipeline.main([str(write(tmp_path, tiny_sparse_study())), "--results", str(tmp_path / "results")])
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
