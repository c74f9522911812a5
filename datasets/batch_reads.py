"""Whole-batch reads: a dataset hands the DataLoader a collated batch in one read.

A family dataset may define ``read_batch(indices) -> dict``: the batch that torch's
``default_collate([dataset[i] for i in indices])`` would build (same keys, dtypes, shapes and
values), read with one indexing per array instead of one item at a time. Where the items are
tensors in memory (digits, CIFAR, the decoded and encoded caches), picking and collating
items one by one is most of a DataLoader batch's cost: for bench_engine's tiny MLP, 160
batches of 16 took 8.1 ms item by item and 1.9 ms read whole (docs/BENCHMARKS.md), and the
federated engines draw every client's batches each round.

:func:`batch_reader` finds such a dataset under any ``Subset`` wrappers (a client's rows, a
temporal schedule's rows) and wraps it so that torch's DataLoader can run with automatic
batching off (``batch_size=None``, a ``BatchSampler`` as the sampler: torch's documented
pattern for bulk reads). ``training.loop.make_loader`` uses it; a loader with a client's skew
(a ``collate_fn`` that transforms items) keeps item reads.
"""

from __future__ import annotations

import numpy as np
from torch.utils.data import Dataset, Subset


class BatchReads(Dataset):
    """A dataset keyed by a list of indices of ``dataset``, whose item is their collated batch.

    Args:
        dataset: the dataset a DataLoader would read item by item (possibly ``Subset``s of ``base``).
        base: the innermost dataset, which defines ``read_batch``.
        index_maps: each ``Subset``'s indices as an int64 array, outermost first.
    """

    def __init__(self, dataset: Dataset, base: Dataset, index_maps: list[np.ndarray]) -> None:
        self.dataset, self.base, self.index_maps = dataset, base, index_maps

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: list[int]) -> dict:
        rows = np.asarray(indices, dtype=np.int64)
        for index_map in self.index_maps:
            rows = index_map[rows]
        return self.base.read_batch(rows.tolist())


def batch_reader(dataset: Dataset) -> BatchReads | None:
    """``dataset`` as a :class:`BatchReads`, or None when the dataset under its ``Subset``s reads items only."""
    base, index_maps = dataset, []
    while type(base) is Subset:  # noqa: E721 (a subclass may change items; it keeps item reads)
        index_maps.append(np.asarray(base.indices, dtype=np.int64))
        base = base.dataset
    if not callable(getattr(base, "read_batch", None)):
        return None
    return BatchReads(dataset, base, index_maps)
