"""Client partitions (step 3b): who holds which sample, scikit-learn-splitter style.

A scheme is a class registered in :data:`SCHEMES`. Its constructor only stores
parameters; :meth:`Partitioner.split` validates them against the data, draws from
its own generator (derived from ``seed``) and returns a :class:`Partition`.
Statistics live in :mod:`partitioning.partition_stats`.

``groups`` are the categories whose skew a scheme controls: class labels (scene class, digit) for
label-based partitions, embedding clusters for embedding-based ones (the paper's
point). Every draw is vectorised over clients and groups, and every retry loop is
bounded: a draw that cannot be met ends in a :class:`TaskHetError` that says what
could not be met and which flag to change.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from partitioning.allocation import (UNUSED, assign_counts, client_sizes, dirichlet, parse_size_skew,
                                     size_weights, transport)
from partitioning.partitioner import MAX_DRAWS, SCHEMES, Partition, Partitioner
from partitioning import shards  # noqa: F401  (registers the class-sharding schemes)
from utils.errors import TaskHetError


class DirichletBase(Partitioner):
    """Base of the Dirichlet schemes: adds the concentration ``alpha`` (> 0)."""

    def __init__(self, n_clients: int, *, alpha: float = 1.0, seed: int = 0, size_skew: str | None = None, min_client_size: int = 1) -> None:
        super().__init__(n_clients, seed=seed, size_skew=size_skew, min_client_size=min_client_size)
        self.alpha = alpha

    def _validate(self, n_samples: int) -> None:
        super()._validate(n_samples)
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float, np.number)) or not np.isfinite(self.alpha) or self.alpha <= 0:
            raise TaskHetError(f"{self.name}: alpha (--alpha) must be a finite number > 0, got {self.alpha!r}")


@SCHEMES.register("iid")
class IIDPartitioner(Partitioner):
    """IID, stratified: client sizes n_k are equal within 1 (or drawn by ``size_skew``), and
    client k holds ⌊n_g·n_k/n⌋ or ⌈n_g·n_k/n⌉ samples of every group g (n_g its size, n the
    total), chosen uniformly at random inside the group. So with the labels as groups every
    client's label histogram is the global one up to rounding (labels uniform), not only in
    expectation as a plain random split's would be. Such a rounding of the table
    n_g·n_k/n with exact row and column sums always exists (it is a flow problem;
    ``allocation.transport`` finds it). Uses every sample."""

    name = "iid"

    def _assign(self, group_codes: np.ndarray, sources: np.ndarray | None, rng: np.random.Generator) -> Partition:
        sizes = client_sizes(group_codes.size, self.n_clients, self.size_skew, self.min_client_size, rng)
        group_sizes = np.bincount(group_codes)
        share = sizes[:, None] * group_sizes[None, :] / group_codes.size  # [K, G], the proportional table
        # Clients in a random order, so which clients round up in a group is not decided by their ids.
        order = rng.permutation(self.n_clients)
        cells = np.stack(np.meshgrid(np.arange(self.n_clients), np.arange(group_sizes.size), indexing="ij"), -1).reshape(-1, 2)
        rounded = transport(group_sizes, sizes[order], cells, np.floor(share[order]).astype(np.int64).ravel(),
                            np.ceil(share[order]).astype(np.int64).ravel())
        counts = np.empty((self.n_clients, group_sizes.size), dtype=np.int64)
        counts[order] = rounded.reshape(self.n_clients, group_sizes.size)
        return Partition(assign_counts(group_codes, counts, rng), self.n_clients)


@SCHEMES.register("dirichlet_mixture")
class DirichletMixturePartitioner(DirichletBase):
    """The paper's scheme (Hsu et al. 2019): client k's mixture over groups is
    q_k ~ Dir(α·p), p the global group proportions; its size n_k is equal (or from
    ``size_skew``) and its per-group counts are Multinomial(n_k, q_k).

    Sampling is without replacement and uses every sample. Clients are served in a
    random order; when a group runs out, the clients it could not serve draw their
    shortfall from q_k renormalised over the groups that are left, which is again
    Dir(α·p) restricted to those groups (the Dirichlet's aggregation property). Each
    round fills at least one group, so at most G rounds run. α → ∞: iid; α → 0: one
    group per client (up to the clients that a group's end cuts short).
    """

    name = "dirichlet_mixture"

    def _assign(self, group_codes: np.ndarray, sources: np.ndarray | None, rng: np.random.Generator) -> Partition:
        group_sizes = np.bincount(group_codes)
        sizes = client_sizes(group_codes.size, self.n_clients, self.size_skew, self.min_client_size, rng)
        concentration = self.alpha * group_sizes / group_sizes.sum()
        mixtures = dirichlet(rng, concentration, self.n_clients)
        counts = np.zeros((self.n_clients, group_sizes.size), dtype=np.int64)
        shortfall = sizes.copy()
        for _ in range(group_sizes.size + 1):
            capacity = group_sizes - counts.sum(axis=0)
            if not shortfall.any():
                break
            left = capacity > 0
            weights = np.where(left, mixtures, 0.0)
            # A row whose mass underflowed on the groups left is redrawn from Dir(α·p_left):
            # the same law as renormalising it (Dirichlet aggregation property).
            empty = ~(weights.sum(axis=1) > 1e-300) & (shortfall > 0)
            if empty.any():
                weights[empty] = 0.0
                weights[np.ix_(empty, left)] = dirichlet(rng, concentration[left], int(empty.sum()))
            weights[shortfall == 0] = left  # rows that need nothing; any valid pvals
            asked = rng.multinomial(shortfall, weights / weights.sum(axis=1, keepdims=True))
            # First come, first served in a fresh random client order: a group that runs out
            # cuts few clients deeply rather than every client a little, so small alphas
            # keep clients close to their drawn mixture.
            priority = rng.permutation(self.n_clients)
            before = np.cumsum(asked[priority], axis=0) - asked[priority]
            counts[priority] += np.clip(capacity[None, :] - before, 0, asked[priority])
            shortfall = sizes - counts.sum(axis=1)
        if shortfall.any():
            raise TaskHetError(f"{self.name}: could not fill {int((shortfall > 0).sum())} clients after {group_sizes.size + 1} rounds")
        return Partition(assign_counts(group_codes, counts, rng), self.n_clients)


class PerGroupDirichlet(DirichletBase):
    """Base of the schemes that split each group over clients by shares p_g ~ Dir(α·1), reweighted by the
    clients' size weights (``size_skew``) and renormalised; :meth:`_counts` turns the shares into counts.
    A draw leaving a client below ``min_client_size`` is repeated at most ``MAX_DRAWS`` times, then it fails."""

    def _counts(self, group_sizes: np.ndarray, shares: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """int64 [n_clients, n_groups]: how many of each group's samples each client gets (columns sum to the group
        sizes); ``shares`` is [n_groups, n_clients], rows summing to 1."""
        raise NotImplementedError

    def _assign(self, group_codes: np.ndarray, sources: np.ndarray | None, rng: np.random.Generator) -> Partition:
        group_sizes = np.bincount(group_codes)
        client_weights = size_weights(self.size_skew, self.n_clients, rng)
        for _ in range(MAX_DRAWS):
            shares = dirichlet(rng, np.full(self.n_clients, float(self.alpha)), group_sizes.size) * client_weights
            shares /= shares.sum(axis=1, keepdims=True)
            counts = self._counts(group_sizes, shares, rng)
            if counts.sum(axis=1).min() >= self.min_client_size:
                break
        else:
            self._check_min_size(counts.sum(axis=1), f"after {MAX_DRAWS} draws at alpha={self.alpha}; raise --alpha or "
                                                     "lower --n_clients / --min_client_size")
        return Partition(assign_counts(group_codes, counts, rng), self.n_clients)


@SCHEMES.register("dirichlet_split")
class DirichletSplitPartitioner(PerGroupDirichlet):
    """Yurochkin et al. 2019 / Flower Datasets' DirichletPartitioner: each group's samples
    are split across clients in proportions ~ Dir(α·1), independently per group
    (with ``size_skew``, the proportions are reweighted by each client's size weight
    and renormalised). Uses every sample. If a client ends below ``min_client_size``
    the whole draw is repeated, at most ``MAX_DRAWS`` times, then it fails."""

    name = "dirichlet_split"

    def _counts(self, group_sizes: np.ndarray, shares: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        # Cut points at floor(cumsum(p) * n_g), as Flower does: exact totals, no extra noise.
        cuts = np.floor(np.cumsum(shares, axis=1) * group_sizes[:, None]).astype(np.int64)
        cuts[:, -1] = group_sizes
        return np.diff(cuts, axis=1, prepend=0).T


@SCHEMES.register("dirichlet_per_class")
class DirichletPerClassPartitioner(PerGroupDirichlet):
    """FedLoGe's Fed-LT split (Xiao et al. 2024; also FedRoD's and CReFF's): for each group
    (class) c, client shares p_c ~ Dir(α·1) and each of the group's n_c samples goes to a
    client drawn from p_c independently, so the counts are Multinomial(n_c, p_c). Unlike
    ``dirichlet_split`` (cut points at ⌊cumsum(p)·n_c⌋) the counts carry the multinomial
    noise, and there is no FedAvg-style minimum size beyond ``min_client_size`` (1 by
    default: an empty client would be refused by the assignments check). With
    ``size_skew`` the shares are reweighted by each client's size weight and renormalised.
    Uses every sample; a draw leaving a client below ``min_client_size`` is repeated at
    most ``MAX_DRAWS`` times, then it fails."""

    name = "dirichlet_per_class"

    def _counts(self, group_sizes: np.ndarray, shares: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return np.stack([rng.multinomial(size, share) for size, share in zip(group_sizes, shares)], axis=1)


@SCHEMES.register("natural")
class NaturalPartitioner(Partitioner):
    """Feature skew: one client per source (the data family's source column: a Taskonomy
    building); a client holds all of its building's samples. With fewer clients than
    eligible buildings (those with at least ``min_client_size`` samples), a uniformly
    random subset of buildings is used and the rest is unused. Client ids follow the
    sorted building names. No ``size_skew``: the buildings fix the sizes."""

    name = "natural"

    def _validate(self, n_samples: int) -> None:
        super()._validate(n_samples)
        if self.size_skew is not None:
            raise TaskHetError(f"{self.name}: client sizes are the buildings' sizes; --size_skew cannot be combined with it")

    def _assign(self, group_codes: np.ndarray, sources: np.ndarray | None, rng: np.random.Generator) -> Partition:
        if sources is None or np.asarray(sources).shape != group_codes.shape:
            raise TaskHetError(f"{self.name}: needs the natural owner of every sample (sources of the same length as groups, "
                               "e.g. Taskonomy's building); a data family without a source column (digits) has none")
        names, source_codes = np.unique(np.asarray(sources).astype(str), return_inverse=True)
        source_sizes = np.bincount(source_codes)
        eligible = np.flatnonzero(source_sizes >= self.min_client_size)
        if eligible.size < self.n_clients:
            raise TaskHetError(
                f"{self.name}: --n_clients {self.n_clients} but only {eligible.size} of {names.size} buildings hold at least "
                f"--min_client_size {self.min_client_size} samples"
            )
        chosen = np.sort(rng.choice(eligible, size=self.n_clients, replace=False))
        client_of_source = np.full(names.size, UNUSED, dtype=np.int64)
        client_of_source[chosen] = np.arange(self.n_clients)
        return Partition(client_of_source[source_codes], self.n_clients, tuple(names[chosen].tolist()))


def list_schemes() -> list[str]:
    """Registered scheme names."""
    return SCHEMES.names()


def scheme_parameters(name: str) -> list[str]:
    """The parameters a scheme's constructor takes (besides n_clients)."""
    return [p for p in inspect.signature(SCHEMES.get(name).__init__).parameters if p not in ("self", "n_clients")]


def get_partitioner(name: str, n_clients: int, **params: Any) -> Partitioner:
    """Build a registered scheme; a parameter the scheme does not take is a TaskHetError."""
    accepted = scheme_parameters(name)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise TaskHetError(f"scheme {name!r} does not take {', '.join('--' + p for p in unknown)}; it takes: {', '.join(accepted)}")
    return SCHEMES.get(name)(n_clients, **params)

