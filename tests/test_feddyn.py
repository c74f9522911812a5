"""FedDyn (network/algorithms/feddyn.py): Algorithm 1 of Acar et al. (ICLR 2021) against a numpy oracle, by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from network.algorithms import build_algorithm
from network.algorithms.base import ServerState, Upload
from network.algorithms.feddyn import H_PREFIX
from network.algorithms.skeleton import DELTA
from tests.oracles import (DIM, TwoLayer, client_config, least_squares_clients, linear_model, max_curvature,
                           relative_error, run_oracle, uniform_optimum)
from tests.tiny_models import TinyNet
from utils.errors import TaskHetError

SIZES = (12, 30, 7)  # m = 3 clients of unequal sizes
STEPS = (3, 5, 4)  # each client's local steps
ROUNDS = ((0, 1), (1, 2))  # participants: client 1 trains twice, client 2 joins in round 2 (zero state), 0 leaves


def split_batches(a, b):
    """Two unequal batches of a client's rows (cycled by the local loop)."""
    cut = len(b) // 3
    return [(a[:cut], b[:cut]), (a[cut:], b[cut:])]


def numpy_client(theta, g_prev, batches, lr, steps, alpha):
    """The paper's local problem by plain SGD, in float64 numpy; returns (θ_k^t, ∇L_k(θ_k^t)).

    Local objective L_k(w) − ⟨g_prev, w⟩ + (α/2)‖w − θ‖², with L_k on a batch (A, b) = ‖A w − b‖²/(2 n_b):
    d/dw of ½(a·w − y)² is (a·w − y)·a, so ∇L_k = Aᵀ(A w − b)/n_b; the linear term gives −g_prev; the
    quadratic gives α(w − θ).
    """
    w = theta.copy()
    for step in range(steps):
        a, b = batches[step % len(batches)]
        w = w - lr * (a.T @ (a @ w - b) / len(b) - g_prev + alpha * (w - theta))
    return w, g_prev - alpha * (w - theta)


def numpy_server(theta, h, local_models, shares, alpha):
    """The paper's server: h ← h − α·Σ_P s_k(θ_k − θ), θ ← Σ_P s_k θ_k / Σ_P s_k − h/α (s_k = 1/m: Algorithm 1)."""
    h = h - alpha * sum(shares[k] * (local - theta) for k, local in local_models.items())
    mean = sum(shares[k] * local for k, local in local_models.items()) / sum(shares[k] for k in local_models)
    return mean - h / alpha, h


@pytest.mark.parametrize("weighting, alpha", [("uniform", 0.3), ("samples", 0.05)])
def test_two_rounds_with_partial_participation_equal_the_numpy_oracle(weighting, alpha):
    data = least_squares_clients(sizes=SIZES, seed=4)
    lr = 0.05
    ids = [str(k) for k in range(len(SIZES))]
    algorithm, model = build_algorithm("feddyn", linear_model(), dict(zip(ids, SIZES)),
                                       {"alpha_dyn": alpha, "weighting": weighting})
    theta0 = np.linspace(-1, 1, DIM)
    server = algorithm.init_server({"weight": torch.tensor(theta0).unsqueeze(0)})
    shares = {k: 1 / len(SIZES) if weighting == "uniform" else SIZES[k] / sum(SIZES) for k in range(len(SIZES))}
    theta, h, g = theta0, np.zeros(DIM), {k: np.zeros(DIM) for k in range(len(SIZES))}
    states = {}
    for participants in ROUNDS:
        uploads, local_models = [], {}
        for k in participants:
            a, b = data[k]
            batches = split_batches(a.numpy(), b.numpy())
            local_models[k], g[k] = numpy_client(theta, g[k], batches, lr, STEPS[k], alpha)
            result = algorithm.client_update(model, algorithm.broadcast(server), states.get(ids[k], {}),
                                             [{"x": torch.tensor(x), "y": torch.tensor(y)} for x, y in batches],
                                             client_config(SIZES[k], lr=lr, steps=STEPS[k]))
            states[ids[k]] = result.client_state
            np.testing.assert_allclose(result.client_state["weight"].squeeze(0).numpy(), g[k], rtol=0, atol=1e-12)
            uploads.append(Upload(ids[k], result.upload, SIZES[k]))
        server = algorithm.aggregate(server, uploads)
        theta, h = numpy_server(theta, h, local_models, shares, alpha)
        np.testing.assert_allclose(server.models["global"]["weight"].squeeze(0).numpy(), theta, rtol=0, atol=1e-12)
        np.testing.assert_allclose(server.tensors[H_PREFIX + "weight"].squeeze(0).numpy(), h, rtol=0, atol=1e-12)


def test_the_server_rule_by_hand_and_an_all_zero_round_moves_the_model_by_minus_h_over_alpha():
    algorithm, _ = build_algorithm("feddyn", linear_model(), {"a": 10, "b": 20, "c": 30}, {"alpha_dyn": 0.5})
    server = algorithm.init_server({"weight": torch.ones(1, DIM, dtype=torch.float64)})
    ones = torch.ones(1, DIM, dtype=torch.float64)
    new = algorithm.aggregate(server, [Upload("a", {DELTA: {"weight": 0.2 * ones}}, 10),
                                       Upload("b", {DELTA: {"weight": -0.4 * ones}}, 20)])
    # m = 3: h = −0.5·(1/3)·(0.2 − 0.4) = 1/30; θ = 1 + (0.2 − 0.4)/2 − (1/30)/0.5 = 0.9 − 1/15 (sizes ignored)
    assert torch.allclose(new.tensors[H_PREFIX + "weight"], ones / 30, rtol=0, atol=1e-15)
    assert torch.allclose(new.models["global"]["weight"], (0.9 - 1 / 15) * ones, rtol=0, atol=1e-15)
    zero = algorithm.aggregate(new, [Upload("c", {DELTA: {"weight": 0 * ones}}, 30)])  # h unchanged: θ − h/α
    assert torch.allclose(zero.models["global"]["weight"], (0.9 - 2 / 15) * ones, rtol=0, atol=1e-15)
    first = algorithm.aggregate(server, [Upload("c", {DELTA: {"weight": 0 * ones}}, 30)])  # h = 0: unchanged
    assert torch.equal(first.models["global"]["weight"], server.models["global"]["weight"])


def test_a_first_round_client_is_fedprox_with_mu_alpha():
    """With ∇L_k(θ_k^0) = 0 the linear term vanishes: the local problem is FedProx's with μ = α."""
    a, b = least_squares_clients(sizes=(20,))[0]
    broadcast = {"global": {"weight": torch.linspace(-1, 1, DIM, dtype=torch.float64).unsqueeze(0)}}
    cfg = client_config(20, lr=0.05, steps=4, momentum=0.9)
    dyn, model = build_algorithm("feddyn", linear_model(), {"0": 20}, {"alpha_dyn": 0.7})
    prox, _ = build_algorithm("fedprox", linear_model(), {"0": 20}, {"mu": 0.7})
    dyn_delta = dyn.client_update(model, broadcast, {}, [{"x": a, "y": b}], cfg).upload[DELTA]["weight"]
    prox_delta = prox.client_update(model, broadcast, {}, [{"x": a, "y": b}], cfg).upload[DELTA]["weight"]
    assert torch.allclose(dyn_delta, prox_delta, rtol=0, atol=1e-15)


def test_converges_to_the_optimum_of_the_unweighted_objective_where_fedavg_stays_off(tmp_path):
    data = least_squares_clients(sizes=(10, 40, 20))  # heterogeneous local optima, many local steps
    lr = 0.3 / max_curvature(data)
    dyn, _ = run_oracle(tmp_path, "feddyn", rounds=40, steps=10, lr=lr, data=data, alpha_dyn=1.0)
    fedavg, _ = run_oracle(tmp_path, "fedavg", rounds=40, steps=10, lr=lr, data=data, weighting="uniform")
    assert relative_error(dyn, uniform_optimum(data)) < 1e-7
    assert relative_error(fedavg, uniform_optimum(data)) > 1e-2  # client drift: FedAvg's fixed point is elsewhere


def test_the_gradient_state_stays_on_the_client_and_frozen_entries_are_never_touched():
    model = TwoLayer()
    model.body.weight.requires_grad_(False)  # a frozen encoder: layout.fixed_keys
    algorithm, worker = build_algorithm("feddyn", model, {"0": 20}, {"alpha_dyn": 0.2})
    server = algorithm.init_server({key: value.clone() for key, value in worker.state_dict().items()})
    assert set(server.tensors) == {H_PREFIX + "head.weight"}
    a, b = least_squares_clients(sizes=(20,))[0]
    state = {}
    for _ in range(2):
        result = algorithm.client_update(worker, algorithm.broadcast(server), state, [{"x": a, "y": b}],
                                         client_config(20, steps=3))
        state = result.client_state
        assert set(state) == {"head.weight"} and set(result.upload) == {DELTA}
        assert set(result.upload[DELTA]) == {"head.weight"}  # no gradient state, no frozen entry
        assert not any(torch.equal(value, state["head.weight"]) for value in result.upload[DELTA].values())
        server = algorithm.aggregate(server, [Upload("0", result.upload, 20)])
    assert torch.equal(server.models["global"]["body.weight"], model.body.weight)
    assert bool(state["head.weight"].abs().sum() > 0)


def test_buffers_take_the_plain_mean_without_h():
    algorithm, model = build_algorithm("feddyn", TinyNet(), {"a": 1, "b": 3}, {"alpha_dyn": 0.5})
    server = algorithm.init_server({key: value.clone() for key, value in model.state_dict().items()})
    server = ServerState(server.models, {key: torch.full_like(value, 0.25) for key, value in server.tensors.items()})
    ones = {key: torch.ones_like(value) for key, value in server.models["global"].items()}
    new = algorithm.aggregate(server, [Upload("a", {DELTA: ones}, 1), Upload("b", {DELTA: ones}, 3)])
    before, after = server.models["global"], new.models["global"]
    assert torch.equal(after["body.1.running_mean"], before["body.1.running_mean"] + 1)  # no −h/α on buffers
    assert "feddyn_h/body.1.running_mean" not in new.tensors
    # h = 0.25 − 0.5·(2/2)·1 = −0.25 over the parameters; θ + 1 − h/α = θ + 1.5
    assert torch.allclose(after["body.0.weight"], before["body.0.weight"] + 1.5, rtol=0, atol=1e-6)


@pytest.mark.parametrize("value", [0.0, -0.01])
def test_a_non_positive_alpha_is_refused_naming_the_setting(value):
    with pytest.raises(TaskHetError, match=rf"^setting alpha_dyn must be > 0, got {value}$"):
        build_algorithm("feddyn", linear_model(), {"0": 1}, {"alpha_dyn": value})


def test_the_defaults_are_the_papers():
    settings = build_algorithm("feddyn", linear_model(), {"0": 1})[0].settings
    assert settings.alpha_dyn == 0.01 and settings.weighting == "uniform"
