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


def loss_fn(model: nn.Module, batch: dict, reduction: str = "mean") -> torch.Tensor:
    squared = (model(batch["x"]).squeeze(-1) - batch["y"]) ** 2
    return squared.mean() if reduction == "mean" else squared


def evaluate(model: nn.Module, loader) -> dict[str, float]:
    errors = torch.cat([model(batch["x"]).squeeze(-1) - batch["y"] for batch in loader])
    return {"loss": float((errors ** 2).mean()), "mae": float(errors.abs().mean())}


def client_samples(index: int, count: int) -> list[dict]:
    """Client ``index``'s regression samples: its own weights and a shifted input mean (heterogeneous clients)."""
    generator = torch.Generator().manual_seed(100 + index)
    weights = torch.randn(4, generator=generator)
    x = torch.randn(count, 4, generator=generator) + index
    y = x @ weights + 0.1 * torch.randn(count, generator=generator)
    # Each sample carries its id, as a real data family's do (FedEM keys its E-step by it).
    return [{"x": row, "y": target, "sample_id": f"{index}-{row_index}"}
            for row_index, (row, target) in enumerate(zip(x, y))]
