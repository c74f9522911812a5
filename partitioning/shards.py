"""Class-sharding schemes (McMahan et al.'s ``shards`` and the course's ``nc_shards``): every client
holds a fixed number of groups. Registered in :data:`partitioning.partitioner.SCHEMES` when
:mod:`partitioning.partition` is imported (it imports this module).
"""

from __future__ import annotations

import numpy as np

from partitioning.allocation import assign_counts, largest_remainder, size_weights, transport
from partitioning.partitioner import MAX_DRAWS, SCHEMES, Partition, Partitioner
from utils.errors import TaskHetError


@SCHEMES.register("shards")
class ShardsPartitioner(Partitioner):
    """McMahan-style pathological skew: each client holds exactly ``groups_per_client``
    distinct groups. Groups are laid out in a random cyclic order and client k (in a
    random order) takes the window of Nc consecutive groups starting at k·Nc, so every
    group has ⌊n·Nc/G⌋ or ⌈n·Nc/G⌉ holders; a group's samples are split equally among its
    holders (∝ size weights with ``size_skew``). Groups with no holder stay unused (K·Nc < G),
    and client sizes follow the groups' sizes and holder counts; ``nc_shards`` is the variant
    with equal client sizes and every sample held."""

    name = "shards"

    def __init__(self, n_clients: int, *, groups_per_client: int = 2, seed: int = 0, size_skew: str | None = None, min_client_size: int = 1) -> None:
        super().__init__(n_clients, seed=seed, size_skew=size_skew, min_client_size=min_client_size)
        self.groups_per_client = groups_per_client

    def _validate(self, n_samples: int) -> None:
        super()._validate(n_samples)
        if not isinstance(self.groups_per_client, (int, np.integer)) or self.groups_per_client < 1:
            raise TaskHetError(f"{self.name}: groups_per_client (--groups_per_client) must be an integer >= 1, got {self.groups_per_client!r}")

    def _assign(self, group_codes: np.ndarray, sources: np.ndarray | None, rng: np.random.Generator) -> Partition:
        group_sizes = np.bincount(group_codes)
        n_groups, per_client = group_sizes.size, int(self.groups_per_client)
        if per_client > n_groups:
            raise TaskHetError(f"{self.name}: --groups_per_client {per_client} exceeds the {n_groups} groups in the data")
        client_weights = size_weights(self.size_skew, self.n_clients, rng)
        cycle = rng.permutation(n_groups)
        slots = np.arange(self.n_clients * per_client).reshape(self.n_clients, per_client) % n_groups
        held = cycle[slots[rng.permutation(self.n_clients)]]  # [n_clients, Nc], distinct per row
        weights = np.zeros((n_groups, self.n_clients))
        weights[held.T, np.arange(self.n_clients)[None, :]] = client_weights[None, :]
        holders = (weights > 0).sum(axis=1)
        starved = np.flatnonzero((holders > 0) & (group_sizes < holders))
        if starved.size:
            group = starved[0]
            raise TaskHetError(
                f"{self.name}: group #{group} has {group_sizes[group]} samples but {holders[group]} clients must hold it; "
                "lower --n_clients or --groups_per_client"
            )
        counts = np.zeros((self.n_clients, n_groups), dtype=np.int64)
        kept = holders > 0
        counts[:, kept] = largest_remainder(group_sizes[kept], weights[kept]).T
        if (counts[np.arange(self.n_clients)[:, None], held] == 0).any():
            raise TaskHetError(f"{self.name}: --size_skew {self.size_skew} leaves a client with no sample of a group it holds; use a milder skew")
        self._check_min_size(counts.sum(axis=1), "lower --n_clients or raise --groups_per_client")
        return Partition(assign_counts(group_codes, counts, rng), self.n_clients)


# Slack levels of the per-cell bounds, tried in turn: the first that admits a table gives the most even one.
NC_SLACKS = (0.0, 0.1, 0.25, 0.5, 1.0, None)


@SCHEMES.register("nc_shards")
class NcShardsPartitioner(ShardsPartitioner):
    """The course's non-iid sharding: every client holds exactly Nc = ``groups_per_client`` groups,
    client sizes are equal within 1, clients are disjoint and together hold every sample.

    Differences from ``shards``: no group is left without holders, and sizes are equalised across
    clients instead of within each group. Construction:

    1. Holders. The K·Nc slots are dealt so that group g gets h_g = ⌊K·Nc/G⌋ or ⌈K·Nc/G⌉ holders
       (the extra holders go to the largest groups), dealt at random so that no client holds a group
       twice (class sets are random, not the repeating windows of ``shards``).
    2. Counts. A client × group table with exact group totals n_g, client totals ⌊n/K⌋ or
       ⌈n/K⌉ (the +1 to the clients whose proportional share Σ n_g/h_g is largest), and at
       least 1 in every held cell, found as a flow (``allocation.transport``). Per-cell bounds
       around n_g/h_g are tried from tight to loose, so a client's groups are as even as the
       sizes allow (CIFAR-100, 450 training images a class: K=100, Nc ∈ {1,5,10,50} gives
       every cell exactly 450/Nc).

    Guarantees: (a) exactly Nc groups per client and (b) disjoint clients, always; (c) sizes
    within 1 and (d) every sample held, whenever a table meeting (a)-(d) exists. When cover and
    equal sizes conflict (unequal groups: K = G, Nc = 1 with classes of 142 and 146 samples can
    only give clients the class sizes), (a)-(c) are kept: clients get T or T+1 samples, T the
    largest common size for which a table exists (over ``MAX_DRAWS`` holder deals), then as many
    clients as the samples left allow get the +1; the samples left over are unused
    (``Partition.unused``; step 3b lists them in unused_samples.csv). It is an error when
    Nc > G, when K·Nc < G (fewer slots than groups: a group would have no holder), or when no
    common size of at least max(Nc, ``min_client_size``) exists (a group smaller than its
    number of holders). No ``size_skew``: equal sizes are the point.
    """

    name = "nc_shards"

    def _validate(self, n_samples: int) -> None:
        super()._validate(n_samples)  # shards' checks of groups_per_client
        if self.size_skew is not None:
            raise TaskHetError(f"{self.name}: client sizes are equal by construction; --size_skew cannot be combined with it (use shards)")

    def _assign(self, group_codes: np.ndarray, sources: np.ndarray | None, rng: np.random.Generator) -> Partition:
        group_sizes = np.bincount(group_codes)
        n_groups, per_client, n_clients = group_sizes.size, int(self.groups_per_client), self.n_clients
        if per_client > n_groups:
            raise TaskHetError(f"{self.name}: --groups_per_client {per_client} exceeds the {n_groups} groups in the data")
        if n_clients * per_client < n_groups:
            raise TaskHetError(f"{self.name}: {n_clients} clients × {per_client} groups = {n_clients * per_client} slots cannot "
                               f"hold all {n_groups} groups; raise --n_clients or --groups_per_client (shards leaves groups unused)")
        best = None
        # The holder graph decides whether a covering table exists (Nc = 2 pairs groups into cycles whose
        # sizes must add up), so a few deals are tried before settling for unused samples.
        for _ in range(MAX_DRAWS):
            held = self._holders(group_sizes, rng)  # [K, Nc], distinct per row
            holders = np.bincount(held.ravel(), minlength=n_groups)
            starved = np.flatnonzero(group_sizes < holders)
            if starved.size:
                group = starved[0]
                raise TaskHetError(f"{self.name}: group #{group} has {group_sizes[group]} samples but {holders[group]} clients "
                                   "must hold it; lower --n_clients or --groups_per_client")
            counts = self._counts(group_sizes, held, holders)
            if best is None or counts.sum() > best.sum():
                best = counts
            if best.sum() == group_codes.size:
                break
        self._check_min_size(best.sum(axis=1), "lower --n_clients")
        return Partition(assign_counts(group_codes, best, rng), n_clients)

    def _holders(self, group_sizes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """[K, Nc] distinct groups per row, group g in h_g rows: a sequential random deal that always completes.

        Clients in turn draw Nc groups ∝ the holder places still open, taking first every group with as
        many open places as clients left (else it could not be placed on distinct clients later); since
        open places never exceed clients left and sum to Nc · clients left, at most Nc are forced and
        at least Nc groups are open, so no client is ever stuck.
        """
        n_groups, per_client, n_clients = group_sizes.size, int(self.groups_per_client), self.n_clients
        base, extra = divmod(n_clients * per_client, n_groups)
        open_places = np.full(n_groups, base)
        open_places[np.lexsort((rng.random(n_groups), -group_sizes))[:extra]] += 1  # largest groups hold once more
        held = np.empty((n_clients, per_client), dtype=np.int64)
        for client in range(n_clients):
            forced = np.flatnonzero(open_places == n_clients - client)
            free = np.flatnonzero((open_places > 0) & (open_places < n_clients - client))
            weights = open_places[free] / open_places[free].sum() if free.size else None
            drawn = rng.choice(free, size=per_client - forced.size, replace=False, p=weights)
            held[client] = np.concatenate([forced, drawn])
            open_places[held[client]] -= 1
        return held

    def _counts(self, group_sizes: np.ndarray, held: np.ndarray, holders: np.ndarray) -> np.ndarray:
        n_clients, n_groups = held.shape[0], group_sizes.size
        cells = np.stack([np.repeat(np.arange(n_clients), held.shape[1]), held.ravel()], axis=1)
        share = group_sizes[cells[:, 1]] / holders[cells[:, 1]]  # each holder's equal part of its group
        total = int(group_sizes.sum())
        demand = np.full(n_clients, total // n_clients)
        proportional = np.bincount(cells[:, 0], share, n_clients)
        demand[np.argsort(-proportional, kind="stable")[: total % n_clients]] += 1
        table = self._even_table(group_sizes, demand, cells, share)
        if table is None:  # cover and equal sizes conflict here: the largest common size T that admits a table
            floor = max(1, int(self.min_client_size), held.shape[1])

            def table_of_size(size: int) -> np.ndarray | None:
                return self._even_table(group_sizes, np.full(n_clients, size), cells, share * size * n_clients / total)

            low, high = floor - 1, total // n_clients
            while low < high:  # feasibility is monotone in T: a client of T > Nc can give back a sample
                middle = (low + high + 1) // 2
                low, high = (middle, high) if table_of_size(middle) is not None else (low, middle - 1)
            if low < floor:
                raise TaskHetError(f"{self.name}: no common client size of at least {floor} samples fits the groups "
                                   f"(sizes {group_sizes.min()}..{group_sizes.max()}); lower --n_clients or --groups_per_client")
            table = table_of_size(low)
            # Then a +1 for as many clients as the samples left allow (sizes stay within 1).
            table = transport(group_sizes, np.full(n_clients, low + 1), cells, table, np.full(len(cells), total), exact=False)
        counts = np.zeros((n_clients, n_groups), dtype=np.int64)
        counts[cells[:, 0], cells[:, 1]] = table
        return counts

    @staticmethod
    def _even_table(group_sizes: np.ndarray, demand: np.ndarray, cells: np.ndarray, share: np.ndarray) -> np.ndarray | None:
        """The evenest table: the tightest slack around ``share`` that admits one (None if even (1, ∞) does not)."""
        for slack in NC_SLACKS:
            if slack is None:
                lower, upper = np.ones(len(cells), np.int64), np.full(len(cells), int(group_sizes.max()))
            else:
                lower = np.maximum(1, np.floor(share * (1 - slack))).astype(np.int64)
                upper = np.maximum(lower, np.ceil(share * (1 + slack))).astype(np.int64)
            table = transport(group_sizes, demand, cells, lower, upper)
            if table is not None:
                return table
        return None
