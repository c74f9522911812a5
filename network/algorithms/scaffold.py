"""SCAFFOLD (Karimireddy et al. 2020, Algorithm 1): control variates correct client drift.

Choices, each as in the paper unless said otherwise:

* Control variates exist for the trainable parameters only. c and every c_i start
  at zero; a client's c_i stays on it across rounds (client state).
* Local step: the correction (c − c_i) is added to each parameter's gradient after
  ``backward`` and before ``optimizer.step``, so y ← y − η_l·(g_i(y) − c_i + c).
  Local momentum and weight decay, if configured, act on the corrected gradient (the
  momentum buffer carries the correction like any gradient). The local optimiser must be
  torch SGD (``make_optimizer``); another optimiser is refused (its step is not linear in
  the gradient, so option II has no total step size).
* ``option II`` (default): the paper's c_i⁺ = c_i − c + (x − y_i)/(K·η_l) with K·η_l, the
  total step size of K plain SGD steps, replaced by the total step size of the local
  optimiser actually used: η_l·S with S = Σ_k s_k, s_k the coefficient of a constant gradient
  in the optimiser's k-th step direction (heavy ball: s_k = (1 − μ^k)/(1 − μ), so
  S = Σ_{k=1..K} (1 − μ^k)/(1 − μ); with dampening τ and/or Nesterov, torch SGD's own
  recursion). Because the correction (c − c_i) is constant within a round and the
  optimiser is linear in its gradients, x − y_i = η_l·Σ_k d_k(g) + η_l·S·(c − c_i), with d_k
  the optimiser's k-th direction replayed on the raw minibatch gradients g_i(y_k) alone, so
  the rule is computed as c_i⁺ = Σ_k d_k(g) / S: a weighted mean of the raw gradients (an
  early gradient weighs more: momentum carries it through more of the K steps). Weight
  decay is excluded, so c_i estimates the task gradient. Without momentum d_k = g_i(y_k)
  and S = K: the plain mean of the raw gradients, the paper's option II exactly.
  Why: dividing by K·η_l under momentum μ overstates the client gradient by ~1/(1 − μ);
  the plain (unweighted) mean, this module's earlier option II, is no better. Measured on
  the least-squares oracle (20 clients, K = 10, μ = 0.9; docs/DESIGN.md, "SCAFFOLD with
  local momentum"): the round map's spectral radius stays ≤ 1 up to lr 3.19/L_max with
  this rule, against 0.15/L_max with the plain mean and 0.49/L_max with option I;
  FedAvg's own limit there is 3.83/L_max (heavy ball alone diverges at 3.8/λ), so the
  band 3.19–3.83/L_max is stable for FedAvg but not for SCAFFOLD (no rule of this form
  found closes it; a rule needing L_max cannot be checked on a neural network).
  ``option I``: c_i⁺ = ∇f_i(x), the full gradient at the server model, from one extra
  pass over the client's data.
* Upload: Δy_i = y_i − x (every state-dict entry) and Δc_i = c_i⁺ − c_i.
* Server, ``weighting samples`` (default): with p_i = n_i/n over all N clients,
  x ← x + η_g·Σ_S p_i·Δy_i / Σ_S p_i and c ← c + Σ_S p_i·Δc_i, which keeps
  c = Σ_i p_i·c_i and makes the fixed point argmin Σ_i n_i·f_i, the objective FedAvg,
  FedProx and FedRep aim at. ``weighting uniform`` is the paper's form:
  x ← x + η_g·mean_S(Δy_i), c ← c + (|S|/N)·mean_S(Δc_i) (c = mean_i c_i; optimum of Σ_i f_i).
  ``weighting bucketed`` / ``noisy``: as ``samples`` with every n_i replaced by the size the client
  reports (network/aggregation.py), so p_i = b_i/Σ_j b_j.
* η_g scales the parameters only; buffers (BatchNorm statistics) take the plain
  (weighted) mean of Δy, as in every other algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor, nn

from network.aggregation import (Weights, WeightedMean, WeightingSettings, apply_update, federation_shares,
                                 subtract)
from network.algorithms.base import (ALGORITHMS, GLOBAL_MODEL, LOCAL_STEPS, TRAIN_LOSS, Algorithm, Bundle,
                                     ClientConfig, ClientResult, Federation, ServerState, Upload, load_weights,
                                     make_optimizer, require, trainable)
from network.local_train import local_train
from network.settings import check, setting
from network.vectorized import Hooks, stack_weights, train_lockstep, unstack_weights
from utils.device import autocast, to_device

OPTIONS = ("I", "II")
CONTROL = "control"  # broadcast group: the server control variate c, by parameter name
DELTA = "delta"  # upload group: Δy_i
CONTROL_DELTA = "control_delta"  # upload group: Δc_i


@dataclass(frozen=True)
class ScaffoldSettings(WeightingSettings):
    server_lr: float = setting(1.0, "server learning rate η_g on the parameters")
    option: str = setting("II", "c_i update: II (from the local steps, momentum-aware) or I (full gradient at x)",
                         choices=OPTIONS)

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.server_lr > 0, "server_lr", "> 0", self.server_lr)
        check(self.option in OPTIONS, "option", "I or II", self.option)


@ALGORITHMS.register("scaffold")
class Scaffold(Algorithm):
    """Stochastic controlled averaging: server c, client c_i, corrected local steps."""
    # Client-level DP: Δy_i and Δc_i clipped together (one vector of norm ≤ C) and both noised at the server, so the
    # control variates leak no more than the model update (the server's c is then built from noisy sums).
    dp_groups = (DELTA, CONTROL_DELTA)

    name = "scaffold"
    use_when = "drift under label skew, enough rounds to learn c"
    Settings = ScaffoldSettings
    vectorizable = True  # --vectorize_clients: client_updates below

    def __init__(self, settings: ScaffoldSettings, federation: Federation) -> None:
        super().__init__(settings, federation)
        self.shares = federation_shares(settings, federation.client_sizes, federation.seed)

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
        optimizer = make_optimizer(targets, cfg)
        directions = _StepDirections(optimizer, targets) if self.settings.option == "II" else None

        def correct(_: nn.Module) -> None:
            for param in targets:
                if param.grad is None:  # a parameter unused by this batch still drifts by the correction
                    param.grad = torch.zeros_like(param)
            grads = [param.grad for param in targets]
            if directions is not None:
                directions.add(grads)
            torch._foreach_add_(grads, correction)

        result = local_train(model, loader, cfg.loss_fn, optimizer, cfg.device, **cfg.budget(), grad_hook=correct)
        require(result.steps > 0, "scaffold needs at least one local step (K >= 1) per client")
        if self.settings.option == "II":
            c_new = directions.mean()
        fixed = self.federation.layout.fixed_keys
        upload = {DELTA: subtract(model.state_dict(), weights, [key for key in weights if key not in fixed]),
                  CONTROL_DELTA: {name: new - old for name, new, old in zip(names, c_new, c_old)}}
        return ClientResult(upload, dict(zip(names, c_new)), {TRAIN_LOSS: result.mean_loss, LOCAL_STEPS: result.steps},
                            cfg.num_samples)

    def client_updates(self, model: nn.Module, broadcast: Bundle, client_states: list[Weights],
                       loaders: list[Iterable[dict]], cfgs: list[ClientConfig]) -> list[ClientResult]:
        """``client_update`` of a chunk in lock-step: the correction is a stacked gradient map (network/vectorized.py)."""
        weights = broadcast[GLOBAL_MODEL]
        load_weights(model, weights)
        params = trainable(model)
        names = list(params)
        c = [_read(broadcast[CONTROL], name, params[name]) for name in names]
        c_olds = [[_read(state, name, params[name]) for name in names] for state in client_states]
        c_news = []
        if self.settings.option == "I":
            for loader, cfg in zip(loaders, cfgs):
                c_news.append(_full_gradient(model, list(params.values()), loader, cfg))
                load_weights(model, weights)
        corrections = [torch._foreach_sub(c, c_old) for c_old in c_olds]
        correction = {name: torch.stack([client[index] for client in corrections]) for index, name in enumerate(names)}
        varying = self.federation.layout.varying_keys
        trained = train_lockstep(model, stack_weights([weights] * len(loaders), varying), names, loaders, cfgs[0],
                                 cfgs[0].budget(), Hooks(grad_map=lambda grads: {name: grads[name] + correction[name]
                                                                                  for name in names}, sum_grads=True))
        results = []
        for index, (outcome, c_old, cfg) in enumerate(zip(trained.results, c_olds, cfgs)):
            require(outcome.steps > 0, "scaffold needs at least one local step (K >= 1) per client")
            total = _total_step_size(outcome.steps, cfgs[0].momentum)  # S of _StepDirections (no dampening here)
            c_new = c_news[index] if c_news else [trained.grad_sums[name][index] / total for name in names]
            load_weights(model, unstack_weights(trained.state, index))
            fixed = self.federation.layout.fixed_keys
            upload = {DELTA: subtract(model.state_dict(), weights, [key for key in weights if key not in fixed]),
                      CONTROL_DELTA: {name: new - old for name, new, old in zip(names, c_new, c_old)}}
            results.append(ClientResult(upload, dict(zip(names, c_new)),
                                        {TRAIN_LOSS: outcome.mean_loss, LOCAL_STEPS: outcome.steps}, cfg.num_samples))
        return results

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


class _StepDirections:
    """Option II's sums: Σ_k d_k(g) and S = Σ_k d_k(1) over the local steps.

    d_k is the step direction torch SGD takes at step k (before multiplying by η_l), replayed
    here on the raw minibatch gradients (before SCAFFOLD's correction and weight decay):
    hand-written because torch keeps only the corrected buffer. torch SGD's recursion, with
    momentum μ, dampening τ: b_1 = g_1, b_k = μ·b_{k−1} + (1 − τ)·g_k; d_k = b_k, or
    g_k + μ·b_k with Nesterov; d_k = g_k when μ = 0. The same recursion on the scalar 1 gives S.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[Tensor]) -> None:
        require(type(optimizer) is torch.optim.SGD and len(optimizer.param_groups) == 1,
                f"scaffold option II needs plain torch SGD as the local optimizer, got {type(optimizer).__name__}")
        group = optimizer.param_groups[0]
        self.momentum, self.dampening, self.nesterov = group["momentum"], group["dampening"], group["nesterov"]
        self.sums = [torch.zeros_like(param) for param in params]
        self.total = 0.0  # S
        self.buffer: list[Tensor] | None = None
        self.scalar_buffer = 0.0

    def add(self, grads: list[Tensor]) -> None:
        """Account for one step whose raw gradients are ``grads``."""
        if self.momentum == 0:
            torch._foreach_add_(self.sums, grads)
            self.total += 1.0
            return
        if self.buffer is None:
            self.buffer = [grad.clone() for grad in grads]
            self.scalar_buffer = 1.0
        else:
            torch._foreach_mul_(self.buffer, self.momentum)
            torch._foreach_add_(self.buffer, grads, alpha=1 - self.dampening)
            self.scalar_buffer = self.momentum * self.scalar_buffer + (1 - self.dampening)
        if self.nesterov:
            torch._foreach_add_(self.sums, grads)
            torch._foreach_add_(self.sums, self.buffer, alpha=self.momentum)
            self.total += 1.0 + self.momentum * self.scalar_buffer
        else:
            torch._foreach_add_(self.sums, self.buffer)
            self.total += self.scalar_buffer

    def mean(self) -> list[Tensor]:
        """c_i⁺ = Σ_k d_k(g) / S."""
        return torch._foreach_div(self.sums, self.total)


def _total_step_size(steps: int, momentum: float) -> float:
    """S = Σ_k s_k over ``steps`` steps, s_1 = 1, s_k = μ·s_{k−1} + 1: _StepDirections' total for torch SGD."""
    total, scalar = 0.0, 0.0
    for _ in range(steps):
        scalar = momentum * scalar + 1.0  # s_1 = μ·0 + 1 = 1
        total += scalar
    return total


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
