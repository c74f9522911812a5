"""TaskHet's partitions as Flower Datasets partitioners (``flwr_datasets.partitioner.Partitioner`` subclasses).

A Flower user partitions any Hugging Face ``datasets.Dataset`` the way step 3b partitions a manifest::

    import sys; sys.path.append("/path/to/taskhet")   # append: the repository after site-packages (see Imports)
    from flwr_datasets import FederatedDataset
    from partitioning.flwr_partitioners import TaskHetEmbeddingPartitioner

    partitioner = TaskHetEmbeddingPartitioner(num_partitions=100, partition_by="embedding", n_clusters=10, alpha=0.5)
    fds = FederatedDataset(dataset="cifar10", partitioners={"train": partitioner})
    partition = fds.load_partition(0)

* :class:`TaskHetLabelPartitioner`: the paper's Dirichlet mixture over a label column (step 3b, ``label_based``).
* :class:`TaskHetEmbeddingPartitioner`: the Dirichlet mixture over embedding clusters (``embedding_based``): a
  column of cluster ids (step 3's clusters.csv), or a column of embedding vectors that it clusters with step 3's
  KMeans (:func:`partitioning.kmeans.cluster_embeddings`).
* :class:`TaskHetPartitioner`: their base, any registered scheme by name (``iid``, ``dirichlet_split``, ``shards``).

Every partition is the one step 3b draws: the same :class:`partitioning.partitioner.Partitioner` runs on the
column's values in the dataset's row order, with the same seed, so partition k holds exactly the rows that
assignments.csv gives client k (its train and held-out client-test rows together) when the dataset's rows are the
manifest's train rows in manifest order. The first ``load_partition`` draws every partition at once (one pass over
one column, read from the Arrow table without copying); each call then only selects its rows.

Imports: numpy, scikit-learn (embedding columns only), Hugging Face ``datasets`` and ``flwr_datasets``; never torch
or matplotlib. The repository's own ``datasets/`` package has the same name as Hugging Face's (docs/DESIGN.md §2),
so a Flower user puts the repository root *after* site-packages (``sys.path.append``), never ahead of it
(``PYTHONPATH``, ``sys.path.insert(0, ...)``, a script run from the root): there, the user's own
``from datasets import Dataset`` would find TaskHet's package. This module itself imports Hugging Face's with the
root off ``sys.path``, wherever the root is; but a process that already imported TaskHet's ``datasets`` package (a
TaskHet step, the test suite's conftest) cannot import this module: :func:`import_flower_datasets` says so.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import numpy as np

from partitioning.partition import get_partitioner
from partitioning.partitioner import Partitioner as SchemePartitioner
from utils import cli
from utils.errors import TaskHetError

REPO_ROOT = Path(__file__).resolve().parent.parent
INSTALL_HINT = "pip install -c constraints.txt -r requirements-flwr-datasets.txt (make setup installs it)"
# Step 3b's words for a scheme's parameters -> Flower's, in this order, so that messages name the arguments a Flower
# user passed ("n_clients (--n_clients) must be ..." -> "num_partitions must be ...").
FLOWER_NAMES = (("n_clients (--n_clients)", "num_partitions"), ("min_client_size (--min_client_size)", "min_partition_size"),
                ("alpha (--alpha)", "alpha"), ("--n_clients", "num_partitions"), ("--min_client_size", "min_partition_size"),
                ("--alpha", "alpha"), ("--size_skew", "size_skew"), ("--groups_per_client", "groups_per_client"),
                ("--n_clusters", "n_clusters"), ("--pca_dim", "pca_dim"))


# Every numeric argument is bounded as the step-3b or step-3 flag it stands for (utils/cli.py's ranges): a bool is not
# an int, and a maximum stops a typo (n_init=10**9) from running KMeans for days. The maxima are those flags' own
# (partitioning/assignments.py's MAX_CLIENTS and MAX_ALPHA, steps/assign.py's MAX_GROUPS_PER_CLIENT, steps/embed.py's
# MAX_PCA_DIM and MAX_KMEANS_RESTARTS; tests/test_flwr_partitioners.py keeps them equal), written out here because
# importing those modules imports TaskHet's datasets package, which cannot live beside Hugging Face's.
MAX_PARTITIONS, MAX_ALPHA, MAX_GROUPS_PER_CLIENT, MAX_PCA_DIM, MAX_KMEANS_RESTARTS = 10_000, 1e6, 1_000, 100_000, 1_000
ARGUMENTS = {
    "num_partitions": cli.ints(1, MAX_PARTITIONS), "min_partition_size": cli.ints(1, cli.MAX_SAMPLES),
    "seed": cli.SEEDS, "cluster_seed": cli.SEEDS, "alpha": cli.floats(0.0, MAX_ALPHA, low_open=True),
    "groups_per_client": cli.ints(1, MAX_GROUPS_PER_CLIENT), "n_clusters": cli.ints(1, cli.MAX_CLUSTERS),
    "pca_dim": cli.ints(1, MAX_PCA_DIM), "n_init": cli.ints(1, MAX_KMEANS_RESTARTS),
}


def check_argument(name: str, value: Any) -> int | float:
    """``value`` in the range of ``ARGUMENTS[name]`` (a numpy number counts as the Python one; a bool never does).

    Raises:
        TaskHetError: one line naming the argument and its range (``num_partitions must be an integer in
            [1, 10000], got True``).
    """
    if isinstance(value, (np.integer, np.floating)):
        value = value.item()
    try:
        return ARGUMENTS[name].check(value)
    except ValueError as error:
        raise TaskHetError(f"{name} {error}") from None


def _is_repo_root(entry: str) -> bool:
    try:
        return Path(entry or ".").resolve() == REPO_ROOT
    except OSError:  # an unreadable path entry is not the root
        return False


def import_flower_datasets() -> tuple[Any, Any]:
    """Hugging Face's ``datasets`` and ``flwr_datasets.partitioner``, never the repository's ``datasets`` package.

    The repository root is taken off ``sys.path`` while they import (and put back after), so a ``PYTHONPATH`` or a
    working directory at the root does not shadow Hugging Face's package.

    Raises:
        ImportError: flwr-datasets is not installed (the message says how to install it), or the repository's
            ``datasets`` package is already imported in this process (Hugging Face's cannot be imported beside it).
    """
    loaded = sys.modules.get("datasets")
    if loaded is not None and Path(getattr(loaded, "__file__", None) or "").resolve().parent == REPO_ROOT / "datasets":
        raise ImportError("partitioning.flwr_partitioners needs Hugging Face's datasets package, but TaskHet's own "
                          "datasets package is already imported in this process: import the Flower partitioners in a "
                          "process that runs no TaskHet step (docs/howto/flower-partitioners.md)")
    saved = list(sys.path)
    sys.path[:] = [entry for entry in sys.path if not _is_repo_root(entry)]
    try:
        return importlib.import_module("datasets"), importlib.import_module("flwr_datasets.partitioner")
    except ModuleNotFoundError as error:
        raise ImportError(f"partitioning.flwr_partitioners needs flwr-datasets ({error}): {INSTALL_HINT}") from error
    finally:
        sys.path[:] = saved


hf_datasets, flwr_partitioner = import_flower_datasets()


def _flower_terms(error: TaskHetError) -> TaskHetError:
    """The same error, naming Flower's arguments (num_partitions) instead of step 3b's flags (--n_clients)."""
    message = str(error)
    for taskhet, flower in FLOWER_NAMES:
        message = message.replace(taskhet, flower)
    return TaskHetError(message)


def column_values(dataset: Any, column: str) -> np.ndarray:
    """One column of a ``datasets.Dataset`` as a numpy array, in the dataset's row order.

    Read from the Arrow table behind the dataset (no per-row Python objects), then put in the order of the
    dataset's row mapping when it has one (after ``shuffle`` or ``select``). A column of equal-length lists
    (embeddings) comes back as a 2-D array.

    Raises:
        TaskHetError: the column is missing, has missing values, or holds lists of different lengths.
    """
    if column not in dataset.column_names:
        raise TaskHetError(f"partition_by column {column!r} is not in the dataset; its columns: "
                           f"{', '.join(dataset.column_names)}")
    if not hasattr(dataset, "_indices"):  # a datasets release without the row mapping: the public, slower read
        array = np.asarray(dataset.with_format("numpy")[:][column])
        if array.dtype == object:
            raise TaskHetError(f"column {column!r} has missing values or vectors of different lengths")
        return array
    table_column = dataset.data.column(column)
    table_column = table_column.combine_chunks() if table_column.num_chunks != 1 else table_column.chunk(0)
    if hasattr(table_column, "flatten") and hasattr(table_column, "value_lengths"):  # a list column: a vector a row
        array = _vectors(table_column, column)
    else:
        array = np.asarray(table_column.to_numpy(zero_copy_only=False))
    missing = np.asarray(table_column.is_null()) if table_column.null_count else None
    mapping = dataset._indices  # the rows a shuffle or select left, in order (None: the table's own order)
    if mapping is not None:
        rows = np.asarray(mapping.column(0).to_numpy())
        array, missing = array[rows], None if missing is None else missing[rows]
    if missing is not None and missing.any():
        raise TaskHetError(f"column {column!r} has {int(missing.sum())} missing values (the first in row "
                           f"{int(np.flatnonzero(missing)[0])}); every row needs one")
    return array


def _vectors(table_column: Any, column: str) -> np.ndarray:
    """float [rows, d] from an Arrow list column (rows with a missing list get NaN; the caller refuses them)."""
    lengths = np.asarray(table_column.value_lengths().fill_null(-1))
    present = lengths >= 0
    width = int(lengths[present][0]) if present.any() else 0
    if width == 0 or (lengths[present] != width).any():
        row = int(np.flatnonzero(present & (lengths != width))[0]) if width else 0
        raise TaskHetError(f"column {column!r} must hold vectors of one length >= 1: row {row} of the table has "
                           f"{lengths[row]} values, the first row {width}")
    flat = np.asarray(table_column.flatten().to_numpy(zero_copy_only=False))
    if present.all():
        return flat.reshape(len(lengths), width)
    vectors = np.full((len(lengths), width), np.nan)
    vectors[present] = flat.reshape(-1, width)
    return vectors


class TaskHetPartitioner(flwr_partitioner.Partitioner):
    """A registered TaskHet partition scheme over one column, as a Flower Datasets partitioner.

    Args:
        num_partitions: the number of partitions, an integer in [1, 10000] (step 3b's ``--n_clients``).
        partition_by: the column whose values are the groups the scheme skews (a label).
        scheme: a registered scheme (``partitioning.partition.list_schemes()``; not ``natural``: Flower's
            ``NaturalIdPartitioner`` does that); default ``dirichlet_mixture``, the paper's.
        seed: the root seed, an integer in [0, 2^63-1] (step 3b's ``--seed``): the draw is
            ``numpy_rng(seed, "partition", scheme)``.
        min_partition_size: the fewest rows a partition may hold, an integer in [1, 10^8] (``--min_client_size``).
        **scheme_params: the scheme's other parameters (``alpha`` in (0, 10^6], ``size_skew``,
            ``groups_per_client`` in [1, 1000]).

    Raises:
        TaskHetError: an argument outside its range (a bool is not an integer), or a parameter the scheme does not
            take or refuses: one line naming it, checked here, before any data.
    """

    def __init__(self, num_partitions: int, partition_by: str, *, scheme: str = "dirichlet_mixture", seed: int = 0,
                 min_partition_size: int = 1, **scheme_params: Any) -> None:
        super().__init__()
        if scheme == "natural":
            raise TaskHetError("scheme natural needs each row's owner: use flwr_datasets' NaturalIdPartitioner")
        if not isinstance(partition_by, str) or not partition_by:
            raise TaskHetError(f"partition_by must be a column name (a non-empty string), got {partition_by!r}")
        num_partitions = check_argument("num_partitions", num_partitions)
        seed = check_argument("seed", seed)
        min_partition_size = check_argument("min_partition_size", min_partition_size)
        for name in ("alpha", "groups_per_client"):  # the scheme's numeric parameters (None: the scheme's default)
            if scheme_params.get(name) is not None:
                scheme_params[name] = check_argument(name, scheme_params[name])
        try:
            self._scheme: SchemePartitioner = get_partitioner(scheme, num_partitions, seed=seed,
                                                              min_client_size=min_partition_size, **scheme_params)
            self._scheme.check_parameters()
        except TaskHetError as error:
            raise _flower_terms(error) from None
        self._partition_by = partition_by
        self._partition_indices: list[np.ndarray] | None = None

    @property
    def num_partitions(self) -> int:
        """Total number of partitions."""
        return int(self._scheme.n_clients)

    @property
    def partition_by(self) -> str:
        """The column the partition is drawn from."""
        return self._partition_by

    def groups(self) -> np.ndarray:
        """The group of every row, in the dataset's order (here: the ``partition_by`` column)."""
        values = column_values(self.dataset, self._partition_by)
        if values.ndim != 1:
            raise TaskHetError(f"column {self._partition_by!r} holds vectors; {type(self).__name__} needs one label "
                               "per row (TaskHetEmbeddingPartitioner clusters vectors)")
        return values

    def partition_indices(self) -> list[np.ndarray]:
        """Every partition's row positions in the dataset (sorted int64 arrays), drawn on the first call."""
        if self._partition_indices is None:
            try:
                self._partition_indices = self._scheme.split(self.groups()).client_indices()
            except TaskHetError as error:
                raise _flower_terms(error) from None
        return self._partition_indices

    def load_partition(self, partition_id: int) -> Any:
        """The rows of partition ``partition_id`` (a ``datasets.Dataset``); the first call draws every partition.

        Raises:
            TaskHetError: ``partition_id`` is not an integer in ``[0, num_partitions)``.
        """
        if isinstance(partition_id, bool) or not isinstance(partition_id, (int, np.integer)) \
                or not 0 <= partition_id < self.num_partitions:
            raise TaskHetError(f"partition_id must be an integer in [0, {self.num_partitions - 1}], got {partition_id!r}")
        return self.dataset.select(self.partition_indices()[int(partition_id)])


class TaskHetLabelPartitioner(TaskHetPartitioner):
    """Label-based: the paper's Dirichlet mixture over a label column (step 3b with the label column as
    ``--groups``): partition k's label mixture is q_k ~ Dir(α·p), p the label proportions.

    Args:
        num_partitions: the number of partitions, in [1, 10000] (``--n_clients``).
        partition_by: the label column (default ``label``).
        alpha: the Dirichlet concentration α in (0, 10^6] (``--alpha``): small α, few labels per partition.
        seed: the root seed, in [0, 2^63-1] (``--seed``).
        size_skew: ``None`` (equal sizes), ``"lognormal:σ"`` or ``"powerlaw:a"`` (``--size_skew``).
        min_partition_size: the fewest rows a partition may hold, in [1, 10^8] (``--min_client_size``).
    """

    def __init__(self, num_partitions: int, partition_by: str = "label", *, alpha: float = 1.0, seed: int = 0,
                 size_skew: str | None = None, min_partition_size: int = 1) -> None:
        super().__init__(num_partitions, partition_by, scheme="dirichlet_mixture", seed=seed,
                         min_partition_size=min_partition_size, alpha=alpha, size_skew=size_skew)


class TaskHetEmbeddingPartitioner(TaskHetPartitioner):
    """Embedding-based: the paper's Dirichlet mixture over task-specific embedding clusters (step 3b with step 3's
    clusters.csv as ``--groups``).

    ``partition_by`` holds either each row's cluster id (step 3's clusters, or any grouping) or each row's embedding
    vector (a list column of equal lengths), which is clustered first exactly as step 3 clusters:
    :func:`partitioning.kmeans.cluster_embeddings` (optional PCA, then KMeans; MiniBatchKMeans above 100,000 rows)
    with ``n_clusters``, ``pca_dim``, ``n_init`` and ``cluster_seed`` (step 3's ``--n_clusters``, ``--pca_dim``,
    ``--n_init``, ``--seed``).

    Args:
        num_partitions: the number of partitions, in [1, 10000] (``--n_clients``).
        partition_by: the cluster-id or embedding column.
        n_clusters: the KMeans clusters of an embedding column, in [1, 10000]; must be None for a cluster-id column.
        alpha: the Dirichlet concentration α in (0, 10^6] (``--alpha``).
        seed: the root seed of the partition, in [0, 2^63-1] (step 3b's ``--seed``).
        cluster_seed: the root seed of the PCA and KMeans, in [0, 2^63-1] (step 3's ``--seed``); default ``seed``.
        pca_dim: reduce the embeddings to this many PCA components before KMeans, in [1, 100000] (default: none).
        n_init: KMeans restarts, in [1, 1000] (the best inertia wins).
        size_skew: ``None`` (equal sizes), ``"lognormal:σ"`` or ``"powerlaw:a"``.
        min_partition_size: the fewest rows a partition may hold, in [1, 10^8].

    Attributes:
        clusters: int64 [rows], each row's cluster after the first ``load_partition`` (None before).
    """

    def __init__(self, num_partitions: int, partition_by: str, *, n_clusters: int | None = None, alpha: float = 1.0,
                 seed: int = 0, cluster_seed: int | None = None, pca_dim: int | None = None, n_init: int = 10,
                 size_skew: str | None = None, min_partition_size: int = 1) -> None:
        super().__init__(num_partitions, partition_by, scheme="dirichlet_mixture", seed=seed,
                         min_partition_size=min_partition_size, alpha=alpha, size_skew=size_skew)
        self.n_clusters = None if n_clusters is None else check_argument("n_clusters", n_clusters)
        self.pca_dim = None if pca_dim is None else check_argument("pca_dim", pca_dim)
        self.n_init = check_argument("n_init", n_init)
        # the seed the base checked (and stored on the scheme) when no cluster seed of its own is given
        self.cluster_seed = self._scheme.seed if cluster_seed is None else check_argument("cluster_seed", cluster_seed)
        self.clusters: np.ndarray | None = None

    def groups(self) -> np.ndarray:
        """Each row's cluster: the column itself (cluster ids) or step 3's KMeans of its vectors (embeddings)."""
        values = column_values(self.dataset, self._partition_by)
        if values.ndim == 1:
            if self.n_clusters is not None:
                raise TaskHetError(f"column {self._partition_by!r} holds one value per row (cluster ids); n_clusters "
                                   "clusters an embedding column: leave it out")
            self.clusters = values
            return values
        if self.n_clusters is None:
            raise TaskHetError(f"column {self._partition_by!r} holds embedding vectors: give n_clusters, the number of "
                               "KMeans clusters to partition over")
        if not np.issubdtype(values.dtype, np.number) or not np.isfinite(values).all():
            raise TaskHetError(f"column {self._partition_by!r}: every embedding must be finite numbers")
        from partitioning.kmeans import cluster_embeddings  # scikit-learn only when there is something to cluster

        try:
            clustering = cluster_embeddings(values, self.n_clusters, self.cluster_seed, self.pca_dim, self.n_init)
        except TaskHetError as error:
            raise _flower_terms(error) from None
        self.clusters = clustering.labels
        return clustering.labels
