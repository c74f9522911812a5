"""FedProx (Li et al. 2020): FedAvg plus a proximal term in every client's local loss.

Client: minimise f_i(w) + (μ/2)·‖w − w_global‖² over the trainable parameters,
with w_global the broadcast weights of this round (held fixed). The term is the
squared norm, as in the paper (its gradient is μ·(w − w_global)); it is added
by the shared loop's ``extra_loss`` hook, outside autocast, and is not part of
the reported training loss. Buffers (BatchNorm statistics) are not in it.

Server: FedAvg's (sample-weighted mean, optional server optimizer).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from network.aggregation import ServerOptSettings
from network.algorithms.base import ALGORITHMS, GLOBAL_MODEL, Bundle, ClientConfig, Weights
from network.algorithms.skeleton import DELTA, ModelAveraging, Phase, proximal_term
from network.settings import check, setting


@dataclass(frozen=True)
class FedProxSettings(ServerOptSettings):
    mu: float = setting(0.01, "proximal weight μ in (μ/2)·‖w − w_global‖²")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.mu >= 0, "mu", ">= 0", self.mu)


@ALGORITHMS.register("fedprox")
class FedProx(ModelAveraging):
    """Model averaging whose clients stay near the global model by a proximal penalty of weight μ."""

    name = "fedprox"
    use_when = "clients drift apart over many local steps"
    dp_groups = (DELTA,)  # client-level DP: the shared entries' Δ, clipped and noised as DP-FedAvg's
    vectorizable = True  # --vectorize_clients: the skeleton's phases run in lock-step
    Settings = FedProxSettings

    def phases(self, model: nn.Module, broadcast: Bundle, client_state: Weights, cfg: ClientConfig) -> list[Phase]:
        return [Phase(extra_loss=proximal_term(model, broadcast[GLOBAL_MODEL], self.settings.mu))]
