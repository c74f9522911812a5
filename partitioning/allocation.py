"""The arithmetic under every partition scheme: client sizes, size skews, Dirichlet draws, exact allocation.

Pure functions of their arguments and a caller's generator (no state): how many samples each
client gets (``client_sizes``, with an optional quantity skew from :data:`SIZE_SKEWS`), how a
total is split into integers in proportion to weights without losing a sample
(``largest_remainder``), Dirichlet rows, and turning a client × group count table into a
sample-to-client assignment (``assign_counts``). ``partitioning/partition.py`` builds the
schemes on top.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from utils.cli import floats
from utils.errors import TaskHetError
from utils.registry import Registry

UNUSED = -1  # the client of a sample no client holds
SIZE_SKEWS: Registry[Callable[[np.random.Generator, float, int], np.ndarray]] = Registry("size skew")
# Each size skew's parameter range: wide enough for any skew worth studying, narrow enough that every drawn weight
# is a finite float (LogNormal(0, 10) weights stay below e^710 for any number of clients; so do Pareto weights
# 1 + Pareto(a) for a >= 0.1).
SIZE_SKEW_RANGES = {"lognormal": floats(0.0, 10.0), "powerlaw": floats(0.1, 1000.0)}
SIZE_SKEW_HELP = ("lognormal:SIGMA (SIGMA a number in " + str(SIZE_SKEW_RANGES["lognormal"]) + ") or powerlaw:A (A a "
                  "number in " + str(SIZE_SKEW_RANGES["powerlaw"]) + ")")


@SIZE_SKEWS.register("lognormal")
def lognormal_weights(rng: np.random.Generator, sigma: float, n_clients: int) -> np.ndarray:
    """Client size weights ~ LogNormal(0, σ) (σ = 0: equal sizes)."""
    return rng.lognormal(0.0, sigma, n_clients)


@SIZE_SKEWS.register("powerlaw")
def powerlaw_weights(rng: np.random.Generator, exponent: float, n_clients: int) -> np.ndarray:
    """Client size weights ~ Pareto with tail exponent a (density ∝ w^-(a+1), w >= 1); small a: heavier skew."""
    return 1.0 + rng.pareto(exponent, n_clients)


def parse_size_skew(text: str | None) -> tuple[str, float] | None:
    """Parse ``--size_skew`` (:data:`SIZE_SKEW_HELP`): ``lognormal:σ`` or ``powerlaw:a``, the number ASCII digits in
    its kind's range; None for equal sizes."""
    if text is None:
        return None
    kind, _, value = str(text).partition(":")
    if kind not in SIZE_SKEWS:
        raise TaskHetError(f"--size_skew {text!r}: unknown kind {kind!r}; use {SIZE_SKEW_HELP}")
    allowed = SIZE_SKEW_RANGES[kind]
    try:
        return kind, allowed.parse(value)
    except ValueError:
        raise TaskHetError(f"--size_skew {text!r}: expected {kind}:NUMBER with NUMBER {allowed.describe()}, "
                           f"got {value!r}") from None


def largest_remainder(totals: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Split each ``totals[g]`` into integers ∝ ``weights[g, :]`` that sum exactly to it.

    Args:
        totals: int [G].
        weights: float [G, n], non-negative, each row with a positive sum.

    Returns:
        int64 [G, n]; an entry with zero weight gets zero.
    """
    raw = weights / weights.sum(axis=1, keepdims=True) * totals[:, None]
    counts = np.floor(raw).astype(np.int64)
    shortfall = totals - counts.sum(axis=1)
    # Ties (equal weights) go to the lower index: stable sort keeps the draw reproducible.
    order = np.argsort(-(raw - counts), axis=1, kind="stable")
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(raw.shape[1])[None, :].repeat(raw.shape[0], axis=0), axis=1)
    return counts + (ranks < shortfall[:, None])


def size_weights(size_skew: str | None, n_clients: int, rng: np.random.Generator) -> np.ndarray:
    """Relative client sizes: all ones, or drawn from the ``--size_skew`` distribution."""
    skew = parse_size_skew(size_skew)
    return np.ones(n_clients) if skew is None else SIZE_SKEWS.get(skew[0])(rng, skew[1], n_clients)


def client_sizes(n_samples: int, n_clients: int, size_skew: str | None, min_client_size: int, rng: np.random.Generator) -> np.ndarray:
    """Target client sizes that sum to ``n_samples``: equal, or from ``size_skew`` weights.

    Every client first gets ``min_client_size``; the rest is split ∝ the weights, so the
    minimum always holds (it compresses the skew of the smallest clients slightly).
    """
    weights = size_weights(size_skew, n_clients, rng)
    spare = n_samples - n_clients * min_client_size
    return min_client_size + largest_remainder(np.array([spare]), weights[None, :])[0]


def dirichlet(rng: np.random.Generator, alpha: np.ndarray, n_rows: int) -> np.ndarray:
    """``n_rows`` draws of Dir(alpha), robust to tiny concentrations.

    When every gamma variate of a row underflows to 0 (alpha ~ 1e-5), the row is the
    Dirichlet's small-alpha limit: all mass on one coordinate, picked ∝ alpha.
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        draws = rng.dirichlet(alpha, size=n_rows)
    broken = ~np.isfinite(draws).all(axis=1) | ~(draws.sum(axis=1) > 0)
    if broken.any():
        picks = rng.choice(alpha.size, size=int(broken.sum()), p=alpha / alpha.sum())
        draws[broken] = np.eye(alpha.size)[picks]
    return draws


def assign_counts(group_codes: np.ndarray, counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Give each client ``counts[k, g]`` random samples of group g; the rest stay unused.

    Args:
        group_codes: int64 [n_samples] in 0..G-1.
        counts: int64 [n_clients, G]; column sums must not exceed the group sizes.

    Returns:
        client_of: int64 [n_samples].
    """
    n_clients, n_groups = counts.shape
    group_sizes = np.bincount(group_codes, minlength=n_groups)
    # Samples sorted by group, in random order inside each group.
    permutation = rng.permutation(group_codes.size)
    order = permutation[np.argsort(group_codes[permutation], kind="stable")]
    leftover = group_sizes - counts.sum(axis=0)
    blocks = np.hstack([counts.T, leftover[:, None]])  # [G, n_clients + 1]: each group's run lengths
    owners = np.tile(np.append(np.arange(n_clients), UNUSED), n_groups)
    client_of = np.empty(group_codes.size, dtype=np.int64)
    client_of[order] = np.repeat(owners, blocks.ravel())
    return client_of


def transport(supply: np.ndarray, demand: np.ndarray, cells: np.ndarray, lower: np.ndarray, upper: np.ndarray,
              exact: bool = True) -> np.ndarray | None:
    """Integer counts on client × group cells with bounds, exact client totals and bounded group totals, or None.

    A transportation problem solved as a maximum flow (scipy's ``maximum_flow``: integer
    capacities give an integer flow, and a flow is the standard exact test of whether such
    bounded integer tables exist, which no greedy rounding is):
    source → group g (capacity ``supply[g]``) → client k over each cell (k, g) (between
    ``lower`` and ``upper``) → sink (exactly ``demand[k]``). Lower bounds are subtracted first.

    Args:
        supply: int [G], the most samples of each group that may be used.
        demand: int [K], the exact total of each client.
        cells: int [E, 2], the (client, group) pairs that may hold samples (no pair twice).
        lower, upper: int [E], bounds of each cell's count (0 <= lower <= upper).
        exact: client totals must equal ``demand``; False: at most ``demand``, as much in all as possible
            (the lower bounds are still met).

    Returns:
        int64 [E], the count of each cell, or None when no table meets every bound.
    """
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import maximum_flow

    n_clients, n_groups = demand.size, supply.size
    clients, groups = cells[:, 0], cells[:, 1]
    spare_supply = supply - np.bincount(groups, lower, n_groups).astype(np.int64)
    spare_demand = demand - np.bincount(clients, lower, n_clients).astype(np.int64)
    if (spare_supply < 0).any() or (spare_demand < 0).any() or (upper < lower).any():
        return None
    sink = n_groups + n_clients + 1
    rows = np.concatenate([np.zeros(n_groups, np.int64), 1 + groups, 1 + n_groups + np.arange(n_clients)])
    cols = np.concatenate([1 + np.arange(n_groups), 1 + n_groups + clients, np.full(n_clients, sink)])
    capacity = np.concatenate([spare_supply, upper - lower, spare_demand]).astype(np.int32)
    graph = csr_matrix((capacity, (rows, cols)), shape=(sink + 1, sink + 1))
    result = maximum_flow(graph, 0, sink)
    if exact and result.flow_value != spare_demand.sum():
        return None
    flow = np.asarray(result.flow.tocsr()[1 + groups, 1 + n_groups + clients]).ravel()
    return lower + flow.astype(np.int64)
