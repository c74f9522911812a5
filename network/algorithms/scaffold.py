"""SCAFFOLD (Karimireddy et al. 2020, Algorithm 1): control variates correct client drift.

Choices, each as in the paper unless said otherwise:

* Control variates exist for the trainable parameters only. Buffers (BatchNorm
  statistics) have no gradient; they are averaged like the model change Δy.
* c and every c_i start at zero; they are created lazily, so an unseen client or
  parameter reads as zero, and c_i stays on its client across rounds (client state).
* Local step: the correction (c − c_i) is added to each parameter's gradient after
  ``backward`` and before ``optimizer.step`` (the shared loop's ``grad_hook``), so
  y ← y − η_l·(g_i(y) − c_i + c). The paper analyses plain SGD; local momentum or
  weight decay, if configured, act on the corrected gradient.
* Option II (default): c_i⁺ = c_i − c + (x − y_i)/(K·η_l) with K the optimizer steps
  this client actually took (not a nominal count) and η_l this round's local lr.
  Option I (``--scaffold_option I``): c_i⁺ = ∇f_i(x), the gradient of the client's
  loss at the server model, from one extra pass over its data (batch-size weighted).
* Upload: Δy_i = y_i − x for every state-dict entry and Δc_i = c_i⁺ − c_i.
* Server: the paper's uniform means over the sampled set S (each client counts
  once, which keeps c = (1/N)·Σ c_i): x ← x + η_g·mean(Δy_i) with η_g = ``--server_lr``,
  and c ← c + (|S|/N)·mean(Δc_i) with N = all clients. ``--server_opt`` must be sgd.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor, nn

from network.aggregation import Weights, apply_update, subtract, weighted_average
from network.algorithms.base import (ALGORITHMS, CONTROL_DELTA_PREFIX, CONTROL_PREFIX, LOCAL_STEPS, TRAIN_LOSS,
                                     Algorithm, AlgorithmConfig, ClientConfig, ClientResult, Upload, load_weights,
                                     make_optimizer, require, trainable)
from network.local_train import local_train
from utils.device import autocast, to_device

OPTIONS = ("I", "II")


@ALGORITHMS.register("scaffold")
class Scaffold(Algorithm):
    """Stochastic controlled averaging: server c, client c_i, corrected local steps."""

    name = "scaffold"

    def __init__(self, config: AlgorithmConfig) -> None:
        super().__init__(config)
        require(config.scaffold_option in OPTIONS, f"--scaffold_option must be I or II, got {config.scaffold_option!r}")
        require(config.server_opt == "sgd", "scaffold defines its own server step x ← x + η_g·mean(Δy): "
                f"use --server_opt sgd (got {config.server_opt!r}) and set η_g with --server_lr")
        require(config.server_lr > 0, f"--server_lr must be > 0, got {config.server_lr}")
        require(config.num_clients >= 1, f"scaffold needs the number of clients N >= 1, got {config.num_clients}")

    def broadcast(self, global_weights: Weights, server_state: Weights) -> Weights:
        return {**global_weights, **server_state}

    def client_update(self, model: nn.Module, broadcast: Weights, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        weights = {key: value for key, value in broadcast.items() if not key.startswith(CONTROL_PREFIX)}
        load_weights(model, weights)
        params = trainable(model)
        names = list(params)
        c = [_read(broadcast, CONTROL_PREFIX + name, params[name]) for name in names]
        c_old = [_read(client_state, name, params[name]) for name in names]
        if self.config.scaffold_option == "I":
            c_new = _full_gradient(model, list(params.values()), loader, cfg)
            load_weights(model, weights)  # the extra pass may have moved BatchNorm statistics
        correction = torch._foreach_sub(c, c_old)
        targets = list(params.values())

        def add_correction(_: nn.Module) -> None:
            for param in targets:
                if param.grad is None:  # a parameter unused by this batch still drifts by the correction
                    param.grad = torch.zeros_like(param)
            torch._foreach_add_([param.grad for param in targets], correction)

        optimizer = make_optimizer(targets, cfg)
        result = local_train(model, loader, cfg.loss_fn, optimizer, cfg.device, **cfg.budget(), grad_hook=add_correction)
        require(result.steps > 0, "scaffold needs at least one local step (K >= 1) per client")
        delta_y = subtract(model.state_dict(), weights, weights.keys())
        if self.config.scaffold_option == "II":
            # c_i⁺ = c_i − c + (x − y)/(K·η_l), with x − y = −Δy.
            scale = -1.0 / (result.steps * cfg.lr)
            c_new = [old - server + scale * delta_y[name] for old, server, name in zip(c_old, c, names)]
        upload = {**delta_y, **{CONTROL_DELTA_PREFIX + name: new - old for name, new, old in zip(names, c_new, c_old)}}
        return ClientResult(upload, dict(zip(names, c_new)),
                            {TRAIN_LOSS: result.mean_loss, LOCAL_STEPS: result.steps}, cfg.num_samples)

    def aggregate(self, global_weights: Weights, server_state: Weights,
                  uploads: Iterable[Upload]) -> tuple[Weights, Weights]:
        mean, count = weighted_average((upload, 1.0) for upload, _ in uploads)
        model_delta = {key: value for key, value in mean.items() if not key.startswith(CONTROL_DELTA_PREFIX)}
        new_state = dict(server_state)
        for key, delta_c in mean.items():
            if key.startswith(CONTROL_DELTA_PREFIX):
                name = CONTROL_PREFIX + key[len(CONTROL_DELTA_PREFIX):]
                old = server_state.get(name, torch.zeros_like(delta_c))
                new_state[name] = old + (count / self.config.num_clients) * delta_c
        return apply_update(global_weights, model_delta, self.config.server_lr), new_state


def _read(state: Weights, key: str, like: Tensor) -> Tensor:
    return state[key].to(like.device, like.dtype) if key in state else torch.zeros_like(like)


def _full_gradient(model: nn.Module, params: list[Tensor], loader: Iterable[dict], cfg: ClientConfig) -> list[Tensor]:
    """Option I: the gradient of the client's mean loss at the current weights, over one pass."""
    sums = [torch.zeros_like(param) for param in params]
    total = 0
    model.train()
    for batch in loader:
        batch = to_device(batch, cfg.device)
        size = next(value for value in batch.values() if torch.is_tensor(value)).shape[0]
        model.zero_grad(set_to_none=True)
        with autocast(cfg.device):
            loss = cfg.loss_fn(model, batch)
        grads = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
        torch._foreach_add_(sums, grads, alpha=size)
        total += size
    require(total > 0, "scaffold option I needs a client with training data")
    return torch._foreach_div(sums, total)
