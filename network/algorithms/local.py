"""Local training only: every client trains its own model and nothing is ever communicated.

The reference every personalised method must beat (a client that never federates).

Client: from its own model (the run's initial model in its first round), train for the
local budget exactly as FedAvg's client does; keep the whole model as its state. It
uploads nothing (an empty bundle), so no client learns anything from another.

Server: nothing to aggregate; the server model stays the initial model for the whole
run (evaluated as the "global" model, it shows what no training gives). A client's own
model is its last local model; a never-sampled client has none (skipped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from torch import nn

from network.algorithms.base import (ALGORITHMS, GLOBAL_MODEL, Algorithm, Bundle, ClientConfig, ClientResult,
                                     ServerState, Upload, Weights, copy_state, load_weights)
from network.algorithms.skeleton import Phase, run_phases


@dataclass(frozen=True)
class LocalSettings:
    """Local training has no settings of its own (the run's local budget, lr and momentum apply)."""


@ALGORITHMS.register("local")
class Local(Algorithm):
    """Each client trains only its own model; no communication, the server model never changes."""

    name = "local"
    use_when = "the bar every personalised method must clear"
    dp_refusal = "nothing leaves its clients: there is no upload to privatise"
    result_is_personal = True  # the server model never trains: each client's own model is the result
    Settings = LocalSettings
    personalized = True

    def private_keys(self) -> frozenset[str]:
        return frozenset(self.federation.layout.varying_keys)

    def client_update(self, model: nn.Module, broadcast: Bundle, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        load_weights(model, broadcast[GLOBAL_MODEL])  # the fixed entries, and the start of a first round
        load_weights(model, client_state)
        metrics = run_phases(model, [Phase()], loader, cfg)
        return ClientResult({}, copy_state(model, self.federation.layout.varying_keys), metrics, cfg.num_samples)

    def aggregate(self, server: ServerState, uploads: Iterable[Upload]) -> ServerState:
        for _ in uploads:  # the engine trains its clients while the uploads are read
            pass
        return server

    def personal_model(self, models: dict[str, Weights], client_state: Weights) -> Weights | None:
        return {**models[GLOBAL_MODEL], **client_state} if client_state else None
