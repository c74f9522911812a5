"""A heterogeneity meter: how much clients' gradients disagree at one model.

Two standard measures of a partition's heterogeneity, computed at a fixed model w
(the centralized model, in the pipeline) from each client's full-batch gradient
∇F_k(w) of its mean training loss, with p_k = n_k / n:

* gradient dissimilarity G² = Σ_k p_k ‖∇F_k − ∇F‖², with ∇F = Σ_k p_k ∇F_k
  (the "ζ²" of Karimireddy et al. 2020 and Woodworth et al. 2020, at one point);
* B² = Σ_k p_k ‖∇F_k‖² / ‖∇F‖², FedProx's B-local dissimilarity (Li et al. 2020,
  Definition 3) at w: 1 when every client's gradient equals the global one, larger
  the more they disagree. Note Σ_k p_k ‖∇F_k‖² = ‖∇F‖² + G², so B² = 1 + G²/‖∇F‖².

If embedding-based partitions hurt federated training more than label-based ones,
they should show a larger G² (and B²) at equal α.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import nn

from network.algorithms.base import LossFn
from utils.device import to_device


@dataclass(frozen=True)
class Dissimilarity:
    """The meter's reading for one partition.

    Attributes:
        g2: G² = Σ_k p_k ‖∇F_k − ∇F‖².
        b2: B² = Σ_k p_k ‖∇F_k‖² / ‖∇F‖² (inf when ∇F = 0 but some ∇F_k ≠ 0; 1 when all are 0).
        global_grad_norm2: ‖∇F‖².
    """

    g2: float
    b2: float
    global_grad_norm2: float


def full_gradient(model: nn.Module, batches: Iterable[dict], loss_fn: LossFn, device: torch.device,
                  exclude: frozenset[str] = frozenset()) -> torch.Tensor:
    """∇ of the mean per-sample loss over all of ``batches`` at the model's weights, flattened (float64).

    Batches are weighted by their number of samples, so the result is the gradient of the
    client's mean loss F_k whatever its batch sizes. The model is put in eval mode (BatchNorm
    uses its running statistics, dropout is off): the meter reads the model, not a training step.
    ``exclude`` names parameters left out of the gradient (a personalised algorithm's private
    entries, which the federation never shares); frozen parameters are always left out.
    """
    params = [param for name, param in model.named_parameters() if param.requires_grad and name not in exclude]
    if not params:
        raise ValueError("the model has no trainable parameter to take a gradient over")
    total = [torch.zeros_like(param, dtype=torch.float64) for param in params]
    count = 0
    model.eval()
    for batch in batches:
        batch = to_device(batch, device)
        per_sample = loss_fn(model, batch, reduction="none")
        grads = torch.autograd.grad(per_sample.sum(), params, allow_unused=True, materialize_grads=True)
        for accumulated, grad in zip(total, grads):
            accumulated.add_(grad.to(torch.float64))
        count += per_sample.numel()
    if count == 0:
        raise ValueError("a client has no samples to take a gradient over")
    return torch.cat([grad.flatten() for grad in total]) / count


class DissimilarityAccumulator:
    """G², B² and ‖∇F‖² of client gradients folded in one at a time, in O(one gradient) memory.

    The engines' per-round diagnostics (network/diagnostics.py) fold every client's gradient of a
    large model; stacking K of them would need K times the model in float64. Hand-written rather than
    taken from a library because G² is a weighted variance of vectors, which no library here streams:
    West's (1979) weighted update of the mean and of M2 = Σ_k w_k ‖g_k − mean‖², which avoids the
    cancellation of Σ p_k‖g_k‖² − ‖∇F‖² when the clients nearly agree.
    """

    def __init__(self) -> None:
        self.total_weight = 0.0
        self.mean: torch.Tensor | None = None
        self.m2 = 0.0
        self.weighted_norm2 = 0.0  # Σ_k w_k ‖g_k‖²

    def add(self, gradient: torch.Tensor, size: float) -> None:
        """Fold in one client's gradient (a flat vector) with weight ``size`` (n_k; 0: counted, no weight)."""
        if size < 0:
            raise ValueError(f"a client size must be >= 0, got {size}")
        gradient = gradient.to(torch.float64)
        if self.mean is None:
            self.mean = torch.zeros_like(gradient)
        if size == 0:
            return
        self.total_weight += float(size)
        delta = gradient - self.mean
        self.mean = self.mean + delta * (float(size) / self.total_weight)
        self.m2 += float(size) * float(delta @ (gradient - self.mean))
        self.weighted_norm2 += float(size) * float(gradient @ gradient)

    def result(self) -> Dissimilarity:
        """The reading over every gradient folded in so far."""
        if self.total_weight <= 0:
            raise ValueError("client sizes must be >= 0 and not all 0")
        g2 = max(self.m2, 0.0) / self.total_weight
        mean_norm2 = self.weighted_norm2 / self.total_weight
        global_norm2 = float(self.mean @ self.mean)
        if global_norm2 > 0:
            b2 = mean_norm2 / global_norm2
        else:
            b2 = 1.0 if mean_norm2 == 0 else float("inf")
        return Dissimilarity(g2=g2, b2=b2, global_grad_norm2=global_norm2)


def dissimilarity(gradients: Sequence[torch.Tensor], sizes: Sequence[int]) -> Dissimilarity:
    """G² and B² of client gradients ``gradients`` (flat vectors) weighted by client sizes ``sizes``."""
    if len(gradients) != len(sizes) or not gradients:
        raise ValueError("need one gradient per client and at least one client")
    if any(size < 0 for size in sizes) or sum(sizes) <= 0:
        raise ValueError(f"client sizes must be >= 0 and not all 0, got {list(sizes)}")
    accumulator = DissimilarityAccumulator()
    for gradient, size in zip(gradients, sizes):
        accumulator.add(gradient, size)
    return accumulator.result()
