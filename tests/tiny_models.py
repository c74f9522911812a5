"""A tiny regression network, its loss/evaluation and client data, shared by the engine tests.

Body with BatchNorm and dropout (so buffers and the RNG must travel with the
weights), and a head split by name (the ``head_keys()`` of the TaskModel interface).
"""

from __future__ import annotations

import torch
from torch import nn


class TinyNet(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.2))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def head_keys(self) -> list[str]:
        return [key for key in self.state_dict() if key.startswith("head.")]


NUM_TINY_CLASSES = 3  # TinyClassifier's classes: each client's targets y cut at its own terciles (the "label" key)


class TinyClassifier(TinyNet):
    """TinyNet with a 3-class Linear head, for the algorithms that need a classifier (``needs_classifier``)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__(width)
        self.head = nn.Linear(width, NUM_TINY_CLASSES)


# Settings the generic tests run an algorithm with instead of its defaults: FedLoGe's 10,000 SSE-C refinement steps
# take seconds per engine on a busy CPU, and the generic tests build dozens of engines.
FAST_SETTINGS = {"fedloge": {"etf_steps": 20}, "ccvr": {"num_virtual": 20, "calib_epochs": 2}}


def tiny_model_for(name: str) -> nn.Module:
    """The tiny model the generic tests run algorithm ``name`` on: TinyClassifier if it needs a classifier."""
    from network.algorithms.base import ALGORITHMS

    return TinyClassifier() if ALGORITHMS.get(name).needs_classifier else TinyNet()


def loss_fn(model: nn.Module, batch: dict, reduction: str = "mean") -> torch.Tensor:
    output = model(batch["x"])
    if output.shape[-1] > 1:  # TinyClassifier: cross-entropy on the client's tercile labels
        return nn.functional.cross_entropy(output, batch["label"], reduction=reduction)
    squared = (output.squeeze(-1) - batch["y"]) ** 2
    return squared.mean() if reduction == "mean" else squared


def evaluate(model: nn.Module, loader) -> dict[str, float]:
    outputs = [(model(batch["x"]), batch) for batch in loader]
    if outputs[0][0].shape[-1] > 1:
        logits, labels = torch.cat([output for output, _ in outputs]), torch.cat([batch["label"] for _, batch in outputs])
        return {"loss": float(nn.functional.cross_entropy(logits, labels)),
                "top1": float((logits.argmax(1) == labels).float().mean())}
    errors = torch.cat([output.squeeze(-1) - batch["y"] for output, batch in outputs])
    return {"loss": float((errors ** 2).mean()), "mae": float(errors.abs().mean())}


def class_counts(samples: list[dict]) -> tuple[int, ...]:
    """Training samples per tercile label (what a classification client's ClientData carries)."""
    return tuple(torch.bincount(torch.stack([sample["label"] for sample in samples]),
                                minlength=NUM_TINY_CLASSES).tolist())


def client_samples(index: int, count: int) -> list[dict]:
    """Client ``index``'s regression samples: its own weights and a shifted input mean (heterogeneous clients)."""
    generator = torch.Generator().manual_seed(100 + index)
    weights = torch.randn(4, generator=generator)
    x = torch.randn(count, 4, generator=generator) + index
    y = x @ weights + 0.1 * torch.randn(count, generator=generator)
    # Labels for TinyClassifier: y cut at the terciles of the client's training part (all but the last 6 samples,
    # as the engine tests split them), so every client trains on every class. Each sample carries its id, as a
    # real data family's do (FedEM keys its E-step by it).
    cuts = torch.quantile(y[:max(count - 6, 1)], torch.tensor([1 / 3, 2 / 3]))
    labels = torch.bucketize(y, cuts)
    return [{"x": row, "y": target, "label": label, "sample_id": f"{index}-{row_index}"}
            for row_index, (row, target, label) in enumerate(zip(x, y, labels))]
