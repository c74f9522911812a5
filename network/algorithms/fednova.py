"""FedNova (Jianyu Wang, Qinghua Liu, Hao Liang, Gauri Joshi, H. Vincent Poor, "Tackling the Objective
Inconsistency Problem in Heterogeneous Federated Optimization", NeurIPS 2020): each client's update is divided
by its own amount of local work before averaging, so a client that takes more local steps no longer pulls the
server towards its own objective.

As implemented (x the broadcast model, Δ_i = y_i − x after client i's local training):

* Client i trains as FedAvg's client (the shared loop; its ClientConfig's local steps or epochs, lr η_l,
  momentum ρ, weight decay) and counts τ_i, the optimizer steps it actually took (``LOCAL_STEPS``: with local
  epochs, its number of batches times E). It uploads d_i = Δ_i / a_i over the parameters (group
  ``normalised``) and a_i = ‖a_i‖₁ itself (group ``norm``, a float64 scalar: the server needs nothing else and
  the scalar crosses the Flower wire as any array), with the paper's a_i (its examples of local solvers):
  plain SGD: a_i = τ_i; heavy-ball momentum ρ (torch SGD: u_k = ρ·u_{k−1} + g_k, u_1 = g_1, y_k = y_{k−1} − η_l·u_k):
  Δ_i = −η_l·Σ_{j=1..τ} g_j·Σ_{k=j..τ} ρ^{k−j} = −η_l·Σ_j g_j·(1 − ρ^{τ−j+1})/(1 − ρ), so
  ‖a_i‖₁ = Σ_{s=1..τ} (1 − ρ^s)/(1 − ρ) = [τ − ρ·(1 − ρ^τ)/(1 − ρ)] / (1 − ρ), the paper's closed form.
  Weight decay λ adds λ·y to every g_k before the momentum (torch SGD), so it is part of the local objective's
  gradient and leaves a_i unchanged (the paper's a_i covers SGD and momentum only). A client with no step
  (a_i = 0) cannot normalise its update and is refused.
* Server, with p_i the participants' weights normalised over the round (``weighting samples``, the default:
  p_i = n_i / Σ_{j∈S} n_j, the paper's; the other weightings give their shares, as in every model-averaging
  algorithm): τ_eff = Σ_i p_i·a_i (the paper's FedNova choice) and x ← x + τ_eff·Σ_i p_i·d_i over the
  parameters, applied by the server step (network/aggregation.py ``server_step``: plain SGD with η_g = 1 is the
  paper's rule; η_g, FedAvgM or FedAdam take τ_eff·Σ_i p_i·d_i as their pseudo-gradient step).
* Buffers (BatchNorm statistics) have no steps to normalise: they upload Δ (group ``delta``) and take its
  p-weighted mean, as in FedAvg. Frozen entries (``layout.fixed_keys``) are neither uploaded nor moved.

With equal τ_i, no momentum and sample weights, τ_eff = τ and the rule is FedAvg's exactly.

Settings: FedNova has no hyperparameter of its own; it takes the model-averaging ones (``weighting`` and the
server optimizer), whose defaults are the paper's rule.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from network.aggregation import WeightedMean, server_step, subtract
from network.algorithms.base import (ALGORITHMS, GLOBAL_MODEL, LOCAL_STEPS, Bundle, ClientConfig, ClientResult,
                                     ServerState, Upload, Weights, load_weights, require)
from network.algorithms.skeleton import DELTA, ModelAveraging, Phase, run_phases

NORMALISED = "normalised"  # upload group: d_i = Δ_i / a_i of the parameters
NORM = "norm"  # upload group: {"a": a_i}, the client's ‖a_i‖₁ as a float64 scalar
A = "a"


def momentum_norm(steps: int, momentum: float) -> float:
    """‖a‖₁ of ``steps`` heavy-ball SGD steps with momentum ρ: τ, or [τ − ρ(1 − ρ^τ)/(1 − ρ)]/(1 − ρ)."""
    require(0 <= momentum < 1, f"fednova needs a local momentum in [0, 1), got {momentum!r}")
    if momentum == 0:
        return float(steps)
    return (steps - momentum * (1 - momentum ** steps) / (1 - momentum)) / (1 - momentum)


@ALGORITHMS.register("fednova")
class FedNova(ModelAveraging):
    """Normalised averaging: each client's update is divided by its local work, then rescaled by the mean work."""

    name = "fednova"
    use_when = "clients do unequal local work (different numbers of local steps or epochs per round)"
    dp_refusal = "it rescales each update by the client's own step count τ_i after clipping, so the server's sum has no bound C (not implemented)"

    def client_update(self, model: nn.Module, broadcast: Bundle, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        start = broadcast[GLOBAL_MODEL]
        load_weights(model, start)
        metrics = run_phases(model, [Phase()], loader, cfg)
        steps = int(metrics[LOCAL_STEPS])
        require(steps > 0, "fednova needs at least one local step per client (a_i = 0 cannot normalise its update)")
        norm = momentum_norm(steps, cfg.momentum)
        delta = subtract(model.state_dict(), start, self.shared_keys())
        params = set(self._averaged_params)
        upload = {NORMALISED: {key: value / norm for key, value in delta.items() if key in params},
                  DELTA: {key: value for key, value in delta.items() if key not in params},
                  NORM: {A: torch.tensor(norm, dtype=torch.float64)}}
        return ClientResult(upload, {}, metrics, cfg.num_samples)

    def aggregate(self, server: ServerState, uploads: Iterable[Upload]) -> ServerState:
        directions, buffers, norms = WeightedMean(), WeightedMean(), WeightedMean()
        for upload in uploads:
            weight = self.upload_weight(upload)
            directions.add(upload.tensors[NORMALISED], weight)
            buffers.add(upload.tensors[DELTA], weight)
            norms.add(upload.tensors[NORM], weight)
        tau_eff = float(norms.mean()[A])  # Σ_i p_i·a_i
        step = {key: tau_eff * value for key, value in directions.mean().items()}
        weights, tensors = server_step(server.models[GLOBAL_MODEL], {**step, **buffers.mean()}, server.tensors,
                                       self.settings, self._averaged_params)
        return ServerState({GLOBAL_MODEL: weights}, tensors)
