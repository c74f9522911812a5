"""Per-FedAvg (network/algorithms/perfedavg.py) against the paper's equations, in numpy float64 on least squares.

f(w; D) = ‖A_D w − b_D‖²/(2|D|) (tests/oracles.py's least_squares_loss on a batch D), so by hand
∇f(w; D) = A_Dᵀ(A_D w − b_D)/|D| and ∇²f(w; D) = A_DᵀA_D/|D| (constant: the oracle uses it exactly, so it checks
TaskHet's finite difference too, which is exact on a quadratic up to rounding).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from network.algorithms import build_algorithm
from network.algorithms.perfedavg import hessian_vector_product
from network.algorithms.skeleton import DELTA
from network.client import ClientData, Finetune, evaluate_client
from network.local_train import NonFiniteLossError
from tests.oracles import (CPU, DIM, batched_clients, client_config, least_squares_clients, least_squares_loss,
                           linear_model, mean_loss, numpy_gradient, run_batched)
from utils.errors import TaskHetError

BATCH_SIZES = ((3, 5, 2, 1), (4, 6, 7))  # two clients of 11 and 17 rows, batches of unequal sizes


def client_batches() -> list[list[dict]]:
    return batched_clients(BATCH_SIZES, seed=3)




# ----- the numpy oracle, from the paper's Algorithm 1 -----


def hessian(batch):
    a = batch["x"].numpy()
    return a.T @ a / len(a)


def meta_step(w, group, alpha, beta, version, velocity=None, momentum=0.0, weight_decay=0.0):
    """One local step; weight decay as the L2 term (wd/2)‖w‖² of f (gradient + wd·w, Hessian + wd·I)."""
    w_tilde = w - alpha * (numpy_gradient(w, group[0]) + weight_decay * w)
    direction = numpy_gradient(w_tilde, group[1]) + weight_decay * w_tilde
    if version == "hf":
        direction = direction - alpha * (hessian(group[2]) + weight_decay * np.eye(len(w))) @ direction
    velocity = direction if velocity is None else momentum * velocity + direction  # torch's SGD momentum buffer
    return w - beta * velocity, velocity


def local_round(w, batches, steps, alpha, beta, version, momentum=0.0, weight_decay=0.0):
    size = 2 if version == "fo" else 3
    cycled = [batches[index % len(batches)] for index in range(steps * size)]  # consecutive batches, cycled
    velocity = None
    for step in range(steps):
        w, velocity = meta_step(w, cycled[step * size:(step + 1) * size], alpha, beta, version, velocity, momentum,
                                weight_decay)
    return w


def oracle(batches, rounds, steps, alpha, beta, version):
    w = np.zeros(DIM)
    sizes = np.array([sum(len(batch["y"]) for batch in own) for own in batches], dtype=float)
    for _ in range(rounds):
        deltas = [local_round(w, own, steps, alpha, beta, version) - w for own in batches]
        w = w + sum(size * delta for size, delta in zip(sizes, deltas)) / sizes.sum()  # the paper's average
    return w


@pytest.mark.parametrize("version", ["fo", "hf"])
def test_two_rounds_equal_the_papers_algorithm_in_numpy(tmp_path, version):
    batches = client_batches()
    settings = {"version": version, "outer_lr": 0.3, "delta": 0.01}
    taskhet, _ = run_batched(tmp_path, "perfedavg", batches, rounds=2, steps=3, lr=0.05, **settings)
    expected = oracle(batches, rounds=2, steps=3, alpha=0.05, beta=0.3, version=version)
    assert np.allclose(taskhet, expected, rtol=0, atol=1e-12)
    fedavg_like = oracle(batches, rounds=2, steps=3, alpha=0.0, beta=0.3, version=version)
    assert np.abs(expected - fedavg_like).max() > 1e-3  # α matters: the meta-gradient is not a plain gradient


def test_hf_differs_from_fo_by_the_curvature_term(tmp_path):
    batches = client_batches()
    fo, _ = run_batched(tmp_path / "fo", "perfedavg", batches, rounds=1, steps=2, lr=0.05, version="fo", outer_lr=0.3)
    hf, _ = run_batched(tmp_path / "hf", "perfedavg", batches, rounds=1, steps=2, lr=0.05, version="hf", outer_lr=0.3)
    assert np.abs(fo - hf).max() > 1e-4


@pytest.mark.parametrize("version", ["fo", "hf"])
def test_momentum_acts_on_the_outer_step_and_weight_decay_is_part_of_f(version):
    batches = client_batches()[0]
    algorithm, model = build_algorithm("perfedavg", linear_model(), {"0": 11}, {"version": version, "outer_lr": 0.2})
    start = np.linspace(-1, 1, DIM)
    broadcast = {"global": {"weight": torch.tensor(start).unsqueeze(0)}}
    result = algorithm.client_update(model, broadcast, {}, batches,
                                     client_config(11, lr=0.05, steps=3, momentum=0.6, weight_decay=0.1))
    expected = local_round(start, batches, 3, 0.05, 0.2, version, momentum=0.6, weight_decay=0.1)
    assert np.allclose(result.upload[DELTA]["weight"].squeeze(0).numpy(), expected - start, rtol=0, atol=1e-13)
    assert result.metrics["local_steps"] == 3 and result.client_state == {}  # meta-steps; nothing personal kept


def test_alpha_zero_is_fedavg_at_beta_on_every_second_batch():
    batches = client_batches()[0]
    w0 = {"global": {"weight": torch.linspace(-1, 1, DIM, dtype=torch.float64).unsqueeze(0)}}
    algorithm, model = build_algorithm("perfedavg", linear_model(), {"0": 11}, {"version": "fo", "outer_lr": 0.2})
    meta = algorithm.client_update(model, w0, {}, batches, client_config(11, lr=0.0, steps=2))
    fedavg, model = build_algorithm("fedavg", linear_model(), {"0": 11})
    plain = fedavg.client_update(model, w0, {}, batches[1::2], client_config(11, lr=0.2, steps=2))  # D' = b1, b3
    assert torch.equal(meta.upload[DELTA]["weight"], plain.upload[DELTA]["weight"])


def test_an_epoch_budget_completes_its_last_group_from_the_next_pass():
    batches = client_batches()[1]  # 3 batches: FO groups (b0, b1), (b2 | b0 of the next pass)
    algorithm, model = build_algorithm("perfedavg", linear_model(), {"0": 17}, {"version": "fo", "outer_lr": 0.2})
    start = np.zeros(DIM)
    result = algorithm.client_update(model, {"global": {"weight": torch.zeros(1, DIM, dtype=torch.float64)}}, {},
                                     batches, client_config(17, lr=0.05, steps=None, local_epochs=1))
    assert result.metrics["local_steps"] == 2
    assert np.allclose(result.upload[DELTA]["weight"].squeeze(0).numpy(),
                       local_round(start, batches, 2, 0.05, 0.2, "fo") - start, rtol=0, atol=1e-13)


def test_one_finetuning_step_at_evaluation_is_the_papers_personalisation_at_alpha():
    batches = client_batches()[0]
    algorithm, model = build_algorithm("perfedavg", linear_model(), {"0": 11})
    w = np.linspace(-1, 1, DIM)
    seen = []

    def record(evaluated, loader):
        seen.append(evaluated.weight.detach().squeeze(0).numpy().copy())
        return mean_loss(evaluated, loader)

    client = ClientData("0", 11, lambda seed: batches, batches)
    weights = {"weight": torch.tensor(w).unsqueeze(0)}
    splits = evaluate_client(algorithm, model, record, {"global": weights}, weights, None, client, least_squares_loss,
                             CPU, Finetune(steps=1, lr=0.05), seed=0)
    assert "client_test_finetuned" in splits and not algorithm.personalized
    assert np.allclose(seen[-1], w - 0.05 * numpy_gradient(w, batches[0]), rtol=0, atol=1e-15)  # w − α∇f(w; D)


def test_the_finite_difference_replays_the_dropout_masks_of_its_plus_pass():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 1, bias=False, dtype=torch.float64), nn.Dropout(0.5))
    params = list(model.parameters())
    a, b = least_squares_clients(sizes=(12,), seed=1)[0]
    vector = [torch.linspace(-1, 1, DIM, dtype=torch.float64).unsqueeze(0)]
    products = []
    for delta in (1e-2, 1e-6):
        torch.manual_seed(5)  # the same masks for both calls; within a call, only a replay makes them agree
        products.append(hessian_vector_product(model, params, {"x": a, "y": b}, vector, delta, client_config(12))[0])
    # With one mask the loss is quadratic in w, so the difference is exact whatever δ.
    assert products[0].abs().max() > 0.1 and torch.allclose(products[0], products[1], rtol=0, atol=1e-8)


def test_a_nan_loss_stops_the_client():
    batches = client_batches()[0]
    batches[1] = {"x": batches[1]["x"], "y": torch.full_like(batches[1]["y"], float("nan"))}
    algorithm, model = build_algorithm("perfedavg", linear_model(), {"0": 11})
    with pytest.raises(NonFiniteLossError, match="nan"):
        algorithm.client_update(model, {"global": {"weight": torch.zeros(1, DIM, dtype=torch.float64)}}, {}, batches,
                                client_config(11, steps=2))


def test_defaults_are_the_papers():
    settings = build_algorithm("perfedavg", linear_model(), {"0": 1})[0].settings
    assert (settings.version, settings.outer_lr, settings.delta) == ("hf", 0.001, 0.001)


@pytest.mark.parametrize("settings, message", [
    ({"version": "so"}, "perfedavg setting version must be one of fo, hf, got 'so'"),
    ({"outer_lr": 0.0}, "setting outer_lr must be > 0, got 0.0"),
    ({"delta": -1e-3}, "setting delta must be > 0, got -0.001"),
])
def test_bad_settings_are_refused_naming_the_setting(settings, message):
    with pytest.raises(TaskHetError, match=f"^{message}$"):
        build_algorithm("perfedavg", linear_model(), {"0": 1}, settings)
