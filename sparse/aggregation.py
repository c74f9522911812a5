"""Aggregation of sparse client updates whose masks differ: the mean over the clients that trained each entry.

With per-client masks, an entry some clients froze gets, from each of them, a Δ of
exactly 0 that carries no information: that client never trained it. The plain
sample-weighted mean would count those zeros as votes for "no change" and shrink the
entry's update by the fraction of clients that froze it — penalising exactly the
entries where masks disagree, and making the merged update depend on how many
clients happened to freeze an entry. Here entry j takes
Δ̄_j = Σ_i n_i m_ij Δ_ij / Σ_i n_i m_ij (TIES-merging's "disjoint mean"), and 0 where
no client trained it. With identical masks it is the plain sample-weighted mean.
"""

from __future__ import annotations

import torch
from torch import Tensor

from network.aggregation import Weights
from utils.errors import TaskHetError


class MaskedMean:
    """Streaming per-entry weighted mean: ``add`` one upload at a time (Δ and mask), ``mean`` at the end."""

    def __init__(self) -> None:
        self._sums: Weights = {}
        self._weights: Weights = {}
        self.count = 0

    def add(self, delta: Weights, mask: Weights, weight: float) -> None:
        """Fold one client's Δ, its masks (True = trained; a key without a mask counts as trained) and n_i."""
        if weight < 0:
            raise ValueError(f"aggregation weight must be >= 0, got {weight}")
        if self.count and set(delta) != set(self._sums):
            raise TaskHetError(f"upload keys differ from the first upload's: {sorted(set(delta) ^ set(self._sums))[:5]}")
        for key, value in delta.items():
            value = value.detach()
            share = _share(mask.get(key), value, weight)
            if key not in self._sums:
                self._sums[key] = torch.zeros_like(value)
                self._weights[key] = torch.zeros_like(value)
            self._sums[key].add_(value * share)
            self._weights[key].add_(share)
        self.count += 1

    def mean(self) -> Weights:
        """Σ n_i m_i Δ_i / Σ n_i m_i per entry; 0 where no client trained the entry."""
        if self.count == 0:
            raise TaskHetError("nothing to aggregate: no client upload this round")
        return {key: torch.where(self._weights[key] > 0, total / self._weights[key].clamp(min=1e-30), 0.0)
                for key, total in self._sums.items()}


def _share(mask: Tensor | None, like: Tensor, weight: float) -> Tensor:
    if mask is None:
        return torch.full_like(like, weight)
    return mask.to(device=like.device, dtype=like.dtype) * weight
