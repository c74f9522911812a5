"""FedDyn (Durmus Alp Emre Acar, Yue Zhao, Ramon Matas Navarro, Matthew Mattina, Paul N. Whatmough, Venkatesh
Saligrama, "Federated Learning Based on Dynamic Regularization", ICLR 2021): each client's objective gets a
linear and a quadratic term that move its stationary point onto the global one, so long local training no
longer pulls the server model towards the clients' own optima.

Algorithm 1 as implemented (α = the setting ``alpha_dyn``; θ^{t−1} the broadcast server model; m = every
client of the federation; P_t the round's participants; Δ_k = θ_k^t − θ^{t−1}):

* Client k minimises L_k(θ) − ⟨∇L_k(θ_k^{t−1}), θ⟩ + (α/2)·‖θ − θ^{t−1}‖² from θ^{t−1}, with the round's local
  budget and local optimiser (the shared loop: η_l, momentum, weight decay; weight decay is part of L_k). The
  two terms are one ``extra_loss`` over the trainable parameters (gradient −∇L_k(θ_k^{t−1}) + α·(θ − θ^{t−1})).
* Then ∇L_k(θ_k^t) = ∇L_k(θ_k^{t−1}) − α·Δ_k: the client state, a tensor per trainable parameter, zero before
  the client's first round, never uploaded (the paper's first-order condition of the local problem; kept by
  this rule whether or not the local problem was solved exactly, as in the paper and the authors' code).
* Upload: Δ_k of every entry that can change (parameters and buffers; the frozen ``layout.fixed_keys`` are
  neither uploaded nor moved).
* Server, over the parameters: h^t = h^{t−1} − α·Σ_{k∈P_t} s_k·Δ_k and
  θ^t = θ^{t−1} + Σ_{P_t} s_k·Δ_k / Σ_{P_t} s_k − h^t/α, h^0 = 0 (server tensors ``feddyn_h/<name>``).
  With ``weighting uniform`` (the default) s_k = 1/m: the paper's h^t = h^{t−1} − α·(1/m)·Σ_{P_t}(θ_k^t − θ^{t−1})
  and θ^t = (1/|P_t|)·Σ_{P_t} θ_k^t − h^t/α exactly (the unweighted mean over the participants, h over all m).
  The paper weighs every client alike; the other weightings are an extension, with s_k the client's share of
  the federation (``samples``: n_k/n; ``capped``, ``bucketed``, ``noisy``: network/aggregation.py), the form
  SCAFFOLD uses: h stays Σ_k s_k·∇L_k(θ_k), so the fixed point minimises Σ_k s_k·L_k (Σ_k n_k·L_k for samples).
* Buffers (BatchNorm statistics) take the plain (s-weighted) mean of their Δ, with no h: they have no gradient.
* There is no server optimizer or server learning rate: h is the method's own server-side correction (it acts
  as a momentum); the paper has neither.

Because of h, an all-zero round still moves the server model by −h^{t−1}/α once h^{t−1} ≠ 0 (h vanishes only
at the fixed point, where Σ_k s_k·∇L_k = 0): that is the paper's rule, not an artefact.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor, nn

from network.aggregation import (WEIGHTINGS, Weights, WeightedMean, WeightingSettings, apply_update,
                                 federation_shares, subtract)
from network.algorithms.base import (ALGORITHMS, GLOBAL_MODEL, Algorithm, Bundle, ClientConfig, ClientResult,
                                     Federation, ServerState, Upload, load_weights, trainable)
from network.algorithms.skeleton import DELTA, Phase, proximal_term, run_phases
from network.settings import check, setting

H_PREFIX = "feddyn_h/"  # server tensors: h per parameter


@dataclass(frozen=True)
class FedDynSettings(WeightingSettings):
    # Not ``alpha``: that name is the run's Dirichlet α flag (a setting may not shadow a flag of the run).
    alpha_dyn: float = setting(0.01, "FedDyn's α, the dynamic regularisation weight: (α/2)·‖θ − θ^{t−1}‖² locally, "
                                     "h/α on the server (the paper's 0.01)")
    # The paper's server mean is unweighted: the default here (the other weightings: see the module docstring).
    weighting: str = setting("uniform", "client shares s_k in h and the server mean: uniform (1/m, the paper's), "
                                        "samples (n_k/n), capped, bucketed, noisy (as every model-averaging "
                                        "algorithm's weighting)", choices=WEIGHTINGS)

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.alpha_dyn > 0, "alpha_dyn", "> 0", self.alpha_dyn)


@ALGORITHMS.register("feddyn")
class FedDyn(Algorithm):
    """Dynamic regularisation: each client's linear and quadratic penalty aligns its optimum with the global one."""

    name = "feddyn"
    Settings = FedDynSettings
    use_when = "clients' local optima disagree and long local training drifts FedAvg off the global optimum"
    dp_refusal = "its server state h adds every update with weight 1/N and the model a further 1/α·h, a mechanism whose sensitivity is not DP-FedAvg's (not implemented)"

    def __init__(self, settings: FedDynSettings, federation: Federation) -> None:
        super().__init__(settings, federation)
        self.shares = federation_shares(settings, federation.client_sizes, federation.seed)

    @functools.cached_property
    def _shared(self) -> tuple[str, ...]:
        return self.federation.layout.varying_keys

    @functools.cached_property
    def _params(self) -> tuple[str, ...]:
        return tuple(key for key in self._shared if key in self.federation.layout.param_keys)

    def init_server(self, weights: Weights) -> ServerState:
        return ServerState({GLOBAL_MODEL: weights}, {H_PREFIX + key: torch.zeros_like(weights[key])
                                                     for key in self._params})

    def client_update(self, model: nn.Module, broadcast: Bundle, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        start = broadcast[GLOBAL_MODEL]
        load_weights(model, start)
        params = trainable(model)
        previous = {name: client_state[name] if name in client_state else torch.zeros_like(param.detach())
                    for name, param in params.items()}  # ∇L_k(θ_k^{t−1}); zero before the first round
        regulariser = DynamicRegulariser(model, start, previous, self.settings.alpha_dyn)
        metrics = run_phases(model, [Phase(extra_loss=regulariser)], loader, cfg)
        state = model.state_dict()
        alpha = self.settings.alpha_dyn
        gradient = {name: previous[name] - alpha * (state[name].detach() - start[name]) for name in params}
        return ClientResult({DELTA: subtract(state, start, self._shared)}, gradient, metrics, cfg.num_samples)

    def aggregate(self, server: ServerState, uploads: Iterable[Upload]) -> ServerState:
        mean = WeightedMean()
        for upload in uploads:
            mean.add(upload.tensors[DELTA], self.shares[upload.client_id])
        average = mean.mean()  # Σ_P s_k·Δ_k / Σ_P s_k
        alpha, participating = self.settings.alpha_dyn, mean.total_weight  # Σ_P s_k (|P|/m when uniform)
        h = {key: server.tensors[H_PREFIX + key] - alpha * participating * average[key] for key in self._params}
        weights = apply_update(server.models[GLOBAL_MODEL], average)  # parameters and buffers: the mean model
        weights = apply_update(weights, h, -1.0 / alpha)  # parameters only: − h^t/α
        return ServerState({GLOBAL_MODEL: weights},
                           {**server.tensors, **{H_PREFIX + key: value for key, value in h.items()}})


class DynamicRegulariser:
    """An ``extra_loss`` hook: −⟨g, θ⟩ + (α/2)·‖θ − θ^{t−1}‖² over the trainable parameters (g, θ^{t−1} fixed)."""

    def __init__(self, model: nn.Module, anchor: Weights, previous_gradient: Weights, alpha: float) -> None:
        self.proximal = proximal_term(model, anchor, alpha)
        self.linear = [previous_gradient[name].detach() for name in self.proximal.names]

    def __call__(self, model: nn.Module) -> Tensor:
        inner = sum((gradient * weight).sum() for gradient, weight in zip(self.linear, self.proximal.weights))
        return self.proximal(model) - inner
