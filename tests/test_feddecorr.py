"""FedDecorr (network/algorithms/feddecorr.py) against the paper's equations: a numpy oracle over two rounds, the
regulariser by hand, its boundaries (β = 0 and batches of one are FedAvg), the representation it reads
(network/algorithms/representation.py) and the refusals. The generic tests over ``list_algorithms()`` cover the
engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models import build_task_model
from network.algorithms import build_algorithm
from network.algorithms.feddecorr import decorrelation_loss
from network.algorithms.representation import RepresentationTap
from network.algorithms.skeleton import DELTA
from tests.oracles import TwoLayer, client_config, least_squares_clients, run_oracle
from tests.test_moon import task_gradients
from tests.tiny_models import TinyNet, loss_fn as tiny_loss
from utils.errors import TaskHetError

SIZES = (12, 20)  # unequal clients: the server weighs them 12/32 and 20/32
EPS = 1e-8  # ε of the standardisation z ← (z − μ)/√(σ² + ε)


# ----- the oracle: L = (1/d²)·‖K‖_F², K = ẐᵀẐ/N, in numpy float64, gradient by hand -----
def decorrelation_gradient(w, a):
    """∇_W of (1/d²)·‖K‖_F² for z = A Wᵀ (N × d), K = ẐᵀẐ/N, ẑ_ij = c_ij/s_j, c = z − mean(z),
    s_j = √(mean_i c_ij² + ε).

    ∂L/∂K = 2K/d², so ∂L/∂Ẑ = G = Ẑ(∂L/∂K + ∂L/∂Kᵀ)/N = 4·Ẑ K/(N d²) (K symmetric).
    ẑ_ij = c_ij/s_j with ∂s_j/∂c_ij = c_ij/(N s_j): ∂L/∂c_ij = G_ij/s_j − c_ij·(Σ_k G_kj c_kj)/(N s_j³).
    c = z − mean(z): ∂L/∂z_ij = ∂L/∂c_ij − mean_k ∂L/∂c_kj. z = A Wᵀ: ∂L/∂W = (∂L/∂z)ᵀ A.
    """
    z = a @ w.T
    n, d = z.shape
    c = z - z.mean(0)
    s = np.sqrt((c ** 2).mean(0) + EPS)
    zhat = c / s
    k = zhat.T @ zhat / n
    g = 4 * zhat @ k / (n * d ** 2)
    dc = g / s - c * (g * c).sum(0) / (n * s ** 3)
    dz = dc - dc.mean(0)
    return dz.T @ a


def feddecorr_oracle(data, w, h, rounds, steps, lr, beta):
    """FedDecorr with full-batch SGD, every client every round, the sample-weighted mean of Δ on the server."""
    total = sum(len(b) for _, b in data)
    for _ in range(rounds):
        new_w, new_h = w.copy(), h.copy()
        for a, b in data:
            local_w, local_h = w.copy(), h.copy()
            for _ in range(steps):
                grad_w, grad_h = task_gradients(local_w, local_h, a, b)
                grad_w = grad_w + beta * decorrelation_gradient(local_w, a)
                local_w, local_h = local_w - lr * grad_w, local_h - lr * grad_h
            new_w += len(b) / total * (local_w - w)
            new_h += len(b) / total * (local_h - h)
        w, h = new_w, new_h
    return w, h


def test_two_rounds_of_two_unequal_clients_equal_the_numpy_oracle(tmp_path):
    data = least_squares_clients(sizes=SIZES, seed=5)
    beta, lr, steps = 0.6, 0.05, 3
    final, _ = run_oracle(tmp_path, "feddecorr", rounds=2, steps=steps, lr=lr, data=data, model=TwoLayer(), beta=beta)
    start, arrays = TwoLayer(), [(a.numpy(), b.numpy()) for a, b in data]
    w0, h0 = start.body.weight.detach().numpy(), start.head.weight.detach().numpy()
    w, h = feddecorr_oracle(arrays, w0, h0, rounds=2, steps=steps, lr=lr, beta=beta)
    assert np.allclose(final["body.weight"].numpy(), w, rtol=0, atol=1e-12)
    assert np.allclose(final["head.weight"].numpy(), h, rtol=0, atol=1e-12)
    plain_w, _ = feddecorr_oracle(arrays, w0, h0, rounds=2, steps=steps, lr=lr, beta=0.0)
    assert np.abs(w - plain_w).max() > 1e-4  # the decorrelation term really moved the body


# ----- the regulariser by hand -----
def test_the_decorrelation_loss_by_hand():
    t = torch.arange(1.0, 5.0, dtype=torch.float64)[:, None]
    # two perfectly correlated dimensions: K = [[1, 1], [1, 1]] (up to ε), L = 4/d² = 1
    assert decorrelation_loss(torch.cat([t, 2 * t + 3], 1)).item() == pytest.approx(1.0, abs=1e-7)
    # uncorrelated ±1 dimensions: K = I, L = d/d² = 1/2
    signs = torch.tensor([[1.0, 1.0], [-1.0, 1.0], [1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    assert decorrelation_loss(signs).item() == pytest.approx(0.5, abs=1e-7)
    # a constant dimension standardises to 0 (its K row is 0): K = [[1, 0], [0, 0]], L = 1/4
    assert decorrelation_loss(torch.cat([t, torch.full_like(t, 7.0)], 1)).item() == pytest.approx(0.25, abs=1e-7)
    # the diagonal is part of ‖K‖_F² (the paper's 1/d², not the code's off-diagonal mean): 3 uncorrelated dims give 1/3
    three = torch.tensor([[1.0, 1, 1], [1, -1, -1], [-1, 1, -1], [-1, -1, 1]], dtype=torch.float64)
    assert decorrelation_loss(three).item() == pytest.approx(1 / 3, abs=1e-7)


def test_a_batch_of_one_sample_adds_nothing_and_is_fedavg_exactly():
    a, b = least_squares_clients(sizes=(5,), seed=3)[0]
    z = torch.randn(1, 3, dtype=torch.float64, requires_grad=True)
    loss = decorrelation_loss(z)
    assert loss.item() == 0.0 and not loss.requires_grad
    singles = [{"x": a[index:index + 1], "y": b[index:index + 1]} for index in range(5)]
    decorr, worker = build_algorithm("feddecorr", TwoLayer(), {"0": 5}, {"beta": 0.9})
    fedavg, plain_worker = build_algorithm("fedavg", TwoLayer(), {"0": 5})
    broadcast = {"global": {key: value.clone() for key, value in worker.state_dict().items()}}
    result = decorr.client_update(worker, broadcast, {}, singles, client_config(5, lr=0.05, steps=5))
    plain = fedavg.client_update(plain_worker, broadcast, {}, singles, client_config(5, lr=0.05, steps=5))
    assert all(torch.equal(result.upload[DELTA][key], plain.upload[DELTA][key]) for key in plain.upload[DELTA])
    assert result.client_state == {} and set(result.upload) == {DELTA}  # no personal state: nothing kept, Δ sent


def test_beta_zero_is_fedavg_exactly(tmp_path):
    data = least_squares_clients(sizes=SIZES, seed=5)
    decorr, _ = run_oracle(tmp_path, "feddecorr", rounds=2, steps=3, lr=0.05, data=data, model=TwoLayer(), beta=0.0)
    plain, _ = run_oracle(tmp_path / "fedavg", "fedavg", rounds=2, steps=3, lr=0.05, data=data, model=TwoLayer())
    assert all(torch.equal(decorr[key], plain[key]) for key in plain)


# ----- the representation (network/algorithms/representation.py) -----
def test_a_task_models_representation_is_its_pooled_deepest_encoder_map():
    model = build_task_model("digit_class", "small_cnn", "none", seed=0, num_classes=10)
    x = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    tap = RepresentationTap(model, lambda module, batch, reduction="mean": module(batch)[0].sum(), "feddecorr")
    tap(model, x)
    with torch.no_grad():
        expected = model.encoder(model.normalise(x))[-1].mean(dim=(2, 3))
    assert tap.take().shape == (3, model.encoder.channels[-1])
    tap(model, x)
    assert torch.allclose(tap.take(), expected, rtol=0, atol=1e-6)
    assert not model.encoder._forward_hooks and not model._forward_pre_hooks  # removed after each loss call


def test_a_models_representation_without_an_encoder_is_its_heads_input_and_runs_once_per_step():
    torch.manual_seed(2)
    model, x = TinyNet().eval(), torch.randn(5, 4)
    tap = RepresentationTap(model, tiny_loss, "feddecorr")
    tap(model, {"x": x, "y": torch.zeros(5)})
    assert torch.equal(tap.take(), model.body(x))
    with pytest.raises(TaskHetError, match="feddecorr: the task loss's forward never computed the model's"):
        tap.take()  # consumed: a step reads its own forward's z only
    calls = []
    algorithm, worker = build_algorithm("feddecorr", TinyNet(), {"0": 8}, {"beta": 0.5})
    worker.register_forward_pre_hook(lambda module, args: calls.append(1))
    batch = {"x": torch.randn(8, 4), "y": torch.randn(8)}
    algorithm.client_update(worker, {"global": worker.state_dict()}, {}, [batch],
                            client_config(8, lr=0.05, steps=3, loss_fn=tiny_loss))
    assert len(calls) == 3  # the term reuses the task loss's forward


# ----- refusals -----
@pytest.mark.parametrize("beta", [-0.1, float("inf"), float("nan")])
def test_out_of_range_beta_is_refused(beta):
    with pytest.raises(TaskHetError, match=r"setting beta must be (>= 0|a finite float), got"):
        build_algorithm("feddecorr", TwoLayer(), {"0": 1}, {"beta": beta})


def test_beta_above_one_is_allowed_for_the_authors_strength():
    # The authors' code scales the term about (N − 2)·d/(d − 1) times larger than the paper's (1/d²)·‖K‖_F², so
    # their β = 0.1 at batch 64 is β ≈ 6 here: a β above 1 must be accepted.
    assert build_algorithm("feddecorr", TwoLayer(), {"0": 1}, {"beta": 6.0})[0].settings.beta == 6.0


@pytest.mark.parametrize("samples, dims", [(4, 10), (10, 4), (3, 3)])
def test_the_term_is_the_papers_whether_the_batch_or_the_dimension_is_smaller(samples, dims):
    """N < d takes the N×N Gram matrix (‖ẐẐᵀ‖_F = ‖ẐᵀẐ‖_F); the value and its gradient are the d×d formula's."""
    from network.algorithms.feddecorr import decorrelation_loss

    z = torch.randn(samples, dims, generator=torch.Generator().manual_seed(3), dtype=torch.float64,
                    requires_grad=True)
    array = z.detach().numpy()
    centred = array - array.mean(axis=0)
    standardised = centred / np.sqrt((centred ** 2).mean(axis=0) + 1e-8)
    expected = ((standardised.T @ standardised / samples) ** 2).sum() / dims ** 2
    value = decorrelation_loss(z)
    assert abs(float(value.detach()) - expected) < 1e-12
    (gradient,) = torch.autograd.grad(value, z)
    direct = z.detach().clone().requires_grad_(True)
    centred_t = direct - direct.mean(dim=0)
    standardised_t = centred_t / (centred_t.pow(2).mean(dim=0) + 1e-8).sqrt()
    (reference,) = torch.autograd.grad((standardised_t.T @ standardised_t / samples).pow(2).sum() / dims ** 2, direct)
    assert torch.allclose(gradient, reference, rtol=1e-10, atol=1e-12)
