"""IFCA (Ghosh et al. 2020, "An Efficient Framework for Clustered Federated Learning"), model averaging variant.

The server holds k cluster models θ_1 … θ_k.

Client, each round: evaluate every θ_j on its training rows (the mean per-sample
loss over one pass, in eval mode), pick ĵ = argmin_j F_i(θ_j) (ties: the lowest j),
train θ_ĵ for the local budget as FedAvg does, and upload Δ with the cluster id ĵ.
The choice is written to metrics.csv (metric ``cluster``, one row per sampled client
and round) and kept as the client's state.

Server: for each cluster, the sample-weighted mean of the Δs of the clients that
chose it, applied as θ_j + Δ̄_j (option II of the paper: model averaging); a cluster
nobody chose this round keeps its weights.

Initial models: θ_1 is the run's initial model and θ_j (j > 1) that model plus
Gaussian noise of standard deviation ``init_noise`` on every parameter (buffers are copied),
seeded by the run's seed and j (identical copies would never separate: every client
would pick θ_1 forever).

Evaluation: each cluster model on the global test split (the most-populated cluster
of the last round first: it is the run's "global" model); a client's own model is
the cluster model it chose last (a never-sampled client has none: skipped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from network.aggregation import Weights, WeightedMean, apply_update
from network.algorithms.base import (ALGORITHMS, Algorithm, Bundle, ClientConfig, ClientResult, ServerState, Upload,
                                     load_weights, require)
from network.algorithms.skeleton import DELTA, Phase, run_phases, run_phases_lockstep, training_loss
from network.settings import check, setting
from utils.seeding import torch_generator

CLUSTER = "cluster"  # upload group {"id": ĵ}; client state {"id": ĵ}; client metric ``cluster``
CLUSTER_SAMPLES = "cluster_samples"  # server tensor [k]: training samples per cluster in the last round


MAX_CLUSTER_MODELS = 64  # n_cluster_models: each is a whole model, evaluated by every client every round


@dataclass(frozen=True)
class IFCASettings:
    n_cluster_models: int = setting(2, "k, the number of cluster models", high=MAX_CLUSTER_MODELS)
    init_noise: float = setting(0.01, "standard deviation of the noise that makes cluster models 2..k differ at start")

    def __post_init__(self) -> None:
        check(self.n_cluster_models >= 1, "n_cluster_models", ">= 1", self.n_cluster_models)
        check(self.init_noise >= 0, "init_noise", ">= 0", self.init_noise)


def cluster_name(index: int) -> str:
    return f"cluster{index}"


@ALGORITHMS.register("ifca")
class IFCA(Algorithm):
    """k cluster models; each client trains the one that fits its data best."""

    name = "ifca"
    use_when = "a known number of client groups"
    dp_refusal = "the server's per-cluster means divide by counts that depend on the clients' data (their chosen cluster), not by a fixed m"
    Settings = IFCASettings
    personalized = True
    vectorizable = True  # --vectorize_clients: each client's chosen model trains in lock-step (client_updates)

    @classmethod
    def check_num_clients(cls, settings: IFCASettings, num_clients: int) -> None:
        # More cluster models than clients leaves some never chosen, and a huge k would allocate k models first.
        require(settings.n_cluster_models <= num_clients, f"ifca setting n_cluster_models must be <= the number of "
                f"clients ({num_clients}), got {settings.n_cluster_models}")

    def init_server(self, weights: Weights) -> ServerState:
        models = {cluster_name(0): weights}
        layout = self.federation.layout
        params = layout.param_keys - layout.fixed_keys  # a frozen encoder is the same in every cluster model
        for index in range(1, self.settings.n_cluster_models):
            generator = torch_generator(self.federation.seed, "ifca-init", index)
            models[cluster_name(index)] = {key: _perturbed(value, self.settings.init_noise if key in params else 0.0,
                                                           generator) for key, value in weights.items()}
        return ServerState(models, {CLUSTER_SAMPLES: torch.zeros(self.settings.n_cluster_models)})

    def broadcast(self, server: ServerState) -> Bundle:
        return dict(server.models)

    def client_update(self, model: nn.Module, broadcast: Bundle, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        losses = [self._train_loss(model, broadcast[cluster_name(index)], loader, cfg)
                  for index in range(self.settings.n_cluster_models)]
        chosen = min(range(len(losses)), key=lambda index: (losses[index], index))
        start = broadcast[cluster_name(chosen)]
        load_weights(model, start)
        metrics = run_phases(model, [Phase()], loader, cfg)
        metrics[CLUSTER] = float(chosen)
        identity = {"id": torch.tensor(chosen)}
        state = model.state_dict()
        upload = {DELTA: {key: state[key].detach() - start[key] for key in self.federation.layout.varying_keys},
                  CLUSTER: identity}
        return ClientResult(upload, dict(identity), metrics, cfg.num_samples)

    def client_updates(self, model: nn.Module, broadcast: Bundle, client_states: list[Weights],
                       loaders: list[Iterable[dict]], cfgs: list[ClientConfig]) -> list[ClientResult]:
        """``client_update`` of a chunk: each client chooses its cluster alone, then all train in lock-step."""
        chosen = [self._choose(model, broadcast, loader, cfg) for loader, cfg in zip(loaders, cfgs)]
        starts = [broadcast[cluster_name(index)] for index in chosen]
        load_weights(model, starts[0])  # the entries that are not stacked are the same in every cluster model
        varying = self.federation.layout.varying_keys
        finals, metrics = run_phases_lockstep(model, starts, [Phase()], loaders, cfgs[0], varying)
        results = []
        for index, start, final, client_metrics, cfg in zip(chosen, starts, finals, metrics, cfgs):
            client_metrics[CLUSTER] = float(index)
            identity = {"id": torch.tensor(index)}
            upload = {DELTA: {key: final[key].detach() - start[key] for key in varying}, CLUSTER: identity}
            results.append(ClientResult(upload, dict(identity), client_metrics, cfg.num_samples))
        return results

    def _choose(self, model: nn.Module, broadcast: Bundle, loader: Iterable[dict], cfg: ClientConfig) -> int:
        losses = [self._train_loss(model, broadcast[cluster_name(index)], loader, cfg)
                  for index in range(self.settings.n_cluster_models)]
        return min(range(len(losses)), key=lambda index: (losses[index], index))

    def aggregate(self, server: ServerState, uploads: Iterable[Upload]) -> ServerState:
        means = [WeightedMean() for _ in range(self.settings.n_cluster_models)]
        for upload in uploads:
            means[int(upload.tensors[CLUSTER]["id"])].add(upload.tensors[DELTA], upload.num_samples)
        models = {name: apply_update(weights, mean.mean()) if mean.count else weights
                  for (name, weights), mean in zip(server.models.items(), means)}
        samples = torch.tensor([mean.total_weight for mean in means])
        return ServerState(models, {CLUSTER_SAMPLES: samples})

    def evaluated_models(self, server: ServerState) -> dict[str, Weights]:
        samples = server.tensors[CLUSTER_SAMPLES].tolist()
        order = sorted(range(self.settings.n_cluster_models), key=lambda index: (-samples[index], index))
        return {cluster_name(index): server.models[cluster_name(index)] for index in order}

    def personal_model(self, models: dict[str, Weights], client_state: Weights) -> Weights | None:
        return models[cluster_name(int(client_state["id"]))] if client_state else None

    def _train_loss(self, model: nn.Module, weights: Weights, loader: Iterable[dict], cfg: ClientConfig) -> float:
        """F_i(θ): the mean per-sample loss over one pass of the client's training batches."""
        load_weights(model, weights)
        return training_loss(model, loader, cfg)


def _perturbed(value: torch.Tensor, std: float, generator: torch.Generator) -> torch.Tensor:
    if not value.is_floating_point() or std == 0:
        return value.clone()
    noise = torch.randn(value.shape, generator=generator, dtype=torch.float64) * std
    return value + noise.to(value.dtype).to(value.device)
