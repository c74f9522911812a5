"""q-FedAvg (Li, Sanjabi, Beirami, Smith, "Fair Resource Allocation in Federated Learning", ICLR 2020).

q-FFL minimises Σ_k p_k/(q+1)·F_k^{q+1}: clients with a larger loss weigh more, q = 0 being
plain (uniformly weighted) averaging. This is the authors' q-FedAvg (Algorithm 2 and their code):

Client k, each round:
1. F_k = its *own* training loss at the broadcast w^t, measured before local training (the mean
   per-sample loss over one pass of its training rows, in eval mode: no dropout, BatchNorm's
   running statistics). Flower's QFedAvg uses one loss computed on the server for every client;
   that weighs every client the same, which is not q-FFL.
2. Local training for the local budget, as FedAvg's client, to w̄_k.
3. With L = 1/η_l (the round's local learning rate): Δw_k = L·(w^t − w̄_k),
   Δ_k = F_k^q·Δw_k and h_k = q·F_k^{q−1}·‖Δw_k‖² + L·F_k^q (F_k + 1e-10 in the powers, as the
   authors' code, so q < 1 never raises 0 to a negative power).
4. Upload Δ_k and h_k (parameters), and the change of the buffers (BatchNorm statistics).

Server: w^{t+1} = w^t − Σ_k Δ_k / Σ_k h_k over the parameters (a round whose Σh is 0, which only
all-zero uploads give, leaves them unchanged); buffers take the sample-weighted mean change, as
in every algorithm. The reported client metric ``loss_at_global`` is F_k.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from network.aggregation import Weights, WeightedMean, apply_update, subtract
from network.algorithms.base import (ALGORITHMS, GLOBAL_MODEL, Algorithm, Bundle, ClientConfig, ClientResult,
                                     ServerState, Upload, load_weights)
from network.algorithms.skeleton import DELTA, Phase, run_phases, training_loss
from network.settings import check, setting

Q_DELTA = "q_delta"  # upload group: Δ_k = F_k^q·L·(w^t − w̄_k) of every trainable parameter
H = "h"  # upload group {"h": h_k}
LOSS_AT_GLOBAL = "loss_at_global"  # client metric: F_k, its training loss at w^t before training
LOSS_OFFSET = 1e-10  # the authors' F_k + 1e-10


@dataclass(frozen=True)
class QFedAvgSettings:
    q: float = setting(1.0, "fairness exponent q of q-FFL (0: uniformly weighted averaging)")

    def __post_init__(self) -> None:
        check(self.q >= 0, "q", ">= 0", self.q)


@ALGORITHMS.register("qfedavg")
class QFedAvg(Algorithm):
    """Fair averaging: clients with a larger loss at the global model move it more (q-FFL)."""

    name = "qfedavg"
    use_when = "a fairer spread of client losses (worst clients)"
    dp_refusal = "its uploads carry the loss F_i^q, whose sensitivity no clipping of the update bounds"
    Settings = QFedAvgSettings

    @functools.cached_property
    def _params(self) -> tuple[str, ...]:
        layout = self.federation.layout
        return tuple(key for key in layout.varying_keys if key in layout.param_keys)

    @functools.cached_property
    def _buffers(self) -> tuple[str, ...]:
        layout = self.federation.layout
        return tuple(key for key in layout.varying_keys if key not in layout.param_keys)

    def client_update(self, model: nn.Module, broadcast: Bundle, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        start = broadcast[GLOBAL_MODEL]
        load_weights(model, start)
        loss = training_loss(model, loader, cfg) + LOSS_OFFSET
        metrics = run_phases(model, [Phase()], loader, cfg)
        metrics[LOSS_AT_GLOBAL] = loss - LOSS_OFFSET
        state = model.state_dict()
        lipschitz, q = 1.0 / cfg.lr, self.settings.q
        direction = {key: (start[key] - state[key].detach()) * lipschitz for key in self._params}  # Δw_k
        squared_norm = float(sum(value.double().pow(2).sum() for value in direction.values()))
        h = (q * loss ** (q - 1) * squared_norm if q else 0.0) + lipschitz * loss ** q
        upload = {Q_DELTA: {key: value * loss ** q for key, value in direction.items()},
                  H: {H: torch.tensor(h, dtype=torch.float64)},
                  DELTA: subtract(state, start, self._buffers)}
        return ClientResult(upload, {}, metrics, cfg.num_samples)

    def aggregate(self, server: ServerState, uploads: Iterable[Upload]) -> ServerState:
        sums: Weights = {}
        h_total = 0.0
        buffers = WeightedMean()
        for upload in uploads:
            for key, value in upload.tensors[Q_DELTA].items():
                sums[key] = sums[key] + value if key in sums else value.clone()
            h_total += float(upload.tensors[H][H])
            buffers.add(upload.tensors[DELTA], upload.num_samples)
        weights = server.models[GLOBAL_MODEL]
        if h_total > 0:
            weights = apply_update(weights, sums, -1.0 / h_total)
        if self._buffers:
            weights = apply_update(weights, buffers.mean())
        return ServerState({GLOBAL_MODEL: weights}, server.tensors)
