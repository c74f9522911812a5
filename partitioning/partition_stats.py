"""How skewed a partition is: per-client statistics and a clients × groups heatmap."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from partitioning.allocation import UNUSED

# matplotlib and scipy are imported in the functions that use them: each takes a second to import, and a process
# that only reads step 3b's flag ranges (a Flower node checking its run config, once per message) uses neither.


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
    from scipy.spatial.distance import jensenshannon

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


def js_distance(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Jensen–Shannon *distance* between distributions, base 2, in [0, 1]: one value per row.

    JS(p, q) = √(½·KL(p‖m) + ½·KL(q‖m)) with m = ½(p + q) and KL in bits (log base 2): 0 for equal
    distributions, 1 for disjoint supports. It is the square root of the base-2 Jensen–Shannon divergence
    (``js_divergence`` of :func:`client_stats`), and a metric (the triangle inequality holds); computed by
    ``scipy.spatial.distance.jensenshannon(p, q, base=2)``.

    Args:
        p, q: [..., G] probability vectors over the last axis (broadcast against each other); rows of
            ``p`` may be all-NaN (an empty client), which gives NaN.
    """
    from scipy.spatial.distance import jensenshannon

    p, q = np.broadcast_arrays(np.asarray(p, dtype=float), np.asarray(q, dtype=float))
    with np.errstate(invalid="ignore"):
        return np.asarray(jensenshannon(p, q, axis=-1, base=2))


def hellinger_distance(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Hellinger distance between distributions, in [0, 1]: one value per row.

    H(p, q) = (1/√2)·‖√p − √q‖₂ = √(1 − Σ_g √(p_g·q_g)): 0 for equal distributions, 1 for disjoint
    supports. Hand-written (scipy has no Hellinger distance); the first form is used, which has no
    cancellation near 0.

    Args:
        p, q: [..., G] probability vectors over the last axis (broadcast against each other).
    """
    p, q = np.broadcast_arrays(np.asarray(p, dtype=float), np.asarray(q, dtype=float))
    return np.sqrt(np.sum((np.sqrt(p) - np.sqrt(q)) ** 2, axis=-1) / 2)


# Kinds of distance of :func:`partition_distances`, with their functions: the columns are ``<space>_<kind>``.
DISTANCES = {"js_distance": js_distance, "hellinger": hellinger_distance}


def partition_distances(client_of: np.ndarray, groups: np.ndarray, n_clients: int, space: str) -> pd.DataFrame:
    """How far each client's mixture over ``groups`` lies from the pooled mixture of every client.

    The client's mixture is the share of each group among the samples ``client_of`` gives it: the rows the
    partition was drawn over (step 3b: the manifest's train rows, the client-train and held-out client-test rows
    alike; with ``--client_tests test_split`` the test-split rows dealt to the clients are not among them: they are
    dealt in each client's own train mixture and are never trained on). The pooled mixture is that of all those
    rows together, so a client of 3 rows weighs three times one of 1 (samples no client holds are left out, so a
    scheme that leaves samples unused is compared with what the federation holds). Distances: :func:`js_distance`
    (base 2) and :func:`hellinger_distance`, both in [0, 1].

    Args:
        client_of: int [n_samples], client per sample, ``UNUSED`` (-1) for none.
        groups: [n_samples] what the distance is measured over: class labels (``space`` "label") or embedding
            clusters ("cluster").
        n_clients: number of clients.
        space: the column prefix.

    Returns:
        ``client_id``, ``<space>_js_distance``, ``<space>_hellinger``: one row per client; NaN for a client
        without samples.
    """
    client_of = np.asarray(client_of)
    _, codes = np.unique(np.asarray(groups), return_inverse=True)
    n_groups = int(codes.max(initial=-1)) + 1
    counts = group_counts(client_of, codes.reshape(-1), n_clients, n_groups).astype(float)
    sizes = counts.sum(axis=1)
    pooled = counts.sum(axis=0) / max(sizes.sum(), 1.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mixtures = counts / sizes[:, None]
    table = {"client_id": np.arange(n_clients)}
    for kind, distance in DISTANCES.items():
        table[f"{space}_{kind}"] = np.where(sizes > 0, distance(mixtures, pooled[None, :]), np.nan)
    return pd.DataFrame(table)


def mean_distances(distances: pd.DataFrame, space: str) -> dict[str, float]:
    """``{"mean_<space>_<kind>": unweighted mean over the clients that hold samples}`` (each client counts once,
    whatever its size, as ``mean_js_divergence`` of step 3b's metrics.csv)."""
    means = {}
    for kind in DISTANCES:
        values = distances[f"{space}_{kind}"].to_numpy(dtype=float)
        held = values[~np.isnan(values)]
        means[f"mean_{space}_{kind}"] = float(held.mean()) if held.size else float("nan")
    return means


def plot_heatmap(stats: pd.DataFrame, path: Path, title: str, row_notes: Sequence[str] | None = None) -> None:
    """Save a clients × groups heatmap of each client's group fractions (rows sum to 1).

    ``row_notes``: one short text per client (e.g. its skews: noise σ, swapped pairs), shown after its id."""
    from utils.plots import plt, save_figure  # pyplot on the Agg backend (utils.plots selects it)

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


def phase_stats(table: pd.DataFrame, phases: np.ndarray, n_clients: int) -> pd.DataFrame:
    """Schedule columns of client_stats.csv (temporal skew, ``partitioning/temporal.py``): one row per client.

    Args:
        table: scheduled assignments rows (``sample_id, client_id, group, subset``, one row per window).
        phases: int [rows] the phase of each row, -1 for client-test rows.
        n_clients: number of clients.

    Returns:
        ``client_id``, ``n_phases`` (non-empty phases), ``phase_sizes`` (train samples per phase, ``;``-joined,
        phase 0 first), ``phase_js_divergence`` (each phase's group mixture against the global mixture of every
        assigned sample, base-2 JS divergence, ``;``-joined; blank for an empty phase) and
        ``mean_phase_js_divergence`` (over the non-empty phases).
    """
    from scipy.spatial.distance import jensenshannon

    names, codes = np.unique(table["group"].to_numpy(), return_inverse=True)
    once = ~table.duplicated(["client_id", "sample_id"]).to_numpy()  # a cycled sample counts once
    global_mixture = np.bincount(codes[once], minlength=names.size) / once.sum()
    train = once & (phases >= 0)
    n_phases = int(phases.max(initial=-1)) + 1
    clients = table["client_id"].to_numpy()[train]
    cell = (clients * n_phases + phases[train]) * names.size + codes[train]
    counts = np.bincount(cell, minlength=n_clients * n_phases * names.size).reshape(n_clients, n_phases, names.size)
    sizes = counts.sum(axis=2)
    with np.errstate(invalid="ignore"):
        divergence = jensenshannon(counts / sizes[..., None], global_mixture[None, None, :], axis=2, base=2) ** 2
    divergence = np.where(sizes > 0, divergence, np.nan)
    filled = (sizes > 0).sum(axis=1)
    joined = lambda values, form: ";".join("" if np.isnan(v) else format(v, form) for v in values)  # noqa: E731
    return pd.DataFrame({
        "client_id": np.arange(n_clients),
        "n_phases": filled,
        "phase_sizes": [";".join(map(str, row)) for row in sizes],
        "phase_js_divergence": [joined(row, ".4f") for row in divergence],
        "mean_phase_js_divergence": np.where(filled > 0, np.nansum(divergence, axis=1) / np.maximum(filled, 1), np.nan),
    })


def plot_schedule(starts: np.ndarray, ends: np.ndarray, client_of: np.ndarray, phase: np.ndarray, n_clients: int,
                  last_round: int, path: Path, title: str) -> None:
    """Save a clients × rounds map of the schedule: the colour is the phase a client holds in each round 1..last_round
    (white: none), the number its train rows then (written when the grid is small enough to read).

    Args:
        starts, ends: int [rows] each train row's window (inclusive; ends beyond ``last_round`` are cut).
        client_of, phase: int [rows] the client and the phase of each row.
    """
    from utils.plots import plt, save_figure  # pyplot on the Agg backend (utils.plots selects it)

    n_phases = int(phase.max(initial=0)) + 1
    held = np.zeros((n_phases, n_clients, last_round + 2), dtype=np.int64)  # +1 at a start, -1 after an end, cumsum
    np.add.at(held, (phase, client_of, np.minimum(starts, last_round + 1)), 1)
    np.add.at(held, (phase, client_of, np.minimum(ends, last_round) + 1), -1)
    held = np.cumsum(held, axis=2)[:, :, 1:last_round + 1]
    rows = held.sum(axis=0)
    shown = np.ma.masked_where(rows == 0, held.argmax(axis=0))
    figure, axis = plt.subplots(figsize=(np.clip(3 + 0.35 * last_round, 6, 16), np.clip(2 + 0.3 * n_clients, 4, 12)))
    image = axis.imshow(shown, aspect="auto", interpolation="nearest", cmap=plt.get_cmap("tab10", n_phases),
                        vmin=-0.5, vmax=n_phases - 0.5, extent=(0.5, last_round + 0.5, n_clients - 0.5, -0.5))
    if n_clients <= 40 and last_round <= 40:
        for client, round_index in zip(*np.nonzero(rows)):
            axis.text(round_index + 1, client, str(rows[client, round_index]), ha="center", va="center", fontsize=7)
    axis.set_xlabel("round")
    axis.set_ylabel("client")
    axis.set_title(title)
    figure.colorbar(image, ax=axis, label="phase held (number: its train rows)", ticks=range(n_phases))
    save_figure(figure, path, dpi=120)
