"""pFedMe (network/algorithms/pfedme.py): the proximal point, one round by hand, and its FedAvg limit."""

from __future__ import annotations

import pytest
import torch

from network.algorithms import build_algorithm
from network.algorithms.skeleton import DELTA
from tests.oracles import (DIM, client_config, gradient, least_squares_clients, linear_model, max_curvature,
                           run_oracle)
from utils.errors import TaskHetError


def hand_round(w0, a, b, lr, lam, inner_steps, personal_lr, steps):
    """Algorithm 1 written out on full-batch least squares: (w after the round, θ̃ of the last local step)."""
    w, theta = w0.clone(), w0.clone()
    for _ in range(steps):
        for _ in range(inner_steps):
            theta = theta - personal_lr * (gradient(theta, a, b) + lam * (theta - w))
        w = w - lr * lam * (w - theta)
    return w, theta


def test_one_round_by_hand_with_a_warm_started_personal_model():
    a, b = least_squares_clients(sizes=(25,))[0]
    settings = {"lam": 3.0, "inner_steps": 4, "personal_lr": 0.05}
    algorithm, model = build_algorithm("pfedme", linear_model(), {"0": 25}, settings)
    w0 = torch.linspace(-1, 1, DIM, dtype=torch.float64)
    result = algorithm.client_update(model, {"global": {"weight": w0.unsqueeze(0)}}, {}, [{"x": a, "y": b}],
                                     client_config(25, lr=0.02, steps=3))
    w, theta = hand_round(w0, a, b, 0.02, 3.0, 4, 0.05, 3)
    assert torch.allclose(result.upload[DELTA]["weight"].squeeze(0), w - w0, rtol=0, atol=1e-13)
    assert torch.allclose(result.client_state["weight"].squeeze(0), theta, rtol=0, atol=1e-13)
    assert result.metrics["local_steps"] == 12  # J·K gradient steps
    personal = algorithm.personal_model({"global": {"weight": w0.unsqueeze(0)}}, result.client_state)
    assert torch.equal(personal["weight"], result.client_state["weight"])


@pytest.mark.parametrize("inner_steps", [3, 10, 200])
def test_the_personal_model_is_the_closed_form_proximal_point_to_the_tolerance_of_k_steps(inner_steps):
    a, b = least_squares_clients(sizes=(40,))[0]
    lam, personal_lr = 15.0, 0.02
    algorithm, model = build_algorithm("pfedme", linear_model(), {"0": 40},
                                       {"lam": lam, "inner_steps": inner_steps, "personal_lr": personal_lr})
    w0 = torch.linspace(-1, 1, DIM, dtype=torch.float64)
    result = algorithm.client_update(model, {"global": {"weight": w0.unsqueeze(0)}}, {}, [{"x": a, "y": b}],
                                     client_config(40, lr=0.01, steps=1))
    hessian = a.T @ a / len(b)
    proximal_point = torch.linalg.solve(hessian + lam * torch.eye(DIM, dtype=torch.float64), a.T @ b / len(b) + lam * w0)
    # K gradient steps on a (H + λI)-quadratic contract the error by ρ = max |1 − η_p·(eig + λ)| each.
    rho = float((1 - personal_lr * (torch.linalg.eigvalsh(hessian) + lam)).abs().max())
    error = float((result.client_state["weight"].squeeze(0) - proximal_point).norm())
    assert error <= rho ** inner_steps * float((w0 - proximal_point).norm()) * (1 + 1e-9) + 1e-13
    if inner_steps == 200:
        assert error < 1e-10


def test_beta_one_and_a_huge_lambda_make_a_round_a_fedavg_round(tmp_path):
    data = least_squares_clients(sizes=(10, 25, 40))  # unequal sizes
    lr = 0.5 / max_curvature(data)
    lam = 1e7
    fedavg, _ = run_oracle(tmp_path, "fedavg", rounds=1, steps=4, lr=lr, data=data)
    # η_p = 1/λ: the inner steps stay stable and λ·(w − θ̃) → ∇F_i(w) as λ → ∞.
    pfedme, _ = run_oracle(tmp_path, "pfedme", rounds=1, steps=4, lr=lr, data=data, lam=lam, inner_steps=5,
                           personal_lr=1 / lam)
    assert torch.allclose(pfedme, fedavg, rtol=1e-5, atol=1e-7)
    assert float((fedavg - torch.zeros(DIM, dtype=torch.float64)).norm()) > 0.1  # the round moved


def test_beta_is_the_server_lr_and_defaults_to_one(tmp_path):
    assert build_algorithm("pfedme", linear_model(), {"0": 1})[0].settings.server_lr == 1.0
    data = least_squares_clients(sizes=(10, 30))
    full, _ = run_oracle(tmp_path / "one", "pfedme", rounds=1, steps=2, lr=0.05, data=data)
    half, _ = run_oracle(tmp_path / "half", "pfedme", rounds=1, steps=2, lr=0.05, data=data, server_lr=0.5)
    assert torch.allclose(half, 0.5 * full, rtol=0, atol=1e-14)  # (1 − β)·0 + β·mean(w_i)


def test_bad_settings_are_refused_naming_the_setting():
    with pytest.raises(TaskHetError, match=r"^setting lam must be >= 0, got -1.0$"):
        build_algorithm("pfedme", linear_model(), {"0": 1}, {"lam": -1})
    with pytest.raises(TaskHetError, match=r"^setting inner_steps must be >= 1, got 0$"):
        build_algorithm("pfedme", linear_model(), {"0": 1}, {"inner_steps": 0})
