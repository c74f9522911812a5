"""KMeans clustering of embeddings and its diagnostics against scene labels."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from sklearn.datasets import make_blobs

from partitioning.clustering import cluster_diagnostics, cluster_embeddings, contingency, write_diagnostics
from utils.errors import TaskHetError


def blobs(n_samples: int = 300, n_features: int = 16, centers: int = 3, seed: int = 0):
    features, truth = make_blobs(n_samples=n_samples, n_features=n_features, centers=centers, cluster_std=0.5, random_state=seed)
    return features.astype(np.float32), truth


def test_separated_blobs_are_recovered_and_agree_with_labels():
    features, truth = blobs()
    clustering = cluster_embeddings(features, n_clusters=3, seed=0)
    assert clustering.algorithm == "KMeans"
    assert clustering.labels.dtype == np.int64 and clustering.centers.shape == (3, 16)
    summary = cluster_diagnostics(clustering.features, clustering.labels, truth, seed=0)
    assert summary["nmi"] == pytest.approx(1.0) and summary["ari"] == pytest.approx(1.0)
    assert summary["silhouette"] > 0.7
    assert sorted(summary["cluster_sizes"]) == sorted(np.bincount(truth).tolist())


def test_unrelated_labels_have_low_agreement():
    features, _ = blobs(n_samples=600)
    clustering = cluster_embeddings(features, n_clusters=3, seed=0)
    random_labels = np.random.default_rng(0).integers(0, 4, 600)
    summary = cluster_diagnostics(clustering.features, clustering.labels, random_labels, seed=0)
    assert summary["nmi"] < 0.05 and abs(summary["ari"]) < 0.05


def test_seeded_and_pca():
    features, _ = blobs(n_samples=200, n_features=32, centers=6)
    first = cluster_embeddings(features, n_clusters=6, seed=1, pca_dim=4)
    again = cluster_embeddings(features, n_clusters=6, seed=1, pca_dim=4)
    assert np.array_equal(first.labels, again.labels) and np.array_equal(first.centers, again.centers)
    assert first.features.shape == (200, 4) and first.centers.shape == (6, 4)
    assert 0 < first.pca_explained_variance <= 1


def test_minibatch_above_threshold():
    features, truth = blobs(n_samples=500)
    clustering = cluster_embeddings(features, n_clusters=3, seed=0, minibatch_threshold=100)
    assert clustering.algorithm == "MiniBatchKMeans"
    assert cluster_diagnostics(clustering.features, clustering.labels, truth, seed=0)["ari"] > 0.95


@pytest.mark.parametrize("kwargs, flag", [({"n_clusters": 0}, "--n_clusters"), ({"n_clusters": 301}, "--n_clusters"),
                                          ({"n_clusters": 3, "pca_dim": 17}, "--pca_dim")])
def test_bad_arguments_name_the_flag(kwargs, flag):
    features, _ = blobs()
    with pytest.raises(TaskHetError, match=flag):
        cluster_embeddings(features, seed=0, **kwargs)


def test_nan_embeddings_rejected():
    features, _ = blobs()
    features[5, 2] = np.nan
    with pytest.raises(TaskHetError, match="NaN"):
        cluster_embeddings(features, n_clusters=3, seed=0)


def test_contingency_counts():
    table = contingency(np.array([0, 0, 1, 1, 1]), np.array([2, 5, 5, 5, 2]))
    assert table.loc[0].tolist() == [1, 1] and table.loc[1].tolist() == [1, 2]


def test_write_diagnostics(tmp_path):
    features, truth = blobs()
    clustering = cluster_embeddings(features, n_clusters=4, seed=0)
    summary = write_diagnostics(tmp_path, clustering, truth, seed=0, label_name="scene_class")
    for name in ("scatter_clusters.png", "scatter_scene_class.png", "contingency.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    table = pd.read_csv(tmp_path / "contingency.csv", index_col=0)
    assert table.to_numpy().sum() == 300 and table.shape == (4, 3)
    assert summary["algorithm"] == "KMeans" and sum(summary["cluster_sizes"]) == 300
