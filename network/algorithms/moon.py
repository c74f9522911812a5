"""MOON (Qinbin Li, Bingsheng He & Dawn Song, "Model-Contrastive Federated Learning", CVPR 2021).

Local loss of client i in round t, per batch (the paper's Eq. 3 and 4, with z, z_glob, z_prev ∈ R^d per sample):

    ℓ = ℓ_task + μ·ℓ_con,   ℓ_con = −log( e^{sim(z, z_glob)/τ} / (e^{sim(z, z_glob)/τ} + e^{sim(z, z_prev)/τ}) )

sim the cosine similarity; z the representation of the model being trained, z_glob that of the received global model
w^t (fixed), z_prev that of the client's own model of its previous round w_i^{t−1} (fixed; client state); ℓ_con is
computed per sample and averaged over the batch, as ℓ_con = logaddexp(a/τ, b/τ) − a/τ with a = sim(z, z_glob),
b = sim(z, z_prev) (the same quantity, stable for every τ). Upload: Δ = y − x of the model; server: FedAvg's
sample-weighted mean and server optimizer (``ModelAveraging``).

Choices where the paper leaves room:

* z (``network.algorithms.representation``): the pooled encoder output of a TaskModel, the head's input otherwise. The
  paper's networks add a 2-layer projection head whose output is z and feeds the classifier; TaskHet trains the study's
  task model unchanged, so no projection head is added (a frozen encoder is refused: z could not change).
* The client's first round: it has no previous model. The authors' code (QinbinLi/MOON, main.py) starts with an empty
  model pool, so the first round's logits hold the positive pair alone and ℓ_con = 0; taking the global model as the
  previous one gives ℓ_con = log 2 whatever z is. Both have zero gradient, so the first round of a client is FedAvg's
  local training exactly, and it is run without the term (no extra forward pass).
* The previous model is the client's own model at the end of its last round (what it uploaded), kept in its state
  with BatchNorm statistics; a client that skips rounds contrasts with its last trained model, as in the authors' code.
  The state is a full model per client, so it is the same size as the model (spilled to disk like any client state).
  It is not a private entry: the server saw it as Δ; it is just never sent again.
* The two fixed models run in eval mode, as in the authors' code (global_model.eval(), previous nets .eval()):
  BatchNorm uses their running statistics and never changes them, dropout is off. They run without gradient, on the
  step's own input (``torch.func.functional_call`` with their weights), so MOON costs two extra forward passes per step.
* μ = 1 by default: the authors' code default, and the paper's best value for CIFAR-100 and Tiny-ImageNet (tuned over
  {0.1, 1, 5, 10}; 5 was best for CIFAR-10). τ = 0.5, the paper's. μ = 0 is FedAvg exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from network.aggregation import ServerOptSettings
from network.algorithms.base import (ALGORITHMS, GLOBAL_MODEL, Bundle, ClientConfig, Weights,
                                     copy_state)
from network.algorithms.representation import RepresentationAveraging, RepresentationTap
from network.algorithms.skeleton import DELTA, Phase
from network.settings import check, setting


@dataclass(frozen=True)
class MoonSettings(ServerOptSettings):
    mu: float = setting(1.0, "weight μ of the model-contrastive loss (paper: tuned over 0.1, 1, 5, 10)")
    tau: float = setting(0.5, "temperature τ of the model-contrastive loss")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.mu >= 0, "mu", ">= 0", self.mu)
        check(self.tau > 0 and math.isfinite(self.tau), "tau", "> 0", self.tau)


def model_contrastive_loss(z: Tensor, z_glob: Tensor, z_prev: Tensor, tau: float) -> Tensor:
    """The batch mean of −log(e^{a/τ}/(e^{a/τ} + e^{b/τ})), a = cos(z, z_glob), b = cos(z, z_prev), per sample."""
    to_global = F.cosine_similarity(z, z_glob, dim=1) / tau
    to_previous = F.cosine_similarity(z, z_prev, dim=1) / tau
    return (torch.logaddexp(to_global, to_previous) - to_global).mean()


class ContrastiveTerm:
    """An ``extra_loss``: μ·ℓ_con of this step's z against the fixed global and previous models' z on the same input."""

    def __init__(self, tap: RepresentationTap, global_weights: Weights, previous_weights: Weights,
                 settings: MoonSettings, device: torch.device) -> None:
        self.tap, self.device, self.mu, self.tau = tap, device, settings.mu, settings.tau
        self.global_weights = {key: value.to(device) for key, value in global_weights.items()}
        self.previous_weights = {key: value.to(device) for key, value in previous_weights.items()}

    def __call__(self, _: nn.Module) -> Tensor:
        z = self.tap.take()  # first: the replays below record their own z
        z_glob = self.tap.replay(self.global_weights, self.device)
        z_prev = self.tap.replay(self.previous_weights, self.device)
        return self.mu * model_contrastive_loss(z, z_glob.to(z.dtype), z_prev.to(z.dtype), self.tau)


@ALGORITHMS.register("moon")
class Moon(RepresentationAveraging):
    """Model averaging whose clients pull their representation to the global model's, away from their last one's."""

    name = "moon"
    Settings = MoonSettings
    verb = "contrasted"
    use_when = "label skew pulls each client's representation away from the global model's"
    dp_groups = (DELTA,)  # client-level DP: its uploads are FedAvg's (only the local loss differs)

    def phases(self, model: nn.Module, broadcast: Bundle, client_state: Weights, cfg: ClientConfig) -> list[Phase]:
        if self.settings.mu == 0 or not client_state:  # no previous model yet: ℓ_con has zero gradient (docstring)
            return [Phase()]
        global_weights = broadcast[GLOBAL_MODEL]
        previous = {**global_weights, **client_state}  # the state holds every entry training changes
        return [Phase(extra_loss=ContrastiveTerm(cfg.loss_fn, global_weights, previous, self.settings, cfg.device))]

    def own_entries(self, client_state: Weights) -> Weights:
        return {}  # the previous model is contrasted with, never trained from: every round starts at the global model

    def next_client_state(self, model: nn.Module, client_state: Weights) -> Weights:
        return copy_state(model, self.federation.layout.varying_keys)  # w_i^t: next round's previous model
