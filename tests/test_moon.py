"""MOON (network/algorithms/moon.py) against the paper's equations: a numpy oracle over two rounds, the contrastive
loss by hand, its boundaries (μ = 0 and a client's first round are FedAvg), the fixed models' eval-mode replay, the
client state and the refusals. The generic tests over ``list_algorithms()`` cover the engine properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from models import build_task_model
from network.algorithms import build_algorithm
from network.algorithms.moon import model_contrastive_loss
from network.algorithms.representation import RepresentationTap
from network.algorithms.skeleton import DELTA
from tests.oracles import TwoLayer, client_config, least_squares_clients, least_squares_loss, run_oracle
from tests.tiny_models import TinyNet, loss_fn as tiny_loss
from utils.errors import TaskHetError

SIZES = (12, 20)  # unequal clients: the server weighs them 12/32 and 20/32


# ----- the oracle: the paper's Eq. 3–4 in numpy float64, gradients by hand -----
def task_gradients(w, h, a, b):
    """∇ of 0.5·mean((h·W·x − y)²) for the TwoLayer model (z = A Wᵀ, prediction z hᵀ).

    r = z hᵀ − y; ∂L/∂h = rᵀ z / N; ∂L/∂z = r hᵀ... per sample r_i·h / N; ∂L/∂W = (∂L/∂z)ᵀ A.
    """
    z = a @ w.T
    r = (z @ h.T)[:, 0] - b
    return (r[:, None] * h / len(b)).T @ a, (r @ z / len(b))[None, :]


def cosine_and_gradient(z, u):
    """cos(z_i, u_i) per row and its gradient in z_i: u/(‖z‖‖u‖) − cos·z/‖z‖² (quotient rule on z·u/(‖z‖‖u‖))."""
    nz, nu = np.linalg.norm(z, axis=1), np.linalg.norm(u, axis=1)
    cos = (z * u).sum(1) / (nz * nu)
    return cos, u / (nz * nu)[:, None] - cos[:, None] * z / (nz ** 2)[:, None]


def contrastive_gradient(w, w_glob, w_prev, a, tau):
    """∇_W of ℓ_con = mean_i −log(e^{a_i/τ}/(e^{a_i/τ} + e^{b_i/τ})), a_i = cos(z_i, z_glob_i),
    b_i = cos(z_i, z_prev_i).

    ℓ_i = log(e^{a/τ} + e^{b/τ}) − a/τ, so ∂ℓ_i/∂a = (p_a − 1)/τ = −p_b/τ and ∂ℓ_i/∂b = p_b/τ with
    p_b = e^{b/τ}/(e^{a/τ} + e^{b/τ}); ∂ℓ/∂z_i = (1/N)·(p_b/τ)·(∂b/∂z_i − ∂a/∂z_i); z = A Wᵀ so ∂ℓ/∂W = (∂ℓ/∂z)ᵀ A.
    z_glob = A W_globᵀ and z_prev = A W_prevᵀ are fixed (no gradient).
    """
    z = a @ w.T
    cos_glob, d_glob = cosine_and_gradient(z, a @ w_glob.T)
    cos_prev, d_prev = cosine_and_gradient(z, a @ w_prev.T)
    p_prev = 1.0 / (1.0 + np.exp((cos_glob - cos_prev) / tau))
    dz = (p_prev / tau)[:, None] * (d_prev - d_glob) / len(a)
    return dz.T @ a


def moon_oracle(data, w, h, rounds, steps, lr, mu, tau):
    """MOON with full-batch SGD, every client every round, the sample-weighted mean of Δ on the server."""
    previous = {}  # client -> its body weights at the end of its last round (w_i^{t−1})
    total = sum(len(b) for _, b in data)
    for _ in range(rounds):
        new_w, new_h = w.copy(), h.copy()
        for client, (a, b) in enumerate(data):
            local_w, local_h = w.copy(), h.copy()
            for _ in range(steps):
                grad_w, grad_h = task_gradients(local_w, local_h, a, b)
                if client in previous:  # first round: no previous model, ℓ_con has zero gradient
                    grad_w = grad_w + mu * contrastive_gradient(local_w, w, previous[client], a, tau)
                local_w, local_h = local_w - lr * grad_w, local_h - lr * grad_h
            previous[client] = local_w
            new_w += len(b) / total * (local_w - w)
            new_h += len(b) / total * (local_h - h)
        w, h = new_w, new_h
    return w, h


def test_two_rounds_of_two_unequal_clients_equal_the_numpy_oracle(tmp_path):
    data = least_squares_clients(sizes=SIZES, seed=4)
    mu, tau, lr, steps = 2.5, 0.7, 0.05, 3
    final, _ = run_oracle(tmp_path, "moon", rounds=2, steps=steps, lr=lr, data=data, model=TwoLayer(), mu=mu, tau=tau)
    start = TwoLayer()
    w, h = moon_oracle([(a.numpy(), b.numpy()) for a, b in data], start.body.weight.detach().numpy(),
                       start.head.weight.detach().numpy(), rounds=2, steps=steps, lr=lr, mu=mu, tau=tau)
    assert np.allclose(final["body.weight"].numpy(), w, rtol=0, atol=1e-12)
    assert np.allclose(final["head.weight"].numpy(), h, rtol=0, atol=1e-12)
    plain_w, _ = moon_oracle([(a.numpy(), b.numpy()) for a, b in data], start.body.weight.detach().numpy(),
                             start.head.weight.detach().numpy(), rounds=2, steps=steps, lr=lr, mu=0.0, tau=tau)
    assert np.abs(w - plain_w).max() > 1e-4  # the contrastive term really moved round 2


# ----- boundaries -----
def test_mu_zero_is_fedavg_exactly(tmp_path):
    data = least_squares_clients(sizes=SIZES, seed=4)
    moon, _ = run_oracle(tmp_path, "moon", rounds=2, steps=3, lr=0.05, data=data, model=TwoLayer(), mu=0.0)
    plain, _ = run_oracle(tmp_path / "fedavg", "fedavg", rounds=2, steps=3, lr=0.05, data=data, model=TwoLayer())
    assert all(torch.equal(moon[key], plain[key]) for key in plain)


def test_a_clients_first_round_is_fedavgs_local_training_and_its_state_is_its_trained_model():
    a, b = least_squares_clients(sizes=(9,), seed=2)[0]
    moon, worker = build_algorithm("moon", TwoLayer(), {"0": 9}, {"mu": 5.0})
    fedavg, plain_worker = build_algorithm("fedavg", TwoLayer(), {"0": 9})
    broadcast = {"global": {key: value.clone() for key, value in worker.state_dict().items()}}
    first = moon.client_update(worker, broadcast, {}, [{"x": a, "y": b}], client_config(9, lr=0.05, steps=4))
    plain = fedavg.client_update(plain_worker, broadcast, {}, [{"x": a, "y": b}], client_config(9, lr=0.05, steps=4))
    assert all(torch.equal(first.upload[DELTA][key], plain.upload[DELTA][key]) for key in plain.upload[DELTA])
    # privacy: the previous model w_i^t stays on the client; only Δ = w_i^t − w^t is uploaded
    assert set(first.upload) == {DELTA} and set(first.client_state) == {"body.weight", "head.weight"}
    for key, value in first.client_state.items():
        assert torch.equal(value, broadcast["global"][key] + first.upload[DELTA][key])
        assert not any(torch.equal(value, sent) for sent in first.upload[DELTA].values())
    assert moon.personal_model({"global": broadcast["global"]}, first.client_state) is None  # not a personal model
    second = moon.client_update(worker, broadcast, first.client_state, [{"x": a, "y": b}],
                                client_config(9, lr=0.05, steps=4))
    assert not torch.equal(second.upload[DELTA]["body.weight"], plain.upload[DELTA]["body.weight"])  # round 2 contrasts


def test_the_contrastive_loss_by_hand():
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    orthogonal = torch.tensor([[0.0, 3.0], [-1.0, 0.0]], dtype=torch.float64)
    # z_glob ∥ z (cos 1), z_prev ⟂ z (cos 0): −log(e^{1/τ}/(e^{1/τ} + 1)) = log(1 + e^{−1/τ})
    expected = math.log(1 + math.exp(-2))
    assert model_contrastive_loss(z, 3 * z, orthogonal, 0.5).item() == pytest.approx(expected, abs=1e-15)
    # z_prev = z_glob: log 2 whatever z is (the first round's value with the global model as the previous one)
    other = torch.tensor([[0.3, -0.2], [1.0, 1.0]], dtype=torch.float64)
    assert model_contrastive_loss(z, other, other, 0.7).item() == pytest.approx(math.log(2), abs=1e-15)
    # the roles swapped (z_glob ⟂ z, z_prev ∥ z): log(1 + e^{1/τ})
    assert model_contrastive_loss(z, orthogonal, z, 0.5).item() == pytest.approx(math.log(1 + math.exp(2)), abs=1e-14)


def test_each_step_runs_the_trained_model_once_and_each_fixed_model_once_in_eval_mode():
    torch.manual_seed(0)
    samples = {"x": torch.randn(8, 4), "y": torch.randn(8)}
    algorithm, worker = build_algorithm("moon", TinyNet(), {"0": 8})
    start = {key: value.clone() for key, value in worker.state_dict().items()}
    previous = {key: value + 0.1 if value.is_floating_point() else value for key, value in start.items()}
    modes = []
    worker.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    result = algorithm.client_update(worker, {"global": start}, previous, [samples],
                                     client_config(8, lr=0.05, steps=3, loss_fn=tiny_loss))
    assert modes == [True, False, False] * 3  # trained model (train mode), then z_glob and z_prev (eval mode)
    assert worker.training and result.metrics["local_steps"] == 3
    assert not worker.body[0]._forward_hooks and not worker.head._forward_pre_hooks  # the tap's hooks are gone
    assert torch.equal(previous["body.1.running_mean"], start["body.1.running_mean"] + 0.1)  # fixed models unchanged


def test_a_replayed_fixed_model_is_the_models_eval_forward_and_changes_nothing():
    torch.manual_seed(1)
    model, x = TinyNet(), torch.randn(6, 4)
    other = TinyNet()
    weights = {key: value.clone() for key, value in other.state_dict().items()}
    tap = RepresentationTap(model, tiny_loss, "moon")
    tap(model, {"x": x, "y": torch.zeros(6)})  # the trained model's step (train mode: its BatchNorm statistics move)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    z = tap.take()
    replayed = tap.replay(weights, torch.device("cpu"))
    other.eval()
    with torch.no_grad():
        assert torch.equal(replayed, other.body(x))
    assert model.training and z.requires_grad and not replayed.requires_grad
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
    assert all(torch.equal(value, other.state_dict()[key]) for key, value in weights.items())


def test_hooks_are_removed_when_the_task_loss_raises():
    model = TinyNet()

    def failing(module, batch, reduction="mean"):
        module(batch["x"])
        raise RuntimeError("disk on fire")

    algorithm, worker = build_algorithm("moon", model, {"0": 4})
    with pytest.raises(RuntimeError, match="disk on fire"):
        algorithm.client_update(worker, {"global": worker.state_dict()}, {}, [{"x": torch.randn(4, 4)}],
                                client_config(4, steps=1, loss_fn=failing))
    assert not worker._forward_pre_hooks and not worker.body[0]._forward_hooks and not worker.head._forward_pre_hooks


# ----- refusals -----
@pytest.mark.parametrize("settings, message", [({"mu": -0.5}, "setting mu must be >= 0, got -0.5"),
                                               ({"tau": 0.0}, "setting tau must be > 0, got 0.0")])
def test_out_of_range_settings_are_refused(settings, message):
    with pytest.raises(TaskHetError, match=message):
        build_algorithm("moon", TwoLayer(), {"0": 1}, settings)


def test_the_oracle_loss_is_the_tasks():  # guards the oracle's task gradient against the loss the engine uses
    a, b = least_squares_clients(sizes=(5,), seed=1)[0]
    model = TwoLayer()
    least_squares_loss(model, {"x": a, "y": b}).backward()
    grad_w, grad_h = task_gradients(model.body.weight.detach().numpy(), model.head.weight.detach().numpy(), a.numpy(),
                                    b.numpy())
    assert np.allclose(model.body.weight.grad.numpy(), grad_w, rtol=0, atol=1e-14)
    assert np.allclose(model.head.weight.grad.numpy(), grad_h, rtol=0, atol=1e-14)


def test_a_fixed_models_replay_stops_once_the_representation_exists():
    """MOON's two fixed models need z only: the replay runs no head (a dense TaskModel: no decoder either)."""
    model = TinyNet()
    calls = []
    model.head.register_forward_hook(lambda *_: calls.append("head"))
    tap = RepresentationTap(model, tiny_loss, "moon")
    batch = {"x": torch.randn(5, 4), "y": torch.randn(5)}
    tap(model, batch)
    z = tap.take()
    assert calls == ["head"]  # the trained model's own forward reaches its head
    replayed = tap.replay({key: value.clone() for key, value in model.state_dict().items()}, torch.device("cpu"))
    assert calls == ["head"] and replayed.shape == z.shape  # the replay stopped at the head's input
    dense = build_task_model("depth_euclidean", "small_cnn", "none", seed=0)
    dense.decoder.register_forward_hook(lambda *_: calls.append("decoder"))
    dense_tap = RepresentationTap(dense, lambda net, batch, reduction="mean": net(batch["x"])[0].mean(), "moon")
    dense_tap(dense, {"x": torch.rand(2, 3, 32, 32)})
    dense_tap.take()
    dense_tap.replay(dense.state_dict(), torch.device("cpu"))
    assert calls.count("decoder") == 1  # only the trained model's forward ran the decoder
