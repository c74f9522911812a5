"""FedALA (network/algorithms/fedala.py): adaptive local aggregation of the old local model and the global one."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch import nn

from network.algorithms import build_algorithm
from network.algorithms.fedala import ALA_EPOCHS, ALA_WEIGHT, top_layer_keys
from network.algorithms.skeleton import DELTA
from network.client import seeded_torch_rng
from tests.oracles import TwoLayer, client_config, least_squares_clients, least_squares_loss, run_oracle
from tests.tiny_models import TinyNet, loss_fn
from utils.errors import TaskHetError

SIZES = (7, 13)  # unequal clients: the sample weights matter
ORACLE = {"rand_percent": 100, "ala_eta": 0.5, "ala_window": 3, "ala_threshold": 0.05, "ala_max_epochs": 40,
          "server_lr": 0.8}


def loss_and_gradients(body: np.ndarray, head: np.ndarray, a: np.ndarray, b: np.ndarray):
    """f(B, h) = ‖A Bᵀ hᵀ − b‖² / (2n) and its gradients by hand. With z = A Bᵀ (n×H), r = z hᵀ − b (n):
    ∂f/∂h = rᵀ z / n (1×H); ∂f/∂B_kd = Σ_j r_j h_k A_jd / n, i.e. hᵀ (Aᵀ r)ᵀ / n (H×D)."""
    z = a @ body.T
    r = z @ head[0] - b
    return 0.5 * np.mean(r * r), np.outer(head[0], a.T @ r) / len(b), (r @ z)[None, :] / len(b)


def adaptive_head(body, head, own_head, weights, a, b, start_phase, settings):
    """ALA of the top layer (the head, p = 1) on the whole client (s = 100, one full batch per epoch):
    ĥ = h_i + (h − h_i) ⊙ W; per batch W ← clip(W − η ∂f/∂ĥ ⊙ (h − h_i), 0, 1) (chain rule: ∂ĥ/∂W = h − h_i);
    the start phase repeats epochs until the population std of the last `window` epoch losses < threshold."""
    gap, losses = head - own_head, []
    mixed = own_head + gap * weights
    while True:
        loss, _, grad_head = loss_and_gradients(body, mixed, a, b)
        weights = np.clip(weights - settings["ala_eta"] * grad_head * gap, 0.0, 1.0)
        mixed = own_head + gap * weights
        losses.append(loss)
        window = settings["ala_window"]
        converged = len(losses) > window and np.std(losses[-window:]) < settings["ala_threshold"]
        if not start_phase or converged or len(losses) >= settings["ala_max_epochs"]:
            return mixed, weights, len(losses)


def fedala_oracle(data, body0, head0, rounds, steps, lr, settings):
    """The paper's Algorithm 1 in float64 numpy: ALA start (not in a client's first round), J full-batch SGD steps
    on the whole model, server θ ← θ + η_g·Σ n_i Δ_i / Σ n_i; the client keeps its trained model and W."""
    body, head, local, weights, epochs = body0.copy(), head0.copy(), {}, {}, []
    for _ in range(rounds):
        changes = []
        for client, (a, b) in enumerate(data):
            own_body, own_head = body.copy(), head.copy()  # the lower layer always takes the global model
            if client in local:
                start_phase = client not in weights
                own_head, weights[client], taken = adaptive_head(
                    body, head, local[client][1], np.ones_like(head) if start_phase else weights[client], a, b,
                    start_phase, settings)
                epochs.append(taken)
            for _ in range(steps):
                _, grad_body, grad_head = loss_and_gradients(own_body, own_head, a, b)
                own_body, own_head = own_body - lr * grad_body, own_head - lr * grad_head
            local[client] = (own_body, own_head)
            changes.append((len(b), own_body - body, own_head - head))
        total = sum(n for n, _, _ in changes)
        body = body + settings["server_lr"] * sum(n * change for n, change, _ in changes) / total
        head = head + settings["server_lr"] * sum(n * change for n, _, change in changes) / total
    return body, head, local, weights, epochs


def test_three_rounds_of_two_unequal_clients_equal_the_papers_algorithm_in_numpy(tmp_path):
    """Round 1 trains from θ, round 2 is ALA's start phase (until the loss settles), round 3 one ALA epoch."""
    data = least_squares_clients(sizes=SIZES, seed=3)
    initial = TwoLayer().state_dict()
    final, engine = run_oracle(tmp_path, "fedala", rounds=3, steps=3, lr=0.03, data=data, model=TwoLayer(), **ORACLE)
    body, head, local, weights, epochs = fedala_oracle(
        [(a.numpy(), b.numpy()) for a, b in data], initial["body.weight"].numpy(), initial["head.weight"].numpy(),
        rounds=3, steps=3, lr=0.03, settings=ORACLE)
    np.testing.assert_allclose(final["body.weight"].numpy(), body, rtol=0, atol=1e-12)
    np.testing.assert_allclose(final["head.weight"].numpy(), head, rtol=0, atol=1e-12)
    for client in (0, 1):
        state = engine.store.get(str(client))
        assert set(state) == {"body.weight", "head.weight", ALA_WEIGHT + "head.weight"}  # W of the top layer only
        np.testing.assert_allclose(state["body.weight"].numpy(), local[client][0], rtol=0, atol=1e-12)
        np.testing.assert_allclose(state["head.weight"].numpy(), local[client][1], rtol=0, atol=1e-12)
        np.testing.assert_allclose(state[ALA_WEIGHT + "head.weight"].numpy(), weights[client], rtol=0, atol=1e-12)
    assert epochs[:2] == [5, 4] and epochs[2:] == [1, 1]  # the start phase stopped on the std test, not the cap
    inside = (weights[0] > 0) & (weights[0] < 1)
    assert inside.any() and (weights[0] == 0).any() and (weights[1] == 1).any()  # W learned, clipped to [0, 1]


def ala_state(model: nn.Module, offset: float, weight: float | None = None) -> dict:
    """A previous local model θ_i = θ + offset, with W_i = ``weight`` everywhere on the head (None: no W yet)."""
    state = {key: value + offset for key, value in model.state_dict().items()}
    return state if weight is None else {**state, ALA_WEIGHT + "head.weight": torch.full((1, 3), weight,
                                                                                           dtype=torch.float64)}


@pytest.mark.parametrize("weight, head_share", [(1.0, 0.0), (0.25, 0.75), (0.0, 1.0)])
def test_with_eta_zero_the_start_mixes_the_head_by_w_and_takes_the_global_body(weight, head_share):
    """No local step, η = 0: the upload is θ̂ − θ, i.e. (1 − W)(θ_i − θ) on the head and 0 on the body."""
    algorithm, model = build_algorithm("fedala", TwoLayer(), {"0": 5}, {"ala_eta": 0})
    start = {key: value.clone() for key, value in model.state_dict().items()}
    a, b = least_squares_clients(sizes=(5,))[0]
    result = algorithm.client_update(model, {"global": start}, ala_state(model, 0.5, weight), [{"x": a, "y": b}],
                                     client_config(5, steps=0))
    assert torch.allclose(result.upload[DELTA]["head.weight"], torch.full((1, 3), 0.5 * head_share,
                                                                          dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.equal(result.upload[DELTA]["body.weight"], torch.zeros_like(start["body.weight"]))
    assert result.metrics[ALA_EPOCHS] == 0


def test_eta_zero_with_w_one_is_fedavgs_client_from_the_global_model():
    a, b = least_squares_clients(sizes=(6,), seed=4)[0]
    fedala, model = build_algorithm("fedala", TwoLayer(), {"0": 6}, {"ala_eta": 0})
    fedavg, _ = build_algorithm("fedavg", TwoLayer(), {"0": 6})
    start = {key: value.clone() for key, value in model.state_dict().items()}
    ala = fedala.client_update(model, {"global": start}, ala_state(model, 0.3), [{"x": a, "y": b}], client_config(6))
    plain = fedavg.client_update(model, {"global": start}, {}, [{"x": a, "y": b}], client_config(6))
    for key, value in plain.upload[DELTA].items():
        assert torch.allclose(ala.upload[DELTA][key], value, rtol=0, atol=1e-14), key
    assert torch.equal(ala.client_state[ALA_WEIGHT + "head.weight"], torch.ones(1, 3, dtype=torch.float64))


def test_the_start_phase_stops_on_the_std_test_or_the_cap_and_later_rounds_take_one_epoch():
    a, b = least_squares_clients(sizes=(6,), seed=5)[0]

    def epochs(settings, weight):
        algorithm, model = build_algorithm("fedala", TwoLayer(), {"0": 6}, {"rand_percent": 100, **settings})
        start = {key: value.clone() for key, value in model.state_dict().items()}
        result = algorithm.client_update(model, {"global": start}, ala_state(model, 0.2, weight), [{"x": a, "y": b}],
                                         client_config(6, steps=1))
        return result.metrics[ALA_EPOCHS]

    assert epochs({"ala_threshold": 1e9, "ala_window": 2}, None) == 3  # more than `window` losses are needed
    assert epochs({"ala_threshold": 0, "ala_max_epochs": 7}, None) == 7  # a std never below 0: the cap
    assert epochs({"ala_threshold": 0, "ala_max_epochs": 7}, 0.5) == 1  # W kept from before: one epoch
    fresh, model = build_algorithm("fedala", TwoLayer(), {"0": 6})
    first = fresh.client_update(model, {"global": model.state_dict()}, {}, [{"x": a, "y": b}], client_config(6))
    assert first.metrics[ALA_EPOCHS] == 0 and not any(key.startswith(ALA_WEIGHT) for key in first.client_state)


def test_the_sample_is_a_window_of_s_percent_of_the_rows_drawn_from_the_clients_seed():
    """n = 10 rows in batches of 3, s = 50: W learns on 5 consecutive rows of the pass (edge batches cut), the
    start drawn from the client's seeded generator: the same seed, the same rows."""
    x = torch.arange(10, dtype=torch.float64).unsqueeze(1).repeat(1, 5) / 10
    batches = [{"x": x[i:i + 3], "y": torch.zeros(len(x[i:i + 3]), dtype=torch.float64),
                "sample_id": [str(row) for row in range(i, min(i + 3, 10))]} for i in range(0, 10, 3)]
    seen: list[str] = []

    def spying_loss(model, batch, reduction="mean"):
        if not model.training:  # W-learning runs in eval mode, local training in train mode
            seen.extend(batch["sample_id"])
        return least_squares_loss(model, batch, reduction)

    def sample(seed):
        algorithm, model = build_algorithm("fedala", TwoLayer(), {"0": 10}, {"rand_percent": 50})
        seen.clear()
        with seeded_torch_rng(seed, torch.device("cpu")):
            algorithm.client_update(model, {"global": model.state_dict()}, ala_state(model, 0.1, 1.0), batches,
                                    client_config(10, steps=1, loss_fn=spying_loss))
        return [int(row) for row in seen]

    samples = {seed: sample(seed) for seed in range(6)}
    for rows in samples.values():
        assert rows == list(range(rows[0], rows[0] + 5)) and 0 <= rows[0] <= 5
    assert sample(3) == samples[3] and len({rows[0] for rows in samples.values()}) > 1


class HeadFirst(nn.Module):
    """A head registered before the body, a frozen encoder, a BatchNorm layer: what "top layers" must see through."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(3, 1)
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))

    def forward(self, x):
        return self.head(self.body(self.encoder(x)))

    def head_keys(self):
        return ["head.weight", "head.bias"]


def test_top_layers_are_the_last_trainable_modules_with_the_head_on_top():
    layout = build_algorithm("fedala", HeadFirst(), {"0": 1})[0].federation.layout
    assert top_layer_keys(layout, 1) == ("head.weight", "head.bias")
    assert top_layer_keys(layout, 2) == ("body.1.weight", "body.1.bias", "head.weight", "head.bias")
    assert top_layer_keys(layout, 3)[:2] == ("body.0.weight", "body.0.bias")  # the frozen encoder is no layer
    with pytest.raises(TaskHetError, match=r"^fedala setting ala_layers must be at most the model's 3 layers"):
        build_algorithm("fedala", HeadFirst(), {"0": 1}, {"ala_layers": 4})


def test_w_and_the_local_model_stay_on_the_client():
    algorithm, model = build_algorithm("fedala", TinyNet(), {"0": 6}, {"ala_layers": 2})
    generator = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(6, 4, generator=generator), "y": torch.randn(6, generator=generator)}
    start = {key: value.clone() for key, value in model.state_dict().items()}
    state = {key: value + 0.1 if value.is_floating_point() else value for key, value in start.items()}
    result = algorithm.client_update(model, {"global": start}, state, [batch], client_config(6, loss_fn=loss_fn))
    kept = {key for key in result.client_state if key.startswith(ALA_WEIGHT)}
    assert kept == {ALA_WEIGHT + key for key in ("body.1.weight", "body.1.bias", "head.weight", "head.bias")}
    assert set(result.upload) == {DELTA} and set(result.upload[DELTA]) == set(start)  # the model's entries only
    personal = algorithm.personal_model({"global": start}, result.client_state)
    assert set(personal) == set(start) and all(torch.equal(personal[key], result.client_state[key]) for key in start)
    assert algorithm.personalized and algorithm.personal_model({"global": start}, {}) is None


@pytest.mark.parametrize("settings, message", [
    ({"ala_layers": 0}, "setting ala_layers must be >= 1, got 0"),
    ({"rand_percent": 0}, "setting rand_percent must be in [1, 100], got 0"),
    ({"rand_percent": 101}, "setting rand_percent must be in [1, 100], got 101"),
    ({"ala_eta": -0.1}, "setting ala_eta must be >= 0, got -0.1"),
    ({"ala_threshold": -1}, "setting ala_threshold must be >= 0, got -1.0"),
    ({"ala_window": 1}, "setting ala_window must be >= 2, got 1"),
    ({"ala_max_epochs": 0}, "setting ala_max_epochs must be >= 1, got 0")])
def test_settings_outside_their_range_are_refused_naming_the_setting(settings, message):
    with pytest.raises(TaskHetError, match=f"^{re.escape(message)}$"):
        build_algorithm("fedala", TwoLayer(), {"0": 1}, settings)
