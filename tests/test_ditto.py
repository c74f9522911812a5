"""Ditto (network/algorithms/ditto.py): the personal model's proximal objective, at its limits and by hand."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from network.algorithms import build_algorithm
from network.algorithms.skeleton import DELTA
from tests.oracles import (DIM, client_config, gradient, least_squares_clients, linear_model, max_curvature,
                           run_oracle)


def test_one_round_by_hand_explicit_step():
    a, b = least_squares_clients(sizes=(20,))[0]
    lam, lr, steps = 0.5, 0.05, 3
    algorithm, model = build_algorithm("ditto", linear_model(), {"0": 20}, {"lam": lam})
    w0 = torch.linspace(-1, 1, DIM, dtype=torch.float64)
    v0 = w0 + 1.0
    result = algorithm.client_update(model, {"global": {"weight": w0.unsqueeze(0)}}, {"weight": v0.unsqueeze(0)},
                                     [{"x": a, "y": b}], client_config(20, lr=lr, steps=steps))
    w, v = w0.clone(), v0.clone()
    for _ in range(steps):
        w = w - lr * gradient(w, a, b)  # the global part: FedAvg's local steps from w^t
        v = v - lr * (gradient(v, a, b) + lam * (v - w0))  # the personal part, anchored at w^t
    assert torch.allclose(result.upload[DELTA]["weight"].squeeze(0), w - w0, rtol=0, atol=1e-13)
    assert torch.allclose(result.client_state["weight"].squeeze(0), v, rtol=0, atol=1e-13)
    assert result.metrics["local_steps"] == 2 * steps  # about twice FedAvg's local compute


def test_huge_lambda_makes_personal_models_the_global_model(tmp_path):
    data = least_squares_clients()
    _, engine = run_oracle(tmp_path, "ditto", rounds=3, steps=5, lr=0.5 / max_curvature(data), data=data,
                           lam=1e9, prox_step="implicit")  # the largest legal λ
    # Each v_i is anchored at the w^t it was sent; the last round's w^t is the model before the last aggregate.
    for client_id, state in engine.store.snapshot().items():
        personal = engine.algorithm.personal_model(engine.server.models, state)["weight"]
        assert personal.abs().sum() > 0
    last_broadcast = _global_before_last_round(tmp_path, data)
    for state in engine.store.snapshot().values():
        # the implicit step leaves v within about |v - w|/(lr·λ) of w: ~1e-8 at the largest legal λ
        assert torch.allclose(state["weight"], last_broadcast, rtol=1e-6, atol=1e-7)
        assert not torch.allclose(state["weight"], torch.zeros_like(state["weight"]), atol=1e-3)


def _global_before_last_round(tmp_path, data):
    weights, _ = run_oracle(tmp_path / "two", "fedavg", rounds=2, steps=5, lr=0.5 / max_curvature(data), data=data)
    return weights.unsqueeze(0)


@pytest.mark.parametrize("prox_step", ["explicit", "implicit"])
def test_lambda_zero_is_local_training(tmp_path, prox_step):
    data = least_squares_clients(sizes=(10, 30))
    lr, rounds, steps = 0.5 / max_curvature(data), 3, 4
    _, engine = run_oracle(tmp_path, "ditto", rounds=rounds, steps=steps, lr=lr, data=data, lam=0.0,
                           prox_step=prox_step)
    for index, (a, b) in enumerate(data):
        v = torch.zeros(DIM, dtype=torch.float64)
        for _ in range(rounds * steps):  # its own model, never pulled towards w
            v = v - lr * gradient(v, a, b)
        assert torch.allclose(engine.store.get(str(index))["weight"].squeeze(0), v, rtol=0, atol=1e-12)


def test_global_model_is_fedavgs(tmp_path):
    data = least_squares_clients()
    lr = 0.5 / max_curvature(data)
    ditto, _ = run_oracle(tmp_path, "ditto", rounds=4, steps=3, lr=lr, data=data, lam=0.3)
    fedavg, _ = run_oracle(tmp_path / "avg", "fedavg", rounds=4, steps=3, lr=lr, data=data)
    assert torch.allclose(ditto, fedavg, rtol=0, atol=1e-13)


def test_never_sampled_clients_have_no_personal_model_and_are_counted(tmp_path):
    data = least_squares_clients(sizes=(10, 20, 30, 40, 50))
    _, engine = run_oracle(tmp_path, "ditto", rounds=1, steps=2, lr=0.01, data=data, fraction=0.4)
    trained = {client for client in "01234" if engine.store.get(client)}
    assert len(trained) == 2
    for client in "01234":
        own = engine.algorithm.personal_model(engine.server.models, engine.store.get(client) or {})
        assert (own is None) == (client not in trained)
    metrics = pd.read_csv(tmp_path / "ditto" / "metrics.csv", dtype={"client": str})
    skipped = metrics.query("split == 'client_test_personal' and client == 'skipped' and round == 1").value
    assert list(skipped) == [3]
