"""Server-side mask calibration (issue 15, mode a): the held-out split, the engine hook, and step 4 end to end."""

from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import pytest
import torch

import test_fed
from datasets.taskonomy import read_manifest
from network.algorithms.sparse_finetune import MASK_PREFIX, SparseFinetune
from network.calibration_split import calibration_ids
from partitioning.assignments import write_assignments
from sparse.calibration import mask_density
from steps.merge import main as merge_main
from tests.fixtures import tiny_data_root, tiny_manifest  # noqa: F401  (session fixtures)
from tests.test_engine import global_test, make_engine
from tests.test_step4 import argv
from utils.errors import TaskHetError
from utils.run_dir import load_checkpoint

MANIFEST = pd.DataFrame({"sample_id": [f"s{index}" for index in range(12)], "split": ["train"] * 10 + ["test"] * 2})
ASSIGNED = pd.DataFrame({"sample_id": ["s0", "s1", "s2", "s3", "s4", "s5"]})  # s6..s9 are free


def test_the_split_draws_its_size_from_the_free_train_rows_seeded_and_in_manifest_order():
    chosen = calibration_ids(MANIFEST, ASSIGNED, 0.2, seed=3)  # round(0.2 · 10 train rows) = 2
    assert len(chosen) == 2 and set(chosen) <= {"s6", "s7", "s8", "s9"}
    assert chosen == sorted(chosen, key=lambda name: int(name[1:]))
    assert calibration_ids(MANIFEST, ASSIGNED, 0.2, seed=3) == chosen
    assert {tuple(calibration_ids(MANIFEST, ASSIGNED, 0.2, seed=seed)) for seed in range(20)} != {tuple(chosen)}
    assert calibration_ids(MANIFEST, ASSIGNED, 0.4, seed=0) == ["s6", "s7", "s8", "s9"]  # all 4 free rows
    assert calibration_ids(MANIFEST, ASSIGNED, 0.0, seed=0) == []


def test_a_split_larger_than_the_free_rows_or_a_bad_fraction_is_one_clear_error():
    with pytest.raises(TaskHetError, match="needs 5 of the manifest's 10 train rows .* leave 4"):
        calibration_ids(MANIFEST, ASSIGNED, 0.5, seed=0)
    with pytest.raises(TaskHetError, match=r"must be in \[0, 1\), got 1.0"):
        calibration_ids(MANIFEST, ASSIGNED, 1.0, seed=0)


class CountingSparseFinetune(SparseFinetune):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def calibrate_server(self, server, model, batches, device):
        self.calls += 1
        return super().calibrate_server(server, model, batches, device)


def test_the_engine_calibrates_once_before_round_1_and_a_resume_keeps_the_masks(tmp_path):
    settings = {"mask_source": "server", "density": 0.1, "mask_rule": "random"}
    engine = make_engine(tmp_path, "sparse_ft", rounds=1, client_fraction=1.0, settings=settings,
                         algorithm_class=CountingSparseFinetune)
    engine.calibration_loader = global_test()
    start = {key: value.clone() for key, value in engine.server.models["global"].items()}
    engine.run()
    assert engine.algorithm.calls == 1
    masks = {key[len(MASK_PREFIX):]: value for key, value in engine.server.tensors.items() if key.startswith(MASK_PREFIX)}
    assert mask_density(masks) == round(0.1 * 112) / 112  # TinyNet's maskable body: 112 entries
    resumed = make_engine(tmp_path, "sparse_ft", rounds=3, client_fraction=1.0, settings=settings,
                          algorithm_class=CountingSparseFinetune)  # no calibration data: the checkpoint has the masks
    resumed.run()
    assert resumed.algorithm.calls == 0
    final = resumed.server.models["global"]
    for key, mask in masks.items():
        assert torch.equal(resumed.server.tensors[MASK_PREFIX + key], mask)
        assert torch.equal(final[key][~mask], start[key][~mask])
    assert any(not torch.equal(final[key][mask], start[key][mask]) for key, mask in masks.items())


@pytest.fixture
def assignments_with_free_rows(tiny_manifest, tmp_path):  # noqa: F811
    """Two clients over three quarters of the train split; every fourth train row is held out."""
    train = read_manifest(tiny_manifest).query("split == 'train'").sort_values("sample_id").reset_index(drop=True)
    train = train[train.index % 4 != 3].reset_index(drop=True)
    table = pd.DataFrame({"sample_id": train["sample_id"], "client_id": train.index % 2, "group": train["scene_class"],
                          "subset": ["test" if index % 5 == 4 else "train" for index in train.index]})
    path = tmp_path / "assignments" / "assignments.csv"
    write_assignments(path, table, {"scheme": "round_robin", "alpha": 1.0, "n_clients": 2, "groups": "scene_class"})
    return path


def test_step4_calibrates_the_server_mask_on_the_held_out_rows(tiny_data_root, tiny_manifest,  # noqa: F811
                                                               assignments_with_free_rows, tmp_path):
    sparse = ["--method", "sparse_ft", "--mask_source", "server", "--density", "0.2", "--calibration_rounds", "1",
              "--calibration_batches", "1", "--mask_rule", "lowest_magnitude"]
    out = tmp_path / "run"
    with pytest.raises(TaskHetError, match="needs a held-out calibration split: pass --calibration_fraction"):
        test_fed.main(argv(tiny_data_root, tiny_manifest, assignments_with_free_rows, out, *sparse))
    with pytest.raises(TaskHetError, match=r"--calibration_fraction 0.5 needs \d+ of the manifest's"):
        test_fed.main(argv(tiny_data_root, tiny_manifest, assignments_with_free_rows, tmp_path / "big", *sparse,
                           "--calibration_fraction", "0.5"))
    assert not (tmp_path / "big").exists()  # refused before the folder is claimed
    test_fed.main(argv(tiny_data_root, tiny_manifest, assignments_with_free_rows, tmp_path / "ok", *sparse,
                       "--calibration_fraction", "0.1", "--keep_local_models", "true"))
    tensors = load_checkpoint(tmp_path / "ok" / "checkpoint.pt")["server"]["tensors"]
    masks = {key: value for key, value in tensors.items() if key.startswith(MASK_PREFIX)}
    assert masks and abs(mask_density(masks) - 0.2) < 1e-3
    assert "server calibration split:" in (tmp_path / "ok" / "run.log").read_text()

    # merge_task_vectors.py --run on it: λ = 0 is θ_0, so the merged model's loss on each client is the base's.
    merge_main(["--run", str(tmp_path / "ok"), "--lam", "0", "--val_fraction", "0.1", "--out", str(tmp_path / "m")])
    table = pd.read_csv(tmp_path / "m" / "merge.csv", dtype={"client": str})
    assert list(table.client) == ["0", "1"] and (table.merged_loss == table.base_loss).all()
    assert not (table.own_loss == table.base_loss).any()
    assert np.load(tmp_path / "m" / "jaccard.npy").tolist() == [[1.0, 1.0], [1.0, 1.0]]  # one server mask
    merge_main(["--run", str(tmp_path / "ok"), "--lambdas", "0,1", "--val_split", "client_test", "--out",
                str(tmp_path / "grid")])
    searched = pd.read_csv(tmp_path / "grid" / "metrics.csv").query("split == 'val'")
    assert list(searched.other) == ["lambda=0.0", "lambda=1.0"]
    bare = tmp_path / "bare"  # the same run without --keep_local_models: no θ_k to merge
    bare.mkdir()
    shutil.copy(tmp_path / "ok" / "config.json", bare / "config.json")
    checkpoint = load_checkpoint(tmp_path / "ok" / "checkpoint.pt")
    checkpoint["client_states"] = {client_id: {} for client_id in checkpoint["client_states"]}
    torch.save(checkpoint, bare / "checkpoint.pt")
    with pytest.raises(TaskHetError, match="holds no client models: run step 4 with --method sparse_ft"):
        merge_main(["--run", str(bare), "--out", str(tmp_path / "n")])
