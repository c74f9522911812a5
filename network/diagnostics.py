"""Per-round drift diagnostics of step 4 (``--diagnostics``): how far and in which directions clients move.

For every sampled client k of a round, from its upload's model change Δ_k = y_k − x over
the model's parameters (buffers excluded):

* drift ‖y_k − x‖ (metrics.csv: split ``train``, the client's id, metric ``drift``);
* the round's mean and max drift (clients ``mean`` and ``max``, metric ``update_norm``);
* the cosine matrix cos(Δ_j, Δ_k) of the sampled clients, saved as
  ``diagnostics/round_<r>_cosine.npy`` (rows and columns in the sampled order, listed in
  ``round_<r>_clients.txt``) and, on evaluation rounds, as a heatmap PNG.

Memory: the round's K flattened parameter changes (float32, on the CPU), K × the
number of parameters, are held until the round's matrix is computed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from network.aggregation import Weights

DELTA_GROUP = "delta"  # the upload group that holds y − x (every model-averaging algorithm, SCAFFOLD, IFCA)
DRIFT, UPDATE_NORM = "drift", "update_norm"
FOLDER = "diagnostics"


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


def _row(round_index: int, client: str, metric: str, value: float) -> dict[str, Any]:
    return {"round": round_index, "split": "train", "client": client, "metric": metric, "value": value}
