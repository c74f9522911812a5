"""Task arithmetic (sparse/merge.py) and the merge command (steps/merge.py)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from sparse.merge import choose_lambda, cosine_matrix, jaccard_matrix, merge, support, task_vector
from steps.merge import main, run_merge
from tests.tiny_models import TinyNet
from utils.errors import TaskHetError


def models(count: int = 2) -> tuple[dict, list[dict]]:
    base = TinyNet().state_dict()
    tuned = []
    for index in range(count):
        weights = {key: value.clone() for key, value in base.items()}
        weights["head.weight"][0, index] += 1.0 + index
        weights["body.0.bias"][index] -= 2.0
        tuned.append(weights)
    return base, tuned


def test_lambda_zero_is_the_base_and_one_vector_at_lambda_one_is_the_finetuned_model():
    base, tuned = models(2)
    vectors = [task_vector(base, weights) for weights in tuned]
    assert "body.1.num_batches_tracked" not in vectors[0]  # integer buffers are no task vector
    for key, value in merge(base, vectors, 0.0).items():
        assert torch.equal(value, base[key]) and value.dtype == base[key].dtype
    for key, value in merge(base, vectors[:1], 1.0).items():
        assert torch.equal(value, tuned[0][key]), key


def test_cosine_and_jaccard_by_hand():
    a = {"w": torch.tensor([1.0, 0.0, 2.0]), "b": torch.tensor([0.0])}
    b = {"w": torch.tensor([0.0, 3.0, 4.0]), "b": torch.tensor([0.0])}
    zero = {"w": torch.zeros(3), "b": torch.zeros(1)}
    cosine = cosine_matrix([a, b, zero])
    assert cosine[0, 1].item() == pytest.approx(8 / (math.sqrt(5) * 5)) and cosine[0, 0].item() == pytest.approx(1.0)
    assert cosine[2].tolist() == [0.0, 0.0, 0.0]
    small = {"w": torch.tensor([1e-3, 0.0, 2e-3]), "b": torch.tensor([0.0])}  # a task vector of norm < 1
    assert cosine_matrix([a, small])[0, 1].item() == pytest.approx(1.0)
    jaccard = jaccard_matrix([support(a), support(b), support(zero)])
    assert jaccard[0, 1].item() == pytest.approx(1 / 3)  # supports {0, 2} and {1, 2}
    assert jaccard[0, 2].item() == 0.0 and jaccard[2, 2].item() == 1.0


def test_lambda_is_chosen_on_the_validation_loss():
    base, tuned = models(2)
    vectors = [task_vector(base, weights) for weights in tuned]
    target = tuned[0]["head.weight"][0, 0] - 0.5  # the loss is lowest at λ = 0.5 along the first entry

    def loss(weights):
        return float((weights["head.weight"][0, 0] - target) ** 2)

    lam, losses = choose_lambda(base, vectors, loss, [0.0, 0.25, 0.5, 1.0])
    assert lam == 0.5 and set(losses) == {0.0, 0.25, 0.5, 1.0}
    with pytest.raises(TaskHetError, match="grid is empty"):
        choose_lambda(base, vectors, loss, [])


def test_run_merge_writes_the_run_folder_and_the_command_reads_best_pt_files(tmp_path):
    base, tuned = models(2)
    merged = run_merge(base, {"0": tuned[0], "1": tuned[1]}, tmp_path / "lib", [0.0, 1.0],
                       validation_loss=lambda weights: -float(weights["head.weight"].sum()),
                       client_loss=lambda name, weights: float(weights["body.0.bias"].sum()))
    assert torch.equal(merged["body.0.bias"], base["body.0.bias"] + tuned[0]["body.0.bias"] - base["body.0.bias"]
                       + tuned[1]["body.0.bias"] - base["body.0.bias"])
    metrics = pd.read_csv(tmp_path / "lib" / "metrics.csv")
    assert set(metrics["split"]) == {"val", "interference", "client"}
    assert {"config.json", "run.log", "cosine.png", "merged.pt"} <= {path.name for path in (tmp_path / "lib").iterdir()}
    torch.save(base, tmp_path / "base.pt")
    torch.save({"model": tuned[0], "model_config": {}}, tmp_path / "best.pt")
    merged = main(["--base", str(tmp_path / "base.pt"), "--finetuned", f"a={tmp_path / 'best.pt'}", "--lam", "1",
                   "--out", str(tmp_path / "cli")])
    assert all(torch.equal(value, tuned[0][key]) for key, value in merged.items())
    with pytest.raises(TaskHetError, match="needs validation data"):
        run_merge(base, {"0": tuned[0]}, tmp_path / "x", [0.0, 1.0])
    with pytest.raises(TaskHetError, match="checkpoint to merge b does not exist"):
        main(["--base", str(tmp_path / "nope.pt"), "--finetuned", "a=b", "--out", str(tmp_path / "y")])


def test_jaccard_of_given_masks_and_the_npy_files_by_hand(tmp_path):
    base = {"w": torch.zeros(4)}
    tuned = {"a": {"w": torch.tensor([1.0, 0.0, 0.0, 0.0])}, "b": {"w": torch.tensor([0.0, 0.0, 0.0, -2.0])}}
    masks = {"a": {"w": torch.tensor([True, True, False, False])}, "b": {"w": torch.tensor([False, True, True, True])}}
    run_merge(base, tuned, tmp_path / "m", [1.0], masks=masks,
              client_loss=lambda name, weights: float(weights["w"].abs().sum()))
    jaccard = np.load(tmp_path / "m" / "jaccard.npy")
    assert jaccard[0, 1] == pytest.approx(1 / 4) and jaccard[0, 0] == 1.0  # {0, 1} vs {1, 2, 3}: one of four
    assert np.load(tmp_path / "m" / "cosine.npy")[0, 1] == 0.0  # disjoint supports: orthogonal
    table = pd.read_csv(tmp_path / "m" / "merge.csv", dtype={"client": str})
    assert table.to_dict("records") == [
        {"client": "a", "lambda": 1.0, "own_loss": 1.0, "merged_loss": 3.0, "base_loss": 0.0},
        {"client": "b", "lambda": 1.0, "own_loss": 2.0, "merged_loss": 3.0, "base_loss": 0.0}]
    assert {"cosine.png", "jaccard.png"} <= {path.name for path in (tmp_path / "m").iterdir()}
