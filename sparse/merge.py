"""Task arithmetic (Ilharco et al. 2023) over sparse fine-tunes, and interference diagnostics.

From a base θ_0 and fine-tuned models θ_k: task vectors τ_k = θ_k − θ_0 and the merged
model θ_0 + λ Σ_k τ_k, with λ chosen on validation data. Sparse fine-tuning (TaLoS)
aims at task vectors that interfere little: nearly orthogonal (pairwise cosine) and
with little overlap of their supports (Jaccard of the masks).

Only floating-point entries form a task vector; integer buffers (BatchNorm's counter)
keep the base's value in a merge.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
from torch import Tensor

from network.aggregation import Weights
from utils.errors import TaskHetError


def task_vector(base: Weights, finetuned: Weights) -> Weights:
    """τ = θ_k − θ_0 over the base's floating-point entries (the fine-tuned model must have them all)."""
    missing = [key for key in base if key not in finetuned]
    if missing:
        raise TaskHetError(f"the fine-tuned model lacks {len(missing)} entries of the base, e.g. {missing[:3]}")
    return {key: finetuned[key].detach().float() - value.detach().float()
            for key, value in base.items() if value.is_floating_point()}


def merge(base: Weights, vectors: Sequence[Weights], lam: float) -> Weights:
    """θ_0 + λ Σ_k τ_k (entries without a task vector, and the dtype of each entry, as in the base)."""
    merged = {}
    for key, value in base.items():
        if not value.is_floating_point() or not vectors:
            merged[key] = value.clone()
            continue
        total = torch.stack([vector[key] for vector in vectors]).sum(0)
        merged[key] = (value.float() + lam * total).to(value.dtype)
    return merged


def choose_lambda(base: Weights, vectors: Sequence[Weights], loss: Callable[[Weights], float],
                  grid: Iterable[float]) -> tuple[float, dict[float, float]]:
    """The λ of ``grid`` whose merged model has the lowest ``loss`` (first on ties), and every λ's loss."""
    losses = {float(lam): float(loss(merge(base, vectors, lam))) for lam in grid}
    if not losses:
        raise TaskHetError("the λ grid is empty")
    return min(losses, key=losses.get), losses


def flatten(vector: Weights, keys: Sequence[str]) -> Tensor:
    """One flat float vector of the named entries, in ``keys`` order."""
    return torch.cat([vector[key].reshape(-1).float() for key in keys])


def cosine_matrix(vectors: Sequence[Weights]) -> Tensor:
    """[K, K] cosine similarities between flattened task vectors (0 where a vector is all zero)."""
    keys = sorted(vectors[0]) if vectors else []
    flat = torch.stack([flatten(vector, keys) for vector in vectors]).double()
    norms = flat.norm(dim=1, keepdim=True)
    unit = torch.where(norms > 0, flat / norms.clamp(min=1e-300), torch.zeros_like(flat))
    return unit @ unit.T


def support(vector: Weights) -> Weights:
    """The mask of a task vector: True where it is non-zero (for a sparse fine-tune, its trained entries)."""
    return {key: value != 0 for key, value in vector.items()}


def jaccard_matrix(masks: Sequence[Weights]) -> Tensor:
    """[K, K] Jaccard index |A ∩ B| / |A ∪ B| between masks over their common keys (1 when both are empty)."""
    keys = sorted(set.intersection(*(set(mask) for mask in masks))) if masks else []
    flat = [torch.cat([mask[key].reshape(-1).bool() for key in keys]) for mask in masks]
    result = torch.ones(len(flat), len(flat), dtype=torch.float64)
    for row, first in enumerate(flat):
        for column, second in enumerate(flat):
            union = int((first | second).sum())
            if union:
                result[row, column] = int((first & second).sum()) / union
    return result


def plot_matrix(matrix: Tensor, names: Sequence[str], title: str, out_png, vmin: float = -1.0) -> None:
    """A [K, K] heatmap (cosine: vmin −1; Jaccard: vmin 0), clients on both axes."""
    from utils.plots import plt, save_figure  # only here: the arithmetic never needs matplotlib

    size = min(12.0, 2.5 + 0.35 * len(names))
    figure, axis = plt.subplots(figsize=(size, size * 0.85))
    image = axis.imshow(matrix.numpy(), vmin=vmin, vmax=1, cmap="RdBu_r" if vmin < 0 else "viridis")
    axis.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
    axis.set_yticks(range(len(names)), names, fontsize=7)
    axis.set_xlabel("client")
    axis.set_ylabel("client")
    axis.set_title(title)
    figure.colorbar(image, ax=axis, fraction=0.046)
    save_figure(figure, out_png, dpi=110)
