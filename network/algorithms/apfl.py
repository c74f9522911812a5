"""APFL (Deng, Kamani & Mahdavi, "Adaptive Personalized Federated Learning", arXiv:2003.13461, 2020).

Each client i keeps a personal model v_i and a mixing weight α_i ∈ [0, 1]; its personalised model is the parameter
mix v̄_i = α_i·v_i + (1 − α_i)·w. The global model w is trained and averaged as in FedAvg.

Client, each local step on one batch ξ (Algorithm 1 and the adaptive-α update of Section 3), all three updates from
the values before the step (v̄ is built from the w of before its own step, as the paper's v̄_i^(t−1)):

* w ← w − η·∇f(w; ξ)
* v ← v − η·∇_v f(v̄; ξ) = v − η·α·∇f(v̄; ξ)
* α ← clip_[0,1](α − η_α·⟨v − w, ∇f(v̄; ξ)⟩)    (∂f(v̄)/∂α; only with ``adaptive``, else α stays ``alpha_init``)

with η the run's local learning rate. The paper steps α with the model's η_t; here η_α is its own setting
(``alpha_lr``, default 0.01, the run's default ``--init_lr``), since α is one scalar on another scale than the
weights and the lr schedule should not move it. The mix and ⟨v − w, ·⟩ cover the trained parameters; buffers
(BatchNorm running statistics) are not mixed: w keeps those of its own forward passes, v those of v̄'s passes (the
statistics of the personalised model's activations), and v̄ is evaluated with v's. The w and v steps are the run's
local optimizer (one each, fresh every round): plain SGD as in the paper unless the run sets momentum or weight
decay, which then act on each as on any local step (weight decay pulls v, not v̄, towards 0).

First round of a client: v_i = w^t (the broadcast) and α_i = ``alpha_init``. v_i and α_i are the client state and
never leave the client. Upload: Δ = w − w^t of every entry. Server: the model-averaging server (sample-weighted mean
of the Δs, ``weighting``; the paper's server averages the w_i).

Evaluation: the client's own model is v̄_i = α_i·v_i + (1 − α_i)·w_global with the current global model (parameters
mixed, buffers v_i's); a client that never trained has none. α fixed at 0 makes v̄ the global model; α fixed at 1
trains v as Local does (the same steps; a random layer such as dropout draws anew for each of the two passes).
Metrics: ``train_loss`` (f(w)), ``personal_train_loss`` (f(v̄)), both over the local steps, and ``mixing_weight``
(α_i after the round). Cost: two forward-backward passes per local step.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor, nn

from network.aggregation import ServerOptSettings, subtract
from network.algorithms.base import (ALGORITHMS, GLOBAL_MODEL, LOCAL_STEPS, TRAIN_LOSS, Bundle, ClientConfig,
                                     ClientResult, Weights, copy_state, load_weights, make_optimizer, require,
                                     trainable)
from network.algorithms.skeleton import DELTA, ModelAveraging
from network.local_train import budget_batches
from network.settings import check, setting
from utils.device import autocast, to_device
from utils.errors import NonFiniteLossError

MIXING_WEIGHT = "mixing_weight"  # client-state entry of α_i (a float64 scalar), and the metric of α_i after a round
PERSONAL_TRAIN_LOSS = "personal_train_loss"  # client metric: mean f(v̄) over the local steps


@dataclass(frozen=True)
class APFLSettings(ServerOptSettings):
    alpha_init: float = setting(0.5, "α_i of a client's first round: the personal model's weight in "
                                     "v̄ = α·v + (1 − α)·w, in [0, 1]")
    alpha_lr: float = setting(0.01, "η_α, the step size of α's gradient step (adaptive only)")
    adaptive: bool = setting(True, "learn each α_i by gradient descent (false: α_i stays alpha_init)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(0 <= self.alpha_init <= 1, "alpha_init", "in [0, 1]", self.alpha_init)
        check(self.alpha_lr >= 0, "alpha_lr", ">= 0", self.alpha_lr)


@ALGORITHMS.register("apfl")
class APFL(ModelAveraging):
    """FedAvg for w plus a personal model v_i mixed into it with a learned weight α_i per client."""

    name = "apfl"
    Settings = APFLSettings
    personalized = True
    use_when = "clients differ by unknown amounts, so each learns how much of its own model to mix into the global one"

    def __init__(self, settings: APFLSettings, federation) -> None:
        super().__init__(settings, federation)
        require(MIXING_WEIGHT not in federation.layout.state_keys,
                f"apfl keeps α_i as {MIXING_WEIGHT!r} in the client state, which the model has as an entry")

    @functools.cached_property
    def _mixed_keys(self) -> tuple[str, ...]:
        params = self.federation.layout.param_keys
        return tuple(key for key in self.federation.layout.varying_keys if key in params)

    def client_update(self, model: nn.Module, broadcast: Bundle, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        start = broadcast[GLOBAL_MODEL]
        load_weights(model, start)  # the fixed entries
        model.train()
        keys, names = self.federation.layout.varying_keys, list(trainable(model, self._mixed_keys))
        w = {key: start[key].detach().to(cfg.device).clone() for key in keys}
        v = {key: (client_state or start)[key].detach().to(cfg.device).clone() for key in keys}
        alpha = float(client_state[MIXING_WEIGHT]) if client_state else self.settings.alpha_init
        global_step = make_optimizer([w[name] for name in names], cfg)
        personal_step = make_optimizer([v[name] for name in names], cfg)
        losses, personal_losses = [], []
        for batch in budget_batches(loader, **cfg.budget()):
            batch = to_device(batch, cfg.device)
            loss, global_grads = entries_gradient(model, w, names, batch, cfg)  # ∇f(w)
            mixed = {**v, **mix(v, w, names, alpha)}
            personal_loss, mixed_grads = entries_gradient(model, mixed, names, batch, cfg)  # ∇f(v̄)
            v.update({key: value for key, value in mixed.items() if key not in names})  # v̄'s statistics are v's
            next_alpha = self.next_alpha(alpha, v, w, names, mixed_grads)
            for name, global_grad, mixed_grad in zip(names, global_grads, mixed_grads):
                w[name].grad, v[name].grad = global_grad, alpha * mixed_grad  # ∇_v f(v̄) = α∇f(v̄)
            global_step.step()
            personal_step.step()
            alpha = next_alpha
            losses.append(loss)
            personal_losses.append(personal_loss)
        upload = {DELTA: subtract(w, start, self.shared_keys())}
        state = {**{key: value.detach() for key, value in v.items()},
                 MIXING_WEIGHT: torch.tensor(alpha, dtype=torch.float64)}
        metrics = {TRAIN_LOSS: finite_mean(losses), PERSONAL_TRAIN_LOSS: finite_mean(personal_losses),
                   MIXING_WEIGHT: alpha, LOCAL_STEPS: len(losses)}
        return ClientResult(upload, state, metrics, cfg.num_samples)

    def next_alpha(self, alpha: float, v: Weights, w: Weights, names: list[str], mixed_grads: list[Tensor]) -> float:
        """α − η_α·⟨v − w, ∇f(v̄)⟩ clipped to [0, 1] (α itself when not adaptive)."""
        if not self.settings.adaptive:
            return alpha
        slope = torch.stack([((v[name] - w[name]) * grad).sum() for name, grad in zip(names, mixed_grads)]).sum()
        return min(1.0, max(0.0, alpha - self.settings.alpha_lr * float(slope)))

    def personal_model(self, models: dict[str, Weights], client_state: Weights) -> Weights | None:
        if not client_state:
            return None
        global_weights = models[GLOBAL_MODEL]
        own = {key: value.to(global_weights[key].device) for key, value in client_state.items() if key != MIXING_WEIGHT}
        return {**global_weights, **own,
                **mix(own, global_weights, self._mixed_keys, float(client_state[MIXING_WEIGHT]))}


def mix(personal: Weights, shared: Weights, keys: Iterable[str], alpha: float) -> Weights:
    """α·personal + (1 − α)·shared of each key (the paper's v̄)."""
    return {key: alpha * personal[key] + (1 - alpha) * shared[key] for key in keys}


def entries_gradient(model: nn.Module, entries: Weights, names: list[str], batch: dict,
                     cfg: ClientConfig) -> tuple[Tensor, list[Tensor]]:
    """The batch's loss and its gradient for ``names`` at ``entries``; the forward pass's buffers go back into them."""
    load_weights(model, entries)
    params = trainable(model, names)
    with autocast(cfg.device):
        loss = cfg.loss_fn(model, batch)
    grads = torch.autograd.grad(loss, [params[name] for name in names], allow_unused=True)
    entries.update(copy_state(model, [key for key in entries if key not in params]))
    return loss.detach(), [torch.zeros_like(params[name]) if grad is None else grad for name, grad in zip(names, grads)]


def finite_mean(losses: list[Tensor]) -> float:
    """The mean loss, checked once at the end as the shared loop checks it."""
    mean = float(torch.stack(losses).float().mean()) if losses else 0.0
    if not math.isfinite(mean):
        raise NonFiniteLossError(f"the local training loss is {mean}")
    return mean
