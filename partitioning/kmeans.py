"""KMeans clusters of task embeddings (step 3's clustering), with numpy and scikit-learn only.

:mod:`partitioning.clustering` (step 3: embedding, diagnostics, plots) re-exports these; they live apart so that a
process without torch or matplotlib can cluster embeddings exactly as step 3 does
(:mod:`partitioning.flwr_partitioners`, Flower Datasets' partitioners).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from utils.errors import TaskHetError
from utils.seeding import derive_seed

# Full KMeans (Lloyd) is exact but O(n·k·d) per iteration over all samples; above this
# many samples MiniBatchKMeans is used, which is much faster at a small cost in inertia.
MINIBATCH_THRESHOLD = 100_000


def sklearn_seed(seed: int, *keys: object) -> int:
    """A derived seed in scikit-learn's accepted range [0, 2**32)."""
    return derive_seed(seed, *keys) % (2**32)


@dataclass(frozen=True)
class Clustering:
    """Result of :func:`cluster_embeddings`.

    Attributes:
        labels: int64 [n_samples], cluster per sample (0..n_clusters-1).
        centers: float32 [n_clusters, d], in the clustered space (after PCA, if any).
        features: float32 [n_samples, d], the clustered features.
        algorithm: "KMeans" or "MiniBatchKMeans".
        pca_explained_variance: fraction of variance PCA kept, or None without PCA.
    """

    labels: np.ndarray
    centers: np.ndarray
    features: np.ndarray
    algorithm: str
    pca_explained_variance: float | None


def cluster_embeddings(
    embeddings: np.ndarray,
    n_clusters: int,
    seed: int,
    pca_dim: int | None = None,
    n_init: int = 10,
    minibatch_threshold: int = MINIBATCH_THRESHOLD,
) -> Clustering:
    """Optional PCA, then KMeans with explicit ``n_init`` and ``random_state``.

    Args:
        embeddings: float [n_samples, D].
        n_clusters: number of clusters (``--n_clusters``).
        seed: root seed (PCA and KMeans get derived seeds).
        pca_dim: reduce to this many components first (``--pca_dim``); None keeps D.
        n_init: KMeans restarts; the best inertia wins.
        minibatch_threshold: use MiniBatchKMeans above this many samples.
    """
    # scikit-learn here, not at the top: its import (about a second) would otherwise be paid by every process that
    # imports the pipeline, each pool worker and Ray task among them, though only step 3 clusters
    from sklearn.cluster import KMeans, MiniBatchKMeans
    from sklearn.decomposition import PCA

    embeddings = np.asarray(embeddings, dtype=np.float32)
    n_samples, dim = embeddings.shape
    if not 1 <= n_clusters <= n_samples:
        raise TaskHetError(f"--n_clusters must be between 1 and the number of samples ({n_samples}), got {n_clusters}")
    if not np.isfinite(embeddings).all():
        raise TaskHetError("the embeddings contain NaN or inf; check the step-2 checkpoint")
    explained = None
    features = embeddings
    if pca_dim is not None:
        if not 1 <= pca_dim <= min(n_samples, dim):
            raise TaskHetError(f"--pca_dim must be between 1 and min(samples, embedding dim) = {min(n_samples, dim)}, got {pca_dim}")
        pca = PCA(n_components=pca_dim, random_state=sklearn_seed(seed, "pca"))
        features = pca.fit_transform(embeddings).astype(np.float32)
        explained = float(pca.explained_variance_ratio_.sum())
    estimator_class = MiniBatchKMeans if n_samples > minibatch_threshold else KMeans
    estimator = estimator_class(n_clusters=n_clusters, n_init=n_init, random_state=sklearn_seed(seed, "kmeans"))
    labels = estimator.fit_predict(features).astype(np.int64)
    return Clustering(labels, estimator.cluster_centers_.astype(np.float32), features, estimator_class.__name__, explained)
