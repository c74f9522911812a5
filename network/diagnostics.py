"""Per-round diagnostics of step 4 (``--diagnostics``): how far and in which directions clients move, and how much
their gradients disagree at the global model.

Drift, every round. For every sampled client k of a round, from its upload's model change
Δ_k = y_k − x over the model's parameters (buffers excluded):

* drift ‖y_k − x‖ (metrics.csv: split ``train``, the client's id, metric ``drift``);
* the round's mean and max drift (clients ``mean`` and ``max``, metric ``update_norm``);
* the cosine matrix cos(Δ_j, Δ_k) of the sampled clients, saved as
  ``diagnostics/round_<r>_cosine.npy`` (rows and columns in the sampled order, listed in
  ``round_<r>_clients.txt``) and, on evaluation rounds, as a heatmap PNG; its spread, the min,
  median and max of the off-diagonal cosines (clients ``min``, ``median``, ``max``, metric
  ``update_cosine``; none with fewer than two sampled clients).

Gradient dissimilarity, every ``diagnostics_every`` rounds (round 0 included), at the global model
(the first of ``Algorithm.evaluated_models``) after the round's aggregation, over **every** client of
the federation, sampled or not: each client's gradient ∇F_k of its mean training loss
(network.heterogeneity.full_gradient, model in eval mode) over all its train rows, or over a fixed
sample of at most ``diagnostics_max_samples`` of them: the first rows of its train loader at a seed
that depends on the run seed and the client only (never on the round), so the sample is the same
every round and after a resume. With p_k = n_k / n (n_k: all of the client's train rows) and
∇F = Σ_k p_k ∇F_k, split ``diagnostics`` of metrics.csv gets (under temporal skew a client's train rows
and n_k are those it holds in round max(r, 1), ``network.schedule.diagnosed_round``; a client holding
none then has no gradient):

* client ``all``: ``g2`` = G² = Σ_k p_k ‖∇F_k − ∇F‖², ``b2`` = B² = Σ_k p_k ‖∇F_k‖² / ‖∇F‖²
  (FedProx's B-local dissimilarity) and ``global_grad_norm2`` = ‖∇F‖²;
* each client's id: ``grad_norm2`` = ‖∇F_k‖².

Personalised algorithms: the gradient is taken at the global (shared) model, the one the
``client_test`` split evaluates, and only over the parameters the federation shares: an
algorithm's private entries (``Algorithm.private_keys``: FedPer's head, FedBN's BatchNorm layers,
FedEM's mixture weights) hold the server's copy in the forward pass (FedPer's initial head, a uniform
π) and private parameters are left out of ∇F_k, so G²
measures how clients disagree about the shared parameters; an algorithm that shares none (local)
gets no gradient rows. Clusterings (IFCA, CFL) are read at their first evaluated model.

The gradients are computed under a forked torch RNG (network.client.seeded_torch_rng) and never
touch a model the run trains on afterwards, so a run with diagnostics trains exactly as one without.

Memory: the round's K flattened parameter changes (float32, on the CPU), K × the number of parameters,
are held until the round's cosine matrix is computed; the gradients are folded into G² one at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import torch
from torch import nn

from network.aggregation import Weights
from network.algorithms.base import LossFn
from network.client import ClientData, seeded_torch_rng
from network.heterogeneity import DissimilarityAccumulator, full_gradient
from utils.errors import TaskHetError
from utils.seeding import derive_seed

DELTA_GROUP = "delta"  # the upload group that holds y − x (every model-averaging algorithm, SCAFFOLD, IFCA)
DRIFT, UPDATE_NORM, UPDATE_COSINE = "drift", "update_norm", "update_cosine"
FOLDER = "diagnostics"
PLOT_FILE = "diagnostics.png"
# metrics.csv names of the gradient diagnostics (the same metric names as step 3c's meter)
DIAGNOSTICS_SPLIT, ALL_CLIENTS = "diagnostics", "all"
G2, B2, GLOBAL_GRAD_NORM2, GRAD_NORM2 = "g2", "b2", "global_grad_norm2", "grad_norm2"


class DriftMeter:
    """Collects one round's parameter changes and turns them into metric rows and files.

    Args:
        out_dir: the run folder (files go to ``out_dir/diagnostics``).
        param_keys: the worker model's parameter names.
    """

    def __init__(self, out_dir: Path, param_keys: frozenset[str]) -> None:
        self.folder = Path(out_dir) / FOLDER
        self.param_keys = param_keys
        self.clients: list[str] = []
        self.changes: list[torch.Tensor] = []

    def add(self, client_id: str, upload: dict[str, Weights]) -> None:
        """Record one client's change (an upload without a ``delta`` group is skipped)."""
        delta = upload.get(DELTA_GROUP)
        if delta is None:
            return
        parts = [value.detach().float().flatten().cpu() for key, value in sorted(delta.items()) if key in self.param_keys]
        if parts:
            self.clients.append(client_id)
            self.changes.append(torch.cat(parts))

    def finish(self, round_index: int, plot: bool) -> list[dict[str, Any]]:
        """The round's metric rows; writes the cosine matrix (and its heatmap when ``plot``). Resets the meter."""
        if not self.changes:
            return []
        stacked = torch.stack(self.changes)
        norms = stacked.norm(dim=1)
        unit = stacked / norms.clamp(min=1e-30).unsqueeze(1)
        cosine = (unit @ unit.T).numpy().astype(np.float64)
        self._save(round_index, cosine, plot)
        rows = [_row(round_index, client, DRIFT, float(norm)) for client, norm in zip(self.clients, norms)]
        rows += [_row(round_index, "mean", UPDATE_NORM, float(norms.mean())),
                 _row(round_index, "max", UPDATE_NORM, float(norms.max()))]
        off_diagonal = cosine[np.triu_indices(len(cosine), k=1)]
        if off_diagonal.size:
            rows += [_row(round_index, name, UPDATE_COSINE, float(statistic(off_diagonal)))
                     for name, statistic in (("min", np.min), ("median", np.median), ("max", np.max))]
        self.clients, self.changes = [], []
        return rows

    def _save(self, round_index: int, cosine: np.ndarray, plot: bool) -> None:
        from utils.run_dir import atomic_write_text

        self.folder.mkdir(parents=True, exist_ok=True)
        np.save(self.folder / f"round_{round_index}_cosine.npy", cosine)
        atomic_write_text(self.folder / f"round_{round_index}_clients.txt", "\n".join(self.clients) + "\n")
        if plot:
            plot_cosine(cosine, self.clients, round_index, self.folder / f"round_{round_index}_cosine.png")


def plot_cosine(cosine: np.ndarray, clients: list[str], round_index: int, out_png: Path) -> None:
    """A heatmap of the clients' update cosines, −1 (opposite) to 1 (aligned)."""
    from utils.plots import plt, save_figure

    size = min(12.0, 2.5 + 0.35 * len(clients))
    figure, axis = plt.subplots(figsize=(size, size * 0.85))
    image = axis.imshow(cosine, vmin=-1, vmax=1, cmap="RdBu_r")
    ticks = range(len(clients))
    axis.set_xticks(ticks, clients, rotation=90, fontsize=7)
    axis.set_yticks(ticks, clients, fontsize=7)
    axis.set_xlabel("client")
    axis.set_ylabel("client")
    axis.set_title(f"cosine of client updates, round {round_index}")
    figure.colorbar(image, ax=axis, fraction=0.046)
    save_figure(figure, out_png, dpi=110)


def _row(round_index: int, client: str, metric: str, value: float, split: str = "train") -> dict[str, Any]:
    return {"round": round_index, "split": split, "client": client, "metric": metric, "value": value}


# ----- gradient dissimilarity at the global model -----
def check_diagnostics_options(every: object, max_samples: object) -> None:
    """One clear error unless ``every`` is an integer >= 1 and ``max_samples`` None or an integer >= 1."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise TaskHetError(f"--diagnostics_every must be an integer >= 1, got {every!r}")
    if max_samples is not None and (isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 1):
        raise TaskHetError(f"--diagnostics_max_samples must be an integer >= 1 (unset: every train row), "
                           f"got {max_samples!r}")


def gradient_seed(seed: int, client_id: str) -> int:
    """The seed of a client's gradient pass: the run's and the client's only, so its sample is fixed across rounds."""
    return derive_seed(seed, "diagnostics", client_id)


def first_samples(batches: Iterable[dict], limit: int | None) -> Iterator[dict]:
    """The first ``limit`` samples of ``batches`` (every batch when None); the last batch is cut to fit.

    A batch's size is the first dimension of its first tensor; a list of tensors (cached feature maps,
    one per scale) is cut tensor by tensor.
    """
    left = limit
    for batch in batches:
        if left is None:
            yield batch
            continue
        size = _batch_size(batch)
        if size < left:
            left -= size
            yield batch
            continue
        yield batch if size == left else {key: _head(value, left) for key, value in batch.items()}
        return


def client_gradient(model: nn.Module, client: ClientData, loss_fn: LossFn, device: torch.device, seed: int,
                    max_samples: int | None, exclude: frozenset[str]) -> torch.Tensor:
    """∇F_k at the weights loaded in ``model``: over the client's train rows, or the first ``max_samples`` of its
    loader at ``seed`` (see the module docstring); parameters in ``exclude`` left out. Flat, float64.

    The global torch generator is forked (augmentation and dropout draws stay out of the run's RNG).
    """
    with seeded_torch_rng(seed, device):
        return full_gradient(model, first_samples(client.train_loader(seed), max_samples), loss_fn, device, exclude)


def gradient_rows(round_index: int, gradients: Iterable[tuple[str, torch.Tensor]],
                  client_sizes: Mapping[str, int]) -> list[dict[str, Any]]:
    """metrics.csv rows of one diagnostics round from ``(client_id, ∇F_k)`` pairs (folded one at a time).

    ``client_sizes`` gives p_k ∝ n_k (every client of the federation; one without train rows has no gradient).
    """
    accumulator, rows = DissimilarityAccumulator(), []
    for client_id, gradient in gradients:
        accumulator.add(gradient, client_sizes[client_id])
        rows.append(_row(round_index, client_id, GRAD_NORM2, float(gradient @ gradient), DIAGNOSTICS_SPLIT))
    if not rows:
        return []
    reading = accumulator.result()
    return rows + [_row(round_index, ALL_CLIENTS, G2, reading.g2, DIAGNOSTICS_SPLIT),
                   _row(round_index, ALL_CLIENTS, B2, reading.b2, DIAGNOSTICS_SPLIT),
                   _row(round_index, ALL_CLIENTS, GLOBAL_GRAD_NORM2, reading.global_grad_norm2, DIAGNOSTICS_SPLIT)]


def _batch_size(batch: dict) -> int:
    for value in batch.values():
        if torch.is_tensor(value):
            return int(value.shape[0])
        if isinstance(value, list) and value and torch.is_tensor(value[0]):
            return int(value[0].shape[0])
    raise TaskHetError(f"a batch with keys {sorted(batch)} has no tensor to count its samples by")


def _head(value: Any, count: int) -> Any:
    if torch.is_tensor(value):
        return value[:count]
    if isinstance(value, list) and value and all(torch.is_tensor(item) for item in value):
        return [item[:count] for item in value]
    return value[:count] if isinstance(value, (list, tuple)) else value


# ----- the plot over rounds -----
def plot_diagnostics(metrics_csv: Path, out_png: Path, title: str | None = None) -> Path | None:
    """``diagnostics.png``: G², B², the mean (and max) drift and the update-cosine spread over rounds.

    Four panels from metrics.csv; a panel whose rows the run has none of (no gradient round yet, an
    algorithm that uploads no model change) says so. Returns ``out_png``, or None without any row.
    """
    import pandas as pd

    from utils.plots import plt, save_figure

    metrics = pd.read_csv(metrics_csv, dtype={"client": str})

    def series(split: str, client: str, metric: str) -> pd.DataFrame:
        rows = metrics[(metrics.split == split) & (metrics.client == client) & (metrics.metric == metric)]
        return rows.sort_values("round")

    g2, b2 = series(DIAGNOSTICS_SPLIT, ALL_CLIENTS, G2), series(DIAGNOSTICS_SPLIT, ALL_CLIENTS, B2)
    drift_mean, drift_max = series("train", "mean", UPDATE_NORM), series("train", "max", UPDATE_NORM)
    cos_min, cos_median, cos_max = (series("train", name, UPDATE_COSINE) for name in ("min", "median", "max"))
    if all(frame.empty for frame in (g2, b2, drift_mean, cos_median)):
        return None
    figure, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    (g2_axis, b2_axis), (drift_axis, cosine_axis) = axes
    g2_axis.plot(g2["round"], g2["value"], marker="o", markersize=3, label="G² = Σ p_k ‖∇F_k − ∇F‖²")
    _label(g2_axis, "gradient dissimilarity at the global model", "G²", g2.empty)
    b2_axis.plot(b2["round"], b2["value"], marker="o", markersize=3, color="tab:orange",
                 label="B² = Σ p_k ‖∇F_k‖² / ‖∇F‖²")
    b2_axis.axhline(1.0, color="grey", linestyle=":", label="B² = 1: identical gradients")
    _label(b2_axis, "FedProx's B² at the global model", "B²", b2.empty)
    drift_axis.plot(drift_mean["round"], drift_mean["value"], marker="o", markersize=3, label="mean drift ‖y_k − x‖")
    drift_axis.plot(drift_max["round"], drift_max["value"], linestyle="--", label="max drift")
    _label(drift_axis, "client drift of the sampled clients", "‖y_k − x‖", drift_mean.empty)
    cosine_axis.fill_between(cos_min["round"], cos_min["value"], cos_max["value"], color="tab:green", alpha=0.25,
                             label="min to max")
    cosine_axis.plot(cos_median["round"], cos_median["value"], marker="o", markersize=3, color="tab:green",
                     label="median")
    cosine_axis.set_ylim(-1.05, 1.05)
    _label(cosine_axis, "cosine of client updates (off-diagonal)", "cos(Δ_j, Δ_k)", cos_median.empty)
    for axis in axes[1]:
        axis.set_xlabel("round")
    if title:
        figure.suptitle(title, fontsize=9)
    save_figure(figure, out_png, dpi=110)
    return Path(out_png)


def _label(axis, title: str, ylabel: str, empty: bool) -> None:
    axis.set_title(title, fontsize=10)
    axis.set_ylabel(ylabel)
    if empty:
        axis.text(0.5, 0.5, "no rows in this run", transform=axis.transAxes, ha="center", va="center", color="grey")
    else:
        axis.legend(fontsize=8)
