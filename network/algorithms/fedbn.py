"""FedBN (Li et al. 2021, "FedBN: Federated Learning on Non-IID Features via Local Batch Normalization").

Every BatchNorm layer stays local: its affine parameters (γ, β) and its running
statistics (mean, variance, batch counter). BatchNorm layers are selected by module
type (``nn.modules.batchnorm._BatchNorm``: BatchNorm1d/2d/3d, SyncBatchNorm,
LazyBatchNorm1d/2d/3d), never by name, so torchvision's ``downsample.1`` is found too
(``ModelLayout.batchnorm_keys``). Other normalisation layers are shared like any layer:
InstanceNorm (even with ``affine=True`` and ``track_running_stats=True``, a ``_NormBase``
like BatchNorm), GroupNorm, LayerNorm.

Client: load the global model, then its own BatchNorm entries (after its first
round); train everything; upload Δ of every other entry; keep its BatchNorm entries.
Server: FedAvg's sample-weighted mean (and server optimizer) over the non-BatchNorm
entries; the global model's BatchNorm entries keep their initial values and are never
used for a client that has its own.

A model without BatchNorm makes FedBN exactly FedAvg (there is nothing private).
"""

from __future__ import annotations

from network.aggregation import ServerOptSettings
from network.algorithms.base import ALGORITHMS
from network.algorithms.skeleton import DELTA, ModelAveraging


@ALGORITHMS.register("fedbn")
class FedBN(ModelAveraging):
    """Model averaging with local BatchNorm."""

    name = "fedbn"
    use_when = "feature shift (domains, cameras)"
    dp_groups = (DELTA,)  # client-level DP: the shared entries' Δ, clipped and noised as DP-FedAvg's
    vectorizable = True  # --vectorize_clients: the skeleton's phases run in lock-step
    Settings = ServerOptSettings

    def private_keys(self) -> frozenset[str]:
        return self.federation.layout.batchnorm_keys
