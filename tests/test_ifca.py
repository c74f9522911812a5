"""IFCA (network/algorithms/ifca.py) on a two-cluster least-squares federation with two different optima."""

from __future__ import annotations

import pandas as pd
import torch

from network.algorithms import build_algorithm
from tests.oracles import DIM, least_squares_clients, linear_model, max_curvature, pooled_optimum, run_oracle

SHIFT = 4.0


def two_cluster_data():
    directions = [torch.full((DIM,), SHIFT, dtype=torch.float64)] * 4 + [torch.full((DIM,), -SHIFT, dtype=torch.float64)] * 4
    return least_squares_clients(sizes=(20, 30, 25, 15, 30, 20, 10, 35), shift=directions)


def test_recovers_the_clusters_and_reaches_each_clusters_optimum(tmp_path):
    data = two_cluster_data()
    _, engine = run_oracle(tmp_path, "ifca", rounds=800, steps=1, lr=1.0 / max_curvature(data), data=data,
                           n_cluster_models=2, init_noise=1.0)
    chosen = {client: int(state["id"]) for client, state in engine.store.snapshot().items()}
    first, second = {chosen[str(index)] for index in range(4)}, {chosen[str(index)] for index in range(4, 8)}
    assert len(first) == 1 and len(second) == 1 and first != second  # purity 1.0
    for members, cluster in ((range(4), first.pop()), (range(4, 8), second.pop())):
        optimum = pooled_optimum([data[index] for index in members])  # one full-batch step: GD on the cluster
        model = engine.server.models[f"cluster{cluster}"]["weight"].squeeze(0)
        assert torch.allclose(model, optimum, rtol=1e-6, atol=1e-6)
    metrics = pd.read_csv(tmp_path / "ifca" / "metrics.csv", dtype={"client": str})
    last = metrics.query("split == 'train' and metric == 'cluster' and round == 800 and client != 'mean'")
    assert {row.client: int(row.value) for row in last.itertuples()} == chosen  # per client, per round
    assert set(metrics.query("split == 'test'").client) >= {"global", "model:cluster0", "model:cluster1"}


def test_a_client_picks_the_model_with_the_lowest_loss_on_its_data():
    data = two_cluster_data()
    algorithm, model = build_algorithm("ifca", linear_model(), {"0": 20}, {"n_cluster_models": 3, "init_noise": 0.0})
    a, b = data[4]
    models = {f"cluster{j}": {"weight": torch.full((1, DIM), value, dtype=torch.float64)}
              for j, value in enumerate((SHIFT, -SHIFT, 0.0))}
    from tests.oracles import client_config

    result = algorithm.client_update(model, models, {}, [{"x": a, "y": b}], client_config(len(b)))
    assert int(result.client_state["id"]) == 1 and result.metrics["cluster"] == 1.0
    assert int(result.upload["cluster"]["id"]) == 1


def test_initial_cluster_models_differ_only_in_parameters_and_are_seeded():
    from tests.tiny_models import TinyNet

    torch.manual_seed(0)
    algorithm, model = build_algorithm("ifca", TinyNet(), {"0": 1}, {"n_cluster_models": 3}, seed=5)
    weights = {key: value.clone() for key, value in model.state_dict().items()}
    server, again = algorithm.init_server(weights), algorithm.init_server(weights)
    assert torch.equal(server.models["cluster0"]["body.0.weight"], weights["body.0.weight"])
    assert not torch.equal(server.models["cluster1"]["body.0.weight"], server.models["cluster2"]["body.0.weight"])
    assert torch.equal(server.models["cluster1"]["body.1.running_var"], weights["body.1.running_var"])
    assert torch.equal(server.models["cluster2"]["body.0.weight"], again.models["cluster2"]["body.0.weight"])
