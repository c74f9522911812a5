"""The base of every partition scheme: the registry :data:`SCHEMES`, the :class:`Partition` a split returns
and the :class:`Partitioner` base class (scikit-learn-splitter style: the constructor stores parameters,
:meth:`Partitioner.split` validates them and draws).

The schemes themselves live in :mod:`partitioning.partition` (Dirichlet, iid, natural) and
:mod:`partitioning.shards` (class sharding); both import this module, and :mod:`partitioning.partition`
imports :mod:`partitioning.shards` to register its schemes, so the import graph has no circle.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from partitioning.allocation import UNUSED, parse_size_skew
from utils.errors import TaskHetError
from utils.registry import Registry
from utils.seeding import numpy_rng

SCHEMES: Registry[type["Partitioner"]] = Registry("partition scheme")
# Flower's DirichletPartitioner also stops after 10 draws; more rarely helps and hides a bad alpha.
MAX_DRAWS = 10


@dataclass(frozen=True)
class Partition:
    """The result of a split.

    Attributes:
        client_of: int64 [n_samples], the client of each sample or ``UNUSED`` (-1).
            One entry per sample, so no sample can be held by two clients.
        n_clients: number of clients (ids 0..n_clients-1).
        client_labels: for ``natural``, the source (e.g. a building) behind each client id.
    """

    client_of: np.ndarray
    n_clients: int
    client_labels: tuple[str, ...] | None = None

    @property
    def sizes(self) -> np.ndarray:
        """int64 [n_clients]: samples per client."""
        return np.bincount(self.client_of[self.client_of != UNUSED], minlength=self.n_clients)

    @property
    def unused(self) -> np.ndarray:
        """Indices of the samples no client holds."""
        return np.flatnonzero(self.client_of == UNUSED)

    def client_indices(self) -> list[np.ndarray]:
        """One sorted index array per client (the splitter's output)."""
        order = np.argsort(self.client_of, kind="stable")
        n_unused = int(np.count_nonzero(self.client_of == UNUSED))
        return np.split(order[n_unused:], np.cumsum(self.sizes)[:-1])


class Partitioner:
    """Base class: stores parameters; :meth:`split` validates them and draws the partition.

    Args:
        n_clients: number of clients.
        seed: root seed; the scheme draws from ``numpy_rng(seed, "partition", name)``.
        size_skew: ``None`` (equal sizes), ``"lognormal:σ"`` or ``"powerlaw:a"``.
        min_client_size: the fewest samples a client may hold (>= 1: no empty clients).
    """

    name = "base"

    def __init__(self, n_clients: int, *, seed: int = 0, size_skew: str | None = None, min_client_size: int = 1) -> None:
        self.n_clients = n_clients
        self.seed = seed
        self.size_skew = size_skew
        self.min_client_size = min_client_size

    def get_params(self) -> dict[str, Any]:
        """The constructor's parameters (recorded in assignments.json)."""
        return {name: getattr(self, name) for name in inspect.signature(type(self).__init__).parameters if name != "self"}

    def split(self, groups: np.ndarray, sources: np.ndarray | None = None) -> Partition:
        """Partition samples among clients.

        Args:
            groups: [n_samples] any hashable labels (a class label, a cluster id).
            sources: [n_samples] the natural owner of each sample (Taskonomy: its building); only
                ``natural`` uses it.

        Returns:
            A :class:`Partition` over the ``n_samples`` positions.

        Raises:
            TaskHetError: bad parameters, or a draw that cannot be met.
        """
        groups = np.asarray(groups)
        if groups.ndim != 1 or groups.size == 0:
            raise TaskHetError(f"{self.name}: groups must be a non-empty 1-D array, got shape {groups.shape}")
        self._validate(groups.size)
        _, group_codes = np.unique(groups, return_inverse=True)
        rng = numpy_rng(self.seed, "partition", self.name)
        return self._assign(group_codes.astype(np.int64), sources, rng)

    def check_parameters(self, n_samples: int | None = None) -> None:
        """The checks :meth:`split` makes before drawing, without data (an experiment file is checked with them before
        step 0); with ``n_samples`` None, those that need the number of samples pass."""
        self._validate(sys.maxsize if n_samples is None else n_samples)

    def _validate(self, n_samples: int) -> None:
        if not isinstance(self.n_clients, (int, np.integer)) or self.n_clients < 1:
            raise TaskHetError(f"{self.name}: n_clients (--n_clients) must be an integer >= 1, got {self.n_clients!r}")
        # An empty client would be rejected by the assignments check, so the floor is 1.
        if not isinstance(self.min_client_size, (int, np.integer)) or self.min_client_size < 1:
            raise TaskHetError(f"{self.name}: min_client_size (--min_client_size) must be an integer >= 1, got {self.min_client_size!r}")
        needed = self.n_clients * self.min_client_size
        if needed > n_samples:
            raise TaskHetError(
                f"{self.name}: {self.n_clients} clients of at least {self.min_client_size} samples need {needed} samples, "
                f"but there are only {n_samples}; lower --n_clients or --min_client_size"
            )
        parse_size_skew(self.size_skew)

    def _assign(self, group_codes: np.ndarray, sources: np.ndarray | None, rng: np.random.Generator) -> Partition:
        raise NotImplementedError

    def _check_min_size(self, sizes: np.ndarray, hint: str) -> None:
        small = np.flatnonzero(sizes < self.min_client_size)
        if small.size:
            raise TaskHetError(
                f"{self.name}: {small.size} clients (e.g. client {small[0]} with {sizes[small[0]]} samples) hold fewer than "
                f"--min_client_size {self.min_client_size}; {hint}"
            )
