"""Task arithmetic (Ilharco et al. 2023) over sparse fine-tunes, and interference diagnostics.

From a base θ_0 and fine-tuned models θ_k: task vectors τ_k = θ_k − θ_0 and the merged
model θ_0 + λ Σ_k τ_k, with λ chosen on validation data. Sparse fine-tuning (TaLoS)
aims at task vectors that interfere little: nearly orthogonal (pairwise cosine) and
with little overlap of their supports (Jaccard of the masks).

Only floating-point entries form a task vector; integer buffers (BatchNorm's counter)
keep the base's value in a merge. Each entry is computed in its own dtype, widened to at
least float32 (:func:`working_dtype`), and stored back in the base's dtype, so a float64
entry is merged in float64 and λ = 0 returns θ_0 bit for bit for every dtype.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import math

import torch
from torch import Tensor

from network.aggregation import Weights
from utils.errors import TaskHetError


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an entry's arithmetic runs in: its own, widened to at least float32 (float16 -> float32,
    float64 stays float64). Either cast back is exact, so λ = 0 gives the base entry bit for bit."""
    return torch.promote_types(dtype, torch.float32)


def check_compatible(base: Weights, finetuned: Weights, base_name: str = "the base",
                     finetuned_name: str = "the fine-tuned model") -> None:
    """Refuse two state dicts that do not share every key with the same shape, naming both and the entry."""
    for key in sorted(set(base) ^ set(finetuned)):
        holder, other = (base_name, finetuned_name) if key in base else (finetuned_name, base_name)
        raise TaskHetError(f"{holder} has entry {key!r} and {other} has not: task arithmetic needs checkpoints of "
                           "one architecture")
    for key, value in base.items():
        if tuple(value.shape) != tuple(finetuned[key].shape):
            raise TaskHetError(f"entry {key!r} has shape {list(value.shape)} in {base_name} but "
                               f"{list(finetuned[key].shape)} in {finetuned_name}: task arithmetic needs checkpoints "
                               "of one architecture")


def task_vector(base: Weights, finetuned: Weights, base_name: str = "the base",
                finetuned_name: str = "the fine-tuned model") -> Weights:
    """τ = θ_k − θ_0 over the base's floating-point entries, each in its :func:`working_dtype`.

    The two state dicts must have the same keys and shapes (:func:`check_compatible`; the names go into its error).
    """
    check_compatible(base, finetuned, base_name, finetuned_name)
    vectors = {}
    for key, value in base.items():
        if value.is_floating_point():
            dtype = working_dtype(value.dtype)
            vectors[key] = finetuned[key].detach().to(dtype) - value.detach().to(dtype)
    return vectors


def merge(base: Weights, vectors: Sequence[Weights], lam: float) -> Weights:
    """θ_0 + λ Σ_k τ_k (entries without a task vector, and the dtype of each entry, as in the base).

    ``lam`` must be finite: a NaN or infinite λ would write a model of NaNs.
    """
    check_lambda(lam)
    merged = {}
    for key, value in base.items():
        if not value.is_floating_point() or not vectors:
            merged[key] = value.clone()
            continue
        total = torch.stack([vector[key] for vector in vectors]).sum(0)
        merged[key] = (value.to(total.dtype) + lam * total).to(value.dtype)
    return merged


def check_lambda(lam: float, what: str = "λ") -> float:
    """``lam`` as a float, or a TaskHetError when it is not a finite number."""
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam):
        raise TaskHetError(f"{what} must be a finite number, got {lam!r}")
    return float(lam)


def choose_lambda(base: Weights, vectors: Sequence[Weights], loss: Callable[[Weights], float],
                  grid: Iterable[float]) -> tuple[float, dict[float, float]]:
    """The λ of ``grid`` whose merged model has the lowest ``loss`` (first on ties), and every λ's loss.

    Every λ must be finite. A λ whose loss is NaN or infinite (a diverged merge) is never chosen over one
    with a finite loss; when no λ has a finite loss, that is an error naming the losses.
    """
    grid = [check_lambda(lam) for lam in grid]
    losses = {lam: float(loss(merge(base, vectors, lam))) for lam in grid}
    if not losses:
        raise TaskHetError("the λ grid is empty")
    finite = [lam for lam in losses if math.isfinite(losses[lam])]
    if not finite:
        raise TaskHetError(f"no λ of the grid gives a finite validation loss: {losses}")
    return min(finite, key=losses.get), losses


def flatten(vector: Weights, keys: Sequence[str]) -> Tensor:
    """One flat float64 vector of the named entries, in ``keys`` order."""
    return torch.cat([vector[key].reshape(-1).double() for key in keys])


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
