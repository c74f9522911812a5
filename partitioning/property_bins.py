"""Groups by a property of each sample's target: the positive control's partition.

A label-based partition skews clients over scene labels and an embedding-based one over a model's clusters. The
positive control skews them over quantile bins of a property of the target itself (for a dense L1 task: the mean
target value over the valid pixels, e.g. how much edge or keypoint response an image holds), through the same
Dirichlet mixture. Clients then hold images whose targets differ in scale, which is a heterogeneity the task's loss
must feel: if the federated loss does not rise under it either, the setup cannot show a penalty at all.
Flower Datasets' ContinuousPartitioner partitions by one continuous property in the same spirit.
"""

from __future__ import annotations

import numpy as np


def quantile_bins(values: np.ndarray, reference: np.ndarray, n_bins: int) -> np.ndarray:
    """The bin of each of ``values`` between the k/n_bins quantiles (k = 1 .. n_bins − 1) of ``reference``.

    The edges come from ``reference`` alone (the training rows), so the test rows are binned by the training rows'
    edges. A value on an edge goes to the lower bin, so tied values always share a bin. Bins that no value falls in
    (ties at a quantile: many zeros) are dropped and the rest renumbered 0, 1, ... in value order.

    Args:
        values: the property of every sample to bin (finite).
        reference: the property of the samples whose quantiles set the edges (finite, at least one).
        n_bins: how many bins at most (≥ 1).

    Returns:
        int64 bin per value, 0 .. (non-empty bins − 1).
    """
    values, reference = np.asarray(values, dtype=float), np.asarray(reference, dtype=float)
    if n_bins < 1:
        raise ValueError(f"n_bins must be at least 1, got {n_bins}")
    if reference.size == 0:
        raise ValueError("no reference values to take quantiles of")
    if not (np.isfinite(values).all() and np.isfinite(reference).all()):
        raise ValueError("values must be finite")
    edges = np.quantile(reference, np.arange(1, n_bins) / n_bins)
    raw = np.searchsorted(edges, values, side="left")
    _, renumbered = np.unique(raw, return_inverse=True)
    return renumbered.astype(np.int64)
