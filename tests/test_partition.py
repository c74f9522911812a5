"""Partition schemes: every registered scheme is disjoint, seeded and rejects bad input;
the Dirichlet, shards and natural schemes have the statistics their docstrings promise."""

from __future__ import annotations

import time

import numpy as np
import pytest

from partitioning.allocation import UNUSED, client_sizes, dirichlet, largest_remainder
from partitioning.client_tests import client_test_mask
from partitioning.partition import get_partitioner, list_schemes, scheme_parameters
from partitioning.partition_stats import client_stats, group_counts, plot_heatmap
from utils.errors import TaskHetError

N_SAMPLES, N_GROUPS, N_BUILDINGS = 3000, 8, 20


def data(seed: int = 0, n_samples: int = N_SAMPLES, n_groups: int = N_GROUPS) -> tuple[np.ndarray, np.ndarray]:
    """Skewed group labels (as strings, like cluster ids read from CSV) and buildings."""
    rng = np.random.default_rng(seed)
    proportions = rng.dirichlet(np.full(n_groups, 2.0))
    groups = rng.choice(n_groups, size=n_samples, p=proportions)
    buildings = np.array([f"b{i:02d}" for i in rng.integers(0, N_BUILDINGS, n_samples)])
    return groups.astype(str), buildings


def build(name: str, n_clients: int = 10, **params):
    """A scheme with the typical parameters it takes (alpha, groups_per_client)."""
    typical = {"alpha": 1.0, "groups_per_client": 2}
    accepted = scheme_parameters(name)
    return get_partitioner(name, n_clients, **{**{k: v for k, v in typical.items() if k in accepted}, **params})


@pytest.mark.parametrize("name", list_schemes())
def test_every_sample_at_most_once_and_unused_reported(name):
    groups, buildings = data()
    partition = build(name).split(groups, sources=buildings)
    indices = partition.client_indices()
    assert len(indices) == 10
    flat = np.concatenate(indices)
    assert np.unique(flat).size == flat.size  # no sample on two clients
    assert np.array_equal(np.sort(np.concatenate([flat, partition.unused])), np.arange(N_SAMPLES))
    assert all(np.all(np.diff(client) > 0) for client in indices)
    assert all(np.all(partition.client_of[client] == k) for k, client in enumerate(indices))
    assert partition.sizes.min() >= 1


@pytest.mark.parametrize("name", list_schemes())
def test_seeded(name):
    groups, buildings = data()
    first = build(name, seed=3).split(groups, sources=buildings).client_of
    again = build(name, seed=3).split(groups, sources=buildings).client_of
    other = build(name, seed=4).split(groups, sources=buildings).client_of
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


@pytest.mark.parametrize("name", list_schemes())
@pytest.mark.parametrize(
    "params, n_samples, flag",
    [
        ({"n_clients": 0}, 100, "n_clients"),
        ({"n_clients": 101}, 100, "only 100"),
        ({"n_clients": 4, "min_client_size": 30}, 100, "min_client_size"),
        ({"n_clients": 4, "min_client_size": 0}, 100, "min_client_size"),
    ],
)
def test_rejects_bad_common_arguments(name, params, n_samples, flag):
    groups, buildings = data(n_samples=n_samples)
    with pytest.raises(TaskHetError, match=flag):
        build(name, **params).split(groups, sources=buildings)


@pytest.mark.parametrize("name", [n for n in list_schemes() if "size_skew" in scheme_parameters(n)])
@pytest.mark.parametrize("skew", ["gauss:1", "lognormal:x", "lognormal:-1", "powerlaw:0"])
def test_rejects_bad_size_skew(name, skew):
    groups, buildings = data()
    with pytest.raises(TaskHetError, match="size_skew"):
        build(name, size_skew=skew).split(groups, sources=buildings)


@pytest.mark.parametrize("name", [n for n in list_schemes() if "alpha" in scheme_parameters(n)])
@pytest.mark.parametrize("alpha", [0.0, -1.0, float("nan"), float("inf")])
def test_rejects_bad_alpha(name, alpha):
    groups, _ = data()
    with pytest.raises(TaskHetError, match="alpha"):
        build(name, alpha=alpha).split(groups)


def test_unknown_scheme_and_parameter_are_named():
    with pytest.raises(TaskHetError, match="iid"):
        get_partitioner("nope", 3)
    with pytest.raises(TaskHetError, match="--alpha"):
        get_partitioner("iid", 3, alpha=1.0)


def test_iid_equal_sizes_use_every_sample():
    groups, _ = data()
    partition = build("iid", n_clients=7).split(groups)
    assert partition.unused.size == 0
    assert partition.sizes.max() - partition.sizes.min() <= 1


def realised_mixtures(partition, groups: np.ndarray) -> np.ndarray:
    _, codes = np.unique(groups, return_inverse=True)
    counts = group_counts(partition.client_of, codes, partition.n_clients, codes.max() + 1)
    return counts / counts.sum(axis=1, keepdims=True)


def test_dirichlet_mixture_mean_client_mixture_is_global():
    # Unequal client sizes, so the unweighted mean over clients is not p by construction;
    # 1000 clients of >= 50 samples keep its noise (Dirichlet + multinomial) near 0.005.
    groups, _ = data(seed=1, n_samples=200_000)
    partitioner = build("dirichlet_mixture", n_clients=1000, alpha=1.0, size_skew="lognormal:0.5", min_client_size=50, seed=5)
    partition = partitioner.split(groups)
    global_mixture = np.bincount(np.unique(groups, return_inverse=True)[1]) / groups.size
    assert partition.sizes.max() > 3 * partition.sizes.min()
    assert np.ptp(global_mixture) > 0.1  # Dir(α·1) instead of Dir(α·p) would be caught
    np.testing.assert_allclose(realised_mixtures(partition, groups).mean(axis=0), global_mixture, atol=0.012)


def test_dirichlet_mixture_large_alpha_is_near_iid():
    groups, _ = data(seed=2, n_samples=20_000)
    mixture = client_stats(build("dirichlet_mixture", 50, alpha=1e4).split(groups).client_of, groups, 50)
    iid = client_stats(build("iid", 50).split(groups).client_of, groups, 50)
    assert mixture["js_divergence"].mean() < 0.01
    assert mixture["effective_groups"].mean() > 0.95 * iid["effective_groups"].mean()


def test_dirichlet_mixture_tiny_alpha_gives_one_group_per_client():
    groups, _ = data(seed=3, n_samples=20_000)
    partition = build("dirichlet_mixture", 100, alpha=1e-3).split(groups)
    dominant = realised_mixtures(partition, groups).max(axis=1)
    assert np.mean(dominant > 0.9) >= 0.9
    assert np.median(dominant) == 1.0


@pytest.mark.parametrize("scheme", ["dirichlet_mixture", "dirichlet_split"])
def test_smaller_alpha_is_more_skewed(scheme):
    groups, _ = data(seed=4, n_samples=20_000)
    divergence = [client_stats(build(scheme, 20, alpha=a).split(groups).client_of, groups, 20)["js_divergence"].mean() for a in (0.3, 3.0, 300.0)]
    assert divergence[0] > divergence[1] > divergence[2]


def test_dirichlet_split_fails_clearly_and_fast_when_clients_stay_empty():
    groups, _ = data(n_samples=500, n_groups=3)
    start = time.perf_counter()
    with pytest.raises(TaskHetError, match=r"after 10 draws.*raise --alpha"):
        build("dirichlet_split", n_clients=100, alpha=1e-3).split(groups)
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("per_client", [1, 2, 3])
def test_shards_hold_exactly_nc_groups(per_client):
    groups, _ = data(seed=5)
    partition = build("shards", n_clients=12, groups_per_client=per_client).split(groups)
    stats = client_stats(partition.client_of, groups, 12)
    assert (stats["n_groups"] == per_client).all()
    assert partition.unused.size == 0  # 12 clients × Nc >= 8 groups: every group has a holder


def test_shards_reject_more_groups_per_client_than_groups():
    groups, _ = data()
    with pytest.raises(TaskHetError, match="groups_per_client 9"):
        build("shards", groups_per_client=9).split(groups)


def test_natural_one_client_per_building():
    groups, buildings = data()
    partition = build("natural", n_clients=N_BUILDINGS).split(groups, sources=buildings)
    assert partition.unused.size == 0
    for client, label in enumerate(partition.client_labels):
        assert set(buildings[partition.client_of == client]) == {label}
    fewer = build("natural", n_clients=5).split(groups, sources=buildings)
    assert len(fewer.client_labels) == 5
    assert set(buildings[fewer.unused]).isdisjoint(fewer.client_labels)
    with pytest.raises(TaskHetError, match="size_skew"):
        build("natural", size_skew="lognormal:1").split(groups, sources=buildings)
    with pytest.raises(TaskHetError, match="only 20"):
        build("natural", n_clients=21).split(groups, sources=buildings)


@pytest.mark.parametrize("skew", ["lognormal:1.5", "powerlaw:1.2"])
def test_size_skew_sizes_sum_and_respect_minimum(skew):
    sizes = client_sizes(10_000, 100, skew, 20, np.random.default_rng(0))
    assert sizes.sum() == 10_000
    assert sizes.min() >= 20
    assert sizes.max() > 5 * np.median(sizes)
    equal = client_sizes(10_001, 100, None, 1, np.random.default_rng(0))
    assert set(equal.tolist()) == {100, 101} and equal.sum() == 10_001


def test_size_skew_combines_with_shards():
    groups, _ = data()
    partition = build("shards", n_clients=10, groups_per_client=2, size_skew="lognormal:1.0").split(groups)
    stats = client_stats(partition.client_of, groups, 10)
    assert (stats["n_groups"] == 2).all()
    assert stats["size"].max() > 2 * stats["size"].min()


def test_largest_remainder_is_exact():
    counts = largest_remainder(np.array([10, 7]), np.array([[1.0, 1.0, 1.0], [0.0, 2.0, 1.0]]))
    assert counts.tolist() == [[4, 3, 3], [0, 5, 2]]


def test_dirichlet_tiny_alpha_rows_are_valid():
    draws = dirichlet(np.random.default_rng(0), np.array([1e-6, 0.5, 1e-7]), 1000)
    assert np.isfinite(draws).all()
    np.testing.assert_allclose(draws.sum(axis=1), 1.0)


def test_client_test_mask_keeps_train_on_every_client():
    client_of = np.array([0] * 10 + [1] * 2 + [2] + [UNUSED] * 3)
    mask = client_test_mask(client_of, 0.3, np.random.default_rng(0))
    assert mask[:10].sum() == 3 and mask[10:12].sum() == 1 and not mask[12] and not mask[13:].any()
    with pytest.raises(TaskHetError, match="client_test_fraction"):
        client_test_mask(client_of, 1.0, np.random.default_rng(0))


def test_client_stats_hand_computed(tmp_path):
    # Global mixture (a, b) = (0.5, 0.5); client 0 holds (a, b), client 1 holds (a, a).
    client_of = np.array([0, 0, 1, 1, UNUSED, UNUSED])
    groups = np.array(["a", "b", "a", "a", "b", "b"])
    stats = client_stats(client_of, groups, 3)
    assert stats["size"].tolist() == [2, 2, 0]
    assert stats["count_a"].tolist() == [1, 2, 0] and stats["count_b"].tolist() == [1, 0, 0]
    np.testing.assert_allclose(stats["effective_groups"][:2], [2.0, 1.0])
    # JS(P ‖ Q) = ½ KL(P ‖ M) + ½ KL(Q ‖ M), M = (P + Q) / 2; client 1: P = (1, 0), Q = (½, ½).
    m = np.array([0.75, 0.25])
    expected = 0.5 * np.log2(1 / m[0]) + 0.5 * (0.5 * np.log2(0.5 / m[0]) + 0.5 * np.log2(0.5 / m[1]))
    np.testing.assert_allclose(stats["js_divergence"][:2], [0.0, expected])
    plot_heatmap(stats, tmp_path / "heatmap.png", "test")
    assert (tmp_path / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_paper_scale_partition_is_fast():
    groups = np.random.default_rng(0).integers(0, 100, 1_000_000)
    start = time.perf_counter()
    partition = build("dirichlet_split", n_clients=1000, alpha=0.5).split(groups)
    assert time.perf_counter() - start < 10
    assert partition.sizes.sum() == 1_000_000


# ----- dirichlet_per_class (FedLoGe's Fed-LT split, issue 20) -----
def per_class_counts(alpha: float, seed: int, n_clients: int = 5, n_per_class: int = 20000) -> np.ndarray:
    """[n_clients, 2] counts of a two-class set split by dirichlet_per_class."""
    groups = np.repeat([0, 1], n_per_class)
    partition = get_partitioner("dirichlet_per_class", n_clients, alpha=alpha, seed=seed).split(groups)
    return np.stack([np.bincount(partition.client_of[groups == label], minlength=n_clients) for label in (0, 1)], axis=1)


def test_dirichlet_per_class_assigns_every_sample_exactly_once():
    groups, _ = data()
    partition = get_partitioner("dirichlet_per_class", 10, alpha=0.1, seed=3).split(groups)
    assert partition.unused.size == 0
    flat = np.concatenate(partition.client_indices())
    assert np.array_equal(np.sort(flat), np.arange(groups.size))  # each sample once, none left over


@pytest.mark.parametrize("alpha", [0.1, 0.5, 2.0])
def test_dirichlet_per_class_shares_follow_the_dirichlet_marginal_over_seeds(alpha):
    from scipy import stats

    n_clients, n = 5, 20000
    shares = np.concatenate([per_class_counts(alpha, seed, n_clients, n)[0] / n for seed in range(200)])
    # A client's share of a class is Beta(α, (K−1)α) (the Dir(α·1) marginal) plus multinomial noise of
    # variance ≤ 1/(4n) = 1.25e-5, negligible next to the Beta's variance (1/K)(1 − 1/K)/(Kα + 1).
    marginal = stats.beta(alpha, (n_clients - 1) * alpha)
    assert abs(shares.mean() - 1 / n_clients) < 4 * marginal.std() / np.sqrt(shares.size)
    assert shares.var() == pytest.approx(0.2 * 0.8 / (n_clients * alpha + 1), rel=0.15)
    tail = marginal.sf(0.5)  # P(one client holds more than half of a class)
    assert abs((shares > 0.5).mean() - tail) < 4 * np.sqrt(tail * (1 - tail) / shares.size)
    if alpha >= 0.5:  # at α = 0.1 a third of the shares lie below 1/n, where counts cannot follow a density
        assert stats.kstest(shares, marginal.cdf).pvalue > 1e-3


def test_dirichlet_per_class_counts_are_multinomial_not_floored_cut_points():
    # At α → ∞ every share is 1/K: dirichlet_split then cuts each class into exact ⌊n/K⌋ blocks,
    # while the per-sample multinomial draw has Var(count) = n·(1/K)(1 − 1/K) = 1000·0.2·0.8 = 160.
    counts = np.concatenate([per_class_counts(1e9, seed, 5, 1000)[:, 0] for seed in range(300)])
    assert 130 < counts.var() < 190
    split = get_partitioner("dirichlet_split", 5, alpha=1e9, seed=0).split(np.zeros(1000, dtype=int))
    assert np.abs(split.sizes - 200).max() <= 1  # cut points: no sampling noise at all
