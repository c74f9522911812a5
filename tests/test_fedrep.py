"""FedRep (network/algorithms/fedrep.py): head phase, then body phase; only the body travels."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from network.algorithms import build_algorithm
from network.algorithms.base import Upload
from network.algorithms.skeleton import DELTA
from network.run_outputs import SUMMARY_CLIENTS
from tests.oracles import TwoLayer, client_config, least_squares_clients, manual_sgd, run_oracle
from tests.tiny_models import TinyNet
from utils.errors import TaskHetError


def batches():
    a, b = least_squares_clients(sizes=(24,))[0]
    return [{"x": a[:12], "y": b[:12]}, {"x": a[12:], "y": b[12:]}]


def test_head_phase_then_body_phase_by_hand():
    algorithm, model = build_algorithm("fedrep", TwoLayer(), {"0": 24}, {"head_epochs": 2, "body_epochs": 1})
    start = {key: value.clone() for key, value in model.state_dict().items()}
    own_head = {"head.weight": start["head.weight"] + 0.5}
    result = algorithm.client_update(model, {"global": start}, own_head, batches(), client_config(24, lr=0.1, steps=3))
    after_head = manual_sgd({**start, **own_head}, {"head.weight"}, batches(), 0.1, steps=6)
    after_body = manual_sgd(after_head, {"body.weight"}, batches(), 0.1, steps=3)
    assert set(result.upload[DELTA]) == {"body.weight"}
    assert torch.allclose(result.upload[DELTA]["body.weight"], after_body["body.weight"] - start["body.weight"],
                          rtol=0, atol=1e-13)
    assert torch.allclose(result.client_state["head.weight"], after_body["head.weight"], rtol=0, atol=1e-13)
    assert result.metrics["local_steps"] == 9


def test_frozen_parts_do_not_move_under_momentum_and_weight_decay():
    torch.manual_seed(0)
    algorithm, model = build_algorithm("fedrep", TinyNet(), {"0": 24}, {"head_epochs": 2, "body_epochs": 0})
    start = {key: value.clone() for key, value in model.state_dict().items()}
    data = [{"x": torch.randn(8, 4), "y": torch.randn(8)} for _ in range(3)]
    from tests.tiny_models import loss_fn

    result = algorithm.client_update(model, {"global": start}, {}, data,
                                     client_config(24, lr=0.05, steps=4, momentum=0.9, weight_decay=0.1, loss_fn=loss_fn))
    for key, delta in result.upload[DELTA].items():  # body parameters and BatchNorm buffers
        assert torch.equal(delta, torch.zeros_like(delta)), key
    assert not torch.equal(result.client_state["head.weight"], start["head.weight"])
    assert all(param.requires_grad for param in model.parameters())  # freezing is undone


def test_server_never_updates_the_global_head():
    algorithm, model = build_algorithm("fedrep", TwoLayer(), {"0": 24})
    server = algorithm.init_server({key: value.clone() for key, value in model.state_dict().items()})
    result = algorithm.client_update(model, algorithm.broadcast(server), {}, batches(), client_config(24))
    new = algorithm.aggregate(server, [Upload("0", result.upload, 24)])
    assert torch.equal(new.models["global"]["head.weight"], server.models["global"]["head.weight"])
    assert not torch.equal(new.models["global"]["body.weight"], server.models["global"]["body.weight"])


def test_never_sampled_clients_have_no_personal_model_and_are_counted(tmp_path):
    data = least_squares_clients(sizes=(10, 20, 30, 40, 50))
    _, engine = run_oracle(tmp_path, "fedrep", rounds=1, steps=2, lr=0.01, data=data, fraction=0.4, model=TwoLayer())
    metrics = pd.read_csv(tmp_path / "fedrep" / "metrics.csv", dtype={"client": str})
    trained = set(metrics.query("split == 'train' and client != 'mean'").client)
    personal = metrics.query("split == 'client_test_personal' and metric == 'loss' and round == 1")
    assert set(personal.client) - set(SUMMARY_CLIENTS) == trained and len(trained) == 2
    skipped = metrics.query("split == 'client_test_personal' and client == 'skipped' and round == 1").value
    assert list(skipped) == [3]
    untrained = next(client for client in "01234" if client not in trained)
    assert engine.algorithm.personal_model(engine.server.models, engine.store.get(untrained) or {}) is None


def test_a_model_without_a_head_is_refused_naming_the_algorithm():
    from tests.oracles import linear_model

    with pytest.raises(TaskHetError, match=r"^fedrep needs a model with head_keys\(\)"):
        build_algorithm("fedrep", linear_model(), {"0": 1})


def test_each_phase_reports_its_own_mean_loss():
    algorithm, model = build_algorithm("fedrep", TwoLayer(), {"0": 24}, {"head_epochs": 2, "body_epochs": 1})
    start = {key: value.clone() for key, value in model.state_dict().items()}
    result = algorithm.client_update(model, {"global": start}, {}, batches(), client_config(24, lr=0.1, steps=3))
    weights, losses = start, {"head.weight": [], "body.weight": []}
    for key, steps in (("head.weight", 6), ("body.weight", 3)):
        for step in range(steps):  # the loss before each step, as the local loop reports it
            batch = batches()[step % 2]
            prediction = batch["x"] @ weights["body.weight"].T @ weights["head.weight"].T
            losses[key].append(float(0.5 * ((prediction.squeeze(-1) - batch["y"]) ** 2).mean()))
            weights = manual_sgd(weights, {key}, [batch], 0.1, steps=1)
    assert result.metrics["head_train_loss"] == pytest.approx(sum(losses["head.weight"]) / 6, rel=1e-6)  # the loop averages in float32
    assert result.metrics["train_loss"] == pytest.approx(sum(losses["body.weight"]) / 3, rel=1e-6)


def test_a_head_phase_of_zero_budgets_leaves_the_body_phase():
    algorithm, model = build_algorithm("fedrep", TwoLayer(), {"0": 24}, {"head_epochs": 0, "body_epochs": 2})
    start = {key: value.clone() for key, value in model.state_dict().items()}
    result = algorithm.client_update(model, {"global": start}, {}, batches(), client_config(24, lr=0.1, steps=3))
    expected = manual_sgd(start, {"body.weight"}, batches(), 0.1, steps=6)
    assert torch.allclose(result.upload[DELTA]["body.weight"], expected["body.weight"] - start["body.weight"],
                          rtol=0, atol=1e-13)
    assert torch.equal(result.client_state["head.weight"], start["head.weight"])
    assert result.metrics["local_steps"] == 6 and "head_train_loss" not in result.metrics
