"""Long-tailed subsets and head/middle/tail groups (datasets/long_tail.py), against published and hand counts."""

from __future__ import annotations

import numpy as np
import pytest

from datasets.long_tail import groups_by_mass, groups_by_shots, long_tail_counts, long_tail_indices
from utils.errors import TaskHetError


def test_cifar_lt_counts_match_the_published_totals():
    assert long_tail_counts(500, 100, 0.01).sum() == 10_847  # CIFAR-100-LT, IF 100
    assert long_tail_counts(5000, 10, 0.01).sum() == 12_406  # CIFAR-10-LT, IF 100
    counts = long_tail_counts(500, 100, 0.01)
    assert counts[0] == 500 and counts[-1] == 5 and (np.diff(counts) <= 0).all()
    with pytest.raises(TaskHetError, match="--imbalance_factor"):
        long_tail_counts(500, 100, 0.0)


def test_the_kept_images_are_seeded_and_exact_per_class():
    labels = np.repeat(np.arange(10), 50)
    kept = long_tail_indices(labels, 0.1, seed=3)
    assert (np.bincount(labels[kept], minlength=10) == long_tail_counts(50, 10, 0.1)).all()
    assert np.array_equal(kept, long_tail_indices(labels, 0.1, seed=3))
    assert not np.array_equal(kept, long_tail_indices(labels, 0.1, seed=4))


def test_groups_by_shots_and_by_mass_by_hand():
    counts = np.array([300, 150, 101, 100, 20, 19, 5])
    assert groups_by_shots(counts) == {"head": [0, 1, 2], "middle": [3, 4], "tail": [5, 6]}
    # total 695: cumulative starts 0, .432, .647, .792, .936, .964, .991 → head 0-2, middle 3-4, tail 5-6
    assert groups_by_mass(counts) == {"head": [0, 1, 2], "middle": [3, 4], "tail": [5, 6]}
    assert groups_by_mass(np.array([10, 40, 50])) == {"head": [2, 1], "middle": [0], "tail": []}
