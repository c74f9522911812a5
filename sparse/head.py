"""Step 0 of TaLoS: fit the classification head on frozen features, then freeze it.

Closed form: ridge regression of one-hot targets on the features,
W = (X̃ᵀX̃ + αI)⁻¹ X̃ᵀỸ on centred X̃, Ỹ and b = ȳ − x̄W (the intercept is not
penalised, as in scikit-learn's ``Ridge``). One solve of a D×D system replaces the
few epochs of head training (no learning rate, no seed); with features of a
pretrained encoder it is the usual linear-probe start for fine-tuning, so the body's
sparse updates do not have to compensate for a random head.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from utils.errors import TaskHetError


def ridge_head(features: Tensor, labels: Tensor, num_classes: int, alpha: float = 1e-3) -> tuple[Tensor, Tensor]:
    """Ridge regression of one-hot ``labels`` on ``features`` [N, D]: returns weight [C, D] and bias [C] (float64)."""
    if features.ndim != 2 or labels.shape != features.shape[:1]:
        raise TaskHetError(f"features must be [N, D] and labels [N], got {tuple(features.shape)} and {tuple(labels.shape)}")
    if alpha < 0:
        raise TaskHetError(f"ridge alpha must be >= 0, got {alpha}")
    x = features.double()
    y = F.one_hot(labels.long(), num_classes).double()
    x_mean, y_mean = x.mean(0), y.mean(0)
    centred = x - x_mean
    gram = centred.T @ centred + alpha * torch.eye(x.shape[1], dtype=torch.float64)
    weight = torch.linalg.solve(gram, centred.T @ (y - y_mean))  # [D, C]
    return weight.T, y_mean - x_mean @ weight


@torch.no_grad()
def fit_head(head: nn.Linear, features: Tensor, labels: Tensor, alpha: float = 1e-3) -> nn.Linear:
    """Write the ridge solution into ``head`` (in place) and freeze it (``requires_grad=False``)."""
    weight, bias = ridge_head(features, labels, head.out_features, alpha)
    head.weight.copy_(weight.to(head.weight.dtype))
    if head.bias is not None:
        head.bias.copy_(bias.to(head.bias.dtype))
    head.requires_grad_(False)
    return head


@torch.no_grad()
def collect_features(features_fn: Callable[[dict], Tensor], batches: Iterable[dict],
                     label_key: str = "label") -> tuple[Tensor, Tensor]:
    """Concatenated ``features_fn(batch)`` [N, D] and ``batch[label_key]`` [N] (e.g. timm's ``forward_features``)."""
    features, labels = [], []
    for batch in batches:
        features.append(features_fn(batch).detach().float().cpu())
        labels.append(batch[label_key].cpu())
    if not features:
        raise TaskHetError("fitting the head needs at least one batch of features")
    return torch.cat(features), torch.cat(labels)
