"""FedAMP (Huang et al., "Personalized Cross-Silo Federated Learning on Non-IID Data", AAAI 2021),
with the authors' heuristic variant HeurFedAMP.

The server keeps every client's latest model w_j (server tensors ``client/<id>/<entry>``: N
models, the cross-silo setting FedAMP is made for) and sends each sampled client i its own
message u_i = Σ_j ξ_ij·w_j (``Algorithm.client_broadcast``), plus its stored w_i so the upload
can be a change (the download is two models).

Attention weights ξ (``variant``):
* ``fedamp`` (the paper): ξ_ij = α·A′(‖w_i − w_j‖²) for j ≠ i, with A(x) = 1 − e^{−x/σ}, so
  A′(x) = e^{−x/σ}/σ, and ξ_ii = 1 − Σ_{j≠i} ξ_ij. Two numerical problems, handled here:
  - *ξ_ii < 0*: with close models and α/σ not small, Σ_{j≠i} ξ_ij exceeds 1 (up to α(N−1)/σ),
    and the published formula gives a negative self-weight (u_i then extrapolates away from
    w_i; one public implementation does exactly that). Rule: when Σ_{j≠i} ξ_ij > 1 the
    off-diagonal weights are divided by their sum and ξ_ii = 0, so every row is a convex
    combination (non-negative, summing to 1).
  - *underflow*: e^{−x/σ} is 0 in float64 for x/σ > ~745, i.e. for any CNN-sized squared
    distance at σ = 1. The weights are computed in float64 as exp(log α − x/σ − log σ), so
    they underflow to exactly 0, never to NaN or inf: u_i = w_i (the client trains alone).
    Choose σ on the scale of the squared distances to get collaboration.
* ``heuristic`` (HeurFedAMP): ξ_ii = ``self_weight`` and, for j ≠ i,
  ξ_ij = (1 − ξ_ii)·softmax_j(σ·cos(w_i, w_j)) over the other clients (cosine of the flattened
  parameters; a softmax cannot underflow to all zeros). With one client ξ_ii = 1.

Distances and cosines use the trainable parameters; u_i mixes every varying entry (BatchNorm
statistics too). Client: from u_i, minimise F_i(w) + (λ/(2α))·‖w − u_i‖² for the local budget
(FedProx's proximal term with μ = λ/α), upload Δ = w − w_i (its stored model) and keep w as its
personal model. Server: w_i ← w_i + Δ_i for each upload; the "global" model reported is the
sample-weighted mean of all N client models (FedAMP itself has none).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from network.aggregation import Weights, WeightedMean, apply_update, subtract
from network.algorithms.base import (ALGORITHMS, GLOBAL_MODEL, Algorithm, Bundle, ClientConfig, ClientResult,
                                     ServerState, Upload, copy_state, load_weights)
from network.algorithms.skeleton import DELTA, Phase, proximal_term, run_phases
from network.settings import check, setting

VARIANTS = ("fedamp", "heuristic")
OWN = "own"  # broadcast group: the client's stored model w_i
CLIENT_PREFIX = "client/{}/"  # server tensors: client i's latest model


@dataclass(frozen=True)
class FedAMPSettings:
    variant: str = setting("fedamp", "attention weights: fedamp (the paper's α·A′(‖w_i − w_j‖²)) or heuristic "
                                     "(HeurFedAMP: self-weight plus a softmax of cosine similarities)", choices=VARIANTS)
    lam: float = setting(1.0, "λ of the client objective F_i(w) + (λ/(2α))·‖w − u_i‖²")
    alpha_k: float = setting(1.0, "α_k, the attentive step size (scales ξ_ij and divides λ)")
    sigma: float = setting(1.0, "σ: the distance scale of A(x) = 1 − e^{−x/σ}, or the heuristic's cosine scale")
    self_weight: float = setting(0.5, "heuristic variant: ξ_ii, each client's weight on its own model")

    def __post_init__(self) -> None:
        check(self.variant in VARIANTS, "variant", f"one of {', '.join(VARIANTS)}", self.variant)
        check(self.lam >= 0, "lam", ">= 0", self.lam)
        check(self.alpha_k > 0, "alpha_k", "> 0", self.alpha_k)
        check(self.sigma > 0, "sigma", "> 0", self.sigma)
        check(0 <= self.self_weight <= 1, "self_weight", "in [0, 1]", self.self_weight)


@ALGORITHMS.register("fedamp")
class FedAMP(Algorithm):
    """Attentive message passing: each client is pulled towards its own mix u_i of similar clients' models."""

    name = "fedamp"
    use_when = "cross-silo: few clients, each pulled to similar ones"
    Settings = FedAMPSettings
    personalized = True

    @functools.cached_property
    def _varying(self) -> tuple[str, ...]:
        return self.federation.layout.varying_keys

    @functools.cached_property
    def _params(self) -> tuple[str, ...]:
        return tuple(key for key in self._varying if key in self.federation.layout.param_keys)

    def init_server(self, weights: Weights) -> ServerState:
        tensors = {CLIENT_PREFIX.format(client_id) + key: weights[key].clone()
                   for client_id in self.federation.client_sizes for key in self._varying}
        return ServerState({GLOBAL_MODEL: self._mean_model(weights, tensors)}, tensors)

    def broadcast(self, server: ServerState) -> Bundle:
        return {}  # every message is the client's own: client_broadcast

    def client_broadcast(self, server: ServerState, broadcast: Bundle, client_id: str) -> Bundle:
        row = self.attention_row(server, client_id)
        message = dict(server.models[GLOBAL_MODEL])  # the fixed entries
        for key in self._varying:
            reference = server.tensors[CLIENT_PREFIX.format(client_id) + key]
            mixed = sum(weight * self._stored(server, other, key).double() for other, weight in row.items())
            message[key] = mixed.to(reference.dtype) if reference.is_floating_point() else mixed.round().to(reference.dtype)
        return {GLOBAL_MODEL: message, OWN: {key: self._stored(server, client_id, key) for key in self._varying}}

    def attention_row(self, server: ServerState, client_id: str) -> dict[str, float]:
        """ξ_i·: client id -> weight, non-negative and summing to 1 (see the module docstring)."""
        others = [other for other in self.federation.client_sizes if other != client_id]
        if not others:
            return {client_id: 1.0}
        settings = self.settings
        own = self._flat(server, client_id)
        if settings.variant == "heuristic":
            cosines = torch.stack([torch.nn.functional.cosine_similarity(own, self._flat(server, other), dim=0)
                                   for other in others])
            weights = (1 - settings.self_weight) * torch.softmax(settings.sigma * cosines, dim=0)
            return {client_id: settings.self_weight, **dict(zip(others, weights.tolist()))}
        distances = [float((own - self._flat(server, other)).pow(2).sum()) for other in others]
        log_scale = math.log(settings.alpha_k) - math.log(settings.sigma)
        weights = [math.exp(log_scale - distance / settings.sigma) for distance in distances]  # 0, never NaN, below ~1e-308
        total = sum(weights)
        if total > 1:  # the published ξ_ii = 1 − total would be negative: make the row convex instead
            return {client_id: 0.0, **{other: weight / total for other, weight in zip(others, weights)}}
        return {client_id: 1.0 - total, **dict(zip(others, weights))}

    def client_update(self, model: nn.Module, broadcast: Bundle, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        message = broadcast[GLOBAL_MODEL]
        load_weights(model, message)
        mu = self.settings.lam / self.settings.alpha_k
        metrics = run_phases(model, [Phase(extra_loss=proximal_term(model, message, mu) if mu else None)], loader, cfg)
        upload = {DELTA: subtract(model.state_dict(), broadcast[OWN], self._varying)}
        return ClientResult(upload, copy_state(model, self._varying), metrics, cfg.num_samples)

    def aggregate(self, server: ServerState, uploads: Iterable[Upload]) -> ServerState:
        tensors = dict(server.tensors)
        for upload in uploads:
            prefix = CLIENT_PREFIX.format(upload.client_id)
            stored = {key: tensors[prefix + key] for key in self._varying}
            tensors.update({prefix + key: value for key, value in apply_update(stored, upload.tensors[DELTA]).items()})
        return ServerState({GLOBAL_MODEL: self._mean_model(server.models.get(GLOBAL_MODEL, {}), tensors)}, tensors)

    def personal_model(self, models: dict[str, Weights], client_state: Weights) -> Weights | None:
        return {**models[GLOBAL_MODEL], **client_state} if client_state else None

    def _mean_model(self, weights: Weights, tensors: Weights) -> Weights:
        """The sample-weighted mean of the N stored client models (fixed entries from ``weights``)."""
        mean = WeightedMean()
        sizes = self.federation.client_sizes
        for client_id, size in sizes.items():
            prefix = CLIENT_PREFIX.format(client_id)
            mean.add({key: tensors[prefix + key] for key in self._varying},
                     size if sum(sizes.values()) else 1.0)
        return {**weights, **mean.mean()}

    def _stored(self, server: ServerState, client_id: str, key: str) -> torch.Tensor:
        return server.tensors[CLIENT_PREFIX.format(client_id) + key]

    def _flat(self, server: ServerState, client_id: str) -> torch.Tensor:
        return torch.cat([self._stored(server, client_id, key).double().flatten() for key in self._params])
