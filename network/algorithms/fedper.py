"""FedPer (Arivazhagan et al. 2019): base layers averaged, personalization layers kept on each client.

Client: load the global model, then its own head (its client state after its first
round); train every parameter together for the local budget (unlike FedRep, no
alternating phases); upload Δ of the body; keep the head.

Server: FedAvg's sample-weighted mean (and server optimizer) over the body only.

The personalization layers are the model's ``head_keys()`` (the TaskModel's output
layer). A never-sampled client has no personal model (left out, counted as skipped).
"""

from __future__ import annotations

from network.algorithms.base import ALGORITHMS, Federation
from network.algorithms.fedrep import require_head
from network.algorithms.skeleton import DELTA, ModelAveraging
from network.aggregation import ServerOptSettings


@ALGORITHMS.register("fedper")
class FedPer(ModelAveraging):
    """Joint local training; the head stays private, the body is averaged."""

    name = "fedper"
    use_when = "a cheaper FedRep"
    dp_groups = (DELTA,)  # client-level DP: the shared entries' Δ, clipped and noised as DP-FedAvg's
    result_is_personal = True  # the global head is never updated: its clients' own models are the result
    vectorizable = True  # --vectorize_clients: the skeleton's phases run in lock-step
    Settings = ServerOptSettings

    def __init__(self, settings: ServerOptSettings, federation: Federation) -> None:
        super().__init__(settings, federation)
        self._head = require_head(federation, self.name)

    def private_keys(self) -> frozenset[str]:
        return self._head
