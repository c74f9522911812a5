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
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from datasets.digits import load_arrays, select_digits
from partitioning.kmeans import cluster_embeddings
from partitioning.partition import get_partitioner
from steps import assign
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


CONSTRUCTION = {
    "alpha 0": (dict(alpha=0.0), r"alpha must be a finite number > 0, got 0\.0"),
    "alpha nan": (dict(alpha=float("nan")), r"alpha must be a finite number > 0"),
    "no partitions": (dict(num_partitions=0), r"num_partitions must be an integer >= 1, got 0"),
    "min size 0": (dict(min_partition_size=0), r"min_partition_size must be an integer >= 1, got 0"),
    "bad size skew": (dict(size_skew="zipf:2"), r"zipf"),
}


@pytest.mark.parametrize("case", CONSTRUCTION)
def test_bad_parameters_are_refused_when_the_partitioner_is_built(flower, case):
    changes, message = CONSTRUCTION[case]
    arguments = {"num_partitions": 4, **changes}
    with pytest.raises(TaskHetError, match=message):
        flower.adapter.TaskHetLabelPartitioner(**arguments)


@pytest.mark.parametrize("arguments, message", [
    (dict(n_clusters=0), r"n_clusters must be an integer >= 1, got 0"),
    (dict(pca_dim=1.5), r"pca_dim must be an integer >= 1, got 1\.5"),
    (dict(n_init=True), r"n_init must be an integer >= 1, got True"),
])
def test_bad_kmeans_parameters_are_refused_when_built(flower, arguments, message):
    with pytest.raises(TaskHetError, match=message):
        flower.adapter.TaskHetEmbeddingPartitioner(4, "embedding", **arguments)


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
    """A Flower user's process: the repository on PYTHONPATH (ahead of site-packages, so its datasets/ would shadow
    Hugging Face's), the working directory elsewhere, and no TaskHet venv start-up hook (it imports torch when any
    library looks for torchvision, as Hugging Face's datasets does)."""
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
