"""Which rows are a client's test rows (step 3b's ``--client_tests``).

``held_out``: :func:`client_test_mask` marks a share of each client's own rows; ``test_split``:
:func:`deal_test_split` deals the manifest's test rows to the clients in each client's share of every group.
"""

from __future__ import annotations

import numpy as np

from partitioning.allocation import UNUSED, assign_counts, largest_remainder
from utils.errors import TaskHetError

HELD_OUT, TEST_SPLIT = "held_out", "test_split"
CLIENT_TESTS = (HELD_OUT, TEST_SPLIT)  # step 3b's --client_tests, the experiment key partition.client_tests
DEFAULT_TEST_FRACTION = 0.2  # --client_test_fraction's default under held_out


def client_test_mask(client_of: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Mark ``round(fraction · size)`` random samples of each client as client-test.

    A client with at least 2 samples keeps at least 1 train sample and, when
    ``fraction > 0``, gets at least 1 test sample; a 1-sample client keeps it for training.

    Returns:
        bool [n_samples]; unused samples are False.
    """
    if not 0 <= fraction < 1:
        raise TaskHetError(f"--client_test_fraction must be in [0, 1), got {fraction}")
    held = client_of != UNUSED
    sizes = np.bincount(client_of[held], minlength=int(client_of.max(initial=-1)) + 1)
    n_test = np.rint(fraction * sizes).astype(np.int64)
    if fraction > 0:
        n_test = np.maximum(n_test, (sizes >= 2).astype(np.int64))
    n_test = np.minimum(n_test, np.maximum(sizes - 1, 0))
    indices = np.flatnonzero(held)
    # Sorted by client, then by a uniform draw: np.lexsort((draw, client))'s order exactly, at a fraction of its cost
    # at 1M samples (bench/bench_compound.py): a quicksort of the draws (a stable one only if two draws are equal,
    # where the orders could differ), then a stable sort by client (16 bits: numpy's radix sort).
    draw = rng.random(indices.size)
    by_draw = np.argsort(draw)
    if (draw[by_draw][1:] == draw[by_draw][:-1]).any():
        by_draw = np.argsort(draw, kind="stable")
    clients = client_of[indices][by_draw]
    clients = clients.astype(np.int16) if sizes.size <= np.iinfo(np.int16).max else clients
    order = indices[by_draw[np.argsort(clients, kind="stable")]]
    starts = np.cumsum(sizes) - sizes
    rank = np.arange(order.size) - np.repeat(starts, sizes)
    mask = np.zeros(client_of.size, dtype=bool)
    mask[order] = rank < np.repeat(n_test, sizes)
    return mask


def deal_test_split(train_client_of: np.ndarray, train_groups: np.ndarray, test_groups: np.ndarray,
                    rng: np.random.Generator) -> np.ndarray:
    """Deal the manifest's test rows to the clients: group g's rows in proportion to each client's train rows of g.

    The ``test_split`` protocol of client tests (step 3b's ``--client_tests``): client k gets
    ``n_kg / n_g`` of group g's test rows (largest remainder, so the counts sum exactly), the rows themselves
    drawn at random. A client's test set then follows its own training distribution, like a held-out share
    of its rows, while every client trains on all of its rows; the global test split is only relabelled
    (each row goes to one client), never trained on. Test rows of a group no client trains on stay unused.

    Args:
        train_client_of: int [n_train], the client of each partitioned train row or ``UNUSED``.
        train_groups, test_groups: the group of each train row and of each test row (comparable values).
        rng: draws which rows of a group go to which client.

    Returns:
        int64 [n_test], the client of each test row or ``UNUSED``.
    """
    names, codes = np.unique(np.concatenate([np.asarray(train_groups), np.asarray(test_groups)]), return_inverse=True)
    train_codes, test_codes = codes[:len(train_groups)], codes[len(train_groups):]
    held = train_client_of != UNUSED
    n_clients = int(train_client_of.max(initial=-1)) + 1
    train_counts = np.zeros((names.size, max(n_clients, 1)), dtype=np.int64)  # [G, K]: n_kg
    np.add.at(train_counts, (train_codes[held], train_client_of[held]), 1)
    totals = np.bincount(test_codes, minlength=names.size)
    trained = train_counts.sum(axis=1) > 0
    counts = np.zeros_like(train_counts)  # a group no client trains on deals none of its test rows
    counts[trained] = largest_remainder(totals[trained], train_counts[trained].astype(np.float64))
    return assign_counts(test_codes, counts.T, rng)
