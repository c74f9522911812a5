"""The tasks: what a model predicts for each, its loss, metrics and the data it needs.

A :class:`TaskSpec` ties a task name to the sample-dict key holding its target
(``domain``), the head's output channels and activation (matched to the
target's range), a loss from :mod:`losses`, a metric accumulator from
:mod:`models.metrics` and the domains the dataset must load.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

import losses
from datasets.taskonomy_domains import NUM_SEMANTIC_CLASSES
from models import metrics
from utils.registry import Registry


class TaskMetrics(Protocol):
    """An accumulator over a split: ``update`` per batch, ``compute`` once."""

    def update(self, prediction: torch.Tensor, batch: dict) -> None: ...

    def compute(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class TaskSpec:
    """One task.

    Attributes:
        name: task name (registry key).
        domain: key of the target in a batch dict ("scene_class" for class_scene; every other task's own name).
        kind: "dense" (per-pixel prediction ``[B, C, H, W]``) or "classification" (logits ``[B, K]``).
        out_channels: output channels; None where the data family gives them (``DataFamily.output_channels``): K of
            a classification task, the channels or classes of a folder family's dense target.
        activation: output activation (see :data:`models.heads.ACTIVATIONS`).
        loss_fn: ``(prediction, batch, domain, reduction) -> scalar`` (``[B]`` with reduction "none").
        metrics_factory: ``() -> TaskMetrics``.
        required_domains: domains the dataset must load besides rgb (mask_valid is used when on disk).
        primary_metric: the metric reports quote for the task (a key of ``new_metrics().compute()``).
    """

    name: str
    domain: str
    kind: str
    out_channels: int | None
    activation: str
    loss_fn: Callable[[torch.Tensor, dict, str], torch.Tensor]
    metrics_factory: Callable[[], TaskMetrics]
    required_domains: list[str] = field(default_factory=list)
    primary_metric: str = "l1"

    def loss(self, prediction: torch.Tensor, batch: dict, reduction: str = "mean") -> torch.Tensor:
        """The task's (masked) loss of a prediction against a batch: a scalar, or ``[B]`` with ``reduction="none"``."""
        return self.loss_fn(prediction, batch, self.domain, reduction)

    def new_metrics(self, **options) -> TaskMetrics:
        """A fresh accumulator of the task's metrics (``options``: e.g. a classifier's ``class_groups``)."""
        return self.metrics_factory(**options)


TASKS: Registry[TaskSpec] = Registry("task")


def _register_tasks() -> None:
    """Register every task once, at import."""
    # Output activations follow the targets' ranges (datasets/taskonomy.py decoders):
    # depth >= 0 in metres (a scaled softplus, see models.heads.DepthSoftplus),
    # normals in [-1, 1] (tanh), [0, 1] maps (sigmoid), class logits (identity).
    dense = [
        ("normal", 3, "tanh", losses.normal_loss, metrics.NormalMetrics, "mean_angle"),
        ("segment_semantic", NUM_SEMANTIC_CLASSES, "identity", losses.segmentation_loss,
         functools.partial(metrics.SegmentationMetrics, NUM_SEMANTIC_CLASSES), "miou"),
    ]
    for name in ("depth_euclidean", "depth_zbuffer"):
        dense.append((name, 1, "depth_softplus", losses.dense_l1_loss, functools.partial(metrics.DepthMetrics, name), "abs_rel"))
    for name, channels in (("reshading", 1), ("edge_texture", 1), ("edge_occlusion", 1), ("keypoints2d", 1),
                           ("keypoints3d", 1), ("principal_curvature", 2)):
        dense.append((name, channels, "sigmoid", losses.dense_l1_loss, functools.partial(metrics.L1Metric, name), "l1"))
    for name, channels, activation, loss_fn, metrics_factory, primary in dense:
        TASKS.register(name)(
            TaskSpec(name, name, "dense", channels, activation, loss_fn, metrics_factory, [name], primary)
        )
    # The folder families' dense tasks (datasets/paired_folders.py): a user's targets.yaml declares a regression
    # target's channels and a segmentation target's classes, so their heads are sized from the manifest
    # (out_channels None: DataFamily.output_channels). Regression targets have any range (identity output);
    # segmentation ignores SEGMENT_IGNORE_INDEX, as Taskonomy's does; binary edges are Taskonomy's edge tasks' kind.
    folder_dense = [
        ("folder_regression", None, "identity", losses.dense_l1_loss, functools.partial(metrics.L1Metric, "folder_regression"), "l1"),
        ("folder_segmentation", None, "identity", losses.segmentation_loss,
         functools.partial(metrics.SegmentationMetrics, None, "folder_segmentation"), "miou"),
        ("folder_edges", 1, "sigmoid", losses.dense_l1_loss, functools.partial(metrics.L1Metric, "folder_edges"), "l1"),
    ]
    for name, channels, activation, loss_fn, metrics_factory, primary in folder_dense:
        TASKS.register(name)(TaskSpec(name, name, "dense", channels, activation, loss_fn, metrics_factory, [], primary))
    # Classification tasks take K from their data family (datasets.family.DataFamily.num_classes).
    for name, domain in (("class_scene", "scene_class"), ("digit_class", "digit_class"), ("cifar_class", "cifar_class"),
                         ("folder_class", "folder_class")):
        TASKS.register(name)(
            TaskSpec(name, domain, "classification", None, "identity", losses.classification_loss,
                     functools.partial(metrics.ClassificationMetrics, domain), [], "top1")
        )


_register_tasks()


def get_task(name: str) -> TaskSpec:
    """The task called ``name``; a :class:`TaskHetError` listing the tasks otherwise."""
    return TASKS.get(name)


def list_tasks() -> list[str]:
    """Registered task names, sorted."""
    return TASKS.names()
