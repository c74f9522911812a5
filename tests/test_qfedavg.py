"""q-FedAvg (network/algorithms/qfedavg.py): one round by hand, and fairness on clients of very different sizes."""

from __future__ import annotations

import pytest
import torch

from network.algorithms import build_algorithm
from network.algorithms.base import Upload
from network.algorithms.qfedavg import H, LOSS_AT_GLOBAL, Q_DELTA
from tests.oracles import (DIM, client_config, gradient, least_squares_clients, linear_model, max_curvature,
                           run_oracle)
from utils.errors import TaskHetError


def loss(w, a, b):
    return float(0.5 * ((a @ w - b) ** 2).mean())


@pytest.mark.parametrize("q", [0.0, 2.0])
def test_one_round_equals_the_hand_computation(q):
    data = least_squares_clients(sizes=(8, 20, 45))  # unequal sizes
    lr, steps = 0.05, 4
    sizes = {str(index): len(b) for index, (_, b) in enumerate(data)}
    algorithm, model = build_algorithm("qfedavg", linear_model(), sizes, {"q": q})
    w0 = torch.linspace(-1, 1, DIM, dtype=torch.float64)
    server = algorithm.init_server({"weight": w0.unsqueeze(0)})
    uploads, numerator, denominator = [], torch.zeros(DIM, dtype=torch.float64), 0.0
    for index, (a, b) in enumerate(data):
        result = algorithm.client_update(model, algorithm.broadcast(server), {}, [{"x": a, "y": b}],
                                         client_config(len(b), lr=lr, steps=steps))
        uploads.append(Upload(str(index), result.upload, len(b)))
        own_loss = loss(w0, a, b)  # F_k at w^t, before training
        assert result.metrics[LOSS_AT_GLOBAL] == pytest.approx(own_loss, rel=1e-12)
        w = w0.clone()
        for _ in range(steps):
            w = w - lr * gradient(w, a, b)
        direction = (w0 - w) / lr  # L·(w^t − w̄_k), L = 1/lr
        f = own_loss + 1e-10
        numerator += f ** q * direction
        denominator += q * f ** (q - 1) * float(direction @ direction) + f ** q / lr
        assert torch.allclose(result.upload[Q_DELTA]["weight"].squeeze(0), f ** q * direction, rtol=1e-12, atol=0)
        assert float(result.upload[H][H]) == pytest.approx(q * f ** (q - 1) * float(direction @ direction)
                                                          + f ** q / lr, rel=1e-12)
    new = algorithm.aggregate(server, uploads).models["global"]["weight"].squeeze(0)
    assert torch.allclose(new, w0 - numerator / denominator, rtol=0, atol=1e-12)
    if q == 0:  # q = 0: the uniform mean of the local models, whatever the clients' sizes
        locals_ = []
        for a, b in data:
            w = w0.clone()
            for _ in range(steps):
                w = w - lr * gradient(w, a, b)
            locals_.append(w)
        assert torch.allclose(new, torch.stack(locals_).mean(0), rtol=0, atol=1e-12)


def test_each_client_weighs_by_its_own_loss_not_a_shared_one():
    """Two clients whose losses at w^t differ get different F^q factors (one server loss for all would not)."""
    data = least_squares_clients(sizes=(10, 10))
    algorithm, model = build_algorithm("qfedavg", linear_model(), {"0": 10, "1": 10}, {"q": 1.0})
    server = algorithm.init_server({"weight": torch.zeros(1, DIM, dtype=torch.float64)})
    losses = [algorithm.client_update(model, algorithm.broadcast(server), {}, [{"x": a, "y": b}],
                                      client_config(10)).metrics[LOSS_AT_GLOBAL] for a, b in data]
    assert losses == pytest.approx([loss(torch.zeros(DIM, dtype=torch.float64), a, b) for a, b in data])
    assert abs(losses[0] - losses[1]) > 0.1 * max(losses)


def test_a_positive_q_ends_with_a_lower_worst_client_loss_than_fedavg(tmp_path):
    # A large client and a small one with different optima: FedAvg's sample weights favour the large one.
    data = least_squares_clients(sizes=(300, 12), shift=[torch.full((DIM,), 2.0, dtype=torch.float64),
                                                         torch.full((DIM,), -2.0, dtype=torch.float64)])
    lr = 0.5 / max_curvature(data)
    fedavg, _ = run_oracle(tmp_path, "fedavg", rounds=30, steps=5, lr=lr, data=data)
    fair, _ = run_oracle(tmp_path, "qfedavg", rounds=30, steps=5, lr=lr, data=data, q=2.0)
    worst = {name: max(loss(weights, a, b) for a, b in data) for name, weights in (("fedavg", fedavg), ("q", fair))}
    assert worst["q"] < 0.7 * worst["fedavg"], worst


def test_a_negative_q_is_refused_naming_the_setting():
    with pytest.raises(TaskHetError, match=r"^setting q must be >= 0, got -1.0$"):
        build_algorithm("qfedavg", linear_model(), {"0": 1}, {"q": -1})
