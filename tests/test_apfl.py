"""APFL (network/algorithms/apfl.py) against the paper's equations, in numpy float64 on least squares.

f(w; ξ) = ‖A_ξ w − b_ξ‖²/(2|ξ|) (tests/oracles.py's least_squares_loss on a batch ξ), so by hand
∇f(w; ξ) = A_ξᵀ(A_ξ w − b_ξ)/|ξ|; with v̄ = α·v + (1 − α)·w the chain rule gives ∇_v f(v̄) = α·∇f(v̄) and
∂f(v̄)/∂α = ⟨v − w, ∇f(v̄)⟩.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch import nn

from network.algorithms import build_algorithm
from network.algorithms.apfl import MIXING_WEIGHT
from network.algorithms.skeleton import DELTA
from tests.oracles import DIM, batched_clients, client_config, linear_model, numpy_gradient, run_batched
from utils.errors import TaskHetError

BATCH_SIZES = ((3, 5, 2), (4, 6, 7, 1))  # two clients of 10 and 18 rows, batches of unequal sizes


def client_batches() -> list[list[dict]]:
    return batched_clients(BATCH_SIZES, seed=4)




# ----- the numpy oracle, from the paper's Algorithm 1 and its adaptive α -----


def local_round(w, v, alpha, batches, steps, lr, alpha_lr, adaptive):
    """Every update from the values before the step: v̄^(t−1) = α v^(t−1) + (1 − α) w^(t−1), one batch ξ for all."""
    for step in range(steps):
        batch = batches[step % len(batches)]
        mixed_grad = numpy_gradient(alpha * v + (1 - alpha) * w, batch)
        next_alpha = np.clip(alpha - alpha_lr * (v - w) @ mixed_grad, 0, 1) if adaptive else alpha
        w, v, alpha = w - lr * numpy_gradient(w, batch), v - lr * alpha * mixed_grad, next_alpha
    return w, v, alpha


def oracle(batches, rounds, steps, lr, alpha_init, alpha_lr, adaptive):
    """The global w after ``rounds``, and each client's (v_i, α_i)."""
    w = np.zeros(DIM)
    sizes = np.array([sum(len(batch["y"]) for batch in own) for own in batches], dtype=float)
    personal = [(w.copy(), alpha_init) for _ in batches]  # a client's first round: v_i = w^t, α_i = alpha_init
    for _ in range(rounds):
        results = [local_round(w, v, alpha, own, steps, lr, alpha_lr, adaptive)
                   for own, (v, alpha) in zip(batches, personal)]
        personal = [(v, alpha) for _, v, alpha in results]
        w = w + sum(size * (local - w) for size, (local, _, _) in zip(sizes, results)) / sizes.sum()  # server mean
    return w, personal


@pytest.mark.parametrize("settings", [{"alpha_init": 0.3, "alpha_lr": 0.2, "adaptive": True},
                                      {"alpha_init": 0.7, "alpha_lr": 0.2, "adaptive": False}])
def test_two_rounds_equal_the_papers_algorithm_in_numpy(tmp_path, settings):
    batches = client_batches()
    taskhet, engine = run_batched(tmp_path / "apfl", "apfl", batches, rounds=2, steps=3, lr=0.05, **settings)
    w, personal = oracle(batches, rounds=2, steps=3, lr=0.05, **settings)
    assert np.allclose(taskhet, w, rtol=0, atol=1e-12)
    models = {"global": {"weight": torch.tensor(taskhet).unsqueeze(0)}}
    for client_id, (v, alpha) in zip(("0", "1"), personal):
        state = engine.store.get(client_id)
        assert np.allclose(state["weight"].squeeze(0).numpy(), v, rtol=0, atol=1e-12)
        assert abs(float(state[MIXING_WEIGHT]) - alpha) < 1e-12
        own = engine.algorithm.personal_model(models, state)["weight"].squeeze(0).numpy()
        assert np.allclose(own, alpha * v + (1 - alpha) * taskhet, rtol=0, atol=1e-12)  # v̄ with the current w
        if settings["adaptive"]:
            assert abs(alpha - settings["alpha_init"]) > 1e-3  # α moved


def test_a_huge_alpha_step_is_clipped_to_the_unit_interval():
    batches = client_batches()[0]
    algorithm, model = build_algorithm("apfl", linear_model(), {"0": 10}, {"alpha_lr": 1e6})
    zero = {"global": {"weight": torch.zeros(1, DIM, dtype=torch.float64)}}
    result = algorithm.client_update(model, zero, {}, batches, client_config(10, lr=0.05, steps=3))
    _, _, alpha = local_round(np.zeros(DIM), np.zeros(DIM), 0.5, batches, 3, 0.05, 1e6, True)
    assert alpha in (0.0, 1.0) and result.metrics[MIXING_WEIGHT] == alpha == float(result.client_state[MIXING_WEIGHT])


def test_alpha_fixed_at_zero_makes_the_personal_model_the_global_model(tmp_path):
    batches = client_batches()
    _, engine = run_batched(tmp_path / "apfl", "apfl", batches, rounds=2, steps=3, lr=0.05, alpha_init=0.0,
                            adaptive=False)
    for client_id in ("0", "1"):
        state = engine.store.get(client_id)
        assert torch.equal(state["weight"], torch.zeros(1, DIM, dtype=torch.float64))  # v never moves: ∇_v = 0·∇f
        own = engine.algorithm.personal_model(engine.server.models, state)
        assert torch.equal(own["weight"], engine.server.models["global"]["weight"])


def test_alpha_fixed_at_one_trains_the_personal_model_as_local_does(tmp_path):
    batches = client_batches()
    _, apfl = run_batched(tmp_path / "apfl", "apfl", batches, rounds=2, steps=3, lr=0.05, alpha_init=1.0,
                          adaptive=False)
    _, local = run_batched(tmp_path / "local", "local", batches, rounds=2, steps=3, lr=0.05)
    for client_id in ("0", "1"):
        assert torch.equal(apfl.store.get(client_id)["weight"], local.store.get(client_id)["weight"])
        own = apfl.algorithm.personal_model(apfl.server.models, apfl.store.get(client_id))
        assert torch.equal(own["weight"], local.store.get(client_id)["weight"])


def test_the_personal_model_and_alpha_never_leave_the_client():
    batches = client_batches()[0]
    algorithm, model = build_algorithm("apfl", linear_model(), {"0": 10}, {"alpha_init": 0.4})
    state = {"weight": torch.full((1, DIM), 0.5, dtype=torch.float64),
             MIXING_WEIGHT: torch.tensor(0.4, dtype=torch.float64)}
    broadcast = {"global": {"weight": torch.zeros(1, DIM, dtype=torch.float64)}}
    result = algorithm.client_update(model, broadcast, state, batches, client_config(10, lr=0.05, steps=2))
    assert result.upload.keys() == {DELTA} and result.upload[DELTA].keys() == {"weight"}  # Δw only
    assert not torch.allclose(result.upload[DELTA]["weight"], result.client_state["weight"])
    assert set(result.client_state) == {"weight", MIXING_WEIGHT}
    assert algorithm.personal_model(broadcast, {}) is None  # a client that never trained has no personal model


def test_buffers_are_not_mixed_the_personal_model_keeps_its_own_statistics():
    model = nn.Sequential(nn.Linear(DIM, 2, dtype=torch.float64), nn.BatchNorm1d(2, dtype=torch.float64),
                          nn.Linear(2, 1, dtype=torch.float64))
    algorithm, worker = build_algorithm("apfl", model, {"0": 10})
    state = {key: value + 1 for key, value in worker.state_dict().items()}
    state[MIXING_WEIGHT] = torch.tensor(0.25, dtype=torch.float64)
    shared = {key: value.clone() for key, value in worker.state_dict().items()}
    own = algorithm.personal_model({"global": shared}, state)
    assert torch.equal(own["1.running_var"], state["1.running_var"])
    assert torch.equal(own["1.num_batches_tracked"], state["1.num_batches_tracked"])
    assert torch.allclose(own["0.weight"], 0.25 * state["0.weight"] + 0.75 * shared["0.weight"], rtol=0, atol=1e-15)


@pytest.mark.parametrize("settings, message", [
    ({"alpha_init": -0.1}, "setting alpha_init must be in [0, 1], got -0.1"),
    ({"alpha_init": 1.5}, "setting alpha_init must be in [0, 1], got 1.5"),
    ({"alpha_lr": -1.0}, "setting alpha_lr must be >= 0, got -1.0"),
])
def test_bad_settings_are_refused_naming_the_setting(settings, message):
    with pytest.raises(TaskHetError, match=f"^{re.escape(message)}$"):
        build_algorithm("apfl", linear_model(), {"0": 1}, settings)


def test_a_model_with_an_entry_named_like_alpha_is_refused():
    class Clashing(nn.Module):
        def __init__(self):
            super().__init__()
            self.mixing_weight = nn.Parameter(torch.zeros(1))

    with pytest.raises(TaskHetError, match="apfl keeps α_i as 'mixing_weight' in the client state"):
        build_algorithm("apfl", Clashing(), {"0": 1})
