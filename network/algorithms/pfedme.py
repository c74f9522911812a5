"""pFedMe (Dinh, Tran, Nguyen, "Personalized Federated Learning with Moreau Envelopes", NeurIPS 2020).

Each client's personal model θ_i is the proximal point of its loss around its local copy w of
the global model; w moves towards θ_i, and the server averages the ws.

Client, each round (Algorithm 1 and the authors' code):
* Start from the broadcast w^t: the local model w and the personal model θ both begin there.
* For each step of the local budget (J batches or E epochs), on that batch:
  - inner problem: θ̃ ≈ argmin_θ F_i(θ; batch) + (λ/2)·‖θ − w‖², by K (``inner_steps``) plain
    SGD steps of lr η_p (``personal_lr``), from the current θ (warm start, as the authors' code);
  - local update: w ← w − η·λ·(w − θ̃), with η the run's local learning rate.
* Upload Δ = w − w^t (parameters; buffers such as BatchNorm statistics are those θ's forward
  passes left, as for every other algorithm); keep θ̃ as the client's personal model.

The inner SGD uses the run's weight decay but no momentum (the authors' pFedMe optimiser has
none). Server: w^{t+1} = (1 − β)·w^t + β·mean(w_i) = w^t + β·mean(Δ), i.e. the model-averaging
server with β = ``server_lr``, default 1 (one widely used library defaults β to 0, which never
moves the global model), weighted by ``weighting``.

Cost: K gradient steps per local step (``local_steps`` counts all J·K of them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from network.aggregation import ServerOptSettings, subtract
from network.algorithms.base import (ALGORITHMS, GLOBAL_MODEL, LOCAL_STEPS, TRAIN_LOSS, Bundle, ClientConfig,
                                     ClientResult, Weights, copy_state, load_weights, trainable)
from network.algorithms.skeleton import DELTA, ModelAveraging, proximal_term
from network.local_train import budget_batches, local_train
from network.settings import check, setting


MAX_INNER_STEPS = 1_000  # inner_steps: each local step runs this many SGD steps


@dataclass(frozen=True)
class PFedMeSettings(ServerOptSettings):
    lam: float = setting(15.0, "λ of the inner problem F_i(θ) + (λ/2)·‖θ − w‖²")
    inner_steps: int = setting(5, "K, SGD steps on the inner problem per local step", high=MAX_INNER_STEPS)
    personal_lr: float = setting(0.01, "η_p, the learning rate of the inner steps")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.lam >= 0, "lam", ">= 0", self.lam)
        check(self.inner_steps >= 1, "inner_steps", ">= 1", self.inner_steps)
        check(self.personal_lr > 0, "personal_lr", "> 0", self.personal_lr)


@ALGORITHMS.register("pfedme")
class PFedMe(ModelAveraging):
    """Personal models as Moreau-envelope proximal points of the local loss; β-averaging of the local models."""

    name = "pfedme"
    use_when = "personal models from a Moreau envelope; K× the compute"
    Settings = PFedMeSettings
    personalized = True

    def client_update(self, model: nn.Module, broadcast: Bundle, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        settings = self.settings
        start = broadcast[GLOBAL_MODEL]
        load_weights(model, start)
        theta = trainable(model)
        local = {name: param.detach().clone() for name, param in theta.items()}  # w, updated in place
        thetas, locals_ = list(theta.values()), list(local.values())
        inner = torch.optim.SGD(thetas, lr=settings.personal_lr, weight_decay=cfg.weight_decay)
        prox = proximal_term(model, local, settings.lam) if settings.lam else None
        losses, steps = [], 0
        for batch in budget_batches(loader, **cfg.budget()):
            result = local_train(model, [batch], cfg.loss_fn, inner, cfg.device, steps=settings.inner_steps,
                                 extra_loss=prox)
            with torch.no_grad():  # w ← w − η·λ·(w − θ̃)
                torch._foreach_add_(locals_, torch._foreach_sub(locals_, [param.detach() for param in thetas]),
                                    alpha=-cfg.lr * settings.lam)
            losses.append(result.mean_loss)
            steps += result.steps
        personal = copy_state(model, self.federation.layout.varying_keys)  # θ̃ (and the buffers it left)
        final = {**model.state_dict(), **local}
        upload = {DELTA: subtract(final, start, self.shared_keys())}
        metrics = {TRAIN_LOSS: sum(losses) / len(losses) if losses else 0.0, LOCAL_STEPS: steps}
        return ClientResult(upload, personal, metrics, cfg.num_samples)

    def personal_model(self, models: dict[str, Weights], client_state: Weights) -> Weights | None:
        return {**models[GLOBAL_MODEL], **client_state} if client_state else None
