"""FedAvg (McMahan et al. 2017), with an optional server optimizer (FedAvgM, FedAdam).

Client: load the global weights, run the shared local loop (J steps or E epochs of
SGD), upload the change Δ = y − x of every state-dict entry (parameters and
buffers such as BatchNorm statistics).

Server: the mean of the uploads weighted by each client's number of training
samples (so one full-batch step with full participation is exactly centralized
gradient descent on the pooled data). Parameters take a pseudo-gradient step:
``sgd`` x + η_g·Δ̄ (η_g = 1 is plain FedAvg), ``momentum`` FedAvgM (Hsu et al. 2019),
``adam`` FedAdam (Reddi et al. 2021); buffers take the plain mean x + Δ̄. See
:func:`network.aggregation.server_step`; the settings are
:class:`network.aggregation.ServerOptSettings`.
"""

from __future__ import annotations

from network.algorithms.base import ALGORITHMS
from network.algorithms.skeleton import DELTA, ModelAveraging


@ALGORITHMS.register("fedavg")
class FedAvg(ModelAveraging):
    """Sample-weighted model averaging with a pluggable server optimizer (the skeleton's defaults)."""

    name = "fedavg"
    use_when = "the baseline every study needs"
    dp_groups = (DELTA,)  # client-level DP: the shared entries' Δ, clipped and noised as DP-FedAvg's
    vectorizable = True  # --vectorize_clients: the skeleton's phases run in lock-step
