"""The trivial predictors (training/loop.py: trivial_predictors, constant_loss) on hand-made batches, and step 2's
rows of them in metrics.csv (training/fit.py), read back by pipeline.run_results.trivial_losses."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import training.fit
import training.loop
from datasets.digits import select_digits
from pipeline.run_results import trivial_losses as read_trivial_losses
from steps import train_centralized as step2
from tests.fixtures import Killed, die_after_saving, tiny_data_root, tiny_manifest  # noqa: F401
from training.loop import constant_loss, evaluate, trivial_losses, trivial_predictors

CPU = torch.device("cpu")


def keypoint_batch(rows: list[list[float]], valid: list[list[bool]] | None = None) -> dict:
    """Samples of one 1×4 keypoints2d map each (and a 1×4 image, unused by a constant)."""
    target = torch.tensor(rows, dtype=torch.float32).view(len(rows), 1, 1, 4)
    batch = {"rgb": torch.zeros(len(rows), 3, 1, 4), "keypoints2d": target}
    if valid is not None:
        batch["mask"] = torch.tensor(valid).view(len(rows), 1, 1, 4)
    return batch


# Valid training values 0, 0, 0.5, 1, 0.25, 0.75, 0.5 (the masked last 0 left out): sorted 0, 0, 0.25, 0.5, 0.5,
# 0.75, 1, median 0.5. Counting the masked 0 would give 8 values, lower median 0.25.
KEYPOINT_TRAIN = [keypoint_batch([[0, 0, 0.5, 1.0], [0.25, 0.75, 0.5, 0.0]],
                                 [[True] * 4, [True, True, True, False]])]
# Batch 1 (1 sample): zeros |0.5|·3 + |1| over 4 = 0.625; median 0.5: (0 + 0 + 0 + 0.5) / 4 = 0.125.
# Batch 2 (2 samples, 5 valid pixels): zeros (0·4 + 1) / 5 = 0.2; median (0.5·4 + 0.5) / 5 = 0.5.
# By batch size: zeros (0.625 + 2·0.2) / 3 = 1.025 / 3; median (0.125 + 2·0.5) / 3 = 1.125 / 3 = 0.375.
KEYPOINT_TEST = [keypoint_batch([[0.5, 0.5, 0.5, 1.0]]),
                 keypoint_batch([[0, 0, 0, 0], [1, 1, 1, 1]], [[True] * 4, [True, False, False, False]])]


def test_l1_takes_the_median_of_the_valid_training_targets_and_averages_as_evaluation_does():
    predictors = trivial_predictors("keypoints2d", KEYPOINT_TRAIN, 1, CPU)
    assert set(predictors) == {"zero", "median"}
    assert predictors["zero"].tolist() == [0.0] and predictors["median"].tolist() == [0.5]
    losses = trivial_losses("keypoints2d", KEYPOINT_TRAIN, {"test": KEYPOINT_TEST}, 1, CPU)
    assert losses["test"]["zero"] == pytest.approx(1.025 / 3, rel=1e-7)  # 0.2 in float32
    assert losses["test"]["median"] == 0.375  # exact in floats: 0.125, 0.5 and 1.125 / 3


class ConstantModel(nn.Module):
    """Predicts ``constant`` at every pixel of its input's size, as a TaskModel's forward returns it."""

    def __init__(self, constant: torch.Tensor) -> None:
        super().__init__()
        self.constant = constant

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        size = (images.shape[0], len(self.constant), *images.shape[2:])
        return self.constant.view(1, -1, 1, 1).expand(size), torch.zeros(images.shape[0], 1)


def test_a_constant_scores_what_evaluate_gives_a_model_that_predicts_it():
    # the same loss calls on the same tensors, summed in the same order: equal to the last bit
    for constant in (torch.tensor([0.0]), torch.tensor([0.3])):
        evaluated = evaluate(ConstantModel(constant), KEYPOINT_TEST, "keypoints2d", CPU, input_key="rgb", progress=False)
        assert constant_loss("keypoints2d", constant, KEYPOINT_TEST, CPU) == evaluated["loss"]


def test_the_median_of_many_values_is_taken_over_a_regular_thinning(monkeypatch):
    # 8 values 0..7 over a cap of 4: every 2nd is kept (0, 2, 4, 6), lower median 2 (all 8 would give 3)
    monkeypatch.setattr(training.loop, "MEDIAN_VALUES", 4)
    batch = {"keypoints2d": torch.arange(8.0).view(2, 1, 1, 4)}
    assert trivial_predictors("keypoints2d", [batch], 1, CPU)["median"].tolist() == [2.0]


def test_segmentation_takes_the_smoothed_class_prior_of_valid_labelled_pixels():
    # training pixels 0, 0, 1, 1, 255 with the second 1 masked: 255 is unlabelled, so the counts are 2, 1, 0 of 3
    # pixels; add-one smoothing over 3 classes: (3/6, 2/6, 1/6)
    train = [{"segment_semantic": torch.tensor([[[0, 0, 1, 1, 255]]]),
              "mask": torch.tensor([[[[True, True, True, False, True]]]])}]
    prior = trivial_predictors("segment_semantic", train, 3, CPU)["prior"]
    assert torch.allclose(prior, torch.tensor([1 / 2, 1 / 3, 1 / 6]).log())
    # test pixels 0 and 2 (and an unlabelled one): cross-entropy (ln 2 + ln 6) / 2 = ln 12 / 2; all-zero logits ln 3
    test = [{"segment_semantic": torch.tensor([[[0, 2, 255]]])}]
    losses = trivial_losses("segment_semantic", train, {"test": test}, 3, CPU)["test"]
    assert losses["prior"] == pytest.approx(math.log(12) / 2, rel=1e-6)
    assert losses["zero"] == pytest.approx(math.log(3), rel=1e-6)


def test_classification_takes_the_smoothed_class_prior():
    # training labels 0, 0, 0, 1 of 3 classes: (3 + 1, 1 + 1, 0 + 1) / (4 + 3) = (4/7, 2/7, 1/7)
    train = [{"digit_class": torch.tensor([0, 0]), "image": torch.zeros(2, 3, 2, 2)},
             {"digit_class": torch.tensor([0, 1]), "image": torch.zeros(2, 3, 2, 2)}]
    test = [{"digit_class": torch.tensor([0, 2])}]  # -(ln 4/7 + ln 1/7) / 2 = (ln 7/4 + ln 7) / 2
    losses = trivial_losses("digit_class", train, {"test": test}, 3, CPU)["test"]
    assert losses["prior"] == pytest.approx((math.log(7 / 4) + math.log(7)) / 2, rel=1e-6)
    assert losses["zero"] == pytest.approx(math.log(3), rel=1e-6)


# ----- step 2's rows -----
def digits_argv(manifest, out, *extra):
    return ["--task", "digit_class", "--encoder", "small_cnn", "--weights", "none", "--manifest", str(manifest),
            "--image_size", "8", "--batch_size", "8", "--scheduler", "none", "--n_epochs", "2", "--no-use_accelerator",
            "--no-plots", "--no-progress", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def digits60(tmp_path_factory):
    manifest = tmp_path_factory.mktemp("digits60") / "manifest.csv"
    select_digits(0.25, seed=0, n_samples=60).to_csv(manifest, index=False)
    return manifest


def trivial_rows(out) -> pd.DataFrame:
    metrics = pd.read_csv(out / "metrics.csv")
    return metrics[metrics.split.str.startswith("trivial_")]


def test_step2_writes_the_prior_of_its_training_rows_once_per_split(digits60, tmp_path):
    out = tmp_path / "run"
    step2.main(digits_argv(digits60, out))
    rows = trivial_rows(out)
    assert list(zip(rows.epoch, rows.split, rows.metric)) == [
        (0, "trivial_val", "zero_loss"), (0, "trivial_val", "prior_loss"),
        (0, "trivial_test", "zero_loss"), (0, "trivial_test", "prior_loss")]
    # by hand from the manifest: the prior of the rows step 2 trains on (train, not val), scored on the test rows
    manifest = pd.read_csv(digits60)
    train = manifest[(manifest.split == "train") & (manifest.val == 0)]
    counts = np.bincount(train.label, minlength=10)
    prior = (counts + 1) / (counts.sum() + 10)
    test_labels = manifest[manifest.split == "test"].label
    expected = {"zero": math.log(10), "prior": float(np.mean(-np.log(prior[test_labels])))}
    assert read_trivial_losses(out / "metrics.csv") == pytest.approx(expected, rel=1e-6)
    assert set(read_trivial_losses(out / "metrics.csv", "val")) == {"zero", "prior"}



def test_a_resumed_run_keeps_its_rows_and_an_old_folder_gets_them_once(digits60, tmp_path, monkeypatch):
    out = tmp_path / "run"
    real_save = training.fit.atomic_torch_save
    die_after_saving(monkeypatch, training.fit)
    with pytest.raises(Killed):
        step2.main(digits_argv(digits60, out))
    monkeypatch.setattr(training.fit, "atomic_torch_save", real_save)
    written = trivial_rows(out)
    computed = []
    real_trivial = training.fit.trivial_losses
    monkeypatch.setattr(training.fit, "trivial_losses", lambda *args: computed.append(1) or real_trivial(*args))
    step2.main(digits_argv(digits60, out))  # resumes after epoch 1: nothing to compute, nothing written twice
    assert computed == [] and trivial_rows(out).equals(written)
    assert sorted(set(pd.read_csv(out / "metrics.csv").epoch)) == [0, 1, 2]

    # a folder written before the rows existed: the rerun computes them once, after its last epoch's rows
    metrics = pd.read_csv(out / "metrics.csv")
    metrics[~metrics.split.str.startswith("trivial_")].to_csv(out / "metrics.csv", index=False)
    assert read_trivial_losses(out / "metrics.csv") == {}
    step2.main(digits_argv(digits60, out))
    step2.main(digits_argv(digits60, out))
    assert computed == [1]
    assert trivial_rows(out).reset_index(drop=True).equals(written.reset_index(drop=True))


def test_step2_writes_the_median_of_a_dense_task_as_its_valid_test_pixels_score_it(tiny_data_root, tiny_manifest,
                                                                                     tmp_path):
    """keypoints2d, whose masks leave pixels out: the median of the valid training pixels; on the test split each
    batch's mean over its valid pixels, weighted by its size (batches of 6, as step 2 evaluates)."""
    from datasets.family import load_manifest
    from training.selection import centralized_splits

    out = tmp_path / "run"
    step2.main(["--task", "keypoints2d", "--encoder", "small_cnn", "--weights", "none", "--data_path", str(tiny_data_root),
                "--manifest", str(tiny_manifest), "--image_size", "32", "--batch_size", "6", "--n_epochs", "1",
                "--no-use_accelerator", "--no-plots", "--no-progress", "--out", str(out)])
    family, manifest = load_manifest(tiny_manifest)
    splits = centralized_splits(manifest)

    def samples(split):
        data = family.dataset(tiny_data_root, splits[split], step2.get_task("keypoints2d"), 32, None)
        return [(data[index]["keypoints2d"].numpy()[0], data[index]["mask"].numpy()[0]) for index in range(len(data))]

    train, test = samples("train"), samples("test")
    assert not all(mask.all() for _, mask in train + test)  # some pixels are masked out: the mask matters here
    values = np.sort(np.concatenate([target[mask] for target, mask in train]))
    median = values[(len(values) - 1) // 2]  # the lower middle value

    def loss(constant):
        batches = [test[start:start + 6] for start in range(0, len(test), 6)]
        means = [np.concatenate([np.abs(target - constant)[mask] for target, mask in batch]).mean() for batch in batches]
        return float(np.average(means, weights=[len(batch) for batch in batches]))

    assert read_trivial_losses(out / "metrics.csv") == pytest.approx({"zero": loss(0.0), "median": loss(median)}, rel=1e-5)
