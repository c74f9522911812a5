"""Federated algorithms against their equations (network/algorithms, network/local_train.py).

The oracle: clients with heterogeneous least-squares objectives f_i(w) = ‖A_i w − b_i‖² / (2 n_i)
(different data, different curvature, different local optima) whose global optimum is
known in closed form. It runs through the same engine and algorithms as TaskModels.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from network.algorithms import AlgorithmConfig, ClientConfig, get_algorithm, list_algorithms
from network.algorithms.base import CONTROL_DELTA_PREFIX, CONTROL_PREFIX, HEAD_TRAIN_LOSS, TRAIN_LOSS
from network.engine_sequential import ClientData, EngineConfig, SequentialEngine, make_lr_schedule
from network.local_train import NonFiniteLossError, local_train
from utils.errors import TaskHetError

CPU = torch.device("cpu")
DIM = 5


# ----- the least-squares oracle -----
def least_squares_clients(sizes=(30, 30, 30, 30), seed=0):
    """Per client (A_i, b_i), plus the pooled optimum and the largest local curvature L."""
    generator = torch.Generator().manual_seed(seed)
    data = []
    for size in sizes:
        curvature = torch.exp(0.5 * torch.randn(DIM, generator=generator, dtype=torch.float64))
        features = torch.randn(size, DIM, generator=generator, dtype=torch.float64) * curvature
        local_optimum = 3 * torch.randn(DIM, generator=generator, dtype=torch.float64)
        targets = features @ local_optimum + 0.1 * torch.randn(size, generator=generator, dtype=torch.float64)
        data.append((features, targets))
    pooled_a, pooled_b = torch.cat([a for a, _ in data]), torch.cat([b for _, b in data])
    optimum = torch.linalg.lstsq(pooled_a, pooled_b.unsqueeze(1)).solution.squeeze(1)
    curvature_max = max(torch.linalg.eigvalsh(a.T @ a / len(a)).max().item() for a, _ in data)
    return data, optimum, curvature_max


def least_squares_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return 0.5 * ((model(batch["x"]).squeeze(-1) - batch["y"]) ** 2).mean()


def mean_loss(model: nn.Module, loader) -> dict[str, float]:
    batches = list(loader)
    return {"loss": float(sum(least_squares_loss(model, batch) for batch in batches) / len(batches))}


def run_oracle(tmp_path, name, rounds, steps, lr, data, fraction=1.0, **hyper):
    model = nn.Linear(DIM, 1, bias=False, dtype=torch.float64)
    nn.init.zeros_(model.weight)
    clients = [ClientData(str(index), len(b), lambda seed, a=a, b=b: [{"x": a, "y": b}], [{"x": a, "y": b}])
               for index, (a, b) in enumerate(data)]
    pooled = [{"x": torch.cat([a for a, _ in data]), "y": torch.cat([b for _, b in data])}]
    algorithm = get_algorithm(name, AlgorithmConfig(num_clients=len(clients), **hyper))
    config = EngineConfig(out_dir=tmp_path / name, n_rounds=rounds, lr_schedule=make_lr_schedule("constant", lr, rounds),
                          local_steps=steps, client_fraction=fraction, eval_every=rounds, progress=False)
    engine = SequentialEngine(model, algorithm, clients, least_squares_loss, mean_loss, pooled, config, CPU)
    return engine.run()["weight"].squeeze(0), engine


def relative_error(weights, optimum):
    return float((weights - optimum).norm() / optimum.norm())


def test_scaffold_full_participation_converges_to_the_global_optimum(tmp_path):
    data, optimum, curvature = least_squares_clients()
    weights, _ = run_oracle(tmp_path, "scaffold", rounds=80, steps=10, lr=0.5 / curvature, data=data)
    assert relative_error(weights, optimum) < 1e-6


def test_fedavg_with_several_local_steps_converges_elsewhere(tmp_path):
    data, optimum, curvature = least_squares_clients()
    weights, _ = run_oracle(tmp_path, "fedavg", rounds=80, steps=10, lr=0.5 / curvature, data=data)
    more, _ = run_oracle(tmp_path / "more", "fedavg", rounds=160, steps=10, lr=0.5 / curvature, data=data)
    assert torch.allclose(weights, more, atol=1e-9)  # converged ...
    assert relative_error(weights, optimum) > 1e-2  # ... to a point that is not the optimum (client drift)


def test_fedprox_with_huge_mu_barely_moves(tmp_path):
    data, _, _ = least_squares_clients()
    mu, lr = 1e6, 1e-6  # lr·μ = 1 keeps the local steps stable
    prox, _ = run_oracle(tmp_path, "fedprox", rounds=1, steps=20, lr=lr, data=data, mu=mu)
    plain, _ = run_oracle(tmp_path, "fedavg", rounds=1, steps=20, lr=lr, data=data)
    gradient_bound = max(float((a.T @ b).norm()) / len(b) for a, b in data) / mu  # ‖∇f_i(0)‖/μ
    assert 0 < prox.norm() <= gradient_bound
    assert prox.norm() < 0.1 * plain.norm()


def test_fedavg_one_full_batch_step_equals_centralized_gradient_descent(tmp_path):
    data, _, curvature = least_squares_clients(sizes=(10, 25, 40, 15))  # unequal sizes: weights matter
    lr, rounds = 0.5 / curvature, 6
    weights, _ = run_oracle(tmp_path, "fedavg", rounds=rounds, steps=1, lr=lr, data=data)
    pooled_a, pooled_b = torch.cat([a for a, _ in data]), torch.cat([b for _, b in data])
    expected = torch.zeros(DIM, dtype=torch.float64)
    for _ in range(rounds):
        expected = expected - lr * pooled_a.T @ (pooled_a @ expected - pooled_b) / len(pooled_b)
    assert torch.allclose(weights, expected, rtol=0, atol=1e-12)


def _least_squares_update(algorithm, model, broadcast, state, data_index, data, lr=0.01, steps=5):
    a, b = data[data_index]
    cfg = ClientConfig(lr=lr, loss_fn=least_squares_loss, device=CPU, num_samples=len(b), local_steps=steps)
    return algorithm.client_update(model, broadcast, state, [{"x": a, "y": b}], cfg)


def test_scaffold_control_variate_moves_by_sampled_share_of_mean_client_change():
    data, _, _ = least_squares_clients(sizes=(10, 20, 30, 40))  # unequal sizes: the means must be unweighted
    algorithm = get_algorithm("scaffold", AlgorithmConfig(num_clients=4))
    model = nn.Linear(DIM, 1, bias=False, dtype=torch.float64)
    weights = {key: value.detach().clone() for key, value in model.state_dict().items()}
    server_state = algorithm.init_server_state(weights)
    client_states = {index: algorithm.init_client_state(weights) for index in range(4)}
    for sampled in ([0, 2], [1, 2, 3]):
        broadcast = algorithm.broadcast(weights, server_state)
        results = {index: _least_squares_update(algorithm, model, broadcast, client_states[index], index, data)
                   for index in sampled}
        new_weights, new_state = algorithm.aggregate(weights, server_state,
                                                     [(result.upload, result.num_samples) for result in results.values()])
        change = new_state[CONTROL_PREFIX + "weight"] - server_state.get(CONTROL_PREFIX + "weight", 0)
        mean_delta = torch.stack([result.upload[CONTROL_DELTA_PREFIX + "weight"] for result in results.values()]).mean(0)
        assert torch.allclose(change, len(sampled) / 4 * mean_delta, atol=1e-14)
        for index, result in results.items():
            client_states[index] = result.client_state
        weights, server_state = new_weights, new_state
    # c = (1/N)·Σ c_i over all N clients (the ones never sampled count as zero)
    all_c = torch.stack([state.get("weight", torch.zeros(1, DIM, dtype=torch.float64)) for state in client_states.values()])
    assert torch.allclose(server_state[CONTROL_PREFIX + "weight"], all_c.mean(0), atol=1e-14)


def test_scaffold_option_one_uses_the_local_gradient_at_the_server_model():
    data, _, _ = least_squares_clients()
    algorithm = get_algorithm("scaffold", AlgorithmConfig(num_clients=4, scaffold_option="I"))
    model = nn.Linear(DIM, 1, bias=False, dtype=torch.float64)
    weights = {key: value.detach().clone() for key, value in model.state_dict().items()}
    result = _least_squares_update(algorithm, model, algorithm.broadcast(weights, {}), {}, 1, data)
    a, b = data[1]
    x = weights["weight"].squeeze(0)
    assert torch.allclose(result.client_state["weight"].squeeze(0), a.T @ (a @ x - b) / len(b), atol=1e-12)


def test_scaffold_option_two_divides_by_the_steps_actually_taken():
    data, _, _ = least_squares_clients()
    algorithm = get_algorithm("scaffold", AlgorithmConfig(num_clients=4))
    model = nn.Linear(DIM, 1, bias=False, dtype=torch.float64)
    weights = {key: value.detach().clone() for key, value in model.state_dict().items()}
    a, b = data[0]
    batches = [{"x": a[:10], "y": b[:10]}, {"x": a[10:20], "y": b[10:20]}, {"x": a[20:], "y": b[20:]}]
    cfg = ClientConfig(lr=0.01, loss_fn=least_squares_loss, device=CPU, num_samples=len(b), local_epochs=2)
    result = algorithm.client_update(model, algorithm.broadcast(weights, {}), {}, batches, cfg)
    assert result.metrics["local_steps"] == 6  # 2 epochs × 3 batches
    expected = -result.upload["weight"] / (6 * 0.01)  # c_i = 0 - 0 + (x - y)/(K·η)
    assert torch.allclose(result.client_state["weight"], expected, atol=1e-14)


# ----- every registered algorithm -----
class TinyNet(nn.Module):
    """A body (with BatchNorm buffers) and a head, split by name as TaskModel does."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def head_keys(self) -> list[str]:
        return [key for key in self.state_dict() if key.startswith("head.")]

    def body_keys(self) -> list[str]:
        return [key for key in self.state_dict() if not key.startswith("head.")]


def regression_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return ((model(batch["x"]).squeeze(-1) - batch["y"]) ** 2).mean()


def regression_batches(seed: int, count: int = 3) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(8, 4, generator=generator), "y": torch.randn(8, generator=generator) + seed}
            for _ in range(count)]


def tiny_update(algorithm, model, broadcast, state, seed, **cfg_overrides):
    cfg = ClientConfig(**{"lr": 0.05, "loss_fn": regression_loss, "device": CPU, "num_samples": 24, "local_steps": 4,
                          "momentum": 0.9, "weight_decay": 0.1, **cfg_overrides})
    return algorithm.client_update(model, broadcast, state, regression_batches(seed), cfg)


def _start(name, **hyper):
    torch.manual_seed(0)
    model = TinyNet()
    algorithm = get_algorithm(name, AlgorithmConfig(num_clients=3, **hyper))
    weights = {key: value.detach().clone() for key, value in model.state_dict().items()}
    return algorithm, model, weights, algorithm.init_server_state(weights)


@pytest.mark.parametrize("name", list_algorithms())
def test_zero_uploads_leave_the_global_model_and_server_state_unchanged(name):
    algorithm, model, weights, server_state = _start(name)
    upload = tiny_update(algorithm, model, algorithm.broadcast(weights, server_state), {}, seed=1).upload
    zeros = {key: torch.zeros_like(value) for key, value in upload.items()}
    new_weights, new_state = algorithm.aggregate(weights, server_state, [(zeros, 10), (zeros, 30)])
    assert new_weights.keys() == weights.keys()
    for key in weights:
        assert torch.equal(new_weights[key], weights[key]), key
    for key, value in new_state.items():
        assert torch.equal(value, server_state.get(key, torch.zeros_like(value))), key


@pytest.mark.parametrize("name", list_algorithms())
def test_identical_uploads_aggregate_like_one(name):
    algorithm, model, weights, server_state = _start(name)
    upload = tiny_update(algorithm, model, algorithm.broadcast(weights, server_state), {}, seed=1).upload
    many, _ = algorithm.aggregate(weights, server_state, [(upload, 5), (upload, 50), (upload, 7)])
    one, _ = algorithm.aggregate(weights, server_state, [(upload, 5)])
    assert any(not torch.equal(one[key], weights[key]) for key in weights)
    for key in weights:
        assert torch.allclose(many[key], one[key], atol=1e-6), key


@pytest.mark.parametrize("name", list_algorithms())
def test_personal_keys_never_leave_a_client(name):
    algorithm, model, weights, server_state = _start(name)
    result = tiny_update(algorithm, model, algorithm.broadcast(weights, server_state), {}, seed=2)
    assert not set(algorithm.personal_keys(model)) & set(result.upload)
    assert result.num_samples == 24 and math.isfinite(result.metrics[TRAIN_LOSS])


def test_fedrep_uploads_only_the_body_and_keeps_heads_per_client():
    algorithm, model, weights, server_state = _start("fedrep")
    assert algorithm.personal_keys(model) == model.head_keys()
    heads = [tiny_update(algorithm, model, weights, {}, seed=seed).client_state for seed in (1, 2)]
    assert set(heads[0]) == set(model.head_keys())
    assert not torch.allclose(heads[0]["head.weight"], heads[1]["head.weight"])
    result = tiny_update(algorithm, model, weights, {}, seed=1)
    new_weights, _ = algorithm.aggregate(weights, server_state, [(result.upload, 1)])
    assert set(result.upload) == set(model.body_keys())
    assert all(torch.equal(new_weights[key], weights[key]) for key in model.head_keys())
    assert not torch.equal(new_weights["body.0.weight"], weights["body.0.weight"])


def test_fedrep_head_phase_leaves_the_body_unchanged():
    # Momentum and weight decay would move the body if it shared the head's optimizer.
    algorithm, model, weights, _ = _start("fedrep", head_epochs=2, body_epochs=0)
    result = tiny_update(algorithm, model, weights, {}, seed=1)
    for key in model.body_keys():  # parameters and BatchNorm buffers
        assert torch.equal(result.upload[key], torch.zeros_like(result.upload[key])), key
    assert not torch.equal(result.client_state["head.weight"], weights["head.weight"])
    assert HEAD_TRAIN_LOSS in result.metrics


def test_fedrep_body_phase_leaves_the_head_unchanged_and_starts_from_the_clients_head():
    algorithm, model, weights, _ = _start("fedrep", head_epochs=0, body_epochs=1)
    own_head = {key: weights[key] + 1.0 for key in model.head_keys()}
    result = tiny_update(algorithm, model, weights, own_head, seed=1)
    for key in model.head_keys():
        assert torch.equal(result.client_state[key], own_head[key]), key
    assert not torch.equal(result.upload["body.0.weight"], torch.zeros_like(result.upload["body.0.weight"]))
    assert all(param.requires_grad for param in model.parameters())  # freezing is undone


def test_fedrep_needs_a_model_with_a_head():
    algorithm = get_algorithm("fedrep")
    with pytest.raises(TaskHetError, match="head_keys"):
        algorithm.personal_keys(nn.Linear(2, 1))


@pytest.mark.parametrize("name, hyper, flag", [
    ("scaffold", {"scaffold_option": "III"}, "--scaffold_option"),
    ("scaffold", {"server_opt": "adam"}, "--server_opt"),
    ("fedprox", {"mu": -1.0}, "--mu"),
    ("fedavg", {"server_opt": "lamb"}, "--server_opt"),
    ("fedavg", {"server_lr": 0.0}, "--server_lr"),
    ("fedrep", {"head_epochs": 0, "body_epochs": 0}, "--head_epochs"),
])
def test_bad_hyperparameters_are_rejected_naming_the_flag(name, hyper, flag):
    with pytest.raises(TaskHetError, match=flag):
        get_algorithm(name, AlgorithmConfig(**hyper))


def test_unknown_algorithm_or_hyperparameter_lists_the_choices():
    with pytest.raises(TaskHetError, match="fedavg, fedprox, fedrep, scaffold"):
        get_algorithm("fedsgd")
    with pytest.raises(TaskHetError, match="unknown hyperparameter.* nu .*known: .*mu"):
        get_algorithm("fedprox", nu=0.1)
    assert get_algorithm("fedprox", AlgorithmConfig(num_clients=3), mu=0.5).config == AlgorithmConfig(num_clients=3, mu=0.5)


# ----- the shared loop -----
def test_local_train_cycles_the_loader_for_j_steps_and_calls_the_hooks():
    model = nn.Linear(4, 1)
    calls = {"extra": 0, "hook": 0}

    def extra(_):
        calls["extra"] += 1
        return torch.zeros(())

    def hook(_):
        calls["hook"] += 1

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    result = local_train(model, regression_batches(0, count=3), regression_loss, optimizer, CPU, steps=7,
                         extra_loss=extra, grad_hook=hook)
    assert result.steps == 7 and calls == {"extra": 7, "hook": 7}
    assert local_train(model, regression_batches(0, count=3), regression_loss, optimizer, CPU, epochs=2).steps == 6


def test_local_train_stops_on_a_nan_loss_and_on_an_empty_loader():
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = regression_batches(0)
    batches[1]["y"] = torch.full((8,), math.nan)
    with pytest.raises(NonFiniteLossError, match="nan"):
        local_train(model, batches, regression_loss, optimizer, CPU, steps=3)
    with pytest.raises(TaskHetError, match="no training batches"):
        local_train(model, [], regression_loss, optimizer, CPU, steps=3)
