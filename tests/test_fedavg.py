"""FedAvg and its server optimizers (network/algorithms/fedavg.py, network/aggregation.py) against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from network.algorithms import build_algorithm
from network.algorithms.base import ServerState, Upload
from network.algorithms.skeleton import DELTA
from tests.oracles import (DIM, client_config, gradient, least_squares_clients, linear_model, max_curvature,
                           pooled_optimum, relative_error, run_oracle)
from tests.tiny_models import TinyNet, client_samples, loss_fn


def upload(delta: dict, n: int, client_id: str = "c") -> Upload:
    return Upload(client_id, {DELTA: delta}, n)


def linear_fedavg(**settings):
    algorithm, _ = build_algorithm("fedavg", linear_model(), {"a": 1, "b": 3}, settings)
    return algorithm


def test_mean_is_weighted_by_client_samples_and_scaled_by_the_server_lr():
    algorithm = linear_fedavg(server_lr=0.5)
    x = torch.tensor([[1.0, 0, 0, 0, 0]], dtype=torch.float64)
    server = ServerState({"global": {"weight": x}}, algorithm.init_server({"weight": x}).tensors)
    d1, d2 = torch.full((1, DIM), 2.0, dtype=torch.float64), torch.full((1, DIM), 6.0, dtype=torch.float64)
    new = algorithm.aggregate(server, [upload({"weight": d1}, 1), upload({"weight": d2}, 3)])
    # x + 0.5·(1·2 + 3·6)/4 = x + 2.5
    assert torch.equal(new.models["global"]["weight"], x + 2.5)


def test_fedavgm_velocity_and_step_by_hand_with_a_server_lr():
    algorithm = linear_fedavg(server_opt="momentum", server_lr=0.5, server_momentum=0.8)
    x = torch.zeros(1, DIM, dtype=torch.float64)
    server = algorithm.init_server({"weight": x})
    server = algorithm.aggregate(server, [upload({"weight": torch.full((1, DIM), 2.0, dtype=torch.float64)}, 1)])
    server = algorithm.aggregate(server, [upload({"weight": torch.full((1, DIM), 1.0, dtype=torch.float64)}, 1)])
    velocity = 0.8 * 2.0 + 1.0  # v1 = 2, v2 = β·v1 + Δ2 (the learning rate stays outside the velocity)
    assert torch.allclose(server.tensors["server_momentum/weight"], torch.full((1, DIM), velocity, dtype=torch.float64))
    assert torch.allclose(server.models["global"]["weight"], torch.full((1, DIM), 0.5 * 2.0 + 0.5 * velocity,
                                                                        dtype=torch.float64))


def test_fedadam_uses_its_betas_and_tau_settings():
    algorithm = linear_fedavg(server_opt="adam", server_lr=0.1, server_beta1=0.5, server_beta2=0.75, server_tau=0.01)
    server = algorithm.init_server({"weight": torch.zeros(1, DIM, dtype=torch.float64)})
    new = algorithm.aggregate(server, [upload({"weight": torch.full((1, DIM), 2.0, dtype=torch.float64)}, 1)])
    m, v = 0.5 * 2.0, 0.25 * 4.0  # (1−β1)·Δ and (1−β2)·Δ²
    assert torch.allclose(new.tensors["server_adam_m/weight"], torch.full((1, DIM), m, dtype=torch.float64))
    assert torch.allclose(new.tensors["server_adam_v/weight"], torch.full((1, DIM), v, dtype=torch.float64))
    expected = 0.1 * m / (v ** 0.5 + 0.01)
    assert torch.allclose(new.models["global"]["weight"], torch.full((1, DIM), expected, dtype=torch.float64))


@pytest.mark.parametrize("server_opt, server_lr", [("sgd", 0.3), ("momentum", 1.0), ("adam", 0.1)])
def test_batchnorm_buffers_take_the_plain_mean_under_every_server_optimizer(server_opt, server_lr):
    torch.manual_seed(0)
    algorithm, model = build_algorithm("fedavg", TinyNet(), {"a": 10, "b": 30},
                                       {"server_opt": server_opt, "server_lr": server_lr})
    weights = {key: value.clone() for key, value in model.state_dict().items()}
    server = algorithm.init_server(weights)
    assert not any(key.startswith(("server_momentum/", "server_adam")) and "running" in key for key in server.tensors)
    for _ in range(4):  # momentum would keep pushing the variance in the same direction
        deltas = [{key: (torch.full_like(value, -0.5) if key.endswith("running_var")
                         else torch.ones_like(value)) for key, value in weights.items()} for _ in range(2)]
        before = server.models["global"]
        server = algorithm.aggregate(server, [upload(deltas[0], 10), upload(deltas[1], 30)])
        after = server.models["global"]
        assert torch.equal(after["body.1.running_var"], before["body.1.running_var"] - 0.5)
        assert torch.equal(after["body.1.running_mean"], before["body.1.running_mean"] + 1)
        assert after["body.1.num_batches_tracked"] == before["body.1.num_batches_tracked"] + 1


def test_fedavg_uploads_every_entry_including_batchnorm_statistics():
    torch.manual_seed(0)
    algorithm, model = build_algorithm("fedavg", TinyNet(), {"a": 12})
    server = algorithm.init_server({key: value.clone() for key, value in model.state_dict().items()})
    samples = client_samples(0, 12)
    batches = [{"x": torch.stack([s["x"] for s in samples]), "y": torch.stack([s["y"] for s in samples])}]
    result = algorithm.client_update(model, algorithm.broadcast(server), {}, batches,
                                     client_config(12, lr=0.05, steps=2, loss_fn=loss_fn))
    assert set(result.upload[DELTA]) == set(model.state_dict())
    assert result.upload[DELTA]["body.1.running_mean"].abs().sum() > 0
    assert result.upload[DELTA]["body.1.num_batches_tracked"] == 2
    new = algorithm.aggregate(server, [Upload("a", result.upload, 12)])
    assert torch.allclose(new.models["global"]["body.1.running_mean"], model.state_dict()["body.1.running_mean"],
                          rtol=0, atol=1e-7)  # x + (y − x) = y up to rounding


def test_one_full_batch_step_with_unequal_clients_equals_centralized_gradient_descent(tmp_path):
    data = least_squares_clients(sizes=(10, 25, 40, 15))
    lr, rounds = 0.5 / max_curvature(data), 6
    weights, _ = run_oracle(tmp_path, "fedavg", rounds=rounds, steps=1, lr=lr, data=data)
    pooled_a, pooled_b = torch.cat([a for a, _ in data]), torch.cat([b for _, b in data])
    expected = torch.zeros(DIM, dtype=torch.float64)
    for _ in range(rounds):
        expected = expected - lr * gradient(expected, pooled_a, pooled_b)
    assert torch.allclose(weights, expected, rtol=0, atol=1e-12)


def test_partial_participation_averages_only_the_sampled_clients(tmp_path):
    data = least_squares_clients(sizes=(10, 25, 40, 15))
    lr = 0.5 / max_curvature(data)
    weights, engine = run_oracle(tmp_path, "fedavg", rounds=1, steps=3, lr=lr, data=data, fraction=0.5)
    import pandas as pd

    sampled = sorted(pd.read_csv(tmp_path / "fedavg" / "metrics.csv", dtype={"client": str})
                     .query("split == 'train' and metric == 'train_loss' and client != 'mean'").client.astype(int))
    assert len(sampled) == 2
    finals, sizes = [], []
    for index in sampled:
        a, b = data[index]
        w = torch.zeros(DIM, dtype=torch.float64)
        for _ in range(3):
            w = w - lr * gradient(w, a, b)
        finals.append(w * len(b))
        sizes.append(len(b))
    assert torch.allclose(weights, sum(finals) / sum(sizes), atol=1e-12)


@pytest.mark.slow
def test_fedavg_with_several_local_steps_converges_away_from_the_optimum(tmp_path):
    data = least_squares_clients()
    lr = 0.5 / max_curvature(data)
    weights, _ = run_oracle(tmp_path, "fedavg", rounds=80, steps=10, lr=lr, data=data)
    more, _ = run_oracle(tmp_path / "more", "fedavg", rounds=160, steps=10, lr=lr, data=data)
    assert torch.allclose(weights, more, atol=1e-9)  # converged ...
    assert relative_error(weights, pooled_optimum(data)) > 1e-2  # ... to a point that is not the optimum (client drift)


def test_local_steps_use_the_rounds_momentum_and_weight_decay_by_hand():
    a, b = least_squares_clients(sizes=(20,))[0]
    lr, momentum, decay, steps = 0.05, 0.9, 0.3, 4
    algorithm, model = build_algorithm("fedavg", linear_model(), {"0": 20})
    start = torch.linspace(-1, 1, DIM, dtype=torch.float64)
    result = algorithm.client_update(model, {"global": {"weight": start.unsqueeze(0)}}, {}, [{"x": a, "y": b}],
                                     client_config(20, lr=lr, steps=steps, momentum=momentum, weight_decay=decay))
    w, velocity = start.clone(), torch.zeros(DIM, dtype=torch.float64)
    for step in range(steps):
        g = gradient(w, a, b) + decay * w  # torch.optim.SGD: decay enters the gradient, then the momentum buffer
        velocity = g if step == 0 else momentum * velocity + g
        w = w - lr * velocity
    assert torch.allclose(result.upload[DELTA]["weight"].squeeze(0), w - start, rtol=0, atol=1e-13)
