"""FedAMP and HeurFedAMP (network/algorithms/fedamp.py): messages by hand, convex rows, no underflow to NaN."""

from __future__ import annotations

import math

import pytest
import torch

from network.algorithms import build_algorithm
from network.algorithms.fedamp import CLIENT_PREFIX, OWN
from network.algorithms.base import Upload
from network.algorithms.skeleton import DELTA
from tests.oracles import DIM, client_config, gradient, least_squares_clients, linear_model, run_oracle
from utils.errors import TaskHetError

SIZES = {"0": 10, "1": 30, "2": 20}


def server_with(models, **settings):
    algorithm, model = build_algorithm("fedamp", linear_model(), {key: SIZES[key] for key in models}, settings)
    server = algorithm.init_server({"weight": torch.zeros(1, DIM, dtype=torch.float64)})
    for client_id, vector in models.items():
        server.tensors[CLIENT_PREFIX.format(client_id) + "weight"] = vector.view(1, DIM).clone()
    return algorithm, model, server


def test_the_message_by_hand():
    vectors = {"0": torch.zeros(DIM, dtype=torch.float64), "1": torch.full((DIM,), 0.2, dtype=torch.float64),
               "2": torch.full((DIM,), 0.5, dtype=torch.float64)}
    alpha, sigma = 0.3, 2.0
    algorithm, _, server = server_with(vectors, alpha_k=alpha, sigma=sigma)
    xi = {other: alpha * math.exp(-float((vectors["0"] - vectors[other]).pow(2).sum()) / sigma) / sigma
          for other in ("1", "2")}
    xi["0"] = 1 - xi["1"] - xi["2"]
    assert algorithm.attention_row(server, "0") == pytest.approx(xi, rel=1e-14)
    message = algorithm.client_broadcast(server, algorithm.broadcast(server), "0")
    expected = sum(xi[client] * vectors[client] for client in vectors)
    assert torch.allclose(message["global"]["weight"].squeeze(0), expected, rtol=0, atol=1e-15)
    assert torch.equal(message[OWN]["weight"].squeeze(0), vectors["0"])


def test_the_message_keeps_each_entry_dtype():
    """Mixed in float64, sent in the model's own dtype (a float32 model gets float32)."""
    vectors = {client: torch.full((DIM,), value, dtype=torch.float32) for client, value in (("0", 0.0), ("1", 0.2))}
    algorithm, _, server = server_with(vectors)
    message = algorithm.client_broadcast(server, algorithm.broadcast(server), "0")
    assert message["global"]["weight"].dtype == torch.float32


@pytest.mark.parametrize("variant", ["fedamp", "heuristic"])
def test_equal_client_models_give_each_client_its_own_model(variant):
    same = torch.linspace(-1, 1, DIM, dtype=torch.float64)
    algorithm, _, server = server_with({client: same for client in SIZES}, variant=variant, alpha_k=0.1)
    for client in SIZES:
        message = algorithm.client_broadcast(server, {}, client)["global"]["weight"].squeeze(0)
        assert torch.allclose(message, same, rtol=0, atol=1e-15)


@pytest.mark.parametrize("variant, alpha, spread", [("fedamp", 1.0, 0.01), ("fedamp", 0.2, 0.01), ("fedamp", 5.0, 3.0),
                                                    ("heuristic", 1.0, 1.0)])
def test_each_row_sums_to_one_with_a_non_negative_self_weight(variant, alpha, spread):
    generator = torch.Generator().manual_seed(0)
    vectors = {client: spread * torch.randn(DIM, generator=generator, dtype=torch.float64) for client in SIZES}
    algorithm, _, server = server_with(vectors, variant=variant, alpha_k=alpha)
    for client in SIZES:
        row = algorithm.attention_row(server, client)
        assert set(row) == set(SIZES) and sum(row.values()) == pytest.approx(1.0, abs=1e-14)
        assert min(row.values()) >= 0
    if variant == "fedamp" and alpha == 1.0:
        # Close models: the published ξ_ii = 1 − Σ would be about 1 − 2α < 0; the rule makes it 0 and the row convex.
        raw = sum(alpha * math.exp(-float((vectors["0"] - vectors[other]).pow(2).sum())) for other in ("1", "2"))
        assert raw > 1 and algorithm.attention_row(server, "0")["0"] == 0.0
    if variant == "heuristic":
        assert algorithm.attention_row(server, "0")["0"] == 0.5


def test_underflow_scale_distances_give_finite_messages_equal_to_the_own_model():
    vectors = {client: torch.full((DIM,), 1000.0 * index, dtype=torch.float64) for index, client in enumerate(SIZES)}
    algorithm, _, server = server_with(vectors)  # squared distances of 5e6 or more: e^{−x/σ} is 0 in float64
    for client in SIZES:
        row = algorithm.attention_row(server, client)
        assert all(math.isfinite(value) for value in row.values()) and row[client] == 1.0
        message = algorithm.client_broadcast(server, {}, client)["global"]["weight"]
        assert torch.isfinite(message).all() and torch.equal(message.squeeze(0), vectors[client])


def test_one_client_round_by_hand_and_the_server_keeps_each_clients_model():
    data = least_squares_clients(sizes=(10, 30, 20))
    algorithm, model = build_algorithm("fedamp", linear_model(), SIZES, {"lam": 2.0, "alpha_k": 0.5, "sigma": 4.0})
    server = algorithm.init_server({"weight": torch.zeros(1, DIM, dtype=torch.float64)})
    a, b = data[1]
    message = algorithm.client_broadcast(server, algorithm.broadcast(server), "1")
    result = algorithm.client_update(model, message, {}, [{"x": a, "y": b}], client_config(30, lr=0.05, steps=3))
    u = message["global"]["weight"].squeeze(0)
    w = u.clone()
    for _ in range(3):
        w = w - 0.05 * (gradient(w, a, b) + (2.0 / 0.5) * (w - u))  # F_i + (λ/(2α))‖w − u_i‖²
    assert torch.allclose(result.client_state["weight"].squeeze(0), w, rtol=0, atol=1e-13)
    new = algorithm.aggregate(server, [Upload("1", result.upload, 30)])
    assert torch.allclose(new.tensors[CLIENT_PREFIX.format("1") + "weight"].squeeze(0), w, rtol=0, atol=1e-13)
    assert torch.equal(new.tensors[CLIENT_PREFIX.format("0") + "weight"], server.tensors[CLIENT_PREFIX.format("0") + "weight"])
    assert torch.allclose(new.models["global"]["weight"].squeeze(0), 30 / 60 * w, rtol=0, atol=1e-13)


def test_clients_of_two_groups_collaborate_within_their_group(tmp_path):
    shift = [torch.full((DIM,), value, dtype=torch.float64) for value in (2.0, 2.0, -2.0, -2.0)]
    data = least_squares_clients(sizes=(6, 6, 6, 6), shift=shift)
    _, engine = run_oracle(tmp_path, "fedamp", rounds=15, steps=10, lr=0.05, data=data, alpha_k=1.0, sigma=5.0, lam=1.0)
    row = engine.algorithm.attention_row(engine.server, "0")
    assert row["1"] > 10 * max(row["2"], row["3"])  # the other client of its group dominates its message


def test_bad_settings_are_refused_naming_the_setting():
    with pytest.raises(TaskHetError, match=r"^setting sigma must be > 0, got 0.0$"):
        build_algorithm("fedamp", linear_model(), {"0": 1}, {"sigma": 0})
    with pytest.raises(TaskHetError, match=r"^setting lam must be >= 0, got -1.0$"):
        build_algorithm("fedamp", linear_model(), {"0": 1}, {"lam": -1})
