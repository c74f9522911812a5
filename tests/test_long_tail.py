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


# ----- the Fed-LT protocol's pieces (issue 20) -----
def test_class_groups_names_both_conventions_and_drops_empty_groups():
    from datasets.long_tail import class_groups

    # 150+60+30+10 = 250; a class's share starts at 0, .6, .84, .96 -> head {0, 1} (start < .75), middle {2}
    # (< .95), tail {3}; shots: > 100 many {0}, 20..100 medium {1, 2}, < 20 few {3}.
    assert class_groups(np.array([150, 60, 30, 10])) == {"head": [0, 1], "middle": [2], "tail": [3], "many": [0],
                                                         "medium": [1, 2], "few": [3]}
    assert "many" not in class_groups(np.array([50, 30, 10]))  # no class above 100 images


def test_proportional_local_test_follows_the_train_proportions_by_floor():
    from datasets.long_tail import proportional_test_indices

    test_labels = np.repeat(np.arange(4), 25)  # balanced, |test| = 100
    train_counts = np.array([30, 0, 7, 3])  # N = 40 -> ⌊30/40·100⌋ = 75, 0, ⌊7/40·100⌋ = 17, ⌊3/40·100⌋ = 7
    picked = proportional_test_indices(train_counts, test_labels, np.random.default_rng(0), "c1")
    assert np.bincount(test_labels[picked], minlength=4).tolist() == [75, 0, 17, 7]
    # Class 0 asks for 75 of its 25 images: every image three times; class 2's 17 are distinct.
    assert np.bincount(picked[test_labels[picked] == 0]).max() == 3
    assert np.unique(picked[test_labels[picked] == 2]).size == 17
    proportions = np.bincount(test_labels[picked], minlength=4) / picked.size
    assert np.abs(proportions - train_counts / train_counts.sum()).max() < 4 / picked.size  # within rounding


def test_proportional_local_tests_of_two_clients_may_overlap_and_are_seeded():
    from datasets.long_tail import proportional_test_indices

    test_labels = np.repeat(np.arange(2), 10)
    first = proportional_test_indices(np.array([5, 5]), test_labels, np.random.default_rng(1))
    second = proportional_test_indices(np.array([9, 1]), test_labels, np.random.default_rng(2))
    assert np.intersect1d(first, second).size > 0
    assert np.array_equal(first, proportional_test_indices(np.array([5, 5]), test_labels, np.random.default_rng(1)))


def test_a_local_test_request_for_a_client_without_training_rows_is_one_error():
    from datasets.long_tail import proportional_test_indices

    with pytest.raises(TaskHetError, match="^client 7: a local test set drawn in its training class proportions "
                                           "needs training rows, and it has none$"):
        proportional_test_indices(np.zeros(3, dtype=int), np.arange(3), np.random.default_rng(0), "7")
