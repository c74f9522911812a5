"""CFL (Sattler, Müller, Samek, "Clustered Federated Learning: Model-Agnostic Distributed Multitask
Optimization Under Privacy Constraints", IEEE TNNLS 2020).

Clusters start as one (every client); each cluster has its own model.

Client: train its cluster's model (sent to it alone, ``Algorithm.client_broadcast``) for the local
budget as FedAvg's client does; upload Δθ_i and its cluster id.

Server, each round, for each cluster c:
1. Aggregate: θ_c ← θ_c + mean of its members' Δθ_i (weights by ``weighting``).
2. Split when, after aggregating, ‖mean_i Δθ_i‖ < ``eps1`` (the cluster is near a stationary
   point of its joint objective) and max_i ‖Δθ_i‖ > ``eps2`` (some members still pull away), at
   round ≥ ``start_round``, with ≥ ``min_size`` members, all of which took part this round (the
   bipartition needs every member's update). The bipartition is complete-linkage clustering
   (scipy) on the cosine distance 1 − cos(Δθ_i, Δθ_j) of the members' parameter updates, cut into
   two; both halves start from θ_c. Splitting is recursive (a half may split again later).

Clients are named by id throughout: membership is a table over the federation's client ids
(the server model ``membership``: entry ``clusters``, one cluster id per client in the
federation's order), never by positions inside a sub-cluster (one public implementation
confuses the two after the first split).

Cluster ids are heap numbers: the first cluster is 0 and cluster c splits into 2c + 1 (the
half holding its first client, in federation order) and 2c + 2, so the id encodes the tree
(parent (c − 1) // 2, depth ⌊log2(c + 1)⌋). The tree goes into metrics.csv as client metric ``cluster`` (split ``train``): one
row per round and sampled client, the cluster it trained in. A client's own model is its
current cluster's; the first evaluated model is the largest cluster's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch
from torch import nn

from network.aggregation import (Weights, WeightedMean, WeightingSettings, apply_update, federation_shares,
                                 upload_weight)
from network.algorithms.base import (ALGORITHMS, Algorithm, Bundle, ClientConfig, ClientResult, Federation,
                                     ServerState, Upload, load_weights)
from network.algorithms.skeleton import DELTA, Phase, run_phases
from network.settings import check, setting
from utils.errors import TaskHetError

MODEL = "model"  # broadcast group: the client's cluster model
CLUSTER = "cluster"  # broadcast/upload group and client state {"id", "index"}; client metric ``cluster``
MEMBERSHIP = "membership"  # server model {"clusters": [N] cluster id per client}, read by personal_model
ROUNDS = "rounds"  # server tensor: rounds aggregated so far (for start_round)
ROOT = 0


def cluster_name(cluster: int) -> str:
    return f"cluster{cluster}"


@dataclass(frozen=True)
class CFLSettings(WeightingSettings):
    eps1: float = setting(0.4, "ε1: split only when the norm of the cluster's mean update is below it")
    eps2: float = setting(1.6, "ε2: split only when some member's update norm is above it")
    start_round: int = setting(20, "first round at which a cluster may split")
    min_size: int = setting(3, "smallest cluster that may split")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.eps1 > 0, "eps1", "> 0", self.eps1)
        check(self.eps1 < self.eps2, "eps1", f"< eps2 ({self.eps2!r})", self.eps1)
        check(self.start_round >= 0, "start_round", ">= 0", self.start_round)
        check(self.min_size >= 2, "min_size", ">= 2", self.min_size)


@ALGORITHMS.register("cfl")
class CFL(Algorithm):
    """Clusters that split recursively when their members' updates disagree (cosine bipartition)."""

    name = "cfl"
    use_when = "an unknown number of client groups, found by splitting"
    dp_refusal = "the server splits clusters by the clients' unclipped update similarities, which no noise covers"
    Settings = CFLSettings
    personalized = True

    def __init__(self, settings: CFLSettings, federation: Federation) -> None:
        super().__init__(settings, federation)
        self.order = list(federation.client_sizes)
        self.shares = federation_shares(settings, federation.client_sizes, federation.seed)

    @functools.cached_property
    def _params(self) -> tuple[str, ...]:
        layout = self.federation.layout
        return tuple(key for key in layout.varying_keys if key in layout.param_keys)

    def init_server(self, weights: Weights) -> ServerState:
        membership = {"clusters": torch.full((len(self.order),), ROOT, dtype=torch.int64)}
        return ServerState({cluster_name(ROOT): weights, MEMBERSHIP: membership},
                           {ROUNDS: torch.zeros((), dtype=torch.int64)})

    def broadcast(self, server: ServerState) -> Bundle:
        return {}  # each client gets its own cluster's model: client_broadcast

    def client_broadcast(self, server: ServerState, broadcast: Bundle, client_id: str) -> Bundle:
        index = self.order.index(client_id)
        cluster = int(server.models[MEMBERSHIP]["clusters"][index])
        return {MODEL: server.models[cluster_name(cluster)],
                CLUSTER: {"id": torch.tensor(cluster), "index": torch.tensor(index)}}

    def client_update(self, model: nn.Module, broadcast: Bundle, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        start = broadcast[MODEL]
        load_weights(model, start)
        metrics = run_phases(model, [Phase()], loader, cfg)
        metrics[CLUSTER] = float(broadcast[CLUSTER]["id"])
        state = model.state_dict()
        upload = {DELTA: {key: state[key].detach() - start[key] for key in self.federation.layout.varying_keys},
                  CLUSTER: {"id": broadcast[CLUSTER]["id"].clone()}}
        return ClientResult(upload, {key: value.clone() for key, value in broadcast[CLUSTER].items()}, metrics,
                            cfg.num_samples)

    def aggregate(self, server: ServerState, uploads: Iterable[Upload]) -> ServerState:
        rounds = int(server.tensors[ROUNDS]) + 1
        means: dict[int, WeightedMean] = {}
        updates: dict[int, dict[str, tuple[torch.Tensor, float]]] = {}  # cluster -> client -> (flat Δθ, weight)
        for upload in uploads:
            cluster = int(upload.tensors[CLUSTER]["id"])
            weight = upload_weight(self.settings.weighting, self.shares, upload.client_id, upload.num_samples)
            means.setdefault(cluster, WeightedMean()).add(upload.tensors[DELTA], weight)
            flat = torch.cat([upload.tensors[DELTA][key].double().flatten() for key in self._params])
            updates.setdefault(cluster, {})[upload.client_id] = (flat, weight)
        models = dict(server.models)
        for cluster, mean in means.items():
            if cluster_name(cluster) not in models:
                raise TaskHetError(f"cfl: an upload names cluster {cluster}, which the server does not have")
            models[cluster_name(cluster)] = apply_update(models[cluster_name(cluster)], mean.mean())
        clusters = server.models[MEMBERSHIP]["clusters"].clone()
        for cluster, members in updates.items():
            halves = self._split(cluster, members, clusters, rounds)
            if halves is None:
                continue
            parent = models.pop(cluster_name(cluster))
            for child, ids in zip((2 * cluster + 1, 2 * cluster + 2), halves):
                models[cluster_name(child)] = dict(parent)
                for client_id in ids:
                    clusters[self.order.index(client_id)] = child
        models[MEMBERSHIP] = {"clusters": clusters}
        return ServerState(models, {**server.tensors, ROUNDS: torch.tensor(rounds, dtype=torch.int64)})

    def evaluated_models(self, server: ServerState) -> dict[str, Weights]:
        clusters = server.models[MEMBERSHIP]["clusters"].tolist()
        names = [name for name in server.models if name != MEMBERSHIP]
        order = sorted(names, key=lambda name: (-clusters.count(int(name[len("cluster"):])), name))
        return {name: server.models[name] for name in order}

    def personal_model(self, models: dict[str, Weights], client_state: Weights) -> Weights | None:
        if not client_state:
            return None
        return models[cluster_name(int(models[MEMBERSHIP]["clusters"][int(client_state["index"])]))]

    def _split(self, cluster: int, members: dict[str, tuple[torch.Tensor, float]], clusters: torch.Tensor,
               rounds: int) -> tuple[list[str], list[str]] | None:
        """The two halves of ``cluster`` (client ids, federation order) if it splits this round, else None."""
        settings = self.settings
        everyone = [client_id for index, client_id in enumerate(self.order) if int(clusters[index]) == cluster]
        if rounds < settings.start_round or len(everyone) < settings.min_size or set(members) != set(everyone):
            return None
        vectors = torch.stack([members[client_id][0] for client_id in everyone])
        weights = torch.tensor([members[client_id][1] for client_id in everyone], dtype=torch.float64)
        mean_norm = float((weights @ vectors / weights.sum()).norm())
        max_norm = float(vectors.norm(dim=1).max())
        if not (mean_norm < settings.eps1 and max_norm > settings.eps2):
            return None
        labels = bipartition(vectors)
        first = [client_id for client_id, label in zip(everyone, labels) if label == labels[0]]
        return first, [client_id for client_id in everyone if client_id not in first]


def bipartition(vectors: torch.Tensor) -> list[int]:
    """Two groups of the rows by complete-linkage clustering on the cosine distance 1 − cos (scipy)."""
    from scipy.cluster.hierarchy import fcluster, linkage  # here: scipy takes a second to import; only a split needs it
    from scipy.spatial.distance import squareform

    unit = vectors / vectors.norm(dim=1, keepdim=True).clamp(min=1e-300)
    distance = (1 - unit @ unit.T).clamp(min=0).numpy()
    np.fill_diagonal(distance, 0.0)
    tree = linkage(squareform(distance, checks=False), method="complete")
    return fcluster(tree, t=2, criterion="maxclust").tolist()
