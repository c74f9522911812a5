"""Task metrics against hand-computed values, accumulated over several batches."""

import math

import pytest
import torch

from datasets.taskonomy_domains import SEGMENT_IGNORE_INDEX
from models.tasks import get_task, list_tasks
from models.metrics import ClassificationMetrics, DepthMetrics, L1Metric, NormalMetrics, SegmentationMetrics


def logits_for(classes: torch.Tensor, num_classes: int) -> torch.Tensor:
    """[B, H, W] class ids -> one-hot logits [B, C, H, W]."""
    return torch.nn.functional.one_hot(classes, num_classes).permute(0, 3, 1, 2).float()


IGNORE = SEGMENT_IGNORE_INDEX


def test_segmentation_miou_with_absent_class_and_ignore():
    metric = SegmentationMetrics(num_classes=4)
    target = torch.tensor([[[0, 1, 1, 2, IGNORE]]])  # class 3 never appears; the last pixel is unlabelled
    predicted = torch.tensor([[[0, 1, 2, 2, 3]]])  # the unlabelled pixel's prediction must not count
    metric.update(logits_for(predicted, 4), {"segment_semantic": target})
    result = metric.compute()
    # class 0 (background, a class like any other): 1/1; class 1: TP 1, union 2 -> 0.5; class 2: 0.5; class 3 absent
    assert result["miou"] == pytest.approx((1.0 + 0.5 + 0.5) / 3)
    assert result["pixel_acc"] == pytest.approx(3 / 4)


def test_segmentation_accumulates_confusion_over_batches_not_batch_means():
    metric = SegmentationMetrics(num_classes=3)
    # batch 1: 1 pixel of class 1, right; batch 2: 3 pixels of class 2, one wrong (as 1)
    metric.update(logits_for(torch.tensor([[[1]]]), 3), {"segment_semantic": torch.tensor([[[1]]])})
    metric.update(logits_for(torch.tensor([[[2, 2, 1]]]), 3), {"segment_semantic": torch.tensor([[[2, 2, 2]]])})
    result = metric.compute()
    # class 1: TP 1, union 2 -> 0.5; class 2: TP 2, union 3 -> 2/3
    assert result["miou"] == pytest.approx((0.5 + 2 / 3) / 2)
    assert result["pixel_acc"] == pytest.approx(3 / 4)


def test_segmentation_background_is_a_class_and_mask_respected():
    metric = SegmentationMetrics(num_classes=3)
    target = torch.tensor([[[1, 2, 2]]])
    predicted = torch.tensor([[[0, 2, 1]]])
    mask = torch.tensor([[[[True, True, False]]]])
    metric.update(logits_for(predicted, 3), {"segment_semantic": target, "mask": mask})
    result = metric.compute()
    # valid pixels: (1 -> 0) wrong, (2 -> 2) right. class 0: TP 0, union 1; class 1: TP 0, union 1; class 2: 1/1
    assert result["miou"] == pytest.approx(1 / 3)
    assert result["pixel_acc"] == pytest.approx(0.5)


def test_segmentation_miou_runs_over_all_17_taskonomy_classes():
    task = get_task("segment_semantic")
    metric = task.new_metrics()
    target = torch.arange(17).reshape(1, 1, 17)  # every class once, the 17th (id 16) included
    metric.update(logits_for(target, task.out_channels), {"segment_semantic": target})
    assert task.out_channels == 17 and metric.compute()["miou"] == pytest.approx(1.0)
    assert metric.confusion.shape == (17, 17) and metric.confusion.diagonal().sum() == 17


def test_normal_angles_of_known_vectors():
    metric = NormalMetrics()
    target = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]]).T.reshape(1, 3, 1, 4)
    s = math.sqrt(0.5)
    # angles: 0, 90, 45, 10 degrees; the prediction's length must not matter
    prediction = torch.tensor([
        [2.0, 0.0, 0.0],
        [0.0, 1.0, 0.0],
        [s, 0.0, s],
        [0.0, math.cos(math.radians(10)), math.sin(math.radians(10))],
    ]).T.reshape(1, 3, 1, 4)
    metric.update(prediction[..., :2], {"normal": target[..., :2]})
    metric.update(prediction[..., 2:], {"normal": target[..., 2:]})
    result = metric.compute()
    assert result["mean_angle"] == pytest.approx((0 + 90 + 45 + 10) / 4, abs=1e-6)
    assert result["median_angle"] == pytest.approx(10, abs=0.01)
    assert result["within_11_25"] == pytest.approx(0.5)


def test_normal_metrics_skip_masked_pixels():
    metric = NormalMetrics()
    target = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]).T.reshape(1, 3, 1, 2)
    prediction = torch.tensor([[1.0, 0.0, 0.0], [-1.0, 0.0, 0.0]]).T.reshape(1, 3, 1, 2)
    metric.update(prediction, {"normal": target, "mask": torch.tensor([[[[True, False]]]])})
    assert metric.compute()["mean_angle"] == pytest.approx(0.0, abs=1e-6)


def test_depth_metrics_by_hand():
    metric = DepthMetrics("depth_euclidean")
    target = torch.tensor([[[[1.0, 2.0], [4.0, 5.0]]]])
    prediction = torch.tensor([[[[1.1, 3.0], [4.0, 99.0]]]])
    mask = torch.tensor([[[[True, True], [True, False]]]])
    metric.update(prediction, {"depth_euclidean": target, "mask": mask})
    result = metric.compute()
    # valid errors: 0.1, 1.0, 0.0 on targets 1, 2, 4
    assert result["abs_rel"] == pytest.approx((0.1 / 1 + 1.0 / 2 + 0.0) / 3)
    assert result["rmse"] == pytest.approx(math.sqrt((0.01 + 1.0 + 0.0) / 3))
    # ratios 1.1, 1.5, 1.0 -> two under 1.25
    assert result["delta1"] == pytest.approx(2 / 3)
    assert result["l1"] == pytest.approx(1.1 / 3)


def test_depth_metrics_accumulate_pixels_across_batches():
    split = DepthMetrics("depth_euclidean")
    # batch 1 has one valid pixel, batch 2 three: a mean of batch means would give (1 + 0) / 2
    split.update(torch.tensor([[[[2.0]]]]), {"depth_euclidean": torch.tensor([[[[1.0]]]])})
    split.update(torch.ones(1, 1, 1, 3), {"depth_euclidean": torch.ones(1, 1, 1, 3)})
    assert split.compute()["abs_rel"] == pytest.approx(1 / 4)


def test_classification_top1_top5():
    metric = ClassificationMetrics("scene_class")
    logits = torch.tensor([
        [9.0, 8, 7, 6, 5, 4, 3],  # label 0: top-1
        [9.0, 8, 7, 6, 5, 4, 3],  # label 4: top-5 only
        [9.0, 8, 7, 6, 5, 4, 3],  # label 6: neither
    ])
    metric.update(logits[:2], {"scene_class": torch.tensor([0, 4])})
    metric.update(logits[2:], {"scene_class": torch.tensor([6])})
    result = metric.compute()
    assert result["top1"] == pytest.approx(1 / 3)
    assert result["top5"] == pytest.approx(2 / 3)


def test_classification_top5_with_fewer_than_five_classes():
    metric = ClassificationMetrics("scene_class")
    metric.update(torch.tensor([[0.0, 1.0, 2.0]]), {"scene_class": torch.tensor([0])})
    assert metric.compute() == {"top1": 0.0, "top5": 1.0}


def test_classification_group_top1_pools_the_groups_samples_over_batches():
    metric = ClassificationMetrics("scene_class", class_groups={"head": [0], "tail": [1, 2], "empty": [3]})
    logits = torch.eye(4) * 5  # predicts its own row index
    metric.update(logits[[0, 0, 1]], {"scene_class": torch.tensor([0, 1, 1])})  # hit, miss (pred 0), hit
    metric.update(logits[[2, 0]], {"scene_class": torch.tensor([2, 0])})  # hit, hit
    result = metric.compute()
    assert result["top1_head"] == 1.0  # 2 of 2 samples of class 0
    assert result["top1_tail"] == pytest.approx(2 / 3)  # classes 1, 2: 3 samples, 2 hits
    assert math.isnan(result["top1_empty"]) and result["top1"] == pytest.approx(4 / 5)


def test_l1_metric_over_valid_pixels_and_channels():
    metric = L1Metric("principal_curvature")
    target = torch.zeros(1, 2, 1, 2)
    prediction = torch.tensor([[[[0.5, 9.0]], [[0.25, 9.0]]]])
    metric.update(prediction, {"principal_curvature": target, "mask": torch.tensor([[[[True, False]]]])})
    assert metric.compute()["l1"] == pytest.approx(0.375)


@pytest.mark.parametrize("task_name", list_tasks())
def test_every_task_has_metrics_that_report_floats(task_name):
    from tests.test_losses import make_batch, perfect_prediction

    task = get_task(task_name)
    batch = make_batch(task_name)
    metrics = task.new_metrics()
    metrics.update(perfect_prediction(task_name, batch), batch)
    result = metrics.compute()
    assert result and all(isinstance(value, float) for value in result.values())
    assert task.primary_metric in result
    perfect = {"top1": 1.0, "top5": 1.0, "miou": 1.0, "pixel_acc": 1.0, "abs_rel": 0.0, "rmse": 0.0, "delta1": 1.0,
               "l1": 0.0, "mean_angle": 0.0, "within_11_25": 1.0}
    for key, value in result.items():
        if key in perfect:
            assert value == pytest.approx(perfect[key], abs=1e-3), key


def test_empty_metrics_are_nan():
    assert math.isnan(DepthMetrics("depth_euclidean").compute()["rmse"])
    assert math.isnan(SegmentationMetrics(3).compute()["miou"])
