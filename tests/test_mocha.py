"""MOCHA's primal regulariser (network/algorithms/mocha.py): Ω in closed form, a live gradient, learned relationships."""

from __future__ import annotations

import pytest
import scipy.linalg
import torch

from network.algorithms import build_algorithm
from network.algorithms.base import load_weights
from network.algorithms.mocha import COUPLING, HEAD_PREFIX, OMEGA, OMEGA_KK, regulariser, task_covariance
from tests.oracles import DIM, TwoLayer, least_squares_clients, linear_model, run_oracle
from tests.tiny_models import TinyNet
from utils.errors import TaskHetError


def test_sigma_and_omega_are_the_closed_form_of_the_heads_not_a_matrix_of_ones():
    generator = torch.Generator().manual_seed(0)
    heads = torch.randn(4, 3, generator=generator, dtype=torch.float64)  # d = 4, m = 3 tasks
    sigma, omega = task_covariance(heads, eps=1e-9)
    root = torch.from_numpy(scipy.linalg.sqrtm((heads.T @ heads).numpy()).real)
    assert torch.allclose(sigma, root / torch.trace(root), rtol=0, atol=1e-12)
    assert torch.allclose(omega, torch.linalg.inv(root / torch.trace(root)), rtol=0, atol=1e-9)
    assert torch.trace(sigma).item() == pytest.approx(1.0)
    ones = torch.ones(3, 3, dtype=torch.float64)
    assert not torch.allclose(omega / omega.norm(), ones / ones.norm(), atol=0.1)
    # Collinear heads: WᵀW has rank 1; the floor keeps Ω finite (largest eigenvalue 1/eps).
    _, floored = task_covariance(torch.ones(4, 3, dtype=torch.float64), eps=1e-3)
    assert torch.isfinite(floored).all() and torch.linalg.eigvalsh(floored).max().item() == pytest.approx(1e3)


def test_the_clients_regulariser_has_the_full_regularisers_gradient_checked_by_finite_differences():
    """(λ/2)·tr(W Ω Wᵀ) differentiated in w_k, by central differences, equals the client term's autograd gradient."""
    generator = torch.Generator().manual_seed(1)
    m, lam = 3, 0.7
    heads = torch.randn(3, m, generator=generator, dtype=torch.float64)  # TwoLayer's head has 3 entries
    _, omega = task_covariance(heads, eps=1e-6)
    k = 1
    model = TwoLayer()
    with torch.no_grad():
        model.head.weight.copy_(heads[:, k].view(1, 3))
    coupling = {"head.weight": sum(omega[k, j] * heads[:, j] for j in range(m) if j != k).view(1, 3)}
    term = regulariser(model, coupling, float(omega[k, k]), lam)
    value = term(model)
    (gradient,) = torch.autograd.grad(value, [model.head.weight])
    assert gradient.abs().sum() > 0  # a detached regulariser would have none

    def full(w_k):
        w = heads.clone()
        w[:, k] = w_k
        return 0.5 * lam * torch.trace(w @ omega @ w.T)

    step = 1e-6
    numeric = torch.stack([(full(heads[:, k] + step * e) - full(heads[:, k] - step * e)) / (2 * step)
                           for e in torch.eye(3, dtype=torch.float64)])
    assert torch.allclose(gradient.view(3), numeric, rtol=1e-7, atol=1e-9)
    assert torch.allclose(gradient.view(3), lam * (omega @ heads.T)[k], rtol=1e-12, atol=1e-14)


def two_groups(sizes=(20, 25, 30, 20, 25, 30)):
    """Least-squares tasks of two groups with opposite optima (a TwoLayer fits both with one body)."""
    centre = torch.linspace(-1, 1, DIM, dtype=torch.float64) * 2
    shift = [centre if index < len(sizes) // 2 else -centre for index in range(len(sizes))]
    return least_squares_clients(sizes=sizes, shift=shift)


def objective(engine, data, lam):
    server = engine.server
    algorithm = engine.algorithm
    heads = algorithm.head_matrix(server.tensors)
    total = 0.0
    model = TwoLayer()
    load_weights(model, server.models["global"])
    for index, (a, b) in enumerate(data):
        with torch.no_grad():
            model.head.weight.copy_(server.tensors[HEAD_PREFIX.format(str(index)) + "head.weight"])
            total += float(0.5 * ((model(a).squeeze(-1) - b) ** 2).mean())
    return total + 0.5 * lam * float(torch.trace(heads @ server.tensors[OMEGA] @ heads.T))


def test_tasks_of_two_groups_learn_a_sigma_that_correlates_within_groups_and_the_objective_decreases(tmp_path):
    data = two_groups()
    lam = 0.01
    _, early = run_oracle(tmp_path / "early", "mocha", rounds=1, steps=5, lr=0.02, data=data, model=TwoLayer(), lam=lam)
    _, late = run_oracle(tmp_path / "late", "mocha", rounds=30, steps=5, lr=0.02, data=data, model=TwoLayer(), lam=lam)
    assert objective(late, data, lam) < 0.5 * objective(early, data, lam)
    sigma, _ = task_covariance(late.algorithm.head_matrix(late.server.tensors), late.algorithm.settings.eps)
    scale = sigma.diagonal().sqrt()
    correlation = sigma / torch.outer(scale, scale)
    groups = [0, 0, 0, 1, 1, 1]
    within = [float(correlation[i, j]) for i in range(6) for j in range(6) if i != j and groups[i] == groups[j]]
    between = [float(correlation[i, j]) for i in range(6) for j in range(6) if groups[i] != groups[j]]
    assert min(within) > max(between) + 0.5, (within, between)


def test_each_client_gets_its_own_row_of_omega_and_uploads_its_heads_change(tmp_path):
    data = two_groups()
    _, engine = run_oracle(tmp_path, "mocha", rounds=2, steps=3, lr=0.02, data=data, model=TwoLayer(), lam=0.1)
    server, algorithm = engine.server, engine.algorithm
    heads = algorithm.head_matrix(server.tensors)
    for index in range(6):
        message = algorithm.client_broadcast(server, algorithm.broadcast(server), str(index))
        omega = server.tensors[OMEGA]
        expected = sum(omega[index, j] * heads[:, j] for j in range(6) if j != index)
        assert torch.allclose(message[COUPLING]["head.weight"].view(-1), expected, rtol=1e-12, atol=1e-14)
        assert float(message[OMEGA_KK]["value"]) == pytest.approx(float(omega[index, index]))
        personal = algorithm.personal_model(server.models, engine.store.get(str(index)))
        assert torch.equal(personal["head.weight"], server.tensors[HEAD_PREFIX.format(str(index)) + "head.weight"])


def test_a_model_without_a_head_and_bad_settings_are_refused():
    with pytest.raises(TaskHetError, match=r"^mocha couples the clients' classifier heads: the model needs a head"):
        build_algorithm("mocha", linear_model(), {"0": 1})
    with pytest.raises(TaskHetError, match=r"^setting lam must be >= 0, got -1.0$"):
        build_algorithm("mocha", TinyNet(), {"0": 1}, {"lam": -1})
