"""IFCA (network/algorithms/ifca.py) on a two-cluster least-squares federation with two different optima."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from network.algorithms import build_algorithm
from network.algorithms.base import ServerState, Upload
from network.algorithms.skeleton import DELTA
from utils.errors import TaskHetError
from tests.oracles import DIM, least_squares_clients, linear_model, max_curvature, pooled_optimum, run_oracle

SHIFT = 4.0
THREE_CLIENTS = {"0": 1, "1": 1, "2": 1}  # IFCA refuses more cluster models than clients


def two_cluster_data():
    directions = [torch.full((DIM,), SHIFT, dtype=torch.float64)] * 4 + [torch.full((DIM,), -SHIFT, dtype=torch.float64)] * 4
    return least_squares_clients(sizes=(20, 30, 25, 15, 30, 20, 10, 35), shift=directions)


@pytest.mark.slow
def test_recovers_the_clusters_and_reaches_each_clusters_optimum(tmp_path):
    data = two_cluster_data()
    # Each cluster model's error shrinks 9.5-fold per 100 rounds: 5x the rtol/atol of 1e-6 is left after 500
    # rounds, 1/17 of it after 700.
    rounds = 700
    _, engine = run_oracle(tmp_path, "ifca", rounds=rounds, steps=1, lr=1.0 / max_curvature(data), data=data,
                           n_cluster_models=2, init_noise=1.0)
    chosen = {client: int(state["id"]) for client, state in engine.store.snapshot().items()}
    first, second = {chosen[str(index)] for index in range(4)}, {chosen[str(index)] for index in range(4, 8)}
    assert len(first) == 1 and len(second) == 1 and first != second  # purity 1.0
    for members, cluster in ((range(4), first.pop()), (range(4, 8), second.pop())):
        optimum = pooled_optimum([data[index] for index in members])  # one full-batch step: GD on the cluster
        model = engine.server.models[f"cluster{cluster}"]["weight"].squeeze(0)
        assert torch.allclose(model, optimum, rtol=1e-6, atol=1e-6)
    metrics = pd.read_csv(tmp_path / "ifca" / "metrics.csv", dtype={"client": str})
    last = metrics.query("split == 'train' and metric == 'cluster' and round == @rounds and client != 'mean'")
    assert {row.client: int(row.value) for row in last.itertuples()} == chosen  # per client, per round
    assert set(metrics.query("split == 'test'").client) >= {"global", "model:cluster0", "model:cluster1"}


def test_a_client_picks_the_model_with_the_lowest_loss_on_its_data():
    data = two_cluster_data()
    algorithm, model = build_algorithm("ifca", linear_model(), {"0": 20, "1": 20, "2": 20},
                                       {"n_cluster_models": 3, "init_noise": 0.0})
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
    algorithm, model = build_algorithm("ifca", TinyNet(), THREE_CLIENTS, {"n_cluster_models": 3}, seed=5)
    weights = {key: value.clone() for key, value in model.state_dict().items()}
    server, again = algorithm.init_server(weights), algorithm.init_server(weights)
    assert torch.equal(server.models["cluster0"]["body.0.weight"], weights["body.0.weight"])
    assert not torch.equal(server.models["cluster1"]["body.0.weight"], server.models["cluster2"]["body.0.weight"])
    assert torch.equal(server.models["cluster1"]["body.1.running_var"], weights["body.1.running_var"])
    assert torch.equal(server.models["cluster2"]["body.0.weight"], again.models["cluster2"]["body.0.weight"])


def test_initial_cluster_models_are_the_model_plus_noise_of_std_init_noise_and_depend_on_the_seed():
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64))  # 4,160 parameter entries, BatchNorm buffers
    weights = {key: value.clone() for key, value in model.state_dict().items()}
    for std in (0.5, 1.0):
        algorithm, _ = build_algorithm("ifca", model, THREE_CLIENTS, {"n_cluster_models": 3, "init_noise": std}, seed=5)
        server = algorithm.init_server(weights)
        for j in (1, 2):
            cluster = server.models[f"cluster{j}"]
            assert all(cluster[key].dtype == value.dtype for key, value in weights.items())
            noise = torch.cat([(cluster[key] - weights[key]).flatten() for key in ("0.weight", "0.bias", "1.weight",
                                                                                   "1.bias")]).double()
            assert abs(noise.std().item() - std) < 0.05 * std and abs(noise.mean().item()) < 0.05 * std
            for key in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
                assert torch.equal(cluster[key], weights[key])  # buffers are copied
        other_seed, _ = build_algorithm("ifca", model, THREE_CLIENTS, {"n_cluster_models": 3, "init_noise": std}, seed=6)
        assert not torch.equal(other_seed.init_server(weights).models["cluster1"]["0.weight"],
                               server.models["cluster1"]["0.weight"])


def half_squared_error(model: nn.Module, batch: dict, reduction: str = "mean") -> torch.Tensor:
    """The least-squares loss through torch's own ``reduction`` argument (it refuses anything but none/mean/sum)."""
    return 0.5 * F.mse_loss(model(batch["x"]).squeeze(-1), batch["y"], reduction=reduction)


def test_cluster_choice_uses_the_mean_per_sample_loss_over_all_batches():
    # θ0 = 0 fits the 9-row batch B exactly (loss 0.5 per row under θ1); θ1 = e_1 fits the 1-row batch A
    # (loss 2 under θ0). Per sample over all 10 rows: F(θ0) = 2/10 < F(θ1) = 4.5/10, so cluster 0. The mean of
    # the batch means (1 vs 0.25) or the last batch alone (2 vs 0) would pick cluster 1.
    generator = torch.Generator().manual_seed(0)
    x_b = torch.randn(9, DIM, generator=generator, dtype=torch.float64)
    x_b[:, 0] = torch.tensor([1.0, -1.0] * 4 + [1.0], dtype=torch.float64)
    x_a = torch.randn(1, DIM, generator=generator, dtype=torch.float64)
    x_a[:, 0] = 2.0
    loader = [{"x": x_b, "y": torch.zeros(9, dtype=torch.float64)}, {"x": x_a, "y": torch.full((1,), 2.0, dtype=torch.float64)}]
    algorithm, model = build_algorithm("ifca", linear_model(), {"0": 10, "1": 10}, {"n_cluster_models": 2})
    e1 = torch.zeros(1, DIM, dtype=torch.float64)
    e1[0, 0] = 1.0
    models = {"cluster0": {"weight": torch.zeros(1, DIM, dtype=torch.float64)}, "cluster1": {"weight": e1}}
    from tests.oracles import client_config

    result = algorithm.client_update(model, models, {}, loader, client_config(10, steps=1, loss_fn=half_squared_error))
    assert int(result.client_state["id"]) == 0


def test_server_averages_per_cluster_and_evaluates_the_most_populated_cluster_first():
    algorithm, _ = build_algorithm("ifca", linear_model(), {"0": 10, "1": 10, "2": 30}, {"n_cluster_models": 3})
    start = {f"cluster{j}": {"weight": torch.full((1, DIM), float(j), dtype=torch.float64)} for j in range(3)}
    server = ServerState(start, {"cluster_samples": torch.zeros(3)})

    def upload(cluster: int, delta: float, n: int) -> Upload:
        return Upload("c", {DELTA: {"weight": torch.full((1, DIM), delta, dtype=torch.float64)},
                            "cluster": {"id": torch.tensor(cluster)}}, n)

    new = algorithm.aggregate(server, [upload(2, 1.0, 10), upload(0, 4.0, 10), upload(2, 2.0, 30)])
    assert torch.equal(new.models["cluster2"]["weight"], start["cluster2"]["weight"] + (10 * 1.0 + 30 * 2.0) / 40)
    assert torch.equal(new.models["cluster0"]["weight"], start["cluster0"]["weight"] + 4.0)
    assert torch.equal(new.models["cluster1"]["weight"], start["cluster1"]["weight"])  # nobody chose it
    assert list(algorithm.evaluated_models(new)) == ["cluster2", "cluster0", "cluster1"]  # by samples: 40, 10, 0
    tied = algorithm.aggregate(server, [upload(2, 1.0, 10), upload(1, 1.0, 10)])
    assert list(algorithm.evaluated_models(tied)) == ["cluster1", "cluster2", "cluster0"]  # ties: the lowest index
    assert algorithm.personal_model(new.models, {"id": torch.tensor(2)}) is new.models["cluster2"]
    assert algorithm.personal_model(new.models, {}) is None  # never sampled: no own model


def test_more_cluster_models_than_clients_is_refused_before_any_model_is_allocated(monkeypatch):
    from network.algorithms import ifca

    def never(*args, **kwargs):
        raise AssertionError("a cluster model was allocated")

    monkeypatch.setattr(ifca, "_perturbed", never)
    with pytest.raises(TaskHetError, match=r"ifca setting n_cluster_models must be <= the number of clients \(3\), got 4"):
        build_algorithm("ifca", linear_model(), THREE_CLIENTS, {"n_cluster_models": 4})
    # past the setting's own bound the range check speaks first, still before any allocation
    with pytest.raises(TaskHetError, match=r"ifca setting n_cluster_models must be at most 64 in magnitude, got 100000000"):
        build_algorithm("ifca", linear_model(), THREE_CLIENTS, {"n_cluster_models": 100_000_000})
    algorithm, _ = build_algorithm("ifca", linear_model(), THREE_CLIENTS, {"n_cluster_models": 3})  # k = clients is fine
    assert algorithm.settings.n_cluster_models == 3


class NormDropLinear(nn.Module):
    """x → BatchNorm (no affine) → dropout → w·x: its eval and train modes give very different losses."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(1, affine=False, dtype=torch.float64)
        self.drop = nn.Dropout(dropout)
        self.linear = nn.Linear(1, 1, bias=False, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.drop(self.norm(x)))


def cluster(running_mean: float, weight: float) -> dict:
    return {"norm.running_mean": torch.tensor([running_mean], dtype=torch.float64),
            "norm.running_var": torch.ones(1, dtype=torch.float64), "norm.num_batches_tracked": torch.tensor(0),
            "linear.weight": torch.tensor([[weight]], dtype=torch.float64)}


@pytest.mark.parametrize("dropout, models, eval_choice", [
    # BatchNorm: the clusters differ only in their running mean. In eval mode cluster 1 (mean 0, the data's)
    # predicts y = x almost exactly and cluster 0 (mean 3) is off by 3 everywhere; in train mode the batch
    # statistics replace both running means, the losses tie and the lower index, 0, would win.
    (0.0, {"cluster0": cluster(3.0, 1.0), "cluster1": cluster(0.0, 1.0)}, 1),
    # Dropout: cluster 0 (w = 1) fits y = x in eval mode; cluster 1 (w = 0) predicts 0 in both modes (loss
    # E[x²]/2). In train mode p = 0.9 dropout makes cluster 0's expected loss 9·E[x²]/2, so cluster 1 would win.
    (0.9, {"cluster0": cluster(0.0, 1.0), "cluster1": cluster(0.0, 0.0)}, 0),
])
def test_the_cluster_is_chosen_with_the_model_in_eval_mode(dropout, models, eval_choice):
    torch.manual_seed(0)
    x = torch.randn(400, 1, dtype=torch.float64)
    x = (x - x.mean()) / x.std(correction=0)  # mean 0, variance 1: the running statistics of cluster 1 fit exactly
    loader = [{"x": x[:250], "y": x[:250, 0]}, {"x": x[250:], "y": x[250:, 0]}]
    algorithm, model = build_algorithm("ifca", NormDropLinear(dropout), {"0": 400, "1": 400}, {"n_cluster_models": 2})
    model.train()  # the engine hands over a model left in training mode
    from tests.oracles import client_config

    result = algorithm.client_update(model, models, {}, loader,
                                     client_config(400, steps=1, loss_fn=half_squared_error))
    assert int(result.client_state["id"]) == eval_choice
