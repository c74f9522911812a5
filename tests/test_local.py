"""Local training only (network/algorithms/local.py): no communication, each client at its own optimum."""

from __future__ import annotations

import pytest
import torch

from tests.oracles import DIM, least_squares_clients, max_curvature, run_oracle


def own_optimum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.linalg.lstsq(a, b.unsqueeze(1)).solution.squeeze(1)


@pytest.mark.slow
def test_the_server_never_changes_and_each_client_reaches_its_own_optimum(tmp_path):
    data = least_squares_clients(sizes=(12, 30, 50, 8))  # unequal sizes, different local optima
    # 3 rounds of 1500 steps: the slowest client (12 rows) is 1e-13 from its optimum (2.5e-9 after 2 rounds)
    final, engine = run_oracle(tmp_path, "local", rounds=3, steps=1500, lr=0.9 / max_curvature(data), data=data)
    assert torch.equal(final, torch.zeros(DIM, dtype=torch.float64))  # the initial model, never updated
    optima = [own_optimum(a, b) for a, b in data]
    for index, (a, b) in enumerate(data):
        personal = engine.algorithm.personal_model(engine.server.models, engine.store.get(str(index)))["weight"]
        assert torch.allclose(personal.squeeze(0), optima[index], rtol=0, atol=1e-8), index
    assert min((optima[0] - optima[index]).norm() for index in (1, 2, 3)) > 1  # the optima really differ


def test_partial_participation_trains_only_the_sampled_clients_and_uploads_nothing(tmp_path):
    data = least_squares_clients(sizes=(10, 20, 30, 40, 50))
    _, engine = run_oracle(tmp_path, "local", rounds=1, steps=3, lr=0.01, data=data, fraction=0.4)
    trained = [client for client in "01234" if engine.store.get(client)]
    assert len(trained) == 2
    untrained = next(client for client in "01234" if client not in trained)
    assert engine.algorithm.personal_model(engine.server.models, engine.store.get(untrained) or {}) is None
    result = engine.algorithm.client_update(engine.model, engine.algorithm.broadcast(engine.server), {},
                                            [{"x": data[0][0], "y": data[0][1]}],
                                            engine.client_config(0.01, len(data[0][1])))
    assert result.upload == {}
