"""KMeans clusters of task embeddings (step 3) and how they relate to the data's class labels.

The clusters are the embedding-based groups of the paper; their agreement with the class
labels (NMI, ARI, contingency table) measures how far embedding-based partitions can
differ from label-based ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

# The clustering itself has no torch or matplotlib (partitioning/kmeans.py): Flower Datasets' partitioners use it.
from partitioning.kmeans import MINIBATCH_THRESHOLD, Clustering, cluster_embeddings, sklearn_seed  # noqa: F401
from utils.seeding import numpy_rng

# Silhouette is O(n²); it is computed on a seeded subsample of this size.
SILHOUETTE_SAMPLE = 10_000
SCATTER_POINTS = 20_000


@torch.inference_mode()
def embed_samples(model: nn.Module, loader: DataLoader, device: torch.device, input_key: str,
                  progress: bool = True) -> tuple[np.ndarray, list[str]]:
    """Embed every sample of a loader with a TaskModel in eval mode, in float32.

    Eval mode makes batch norm use its running statistics, so a sample's embedding
    does not depend on the batch it is in. No autocast: step 3's clusters should not
    depend on the device's reduced precision.

    Args:
        model: ``model(images) -> (prediction, embedding [B, D])``, already on ``device``.
        loader: batches with ``input_key`` [B, 3, H, W] and ``"sample_id"`` (list of str), in order.
        device: where the model is.
        input_key: batch key of the model input (the data family's ``input_key``).

    Returns:
        ``(embeddings float32 [N, D] in loader order, sample ids)``.
    """
    model.eval()
    chunks, sample_ids = [], []
    for batch in tqdm(loader, desc="embedding", leave=False, dynamic_ncols=True, disable=not progress):
        _, embedding = model(batch[input_key].to(device, non_blocking=True))
        chunks.append(embedding.float().cpu().numpy())
        sample_ids.extend(batch["sample_id"])
    return np.concatenate(chunks).astype(np.float32, copy=False), sample_ids


def contingency(labels: np.ndarray, class_labels: np.ndarray, label_name: str = "label") -> pd.DataFrame:
    """Counts of samples per (cluster, class): rows clusters, columns classes (named ``label_name``)."""
    return pd.crosstab(pd.Series(labels, name="cluster"), pd.Series(class_labels, name=label_name))


def cluster_diagnostics(features: np.ndarray, labels: np.ndarray, class_labels: np.ndarray, seed: int) -> dict[str, Any]:
    """Cluster sizes, silhouette score and the agreement with the class labels.

    Returns:
        ``{"cluster_sizes": list[int], "silhouette": float (NaN with one cluster),
        "nmi": float, "ari": float}``; NMI/ARI are 1 when clusters equal the classes
        and ~0 when unrelated.
    """
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score, silhouette_score  # see kmeans.py

    n_labels = np.unique(labels).size
    silhouette = float("nan")
    if 2 <= n_labels <= labels.size - 1:
        sample = min(labels.size, SILHOUETTE_SAMPLE)
        silhouette = float(silhouette_score(features, labels, sample_size=sample, random_state=sklearn_seed(seed, "silhouette")))
    return {
        "cluster_sizes": np.bincount(labels).tolist(),
        "silhouette": silhouette,
        "nmi": float(normalized_mutual_info_score(class_labels, labels)),
        "ari": float(adjusted_rand_score(class_labels, labels)),
    }


def plot_scatter(features: np.ndarray, colours: np.ndarray, path: Path, title: str, seed: int) -> None:
    """2-D PCA scatter of ``features`` coloured by ``colours`` (a seeded subsample if large)."""
    from sklearn.decomposition import PCA  # see kmeans.py

    from utils.plots import plt, save_figure  # here: matplotlib costs every pool worker 0.4 s of import

    rng = numpy_rng(seed, "scatter")
    keep = np.sort(rng.choice(features.shape[0], size=min(features.shape[0], SCATTER_POINTS), replace=False))
    points = features[keep]
    if points.shape[1] >= 2 and points.shape[0] >= 2:
        points = PCA(n_components=2, random_state=sklearn_seed(seed, "scatter")).fit_transform(points)
    else:
        points = np.hstack([points[:, :1], np.zeros((points.shape[0], 1))])
    figure, axis = plt.subplots(figsize=(7, 6))
    codes = pd.factorize(pd.Series(colours[keep]), sort=True)
    scatter = axis.scatter(points[:, 0], points[:, 1], c=codes[0], cmap="tab20", s=6, alpha=0.8)
    if codes[1].size <= 20:
        handles = [plt.Line2D([], [], marker="o", linestyle="", color=scatter.cmap(scatter.norm(i))) for i in range(codes[1].size)]
        axis.legend(handles, [str(c) for c in codes[1]], fontsize=7, loc="best", markerscale=0.8)
    axis.set_xlabel("PC 1")
    axis.set_ylabel("PC 2")
    axis.set_title(title)
    save_figure(figure, path, dpi=120)


def plot_contingency(table: pd.DataFrame, path: Path) -> None:
    """Heatmap of the cluster × class table (:func:`contingency`), each cluster's row as fractions."""
    from utils.plots import plt, save_figure  # see plot_scatter
    fractions = table.to_numpy(dtype=float) / np.maximum(table.to_numpy().sum(axis=1, keepdims=True), 1)
    figure, axis = plt.subplots(figsize=(np.clip(3 + 0.4 * table.shape[1], 6, 16), np.clip(2 + 0.4 * table.shape[0], 4, 12)))
    image = axis.imshow(fractions, aspect="auto", cmap="magma", vmin=0, vmax=1)
    axis.set_xticks(range(table.shape[1]), [str(c) for c in table.columns], rotation=90)
    axis.set_yticks(range(table.shape[0]), [str(r) for r in table.index])
    axis.set_xlabel(str(table.columns.name))
    axis.set_ylabel("cluster")
    axis.set_title(f"clusters vs {table.columns.name} (row fractions)")
    figure.colorbar(image, ax=axis, label="fraction of the cluster")
    save_figure(figure, path, dpi=120)


def write_diagnostics(out_dir: Path, clustering: Clustering, class_labels: np.ndarray, seed: int,
                      label_name: str = "label") -> dict[str, Any]:
    """All step-3 diagnostics into ``out_dir``; ``label_name`` names the classes (the family's label column).

    Writes ``scatter_clusters.png``, ``scatter_<label_name>.png``, ``contingency.csv``
    and ``contingency.png``; returns :func:`cluster_diagnostics` plus the algorithm
    and PCA variance.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = cluster_diagnostics(clustering.features, clustering.labels, class_labels, seed)
    summary.update(algorithm=clustering.algorithm, pca_explained_variance=clustering.pca_explained_variance)
    plot_scatter(clustering.features, clustering.labels, out_dir / "scatter_clusters.png", "embeddings coloured by cluster", seed)
    plot_scatter(clustering.features, np.asarray(class_labels), out_dir / f"scatter_{label_name}.png",
                 f"embeddings coloured by {label_name}", seed)
    table = contingency(clustering.labels, np.asarray(class_labels), label_name)
    table.to_csv(out_dir / "contingency.csv")
    plot_contingency(table, out_dir / "contingency.png")
    return summary
