"""FedAvg (McMahan et al. 2017), with an optional server optimizer (FedAvgM, FedAdam).

Client: load the global weights, run the shared local loop (J steps or E epochs of
SGD), upload the change Δ = y − x of every state-dict entry (parameters and
buffers such as BatchNorm statistics).

Server: the mean of the uploads weighted by each client's number of training
samples (so one full-batch step with full participation is exactly centralized
gradient descent on the pooled data), applied as a pseudo-gradient step:
``sgd`` x + η_g·Δ̄ (η_g = 1 is plain FedAvg), ``momentum`` FedAvgM (Hsu et al. 2019),
``adam`` FedAdam (Reddi et al. 2021); see :func:`network.aggregation.server_step`.
"""

from __future__ import annotations

from typing import Callable, Iterable

from torch import Tensor, nn

from network.aggregation import SERVER_OPTIMIZERS, Weights, init_server_optimizer, server_step, subtract, weighted_average
from network.algorithms.base import (ALGORITHMS, LOCAL_STEPS, TRAIN_LOSS, Algorithm, AlgorithmConfig, ClientConfig,
                                     ClientResult, Upload, load_weights, make_optimizer, require, trainable)
from network.local_train import local_train


@ALGORITHMS.register("fedavg")
class FedAvg(Algorithm):
    """Sample-weighted model averaging with a pluggable server optimizer."""

    name = "fedavg"

    def __init__(self, config: AlgorithmConfig) -> None:
        super().__init__(config)
        require(config.server_opt in SERVER_OPTIMIZERS,
                f"--server_opt must be one of {', '.join(SERVER_OPTIMIZERS)}, got {config.server_opt!r}")
        require(config.server_lr > 0, f"--server_lr must be > 0, got {config.server_lr}")

    def init_server_state(self, global_weights: Weights) -> Weights:
        return init_server_optimizer(self.config.server_opt, global_weights)

    def extra_loss(self, broadcast: Weights, model: nn.Module) -> Callable[[nn.Module], Tensor] | None:
        """An extra local loss term (none for FedAvg; FedProx's proximal term)."""
        return None

    def client_update(self, model: nn.Module, broadcast: Weights, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        load_weights(model, broadcast)
        optimizer = make_optimizer(trainable(model).values(), cfg)
        result = local_train(model, loader, cfg.loss_fn, optimizer, cfg.device, **cfg.budget(),
                             extra_loss=self.extra_loss(broadcast, model))
        upload = subtract(model.state_dict(), broadcast, broadcast.keys())
        return ClientResult(upload, client_state, {TRAIN_LOSS: result.mean_loss, LOCAL_STEPS: result.steps},
                            cfg.num_samples)

    def aggregate(self, global_weights: Weights, server_state: Weights,
                  uploads: Iterable[Upload]) -> tuple[Weights, Weights]:
        mean_delta, _ = weighted_average(uploads)
        return server_step(global_weights, mean_delta, server_state, self.config.server_opt,
                           self.config.server_lr, momentum=self.config.server_momentum)
