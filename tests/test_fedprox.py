"""FedProx (network/algorithms/fedprox.py): the proximal gradient is exactly μ·(w − w_global)."""

from __future__ import annotations

import pytest
import torch

from network.algorithms import build_algorithm
from network.algorithms.skeleton import DELTA
from tests.oracles import DIM, client_config, gradient, least_squares_clients, linear_model, run_oracle
from utils.errors import TaskHetError


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_local_steps_follow_the_proximal_gradient_by_hand(momentum):
    a, b = least_squares_clients(sizes=(20,))[0]
    mu, lr, steps = 0.7, 0.05, 4
    algorithm, model = build_algorithm("fedprox", linear_model(), {"0": 20}, {"mu": mu})
    start = torch.linspace(-1, 1, DIM, dtype=torch.float64)
    broadcast = {"global": {"weight": start.unsqueeze(0)}}
    result = algorithm.client_update(model, broadcast, {}, [{"x": a, "y": b}],
                                     client_config(20, lr=lr, steps=steps, momentum=momentum))
    w, velocity = start.clone(), torch.zeros(DIM, dtype=torch.float64)
    for step in range(steps):
        g = gradient(w, a, b) + mu * (w - start)
        velocity = g if step == 0 else momentum * velocity + g  # torch.optim.SGD's momentum buffer
        w = w - lr * velocity
    assert torch.allclose(result.upload[DELTA]["weight"].squeeze(0), w - start, rtol=0, atol=1e-13)


def test_huge_mu_keeps_clients_at_the_global_model(tmp_path):
    data = least_squares_clients()
    prox, _ = run_oracle(tmp_path, "fedprox", rounds=1, steps=20, lr=1e-6, data=data, mu=1e6)  # lr·μ = 1: stable
    plain, _ = run_oracle(tmp_path / "plain", "fedavg", rounds=1, steps=20, lr=1e-6, data=data)
    bound = max(float((a.T @ b).norm()) / len(b) for a, b in data) / 1e6  # ‖∇f_i(0)‖/μ
    assert 0 < prox.norm() <= bound and prox.norm() < 0.1 * plain.norm()


def test_negative_mu_is_refused_naming_the_setting():
    with pytest.raises(TaskHetError, match="setting mu must be >= 0"):
        build_algorithm("fedprox", linear_model(), {"0": 1}, {"mu": -1})
