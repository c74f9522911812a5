"""SCAFFOLD (Karimireddy et al. 2020, Algorithm 1): control variates correct client drift.

Choices, each as in the paper unless said otherwise:

* Control variates exist for the trainable parameters only. c and every c_i start
  at zero; a client's c_i stays on it across rounds (client state).
* Local step: the correction (c − c_i) is added to each parameter's gradient after
  ``backward`` and before ``optimizer.step``, so y ← y − η_l·(g_i(y) − c_i + c).
  Local momentum and weight decay, if configured, act on the corrected gradient.
* ``option II`` (default): c_i⁺ = the mean of the raw minibatch gradients g_i(y_k)
  over the K local steps this client took. Under plain SGD this *is* the paper's
  c_i − c + (x − y_i)/(K·η_l) (sum the K steps); unlike that formula it stays the
  mean gradient when momentum or weight decay change the trajectory (with momentum
  0.9 the formula diverged where option I converged). ``option I``: c_i⁺ = ∇f_i(x),
  the full gradient at the server model, from one extra pass over the client's data.
* Upload: Δy_i = y_i − x (every state-dict entry) and Δc_i = c_i⁺ − c_i.
* Server, ``weighting samples`` (default): with p_i = n_i/n over all N clients,
  x ← x + η_g·Σ_S p_i·Δy_i / Σ_S p_i and c ← c + Σ_S p_i·Δc_i, which keeps
  c = Σ_i p_i·c_i and makes the fixed point argmin Σ_i n_i·f_i, the objective FedAvg,
  FedProx and FedRep aim at. ``weighting uniform`` is the paper's form:
  x ← x + η_g·mean_S(Δy_i), c ← c + (|S|/N)·mean_S(Δc_i) (c = mean_i c_i; optimum of Σ_i f_i).
* η_g scales the parameters only; buffers (BatchNorm statistics) take the plain
  (weighted) mean of Δy, as in every other algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor, nn

from network.aggregation import Weights, WeightedMean, WeightingSettings, apply_update, client_weights, subtract
from network.algorithms.base import (ALGORITHMS, GLOBAL_MODEL, LOCAL_STEPS, TRAIN_LOSS, Algorithm, Bundle,
                                     ClientConfig, ClientResult, Federation, ServerState, Upload, load_weights,
                                     make_optimizer, require, trainable)
from network.local_train import local_train
from network.settings import check, setting
from utils.device import autocast, to_device

OPTIONS = ("I", "II")
CONTROL = "control"  # broadcast group: the server control variate c, by parameter name
DELTA = "delta"  # upload group: Δy_i
CONTROL_DELTA = "control_delta"  # upload group: Δc_i


@dataclass(frozen=True)
class ScaffoldSettings(WeightingSettings):
    server_lr: float = setting(1.0, "server learning rate η_g on the parameters")
    option: str = setting("II", "c_i update: II (mean local gradient) or I (full gradient at x)", choices=OPTIONS)

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.server_lr > 0, "server_lr", "> 0", self.server_lr)
        check(self.option in OPTIONS, "option", "I or II", self.option)


@ALGORITHMS.register("scaffold")
class Scaffold(Algorithm):
    """Stochastic controlled averaging: server c, client c_i, corrected local steps."""

    name = "scaffold"
    Settings = ScaffoldSettings

    def __init__(self, settings: ScaffoldSettings, federation: Federation) -> None:
        super().__init__(settings, federation)
        self.shares = client_weights(federation.client_sizes, settings.weighting, settings.cap)

    def broadcast(self, server: ServerState) -> Bundle:
        return {GLOBAL_MODEL: server.models[GLOBAL_MODEL], CONTROL: server.tensors}

    def client_update(self, model: nn.Module, broadcast: Bundle, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        weights = broadcast[GLOBAL_MODEL]
        load_weights(model, weights)
        params = trainable(model)
        names, targets = list(params), list(params.values())
        c = [_read(broadcast[CONTROL], name, params[name]) for name in names]
        c_old = [_read(client_state, name, params[name]) for name in names]
        if self.settings.option == "I":
            c_new = _full_gradient(model, targets, loader, cfg)
            load_weights(model, weights)  # the extra pass may have moved BatchNorm statistics
        correction = torch._foreach_sub(c, c_old)
        gradient_sum = [torch.zeros_like(param) for param in targets]

        def correct(_: nn.Module) -> None:
            for param in targets:
                if param.grad is None:  # a parameter unused by this batch still drifts by the correction
                    param.grad = torch.zeros_like(param)
            grads = [param.grad for param in targets]
            torch._foreach_add_(gradient_sum, grads)
            torch._foreach_add_(grads, correction)

        result = local_train(model, loader, cfg.loss_fn, make_optimizer(targets, cfg), cfg.device, **cfg.budget(),
                             grad_hook=correct)
        require(result.steps > 0, "scaffold needs at least one local step (K >= 1) per client")
        if self.settings.option == "II":
            c_new = torch._foreach_div(gradient_sum, result.steps)
        fixed = self.federation.layout.fixed_keys
        upload = {DELTA: subtract(model.state_dict(), weights, [key for key in weights if key not in fixed]),
                  CONTROL_DELTA: {name: new - old for name, new, old in zip(names, c_new, c_old)}}
        return ClientResult(upload, dict(zip(names, c_new)), {TRAIN_LOSS: result.mean_loss, LOCAL_STEPS: result.steps},
                            cfg.num_samples)

    def aggregate(self, server: ServerState, uploads: Iterable[Upload]) -> ServerState:
        model_mean, control_sum = WeightedMean(), WeightedMean()
        for upload in uploads:
            share = self._share(upload)
            model_mean.add(upload.tensors[DELTA], share)
            control_sum.add(upload.tensors[CONTROL_DELTA], share)
        delta_y = model_mean.mean()
        # Σ_S s_i·Δc_i = (mean over S weighted by s) · Σ_S s_i; s_i = p_i (samples) or 1/N (uniform).
        delta_c = {key: value * control_sum.total_weight for key, value in control_sum.mean().items()}
        global_weights = server.models[GLOBAL_MODEL]
        params = self.federation.layout.param_keys
        weights = apply_update(global_weights, {key: value for key, value in delta_y.items() if key in params},
                               self.settings.server_lr)
        weights = apply_update(weights, {key: value for key, value in delta_y.items() if key not in params})
        control = {key: server.tensors.get(key, torch.zeros_like(value)) + value for key, value in delta_c.items()}
        return ServerState({GLOBAL_MODEL: weights}, {**server.tensors, **control})

    def _share(self, upload: Upload) -> float:
        return self.shares[upload.client_id]


def _read(state: Weights, key: str, like: Tensor) -> Tensor:
    return state[key].to(like.device, like.dtype) if key in state else torch.zeros_like(like)


def _full_gradient(model: nn.Module, params: list[Tensor], loader: Iterable[dict], cfg: ClientConfig) -> list[Tensor]:
    """Option I: the gradient of the client's mean loss at the current weights, over one pass (batch-size weighted)."""
    sums = [torch.zeros_like(param) for param in params]
    total = 0
    model.train()
    for batch in loader:
        batch = to_device(batch, cfg.device)
        size = next(value for value in batch.values() if torch.is_tensor(value)).shape[0]
        with autocast(cfg.device):
            loss = cfg.loss_fn(model, batch)
        grads = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
        torch._foreach_add_(sums, grads, alpha=size)
        total += size
    require(total > 0, "scaffold option I needs a client with training data")
    return torch._foreach_div(sums, total)
