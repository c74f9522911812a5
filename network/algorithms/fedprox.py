"""FedProx (Li et al. 2020): FedAvg plus a proximal term in every client's local loss.

Client: minimise f_i(w) + (μ/2)·‖w − w_global‖² over the trainable parameters,
with w_global the broadcast weights of this round (held fixed). The term is the
squared norm, as in the paper (its gradient is μ·(w − w_global)); it is added
by the shared loop's ``extra_loss`` hook, outside autocast, and is not part of
the reported training loss. Buffers (BatchNorm statistics) are not in it.

Server: exactly FedAvg's (sample-weighted mean, optional server optimizer).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from network.aggregation import Weights
from network.algorithms.base import ALGORITHMS, AlgorithmConfig, require, trainable
from network.algorithms.fedavg import FedAvg


@ALGORITHMS.register("fedprox")
class FedProx(FedAvg):
    """FedAvg whose clients stay near the global model by a proximal penalty of weight μ."""

    name = "fedprox"

    def __init__(self, config: AlgorithmConfig) -> None:
        super().__init__(config)
        require(config.mu >= 0, f"--mu must be >= 0, got {config.mu}")

    def extra_loss(self, broadcast: Weights, model: nn.Module) -> Callable[[nn.Module], Tensor]:
        params = trainable(model)
        names = list(params)
        anchors = [broadcast[name].detach() for name in names]
        weights = [params[name] for name in names]
        half_mu = self.config.mu / 2

        def proximal_term(_: nn.Module) -> Tensor:
            squared = torch._foreach_pow(torch._foreach_sub(weights, anchors), 2)
            return half_mu * sum(term.sum() for term in squared)

        return proximal_term
