"""Property-based checks over random sizes, alphas and client counts (hypothesis).

For every scheme and any input: no sample is held twice, every sample is either held
or reported unused, sizes respect the targets and the minimum, and a split either
succeeds or raises TaskHetError, within a deadline (no hang)."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioning.allocation import client_sizes
from partitioning.partition import client_test_mask, get_partitioner, list_schemes, scheme_parameters
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
