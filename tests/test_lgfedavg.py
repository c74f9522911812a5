"""LG-FedAvg (network/algorithms/lgfedavg.py): local bodies train with the global head; only the head is averaged."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from network.algorithms import build_algorithm
from network.algorithms.base import Upload
from network.algorithms.skeleton import DELTA
from tests.oracles import DIM, TwoLayer, client_config, least_squares_clients, linear_model, manual_sgd, run_oracle
from tests.tiny_models import TinyNet, loss_fn
from utils.errors import TaskHetError

SIZES = (7, 13)  # unequal clients: the sample weights matter


def gradients(body: np.ndarray, head: np.ndarray, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """∇ of f(B, h) = ‖A Bᵀ hᵀ − b‖² / (2n) by hand. With z = A Bᵀ (n×H) and r = z hᵀ − b (n):
    ∂f/∂h = rᵀ z / n (1×H); ∂f/∂B_kd = Σ_j r_j h_k A_jd / n, i.e. hᵀ (Aᵀ r)ᵀ / n (H×D)."""
    z = a @ body.T
    r = z @ head[0] - b
    return np.outer(head[0], a.T @ r) / len(b), (r @ z)[None, :] / len(b)


def lg_fedavg_oracle(data, body0, head0, rounds, steps, lr, uniform, server_lr):
    """The paper's Algorithm 1 in float64 numpy: each client trains (own body, global head) jointly by full-batch
    SGD; the server moves the head by η_g times the weighted mean of the head changes; bodies stay on the clients."""
    bodies, head = {}, head0.copy()
    for _ in range(rounds):
        changes, weights = [], []
        for client, (a, b) in enumerate(data):
            body, own_head = bodies.get(client, body0).copy(), head.copy()
            for _ in range(steps):
                grad_body, grad_head = gradients(body, own_head, a, b)
                body, own_head = body - lr * grad_body, own_head - lr * grad_head
            bodies[client] = body
            changes.append(own_head - head)
            weights.append(1.0 if uniform else float(len(b)))
        head = head + server_lr * sum(w * change for w, change in zip(weights, changes)) / sum(weights)
    return head, bodies


@pytest.mark.parametrize("settings", [{}, {"weighting": "uniform", "server_lr": 0.6}])
def test_two_rounds_of_two_unequal_clients_equal_the_papers_algorithm_in_numpy(tmp_path, settings):
    data = least_squares_clients(sizes=SIZES, seed=3)
    initial = TwoLayer().state_dict()
    final, engine = run_oracle(tmp_path, "lgfedavg", rounds=2, steps=3, lr=0.03, data=data, model=TwoLayer(),
                               **settings)
    head, bodies = lg_fedavg_oracle([(a.numpy(), b.numpy()) for a, b in data], initial["body.weight"].numpy(),
                                    initial["head.weight"].numpy(), rounds=2, steps=3, lr=0.03,
                                    uniform=settings.get("weighting") == "uniform",
                                    server_lr=settings.get("server_lr", 1.0))
    np.testing.assert_allclose(final["head.weight"].numpy(), head, rtol=0, atol=1e-12)
    assert torch.equal(final["body.weight"], initial["body.weight"])  # the global body never trains
    for client, body in bodies.items():
        state = engine.store.get(str(client))
        assert set(state) == {"body.weight"}
        np.testing.assert_allclose(state["body.weight"].numpy(), body, rtol=0, atol=1e-12)
    assert not np.allclose(bodies[0], bodies[1])  # the representations are the clients' own


def test_one_client_is_local_training_of_body_and_head_with_the_head_averaged_alone():
    """One client, server_lr 1: the "average" of one head is that head, so two rounds of J steps are 2J plain steps."""
    a, b = least_squares_clients(sizes=(9,), seed=1)[0]
    algorithm, model = build_algorithm("lgfedavg", TwoLayer(), {"0": 9})
    server = algorithm.init_server({key: value.clone() for key, value in model.state_dict().items()})
    start = {key: value.clone() for key, value in server.models["global"].items()}
    state = {}
    for _ in range(2):
        result = algorithm.client_update(model, algorithm.broadcast(server), state, [{"x": a, "y": b}],
                                         client_config(9, lr=0.04, steps=3))
        state = result.client_state
        server = algorithm.aggregate(server, [Upload("0", result.upload, 9)])
    expected = manual_sgd(start, {"body.weight", "head.weight"}, [{"x": a, "y": b}], 0.04, steps=6)
    assert torch.allclose(state["body.weight"], expected["body.weight"], rtol=0, atol=1e-13)
    assert torch.allclose(server.models["global"]["head.weight"], expected["head.weight"], rtol=0, atol=1e-13)
    assert torch.equal(server.models["global"]["body.weight"], start["body.weight"])
    personal = algorithm.personal_model(server.models, state)
    assert torch.equal(personal["body.weight"], state["body.weight"])  # own body + global head
    assert torch.equal(personal["head.weight"], server.models["global"]["head.weight"])


def test_only_the_head_travels_and_the_body_with_its_batchnorm_statistics_stays():
    algorithm, model = build_algorithm("lgfedavg", TinyNet(), {"0": 6, "1": 6})
    head = {"head.weight", "head.bias"}
    body = {key for key in model.state_dict() if key not in head}
    assert algorithm.private_keys() == body and {"body.1.running_mean", "body.1.num_batches_tracked"} <= body
    assert algorithm.personalized and type(algorithm).result_is_personal
    generator = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(6, 4, generator=generator), "y": torch.randn(6, generator=generator)}
    start = {key: value.clone() for key, value in model.state_dict().items()}
    result = algorithm.client_update(model, {"global": start}, {}, [batch], client_config(6, steps=2, loss_fn=loss_fn))
    assert set(result.upload[DELTA]) == head and set(result.client_state) == body
    assert not torch.equal(result.client_state["body.1.running_mean"], start["body.1.running_mean"])
    assert algorithm.personal_model({"global": start}, {}) is None  # never sampled: no representation of its own


class FrozenFirstLayer(nn.Module):
    """A frozen pretrained layer, a trainable body layer and a head (float64)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(DIM, 4, bias=False, dtype=torch.float64).requires_grad_(False)
        self.body = nn.Linear(4, 3, bias=False, dtype=torch.float64)
        self.head = nn.Linear(3, 1, bias=False, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.encoder(x)))

    def head_keys(self) -> list[str]:
        return ["head.weight"]


def test_a_frozen_encoder_is_neither_private_nor_uploaded_and_every_client_reads_the_global_one(tmp_path):
    data = least_squares_clients(sizes=SIZES, seed=2)
    torch.manual_seed(0)
    model = FrozenFirstLayer()
    encoder = model.encoder.weight.clone()
    final, engine = run_oracle(tmp_path, "lgfedavg", rounds=2, steps=2, lr=0.02, data=data, model=model)
    assert engine.algorithm.private_keys() == {"body.weight"}
    assert torch.equal(final["encoder.weight"], encoder) and torch.equal(engine.model.encoder.weight, encoder)
    for client in ("0", "1"):
        assert set(engine.store.get(client)) == {"body.weight"}
        personal = engine.algorithm.personal_model(engine.server.models, engine.store.get(client))
        assert torch.equal(personal["encoder.weight"], encoder)


def test_models_outside_the_methods_scope_and_bad_settings_are_refused_in_one_line():
    with pytest.raises(TaskHetError, match=r"^lgfedavg needs a model with head_keys\(\)"):
        build_algorithm("lgfedavg", linear_model(), {"0": 1})
    frozen_body = TwoLayer()
    frozen_body.body.requires_grad_(False)
    with pytest.raises(TaskHetError, match=r"^lgfedavg needs a model with trainable entries both outside and inside"):
        build_algorithm("lgfedavg", frozen_body, {"0": 1})
    with pytest.raises(TaskHetError, match="setting server_lr must be > 0, got 0.0"):
        build_algorithm("lgfedavg", TwoLayer(), {"0": 1}, {"server_lr": 0})
    with pytest.raises(TaskHetError, match="setting weighting must be one of"):
        build_algorithm("lgfedavg", TwoLayer(), {"0": 1}, {"weighting": "median"})
