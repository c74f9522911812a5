"""TaskHet's partitions as Flower Datasets partitioners (partitioning/flwr_partitioners.py): on an in-memory
``datasets.Dataset`` of digits, every partition holds exactly the rows step 3b's assignments.csv gives the client,
for the label-based and the embedding-based Dirichlet mixture, through ``load_partition`` and ``FederatedDataset``.

The test process has imported the repository's own ``datasets`` package (conftest, step 3b), whose name Hugging
Face's shares (docs/DESIGN.md §2). The module fixture :func:`flower` therefore runs step 3b first, then puts
Hugging Face's package in its place for the module's tests and restores the repository's afterwards.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from datasets.digits import load_arrays, select_digits
from partitioning.assignments import MAX_ALPHA, MAX_CLIENTS
from partitioning.kmeans import cluster_embeddings
from partitioning.partition import get_partitioner
from steps import assign
from steps.embed import MAX_KMEANS_RESTARTS, MAX_PCA_DIM  # imported before the module swaps in Hugging Face's datasets
from utils.errors import TaskHetError

ROOT = Path(__file__).resolve().parent.parent
ADAPTER = "partitioning.flwr_partitioners"
N_CLIENTS, ALPHA, SEED, N_CLUSTERS, CLUSTER_SEED = 8, 0.5, 5, 6, 7

pytestmark = pytest.mark.skipif(importlib.util.find_spec("flwr_datasets") is None,
                                reason="flwr-datasets is not installed: pip install -c constraints.txt "
                                       "-r requirements-flwr-datasets.txt (make setup installs it)")


def _named_datasets(name: str) -> bool:
    return name == "datasets" or name.startswith("datasets.")


@pytest.fixture(scope="module")
def step3b(tmp_path_factory) -> SimpleNamespace:
    """A digits manifest, its train rows with their embeddings (the 8×8 pixels) and step 3's KMeans clusters of
    them, and step 3b's assignments of the label- and the embedding-based partition (run before the swap)."""
    folder = tmp_path_factory.mktemp("flwr")
    manifest = select_digits(0.2, seed=0, n_samples=600)
    manifest.to_csv(folder / "manifest.csv", index=False)
    train = manifest[(manifest["split"] == "train") & (manifest["val"] == 0)].reset_index(drop=True)  # step 3b's rows
    images, _ = load_arrays()
    embeddings = images[train["image_index"].to_numpy()].reshape(len(train), -1).astype(np.float32)
    clusters = cluster_embeddings(embeddings, N_CLUSTERS, CLUSTER_SEED).labels
    pd.DataFrame({"sample_id": train["sample_id"], "cluster": clusters}).to_csv(folder / "clusters.csv", index=False)
    outputs = {}
    for grouping, flags in (("label", []), ("embedding", ["--groups", str(folder / "clusters.csv")])):
        path = assign.main(["--manifest", str(folder / "manifest.csv"), "--n_clients", str(N_CLIENTS), "--alpha",
                            str(ALPHA), "--seed", str(SEED), "--out", str(folder / grouping), "--no-progress", *flags])
        outputs[grouping] = pd.read_csv(path)
    return SimpleNamespace(folder=folder, train=train, embeddings=embeddings, clusters=clusters, assignments=outputs)


@pytest.fixture(scope="module")
def flower(step3b, tmp_path_factory):
    """Hugging Face's ``datasets``, ``flwr_datasets`` and the adapter module, imported in place of the repository's
    ``datasets`` for this module's tests (offline, without telemetry); the repository's modules come back after."""
    saved = {name: module for name, module in sys.modules.items() if _named_datasets(name)}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in (("HF_HOME", str(tmp_path_factory.mktemp("hf"))), ("HF_DATASETS_OFFLINE", "1"),
                            ("HF_HUB_OFFLINE", "1"), ("FLWR_TELEMETRY_ENABLED", "0")):
            patch.setenv(name, value)  # read when the packages import, so set first
        for name in saved:
            del sys.modules[name]
        try:
            adapter = importlib.import_module(ADAPTER)
            flwr_datasets = importlib.import_module("flwr_datasets")
            yield SimpleNamespace(adapter=adapter, hf=adapter.hf_datasets, FederatedDataset=flwr_datasets.FederatedDataset,
                                  repo_datasets=saved["datasets"])
        finally:
            for name in [name for name in sys.modules if _named_datasets(name) or name.startswith("flwr_datasets")
                         or name == ADAPTER]:
                del sys.modules[name]
            sys.modules.update(saved)


def rows_of_step3b(assignments: pd.DataFrame) -> list[list[str]]:
    """Each client's sample ids in assignments.csv (its train and held-out client-test rows together), sorted."""
    return [sorted(assignments.loc[assignments["client_id"] == client, "sample_id"]) for client in range(N_CLIENTS)]


def rows_of(partitioner) -> list[list[str]]:
    return [sorted(partitioner.load_partition(k)["sample_id"]) for k in range(partitioner.num_partitions)]


def test_label_partitions_hold_the_rows_step3b_gives_each_client(step3b, flower):
    table = flower.hf.Dataset.from_dict({"sample_id": step3b.train["sample_id"].tolist(),
                                         "label": step3b.train["label"].to_numpy()})
    assert type(table).__module__.startswith("datasets.")  # Hugging Face's, not the repository's
    partitioner = flower.adapter.TaskHetLabelPartitioner(N_CLIENTS, "label", alpha=ALPHA, seed=SEED)
    partitioner.dataset = table
    assert rows_of(partitioner) == rows_of_step3b(step3b.assignments["label"])
    assert sum(len(rows) for rows in rows_of(partitioner)) == len(step3b.train)  # every train row, once


@pytest.mark.parametrize("column", ["cluster", "embedding"])
def test_embedding_partitions_hold_the_rows_step3b_gives_each_client(step3b, flower, column):
    values = step3b.clusters if column == "cluster" else list(step3b.embeddings)
    table = flower.hf.Dataset.from_dict({"sample_id": step3b.train["sample_id"].tolist(), column: values})
    # a column of vectors is clustered as step 3 clusters (same k and seed); cluster ids are used as they are
    kmeans = {"n_clusters": N_CLUSTERS, "cluster_seed": CLUSTER_SEED} if column == "embedding" else {}
    partitioner = flower.adapter.TaskHetEmbeddingPartitioner(N_CLIENTS, column, alpha=ALPHA, seed=SEED, **kmeans)
    partitioner.dataset = table
    assert rows_of(partitioner) == rows_of_step3b(step3b.assignments["embedding"])
    np.testing.assert_array_equal(partitioner.clusters, step3b.clusters)
    # and not the label-based partition: the groups matter
    assert rows_of(partitioner) != rows_of_step3b(step3b.assignments["label"])


def test_federated_dataset_takes_the_partitioner_for_its_train_split(step3b, flower, tmp_path):
    path = tmp_path / "train.parquet"
    step3b.train[["sample_id", "label"]].to_parquet(path)
    fds = flower.FederatedDataset(dataset="parquet", data_files={"train": str(path)}, shuffle=False,
                                  cache_dir=str(tmp_path / "cache"),
                                  partitioners={"train": flower.adapter.TaskHetLabelPartitioner(N_CLIENTS, alpha=ALPHA,
                                                                                                seed=SEED)})
    loaded = [sorted(fds.load_partition(k, "train")["sample_id"]) for k in range(N_CLIENTS)]
    assert loaded == rows_of_step3b(step3b.assignments["label"])


def test_a_shuffled_dataset_is_partitioned_in_the_order_it_shows(step3b, flower):
    table = flower.hf.Dataset.from_dict({"sample_id": step3b.train["sample_id"].tolist(),
                                         "label": step3b.train["label"].to_numpy()}).shuffle(seed=3)
    shown = pd.DataFrame({"sample_id": table["sample_id"], "label": table["label"]})  # the rows in the shuffled order
    expected = get_partitioner("dirichlet_mixture", N_CLIENTS, alpha=ALPHA, seed=SEED).split(shown["label"].to_numpy())
    partitioner = flower.adapter.TaskHetLabelPartitioner(N_CLIENTS, alpha=ALPHA, seed=SEED)
    partitioner.dataset = table
    assert rows_of(partitioner) == [sorted(shown["sample_id"].to_numpy()[rows]) for rows in expected.client_indices()]
    assert rows_of(partitioner) != rows_of_step3b(step3b.assignments["label"])  # another order, another partition


IDS = [f"r{row}" for row in range(6)]


def in_two_tables(flower, columns: dict, cut: int):
    """The rows of ``columns`` as a ``datasets.Dataset`` of two Arrow chunks: rows [0, cut) and [cut, end)."""
    first, second = ({name: values[part] for name, values in columns.items()} for part in (slice(cut), slice(cut, None)))
    joined = flower.hf.concatenate_datasets([flower.hf.Dataset.from_dict(first), flower.hf.Dataset.from_dict(second)])
    assert all(joined.data.column(name).num_chunks == 2 for name in columns)  # what the test is about
    return joined


def test_a_label_column_of_several_arrow_chunks_is_partitioned_as_one_chunk(flower):
    import pyarrow as pa

    labels = [0, 0, 1, 1, 1, 0]
    one = flower.hf.Dataset.from_dict({"sample_id": IDS, "label": labels})
    two = in_two_tables(flower, {"sample_id": IDS, "label": labels}, cut=2)
    chunked = flower.hf.Dataset(pa.table({"sample_id": pa.chunked_array([IDS[:3], IDS[3:]]),
                                          "label": pa.chunked_array([labels[:3], labels[3:]])}))
    assert chunked.data.column("label").num_chunks == 2
    # By hand: one partition holds every row, those of the second chunk too.
    whole = flower.adapter.TaskHetLabelPartitioner(1, seed=SEED)
    whole.dataset = two
    assert whole.load_partition(0)["sample_id"] == IDS
    partitions = []
    for dataset in (one, two, chunked):
        partitioner = flower.adapter.TaskHetLabelPartitioner(2, alpha=ALPHA, seed=SEED)
        partitioner.dataset = dataset
        partitions.append(rows_of(partitioner))
    assert partitions[1] == partitions[2] == partitions[0]
    assert sorted(partitions[0][0] + partitions[0][1]) == IDS  # each row once, in one of the two


# Two blobs by hand: rows 1, 2 and 4 lie near (0, 0), rows 0, 3 and 5 near (10, 10).
VECTORS = [[10.0, 10.0], [0.0, 0.0], [0.0, 1.0], [10.0, 11.0], [0.0, 0.5], [10.0, 10.5]]


def blobs(partitioner) -> list[set[str]]:
    """The rows of each KMeans cluster the partitioner found, as sets of sample ids (cluster ids are arbitrary)."""
    ids = partitioner.dataset["sample_id"]
    return sorted(({ids[row] for row in np.flatnonzero(partitioner.clusters == cluster)}
                   for cluster in np.unique(partitioner.clusters)), key=min)


def test_an_embedding_column_of_several_arrow_chunks_is_clustered_and_partitioned_as_one_chunk(flower):
    one = flower.hf.Dataset.from_dict({"sample_id": IDS, "e": VECTORS})
    two = in_two_tables(flower, {"sample_id": IDS, "e": VECTORS}, cut=3)
    partitions = []
    for dataset in (one, two):
        partitioner = flower.adapter.TaskHetEmbeddingPartitioner(2, "e", n_clusters=2, alpha=ALPHA, seed=SEED)
        partitioner.dataset = dataset
        partitions.append(rows_of(partitioner))
        assert blobs(partitioner) == [{"r0", "r3", "r5"}, {"r1", "r2", "r4"}]
    assert partitions[1] == partitions[0]
    # A contiguous select slices the chunks (no row mapping): the first chunk now starts at its row 1, and each
    # vector must still be its own row's, not the one before it (row 0 lies in the other blob). Of one chunk and of
    # two (which are combined into one array first).
    for whole in (one, two):
        sliced = whole.select(range(1, 6))
        assert sliced._indices is None and sliced.data.column("e").chunk(0).offset == 1
        partitioner = flower.adapter.TaskHetEmbeddingPartitioner(2, "e", n_clusters=2, alpha=ALPHA, seed=SEED)
        partitioner.dataset = sliced
        assert sorted(sum(rows_of(partitioner), [])) == IDS[1:]
        assert blobs(partitioner) == [{"r1", "r2", "r4"}, {"r3", "r5"}]


CONSTRUCTION = {
    "alpha 0": (dict(alpha=0.0), r"^alpha must be a number in \(0, 1e\+06\], got 0\.0$"),
    "alpha nan": (dict(alpha=float("nan")), r"^alpha must be a number in \(0, 1e\+06\], got nan$"),
    "alpha above the maximum": (dict(alpha=1e6 * (1 + 1e-15)), r"^alpha must be a number in \(0, 1e\+06\], got 1"),
    "alpha a bool": (dict(alpha=True), r"^alpha must be a number in \(0, 1e\+06\], got True$"),
    "no partitions": (dict(num_partitions=0), r"^num_partitions must be an integer in \[1, 10000\], got 0$"),
    "partitions a bool": (dict(num_partitions=True), r"^num_partitions must be an integer in \[1, 10000\], got True$"),
    "partitions a numpy bool": (dict(num_partitions=np.bool_(True)), r"^num_partitions must be an integer in \[1, "
                                                                      r"10000\], got np\.True_$"),
    "partitions a float": (dict(num_partitions=4.0), r"^num_partitions must be an integer in \[1, 10000\], got 4\.0$"),
    "partitions above the maximum": (dict(num_partitions=10_001),
                                     r"^num_partitions must be an integer in \[1, 10000\], got 10001$"),
    "min size 0": (dict(min_partition_size=0), r"^min_partition_size must be an integer in \[1, 100000000\], got 0$"),
    "min size a bool": (dict(min_partition_size=True), r"^min_partition_size must be an integer in \[1, 100000000\], "
                                                       r"got True$"),
    "min size above the maximum": (dict(min_partition_size=10**8 + 1), r"^min_partition_size must be an integer in "
                                                                      r"\[1, 100000000\], got 100000001$"),
    "seed a bool": (dict(seed=False), r"^seed must be an integer in \[0, 2\^63-1\], got False$"),
    "negative seed": (dict(seed=-1), r"^seed must be an integer in \[0, 2\^63-1\], got -1$"),
    "seed past int64": (dict(seed=2**63), r"^seed must be an integer in \[0, 2\^63-1\], got 9223372036854775808$"),
    "partition_by not a name": (dict(partition_by=3), r"^partition_by must be a column name \(a non-empty string\), "
                                                      r"got 3$"),
    "bad size skew": (dict(size_skew="zipf:2"), r"zipf"),
}


@pytest.mark.parametrize("case", CONSTRUCTION)
def test_bad_parameters_are_refused_when_the_partitioner_is_built(flower, case):
    changes, message = CONSTRUCTION[case]
    arguments = {"num_partitions": 4, **changes}
    with pytest.raises(TaskHetError, match=message):
        flower.adapter.TaskHetLabelPartitioner(**arguments)


@pytest.mark.parametrize("arguments, message", [
    (dict(n_clusters=0), r"^n_clusters must be an integer in \[1, 10000\], got 0$"),
    (dict(n_clusters=True), r"^n_clusters must be an integer in \[1, 10000\], got True$"),
    (dict(n_clusters=10_001), r"^n_clusters must be an integer in \[1, 10000\], got 10001$"),
    (dict(pca_dim=1.5), r"^pca_dim must be an integer in \[1, 100000\], got 1\.5$"),
    (dict(pca_dim=100_001), r"^pca_dim must be an integer in \[1, 100000\], got 100001$"),
    (dict(n_init=True), r"^n_init must be an integer in \[1, 1000\], got True$"),
    (dict(n_init=0), r"^n_init must be an integer in \[1, 1000\], got 0$"),
    (dict(n_init=10**9), r"^n_init must be an integer in \[1, 1000\], got 1000000000$"),  # KMeans for days before
    (dict(cluster_seed=True), r"^cluster_seed must be an integer in \[0, 2\^63-1\], got True$"),
    (dict(cluster_seed=-1), r"^cluster_seed must be an integer in \[0, 2\^63-1\], got -1$"),
])
def test_bad_kmeans_parameters_are_refused_when_built(flower, arguments, message):
    with pytest.raises(TaskHetError, match=message):
        flower.adapter.TaskHetEmbeddingPartitioner(4, "embedding", **arguments)


def test_every_maximum_itself_is_accepted_and_numpy_numbers_count_as_python_ones(flower):
    label = flower.adapter.TaskHetLabelPartitioner(np.int64(10_000), alpha=1e6, seed=2**63 - 1,
                                                   min_partition_size=10**8)
    assert label.num_partitions == 10_000 and type(label.num_partitions) is int
    embedding = flower.adapter.TaskHetEmbeddingPartitioner(1, "e", n_clusters=10_000, pca_dim=100_000, n_init=1_000,
                                                           alpha=np.float32(0.5), cluster_seed=np.int32(0), seed=3)
    assert (embedding.n_clusters, embedding.pca_dim, embedding.n_init, embedding.cluster_seed) == (10_000, 100_000,
                                                                                                   1_000, 0)
    assert flower.adapter.TaskHetEmbeddingPartitioner(1, "e", seed=3).cluster_seed == 3  # the partition's seed
    base = flower.adapter.TaskHetPartitioner(2, "label", scheme="shards", groups_per_client=1_000)
    assert base.num_partitions == 2
    with pytest.raises(TaskHetError, match=r"^groups_per_client must be an integer in \[1, 1000\], got 1001$"):
        flower.adapter.TaskHetPartitioner(2, "label", scheme="shards", groups_per_client=1_001)


def test_the_maxima_are_those_of_the_flags_the_arguments_stand_for(flower):
    """The adapter writes the flags' maxima out (it cannot import TaskHet's steps beside Hugging Face's datasets)."""
    ranges = flower.adapter.ARGUMENTS
    assert (ranges["num_partitions"].high, ranges["alpha"].high) == (MAX_CLIENTS, MAX_ALPHA)
    assert ranges["groups_per_client"].high == assign.MAX_GROUPS_PER_CLIENT
    assert (ranges["pca_dim"].high, ranges["n_init"].high) == (MAX_PCA_DIM, MAX_KMEANS_RESTARTS)


def test_the_natural_scheme_points_to_flowers_own(flower):
    with pytest.raises(TaskHetError, match="NaturalIdPartitioner"):
        flower.adapter.TaskHetPartitioner(4, "label", scheme="natural")


DATA = {
    "missing column": ({"label": [0, 1] * 10}, "TaskHetLabelPartitioner", dict(partition_by="digit"),
                       r"partition_by column 'digit' is not in the dataset; its columns: label"),
    "missing values": ({"label": [0, None, 1] * 5}, "TaskHetLabelPartitioner", {},
                       r"column 'label' has 5 missing values \(the first in row 1\)"),
    "vectors for labels": ({"label": [[0.0, 1.0]] * 10}, "TaskHetLabelPartitioner", {}, r"holds vectors"),
    "ragged vectors": ({"e": [[0.0, 1.0]] * 5 + [[1.0]]}, "TaskHetEmbeddingPartitioner", dict(n_clusters=2),
                       r"vectors of one length >= 1: row 5 of the table has 1 values, the first row 2"),
    "non-finite vectors": ({"e": [[0.0, 1.0]] * 5 + [[1.0, float("inf")]]}, "TaskHetEmbeddingPartitioner",
                           dict(n_clusters=2), r"every embedding must be finite"),
    "vectors without k": ({"e": [[0.0, 1.0]] * 6}, "TaskHetEmbeddingPartitioner", {}, r"give n_clusters"),
    "ids with k": ({"e": [0, 1] * 6}, "TaskHetEmbeddingPartitioner", dict(n_clusters=2), r"cluster ids\); n_clusters"),
    "more clusters than rows": ({"e": [[0.0, 1.0], [1.0, 0.0]] * 2}, "TaskHetEmbeddingPartitioner",
                                dict(n_clusters=9, num_partitions=2), r"n_clusters must be between 1 and the number of"),
    "more partitions than rows": ({"label": [0, 1, 0]}, "TaskHetLabelPartitioner", {},
                                  r"4 clients of at least 1 samples need 4 samples, but there are only 3; lower "
                                  r"num_partitions or min_partition_size"),
}


@pytest.mark.parametrize("case", DATA)
def test_bad_data_is_one_error_naming_the_column_or_argument(flower, case):
    columns, name, arguments, message = DATA[case]
    arguments = {"num_partitions": 4, "partition_by": next(iter(columns)), **arguments}
    partitioner = getattr(flower.adapter, name)(**arguments)
    partitioner.dataset = flower.hf.Dataset.from_dict(columns)
    with pytest.raises(TaskHetError, match=message):
        partitioner.load_partition(0)


@pytest.mark.parametrize("partition_id", [-1, 4, True, 1.0])
def test_a_partition_id_outside_the_partitions_is_refused(flower, partition_id):
    partitioner = flower.adapter.TaskHetLabelPartitioner(4)
    partitioner.dataset = flower.hf.Dataset.from_dict({"label": [0, 1] * 10})
    with pytest.raises(TaskHetError, match=rf"partition_id must be an integer in \[0, 3\], got {partition_id!r}"):
        partitioner.load_partition(partition_id)


def test_the_adapter_refuses_to_import_beside_the_repositorys_datasets_package(flower, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", flower.repo_datasets)
    with pytest.raises(ImportError, match="TaskHet's own datasets package is already imported"):
        flower.adapter.import_flower_datasets()


@pytest.mark.slow
def test_the_adapter_imports_outside_the_repository_without_torch(tmp_path):
    """A process with the repository on PYTHONPATH (ahead of site-packages, so its datasets/ would shadow Hugging
    Face's: the how-to warns against it for the user's own imports, but the module itself still imports Hugging
    Face's), the working directory elsewhere, and no TaskHet venv start-up hook (it imports torch when any library
    looks for torchvision, as Hugging Face's datasets does)."""
    code = ("import sys\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if type(f).__module__ != 'taskhet_torchvision_hook']\n"
            f"import {ADAPTER} as adapter\n"
            "print(adapter.hf_datasets.__file__)\n"
            "print(sorted(m for m in ('torch', 'torchvision') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                 "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1",
                                 "FLWR_TELEMETRY_ENABLED": "0"})
    assert result.returncode == 0, result.stderr[-2000:]
    hf_file, imported = result.stdout.splitlines()[-2:]
    assert Path(hf_file).resolve().parent != ROOT / "datasets" and imported == "[]"  # Hugging Face's, and no torch


HOWTO = ROOT / "docs" / "howto" / "flower-partitioners.md"


def howto_script() -> str:
    """The how-to's first Python block, with the checkout's path where the page says ``/path/to/taskhet``."""
    block = HOWTO.read_text().split("```python\n", 1)[1].split("```", 1)[0]
    assert 'sys.path.append("/path/to/taskhet")' in block
    return block.replace("/path/to/taskhet", str(ROOT))


def run_outside(tmp_path: Path, script: str, **env: str) -> subprocess.CompletedProcess:
    """``python partition_digits.py`` as the how-to says, from a folder outside the checkout, offline."""
    (tmp_path / "partition_digits.py").write_text(script)
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    environment.update({"HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                        "FLWR_TELEMETRY_ENABLED": "0", **env})
    return subprocess.run([sys.executable, "partition_digits.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=environment)


@pytest.mark.slow
def test_the_howtos_script_runs_as_its_page_says_from_outside_the_repository(tmp_path):
    from sklearn.datasets import load_digits

    assert not tmp_path.resolve().is_relative_to(ROOT)
    result = run_outside(tmp_path, howto_script())
    assert result.returncode == 0, result.stderr[-3000:]
    label_line, embedding_line = result.stdout.splitlines()[-2:]
    # What it prints is the partition step 3b's code draws from the same values and seeds.
    digits = load_digits()
    by_label = get_partitioner("dirichlet_mixture", 10, alpha=0.5, seed=0).split(digits.target).client_indices()
    clusters = cluster_embeddings(digits.data.astype(np.float32), 8, 0).labels
    by_cluster = get_partitioner("dirichlet_mixture", 10, alpha=0.5, seed=0).split(clusters).client_indices()
    assert label_line == str(len(by_label[0]))
    assert embedding_line == f"{len(by_cluster[0])} {np.bincount(clusters)}"
    assert np.bincount(clusters).sum() == len(digits.target) == 1797


@pytest.mark.slow
def test_the_route_the_howto_warns_against_fails_as_it_says(tmp_path):
    """With the root on PYTHONPATH (ahead of site-packages), the script's own ``from datasets import Dataset`` finds
    TaskHet's package: the reason the page says ``sys.path.append`` and never ``PYTHONPATH``."""
    result = run_outside(tmp_path, howto_script(), PYTHONPATH=str(ROOT))
    assert result.returncode != 0
    assert "cannot import name 'Dataset' from 'datasets'" in result.stderr
    assert str(ROOT / "datasets") in result.stderr


def test_the_generated_reference_lists_every_class_and_argument_as_the_code_has_them(flower):
    import inspect

    from docsgen.flower_partitioners import page

    text = page()
    classes = [cls for name, cls in vars(flower.adapter).items()
               if inspect.isclass(cls) and cls.__module__ == ADAPTER and not name.startswith("_")]
    assert {cls.__name__ for cls in classes} == {"TaskHetPartitioner", "TaskHetLabelPartitioner",
                                                  "TaskHetEmbeddingPartitioner"}
    for cls in classes:
        section = text.split(f"## {cls.__name__}\n")[1].split("\n## ")[0]
        for parameter in list(inspect.signature(cls.__init__).parameters.values())[1:]:
            name = ("**" if parameter.kind is parameter.VAR_KEYWORD else "") + parameter.name
            default = "required" if parameter.default is parameter.empty else f"`{parameter.default!r}`"
            if parameter.kind is parameter.VAR_KEYWORD:
                default = ""
            assert f"| `{name}` | {default} |" in section, (cls.__name__, name)
