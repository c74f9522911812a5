"""Property-based checks over random sizes, alphas and client counts.

For every scheme and any input (hypothesis): no sample is held twice, every sample is either
held or reported unused, sizes respect the targets and the minimum, and a split either
succeeds or raises TaskHetError, within a deadline (no hang). Then the sharding of issue 14
over loops of seeds and sizes: ``nc_shards`` (exactly Nc groups per client, sizes within 1,
disjoint, covering) and ``iid`` (equal sizes, every client's labels the global mix)."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioning.allocation import client_sizes
from partitioning.client_tests import client_test_mask
from partitioning.partition import get_partitioner, list_schemes, scheme_parameters
from utils.errors import TaskHetError
from utils.seeding import numpy_rng

# A split of a few hundred samples takes milliseconds; two seconds means something loops.
SETTINGS = settings(max_examples=150, deadline=timedelta(seconds=2), suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw):
    n_samples = draw(st.integers(1, 400))
    n_groups = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    groups = rng.integers(0, n_groups, n_samples)
    buildings = rng.integers(0, draw(st.integers(1, 15)), n_samples)
    scheme = draw(st.sampled_from(list_schemes()))
    params = {"seed": seed, "min_client_size": draw(st.integers(1, 5))}
    accepted = scheme_parameters(scheme)
    if "alpha" in accepted:
        params["alpha"] = 10 ** draw(st.floats(-3, 4))
    if "groups_per_client" in accepted:
        params["groups_per_client"] = draw(st.integers(1, 4))
    if scheme != "natural":
        params["size_skew"] = draw(st.sampled_from([None, "lognormal:0.5", "lognormal:2", "powerlaw:1.5"]))
    n_clients = draw(st.integers(1, max(1, min(n_samples, 60))))
    return scheme, n_clients, params, groups, buildings


@SETTINGS
@given(problems())
def test_split_is_a_partition_or_a_clear_error(problem):
    scheme, n_clients, params, groups, buildings = problem
    try:
        partition = get_partitioner(scheme, n_clients, **params).split(groups, sources=buildings)
    except TaskHetError as error:
        assert str(error).startswith(scheme)
        return
    indices = partition.client_indices()
    flat = np.concatenate(indices)
    assert np.unique(flat).size == flat.size
    assert np.array_equal(np.sort(np.concatenate([flat, partition.unused])), np.arange(groups.size))
    assert len(indices) == n_clients
    assert partition.sizes.min() >= params["min_client_size"]
    if scheme in ("iid", "dirichlet_mixture"):
        # These schemes meet their target sizes exactly.
        target = client_sizes(groups.size, n_clients, params.get("size_skew"), params["min_client_size"], numpy_rng(params["seed"], "partition", scheme))
        assert np.array_equal(partition.sizes, target)
    test = client_test_mask(partition.client_of, 0.25, np.random.default_rng(0))
    train_sizes = np.bincount(partition.client_of[~test & (partition.client_of >= 0)], minlength=n_clients)
    assert train_sizes.min() >= 1


@SETTINGS
@given(st.integers(1, 5000), st.integers(1, 200), st.sampled_from([None, "lognormal:1", "powerlaw:0.8"]), st.integers(0, 3))
def test_client_sizes_sum_and_minimum(n_samples, n_clients, skew, min_size):
    if n_clients * min_size > n_samples:
        return
    sizes = client_sizes(n_samples, n_clients, skew, min_size, np.random.default_rng(n_samples))
    assert sizes.sum() == n_samples
    assert sizes.min() >= min_size


# ----- the course's sharding (issue 14): plain loops over seeds and sizes, every case checked -----

def nc_properties(groups: np.ndarray, partition) -> tuple[set, int]:
    """The set of group counts per client and the spread of client sizes, after checking disjointness."""
    held = partition.client_of[partition.client_of >= 0]
    assert held.size + partition.unused.size == groups.size  # one client (or unused) per sample: disjoint
    classes = {np.unique(groups[partition.client_of == k]).size for k in range(partition.n_clients)}
    return classes, int(np.ptp(partition.sizes))


@pytest.mark.parametrize("per_client", [1, 5, 10, 50])
def test_nc_shards_course_setting_cifar100_every_cell_is_equal(per_client):
    # CIFAR-100 after a 10% validation split: 100 classes × 450 training images, K = 100 clients.
    groups = np.repeat(np.arange(100), 450)
    partition = get_partitioner("nc_shards", 100, groups_per_client=per_client, seed=per_client).split(groups)
    counts = np.stack([np.bincount(groups[partition.client_of == k], minlength=100) for k in range(100)])
    assert partition.unused.size == 0
    assert np.array_equal(np.sort(counts, axis=1)[:, -per_client:], np.full((100, per_client), 450 // per_client))
    assert (np.count_nonzero(counts, axis=1) == per_client).all()
    assert (partition.sizes == 450).all()


def test_nc_shards_properties_over_seeds_and_sizes():
    # Equal and unequal groups (within 5%, like digits' classes), K·Nc a multiple of G or not.
    failures = []
    for seed in range(40):
        rng = np.random.default_rng(seed)
        n_groups = int(rng.integers(2, 12))
        per_client = int(rng.integers(1, n_groups + 1))
        n_clients = int(rng.integers(int(np.ceil(n_groups / per_client)), 25))
        sizes = np.full(n_groups, 60) if seed % 2 else rng.integers(57, 63, n_groups)
        groups = rng.permutation(np.repeat(np.arange(n_groups), sizes))
        partition = get_partitioner("nc_shards", n_clients, groups_per_client=per_client, seed=seed).split(groups)
        classes, spread = nc_properties(groups, partition)
        if classes != {per_client} or spread > 1:
            failures.append((seed, n_groups, per_client, n_clients, classes, spread))
        # Equal groups whose holders split them evenly always admit a cover: then nothing may be left out.
        holders, remainder = divmod(n_clients * per_client, n_groups)
        if seed % 2 and remainder == 0 and (n_groups * 60) % n_clients == 0 and partition.unused.size:
            failures.append((seed, "unused", partition.unused.size))
    assert not failures


def test_nc_shards_cover_and_equal_sizes_conflict_keeps_sizes_within_one():
    # K = G = 3, Nc = 1: client = class, so sizes 10, 12, 14 cannot be equal; common size 10, then +1
    # wherever a class has a sample left: sizes 10, 11, 11 and 0 + 1 + 3 samples unused.
    groups = np.repeat(np.arange(3), [10, 12, 14])
    partition = get_partitioner("nc_shards", 3, groups_per_client=1, seed=0).split(groups)
    by_class = {int(groups[partition.client_of == k][0]): int(size) for k, size in enumerate(partition.sizes)}
    assert by_class == {0: 10, 1: 11, 2: 11}
    assert partition.unused.size == 4


@pytest.mark.parametrize("params, n_clients, message", [
    ({"groups_per_client": 4}, 5, "exceeds the 3 groups"),
    ({"groups_per_client": 1}, 2, "2 slots cannot hold all 3 groups"),
    ({"groups_per_client": 1, "size_skew": "lognormal:1"}, 3, "size_skew"),
    ({"groups_per_client": 3}, 11, "group #0 has 10 samples but 11 clients"),
])
def test_nc_shards_impossible_requests_are_named(params, n_clients, message):
    groups = np.repeat(np.arange(3), [10, 12, 14])
    with pytest.raises(TaskHetError, match=message):
        get_partitioner("nc_shards", n_clients, **params).split(groups)


def test_iid_clients_are_equal_and_their_labels_uniform_over_seeds():
    for seed in range(20):
        rng = np.random.default_rng(seed)
        n_groups, n_clients = int(rng.integers(2, 15)), int(rng.integers(1, 30))
        groups = rng.integers(0, n_groups, int(rng.integers(n_clients * 5, 2000)))
        partition = get_partitioner("iid", n_clients, seed=seed).split(groups)
        assert partition.unused.size == 0 and np.ptp(partition.sizes) <= 1
        counts = np.stack([np.bincount(groups[partition.client_of == k], minlength=n_groups) for k in range(n_clients)])
        expected = partition.sizes[:, None] * np.bincount(groups, minlength=n_groups)[None, :] / groups.size
        assert (np.abs(counts - expected) < 1).all(), seed


def test_iid_hand_computed_counts():
    # 10 labels × 100 samples over 4 clients: 250 each, exactly 25 of every label.
    groups = np.repeat(np.arange(10), 100)
    partition = get_partitioner("iid", 4, seed=1).split(groups)
    counts = np.stack([np.bincount(groups[partition.client_of == k], minlength=10) for k in range(4)])
    assert (counts == 25).all()
