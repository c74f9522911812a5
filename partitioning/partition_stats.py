"""How skewed a partition is: per-client statistics and a clients × groups heatmap."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from scipy.spatial.distance import jensenshannon  # noqa: E402

from partitioning.allocation import UNUSED  # noqa: E402
from utils.plots import save_figure  # noqa: E402


def group_counts(client_of: np.ndarray, group_codes: np.ndarray, n_clients: int, n_groups: int) -> np.ndarray:
    """int64 [n_clients, n_groups]: how many samples of each group each client holds."""
    held = client_of != UNUSED
    flat = client_of[held] * n_groups + group_codes[held]
    return np.bincount(flat, minlength=n_clients * n_groups).reshape(n_clients, n_groups)


def client_stats(client_of: np.ndarray, groups: np.ndarray, n_clients: int) -> pd.DataFrame:
    """One row per client.

    Args:
        client_of: int [n_samples], client per sample, ``UNUSED`` (-1) for none.
        groups: [n_samples] group label per sample (scene class, cluster).
        n_clients: number of clients.

    Returns:
        DataFrame with columns ``client_id``, ``size``, ``n_groups`` (groups present),
        ``effective_groups`` (exp of the Shannon entropy of the client's group mixture:
        1 = one group, G = uniform over G groups), ``js_divergence`` (Jensen–Shannon
        divergence, base 2, in [0, 1], between the client's mixture and the global one
        over all samples), then ``count_<group>`` per group.
    """
    names, codes = np.unique(np.asarray(groups), return_inverse=True)
    counts = group_counts(np.asarray(client_of), codes, n_clients, names.size)
    sizes = counts.sum(axis=1)
    global_mixture = np.bincount(codes, minlength=names.size) / codes.size
    with np.errstate(invalid="ignore", divide="ignore"):
        mixtures = counts / sizes[:, None]
        entropy = -np.nansum(np.where(mixtures > 0, mixtures * np.log(mixtures), 0.0), axis=1)
    divergence = jensenshannon(mixtures, global_mixture[None, :], axis=1, base=2) ** 2
    table = pd.DataFrame(
        {
            "client_id": np.arange(n_clients),
            "size": sizes,
            "n_groups": (counts > 0).sum(axis=1),
            "effective_groups": np.where(sizes > 0, np.exp(entropy), 0.0),
            "js_divergence": np.where(sizes > 0, divergence, np.nan),
        }
    )
    count_columns = pd.DataFrame(counts, columns=[f"count_{name}" for name in names])
    return pd.concat([table, count_columns], axis=1)


def plot_heatmap(stats: pd.DataFrame, path: Path, title: str, row_notes: Sequence[str] | None = None) -> None:
    """Save a clients × groups heatmap of each client's group fractions (rows sum to 1).

    ``row_notes``: one short text per client (e.g. its skews: noise σ, swapped pairs), shown after its id."""
    count_columns: Sequence[str] = [c for c in stats.columns if c.startswith("count_")]
    counts = stats[count_columns].to_numpy(dtype=float)
    fractions = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    n_clients, n_groups = fractions.shape
    figure, axis = plt.subplots(figsize=(np.clip(3 + 0.35 * n_groups, 6, 16), np.clip(2 + 0.25 * n_clients, 4, 12)))
    image = axis.imshow(fractions, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, vmax=1)
    axis.set_xlabel("group")
    axis.set_ylabel("client")
    if n_groups <= 40:
        axis.set_xticks(range(n_groups), [c.removeprefix("count_") for c in count_columns], rotation=90)
    if n_clients <= 40:
        names = stats["client_id"].astype(str).tolist()
        if row_notes is not None:
            names = [f"{name} {note}".strip() for name, note in zip(names, row_notes)]
        axis.set_yticks(range(n_clients), names)
    axis.set_title(title)
    figure.colorbar(image, ax=axis, label="fraction of the client's samples")
    save_figure(figure, path, dpi=120)
