"""Task metrics that accumulate over a whole split.

Each metric object is fed batch by batch (``update(prediction, batch)``) and
reports once (``compute() -> dict[str, float]``). Sums and counts are kept in
float64 on the CPU, so the result is the metric over every valid pixel (or
sample) of the split, not an average of per-batch values, which would weigh a
batch with few valid pixels as much as a full one.

Batches are the dicts of a data family's dataset (``datasets/family.py``): ``batch[domain]``
is the target and ``batch["mask"]`` (bool ``[B, 1, H, W]``, when present) marks valid pixels.
"""

from __future__ import annotations

import math

import torch

from datasets.taskonomy_domains import SEGMENT_IGNORE_INDEX
from losses import channel_cosine, valid_pixels

# Angular errors are binned at 0.01 degree: the median over a split of millions
# of pixels then needs 18,000 counters instead of every pixel's error.
ANGLE_BIN_DEGREES = 0.01
ANGLE_BINS = int(round(180 / ANGLE_BIN_DEGREES))
# Metrics (keys of the classes' compute()) for which a larger value is better; every other metric is an error
# (loss, l1, abs_rel, rmse, angles), lower being better. Client summaries read it to know which client is worst.
HIGHER_IS_BETTER = frozenset({"delta1", "within_11_25", "miou", "pixel_acc", "top1", "top5"})


def _valid_values(prediction: torch.Tensor, batch: dict, domain: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Prediction and target at valid pixels, flattened, float64 on the CPU."""
    target = batch[domain].to(prediction.device, prediction.dtype)
    valid = valid_pixels(batch, prediction)
    return prediction[valid].double().cpu(), target[valid].double().cpu()


class L1Metric:
    """Mean absolute error over all valid pixels and channels of a split (key ``l1``)."""

    def __init__(self, domain: str) -> None:
        self.domain = domain
        self.abs_error = 0.0
        self.count = 0

    def update(self, prediction: torch.Tensor, batch: dict) -> None:
        """Add a batch: ``prediction`` and ``batch[domain]`` are ``[B, C, H, W]``."""
        predicted, target = _valid_values(prediction.detach(), batch, self.domain)
        self.abs_error += float((predicted - target).abs().sum())
        self.count += predicted.numel()

    def compute(self) -> dict[str, float]:
        """``{"l1": ...}``; NaN when no valid pixel was seen."""
        return {"l1": self.abs_error / self.count if self.count else math.nan}


class DepthMetrics:
    """Depth in metres: AbsRel, RMSE, delta<1.25 and L1 over valid pixels with positive depth."""

    def __init__(self, domain: str) -> None:
        self.domain = domain
        self.abs_rel = 0.0
        self.squared_error = 0.0
        self.abs_error = 0.0
        self.within_delta = 0
        self.count = 0

    def update(self, prediction: torch.Tensor, batch: dict) -> None:
        """Add a batch: ``prediction`` and ``batch[domain]`` are ``[B, 1, H, W]`` in metres."""
        predicted, target = _valid_values(prediction.detach(), batch, self.domain)
        # A zero target is not a surface; ratios against it are undefined.
        positive = target > 0
        predicted, target = predicted[positive], target[positive]
        error = predicted - target
        self.abs_rel += float((error.abs() / target).sum())
        self.squared_error += float((error**2).sum())
        self.abs_error += float(error.abs().sum())
        ratio = torch.maximum(predicted / target, target / predicted.clamp(min=1e-12))
        self.within_delta += int((ratio < 1.25).sum())
        self.count += target.numel()

    def compute(self) -> dict[str, float]:
        """``abs_rel``, ``rmse`` (metres), ``delta1`` (fraction in [0, 1]) and ``l1`` (metres)."""
        if not self.count:
            return {"abs_rel": math.nan, "rmse": math.nan, "delta1": math.nan, "l1": math.nan}
        return {
            "abs_rel": self.abs_rel / self.count,
            "rmse": math.sqrt(self.squared_error / self.count),
            "delta1": self.within_delta / self.count,
            "l1": self.abs_error / self.count,
        }


class NormalMetrics:
    """Angle between predicted and true normals: mean, median and share under 11.25 degrees."""

    def __init__(self, domain: str = "normal") -> None:
        self.domain = domain
        self.histogram = torch.zeros(ANGLE_BINS, dtype=torch.float64)
        self.angle_sum = 0.0
        self.within = 0
        self.count = 0

    def update(self, prediction: torch.Tensor, batch: dict) -> None:
        """Add a batch: ``prediction`` and ``batch[domain]`` are ``[B, 3, H, W]`` vectors (any length)."""
        prediction = prediction.detach()
        target = batch[self.domain].to(prediction.device, prediction.dtype)
        valid = valid_pixels(batch, prediction[:, :1])[:, 0]
        cosine = channel_cosine(prediction.double(), target.double(), eps=1e-12)[:, 0]
        angles = torch.rad2deg(torch.arccos(cosine[valid].clamp(-1.0, 1.0))).cpu()
        self.angle_sum += float(angles.sum())
        self.within += int((angles < 11.25).sum())
        self.count += angles.numel()
        bins = (angles / ANGLE_BIN_DEGREES).long().clamp(max=ANGLE_BINS - 1)
        self.histogram += torch.bincount(bins, minlength=ANGLE_BINS).double()

    def compute(self) -> dict[str, float]:
        """``mean_angle``, ``median_angle`` (degrees; median to 0.01 degree) and ``within_11_25`` (fraction)."""
        if not self.count:
            return {"mean_angle": math.nan, "median_angle": math.nan, "within_11_25": math.nan}
        cumulative = torch.cumsum(self.histogram, 0)
        median_bin = int(torch.searchsorted(cumulative, torch.tensor(self.count / 2, dtype=torch.float64)))
        return {
            "mean_angle": self.angle_sum / self.count,
            "median_angle": (median_bin + 0.5) * ANGLE_BIN_DEGREES,
            "within_11_25": self.within / self.count,
        }


class SegmentationMetrics:
    """mIoU and pixel accuracy from a confusion matrix of argmax predictions.

    Every class id 0..C-1 is a class (Taskonomy's class 0 is background);
    unlabelled pixels (``SEGMENT_IGNORE_INDEX``) and masked pixels are ignored. A
    class that is absent from both the targets and the predictions of the whole
    split has no IoU and is left out of the mean, rather than counted as 0 or 1.

    ``num_classes`` None takes C from the first prediction's channels: a folder family's segmentation target
    declares its classes in the data (targets.yaml), and the head has exactly that many outputs.
    """

    def __init__(self, num_classes: int | None, domain: str = "segment_semantic") -> None:
        self.domain = domain
        self.num_classes = num_classes
        self.confusion = torch.zeros(num_classes or 0, num_classes or 0, dtype=torch.float64)

    def update(self, prediction: torch.Tensor, batch: dict) -> None:
        """Add a batch: ``prediction`` is logits ``[B, C, H, W]``, ``batch[domain]`` class ids ``[B, H, W]``."""
        if self.num_classes is None:
            self.num_classes = int(prediction.shape[1])
            self.confusion = torch.zeros(self.num_classes, self.num_classes, dtype=torch.float64)
        predicted = prediction.detach().argmax(dim=1)
        target = batch[self.domain].to(predicted.device)
        valid = valid_pixels(batch, prediction[:, :1])[:, 0] & (target != SEGMENT_IGNORE_INDEX)
        pairs = target[valid] * self.num_classes + predicted[valid]
        counts = torch.bincount(pairs.cpu(), minlength=self.num_classes**2)
        self.confusion += counts.reshape(self.num_classes, self.num_classes).double()

    def compute(self) -> dict[str, float]:
        """``miou`` over the classes present in targets or predictions, ``pixel_acc`` over labelled pixels."""
        # rows: true class, columns: predicted class.
        true_positive = self.confusion.diagonal()
        union = self.confusion.sum(1) + self.confusion.sum(0) - true_positive
        present = union > 0
        total = float(self.confusion.sum())
        return {
            "miou": float((true_positive[present] / union[present]).mean()) if present.any() else math.nan,
            "pixel_acc": float(true_positive.sum()) / total if total else math.nan,
        }


class ClassificationMetrics:
    """Top-1 and top-5 accuracy of logits ``[B, K]`` against labels ``batch[domain]`` ([B]).

    With ``class_groups`` (metric name -> class ids, e.g. ``datasets.long_tail.class_groups``), also
    ``top1_<name>``: the top-1 accuracy over the samples whose label is in the group (NaN when the
    split has none of them).
    """

    def __init__(self, domain: str, class_groups: dict[str, list[int]] | None = None) -> None:
        self.domain = domain
        self.class_groups = dict(class_groups or {})
        self.top1 = 0
        self.top5 = 0
        self.count = 0
        self.class_hits: dict[int, int] = {}
        self.class_count: dict[int, int] = {}

    def update(self, prediction: torch.Tensor, batch: dict) -> None:
        """Add a batch of logits and labels."""
        prediction = prediction.detach()
        target = batch[self.domain].to(prediction.device)
        top = prediction.topk(min(5, prediction.shape[1]), dim=1).indices
        hits = top == target.unsqueeze(1)
        self.top1 += int(hits[:, 0].sum())
        self.top5 += int(hits.any(dim=1).sum())
        self.count += target.numel()
        if self.class_groups:
            size = prediction.shape[1]
            for store, values in ((self.class_count, torch.bincount(target, minlength=size)),
                                  (self.class_hits, torch.bincount(target, weights=hits[:, 0].double(), minlength=size))):
                for label, value in enumerate(values.tolist()):
                    store[label] = store.get(label, 0) + int(value)

    def compute(self) -> dict[str, float]:
        """``top1`` and ``top5`` as fractions (top-5 is top-K when there are K < 5 classes), then each group's top-1."""
        if not self.count:
            result = {"top1": math.nan, "top5": math.nan}
        else:
            result = {"top1": self.top1 / self.count, "top5": self.top5 / self.count}
        for name, classes in self.class_groups.items():
            count = sum(self.class_count.get(label, 0) for label in classes)
            result[f"top1_{name}"] = sum(self.class_hits.get(label, 0) for label in classes) / count if count else math.nan
        return result
