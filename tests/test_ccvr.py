"""CCVR (network/algorithms/ccvr.py): two rounds of the real engine against a numpy float64 oracle (FedAvg, the pooled
class moments as np.mean/np.cov of the pooled features, the head's SGD on the virtual features TaskHet drew), the law
of the draws checked on its own, the boundaries (no calibration, no statistics, absent classes, one sample, one
client, diagonal), what a client uploads, and the one-line refusals."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from network.algorithms import build_algorithm
from network.algorithms import ccvr as ccvr_module
from network.algorithms.base import ClientConfig, ServerState, Upload
from network.algorithms.ccvr import PooledMoments, class_moments, labelled_features, minibatches, virtual_features
from tests.test_fedlc import CLASSES, DIM, ce_loss, counts_of, labelled_batches, run_engine, softmax
from utils.errors import TaskHetError

CPU = torch.device("cpu")
HIDDEN = 3
# Three clients of 7, 12 and 3 samples: class 2 is missing on client "1"; client "2" holds one sample of each class.
CLIENT_LABELS = {"0": [[0, 1, 0, 2, 0, 1, 2]], "1": [[1, 1, 0, 1, 1, 0, 1, 1], [1, 0, 1, 1]], "2": [[2, 0, 1]]}
SETTINGS = {"num_virtual": 5, "calib_epochs": 2, "calib_batch": 4, "calib_lr": 0.2, "calib_momentum": 0.5,
            "server_lr": 0.8}


class TanhNet(nn.Module):
    """float64 body z = tanh(W1 x + b1) and a Linear classifier head on z."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(2)
        self.body = nn.Linear(DIM, HIDDEN, dtype=torch.float64)
        self.head = nn.Linear(HIDDEN, CLASSES, dtype=torch.float64)
        with torch.no_grad():
            for layer in (self.body, self.head):
                layer.weight.copy_(0.6 * torch.randn(layer.weight.shape, generator=generator, dtype=torch.float64))
                layer.bias.copy_(0.3 * torch.randn(layer.bias.shape, generator=generator, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))

    def head_keys(self) -> list[str]:
        return ["head.weight", "head.bias"]


def federation(labels=None) -> dict[str, list[dict]]:
    return {client: labelled_batches(20 + index, batches, shift=0.5 * index)
            for index, (client, batches) in enumerate((labels or CLIENT_LABELS).items())}


def as_numpy(weights: dict) -> dict[str, np.ndarray]:
    return {key: value.detach().numpy().copy() for key, value in weights.items()}


class Spy:
    """Records every call of a function of network.algorithms.ccvr (its arguments and result)."""

    def __init__(self, monkeypatch, name: str) -> None:
        self.calls, original = [], getattr(ccvr_module, name)

        def spied(*args):
            result = original(*args)
            self.calls.append((args, result))
            return result

        monkeypatch.setattr(ccvr_module, name, spied)


# ----- the numpy oracle, written from the paper's equations -----
def features_of(w, x):
    """z = tanh(W1 x + b1): the head's input."""
    return np.tanh(x @ w["body.weight"].T + w["body.bias"])


def local_fedavg(w, batches, lr, steps, momentum):
    """J SGD steps (torch.optim.SGD's momentum) on the mean CE of the two-layer net.

    Gradient by hand, with a = W1 x + b1, z = tanh a, s = W2 z + b2, G = (softmax(s) − Y)/B per batch:
    ∂/∂W2 = Gᵀ z, ∂/∂b2 = Σ G; back through the head ∂/∂z = G W2, through tanh ∂/∂a = (G W2) ⊙ (1 − z²);
    ∂/∂W1 = (∂/∂a)ᵀ x, ∂/∂b1 = Σ ∂/∂a.
    """
    w, velocity = dict(w), None
    for step in range(steps):
        x, labels = batches[step % len(batches)]
        z = features_of(w, x)
        g = (softmax(z @ w["head.weight"].T + w["head.bias"]) - np.eye(CLASSES)[labels]) / len(labels)
        da = (g @ w["head.weight"]) * (1 - z * z)
        grads = {"head.weight": g.T @ z, "head.bias": g.sum(0), "body.weight": da.T @ x, "body.bias": da.sum(0)}
        velocity = grads if velocity is None else {key: momentum * velocity[key] + grads[key] for key in grads}
        w = {key: w[key] - lr * velocity[key] for key in w}
    return w


def fedavg_round(w, data, lr, steps, momentum, server_lr):
    sizes = np.array([sum(len(labels) for _, labels in batches) for batches in data.values()], dtype=np.float64)
    new = [local_fedavg(w, batches, lr, steps, momentum) for batches in data.values()]
    return {key: w[key] + server_lr * sum(p * (mine[key] - w[key]) for p, mine in zip(sizes / sizes.sum(), new))
            for key in w}


def pooled_gaussians(w, data):
    """Per class: np.mean and np.cov (unbiased) of every client's features of that class, pooled."""
    z = np.concatenate([features_of(w, x) for batches in data.values() for x, _ in batches])
    y = np.concatenate([labels for batches in data.values() for _, labels in batches])
    return {c: (z[y == c].mean(axis=0), np.cov(z[y == c], rowvar=False)) for c in np.unique(y)}


def calibrated_head(w, features, labels, batches, lr, momentum):
    """SGD (torch's momentum) on the mean CE of the head on each index batch of the virtual features.

    Gradient by hand: G = (softmax(V Wᵀ + b) − Y)/B, ∂/∂W = Gᵀ V, ∂/∂b = Σ G.
    """
    weight, bias, velocity = w["head.weight"], w["head.bias"], None
    for index in batches:
        v, y = features[index], labels[index]
        g = (softmax(v @ weight.T + bias) - np.eye(CLASSES)[y]) / len(y)
        grads = (g.T @ v, g.sum(0))
        velocity = grads if velocity is None else tuple(momentum * old + new for old, new in zip(velocity, grads))
        weight, bias = weight - lr * velocity[0], bias - lr * velocity[1]
    return weight, bias


def test_two_rounds_equal_a_numpy_oracle_of_fedavg_the_pooled_moments_and_the_head_calibration(tmp_path, monkeypatch):
    drawn, orders = Spy(monkeypatch, "virtual_features"), Spy(monkeypatch, "minibatches")
    data = federation()
    lr, steps, momentum = 0.4, 3, 0.5
    served, engine = run_engine(tmp_path, "ccvr", data, lr=lr, steps=steps, momentum=momentum, model=TanhNet(),
                                **SETTINGS)
    numpy_data = {client: [(batch["x"].numpy(), batch["label"].numpy()) for batch in batches]
                  for client, batches in data.items()}
    models = [as_numpy(TanhNet().state_dict())]  # x_1, x_2, x_3
    for _ in range(2):
        models.append(fedavg_round(models[-1], numpy_data, lr, steps, momentum, SETTINGS["server_lr"]))
    for key, value in engine.server.models["global"].items():
        np.testing.assert_allclose(value.numpy(), models[2][key], rtol=0, atol=1e-12, err_msg=key)
    assert len(drawn.calls) == 2
    for (args, _), received in zip(drawn.calls, models):  # round t pools the features of x_t
        gaussians, oracle = args[0], pooled_gaussians(received, numpy_data)
        assert list(gaussians) == [0, 1, 2]
        for label, (mean, cov) in oracle.items():
            np.testing.assert_allclose(gaussians[label][0].numpy(), mean, rtol=0, atol=1e-12)
            np.testing.assert_allclose(gaussians[label][1].numpy(), cov, rtol=0, atol=1e-12)
    (_, (features, labels)), (_, batches) = drawn.calls[-1], orders.calls[-1]
    assert features.shape == (3 * 5, HIDDEN) and [len(batch) for batch in batches] == [4, 4, 4, 3] * 2
    weight, bias = calibrated_head(models[1], features.numpy(), labels.numpy(), [b.numpy() for b in batches],
                                   SETTINGS["calib_lr"], SETTINGS["calib_momentum"])
    np.testing.assert_allclose(served["head.weight"].numpy(), weight, rtol=0, atol=1e-12)
    np.testing.assert_allclose(served["head.bias"].numpy(), bias, rtol=0, atol=1e-12)
    for key in ("body.weight", "body.bias"):  # the calibrated head sits on x_2's backbone, whose features it saw
        np.testing.assert_allclose(served[key].numpy(), models[1][key], rtol=0, atol=1e-12)
    assert np.abs(weight - models[1]["head.weight"]).max() > 1e-3  # the calibration moved the head


def test_virtual_features_follow_the_pooled_gaussian_full_singular_and_diagonal():
    generator = torch.Generator().manual_seed(0)
    mean = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    factor = torch.tensor([[1.0, 0.0], [0.5, 0.8], [-0.3, 0.4]], dtype=torch.float64)
    singular = factor @ factor.T  # rank 2
    variances = torch.tensor([0.25, 4.0, 1.0], dtype=torch.float64)
    features, labels = virtual_features({1: (mean, singular), 4: (mean, variances)}, 40000, generator)
    assert labels.tolist() == [1] * 40000 + [4] * 40000
    for drawn, cov in ((features[:40000], singular), (features[40000:], torch.diag(variances))):
        np.testing.assert_allclose(drawn.mean(0).numpy(), mean.numpy(), atol=0.05)
        np.testing.assert_allclose(np.cov(drawn.numpy(), rowvar=False), cov.numpy(), atol=0.08)
    null = (torch.eye(3, dtype=torch.float64) - factor @ torch.linalg.pinv(factor))[:, 0]  # outside Σ's range
    assert float(((features[:40000] - mean) @ null).abs().max()) < 1e-9


def test_one_sample_gives_zero_covariance_so_every_virtual_feature_is_the_mean():
    pooled = PooledMoments()
    pooled.add(class_moments(torch.tensor([[0.3, -0.7, 2.0]], dtype=torch.float64), torch.tensor([2]), diagonal=False))
    (label, (mean, cov)), = pooled.gaussians().items()
    assert label == 2 and torch.equal(cov, torch.zeros(3, 3, dtype=torch.float64))
    features, _ = virtual_features({2: (mean, cov)}, 4, torch.Generator().manual_seed(0))
    assert torch.equal(features, mean.expand(4, 3))


def test_one_client_and_the_diagonal_pool_equal_numpys_moments_and_absent_classes_get_no_features():
    generator = torch.Generator().manual_seed(3)
    parts = [torch.randn(size, HIDDEN, generator=generator, dtype=torch.float64) + 2 for size in (9, 4)]
    labels = [torch.tensor([0, 2, 0, 0, 2, 0, 2, 0, 0]), torch.tensor([2, 2, 0, 2])]
    alone = PooledMoments()
    alone.add(class_moments(parts[0], labels[0], diagonal=False))
    for label, (mean, cov) in alone.gaussians().items():
        mine = parts[0][labels[0] == label].numpy()
        np.testing.assert_allclose(mean.numpy(), mine.mean(0), rtol=0, atol=1e-12)
        np.testing.assert_allclose(cov.numpy(), np.cov(mine, rowvar=False), rtol=0, atol=1e-12)
    diagonal = PooledMoments()
    for features, label in zip(parts, labels):
        moments = class_moments(features, label, diagonal=True)
        assert {key.split(".")[0] for key in moments} == {"count", "mean", "var"}
        diagonal.add(moments)
    pooled, pooled_labels = torch.cat(parts).numpy(), torch.cat(labels).numpy()
    gaussians = diagonal.gaussians()
    assert list(gaussians) == [0, 2]  # class 1: nobody holds it, so no virtual feature is drawn for it
    for label, (mean, var) in gaussians.items():
        np.testing.assert_allclose(var.numpy(), pooled[pooled_labels == label].var(0, ddof=1), rtol=0, atol=1e-12)
    _, drawn = virtual_features(gaussians, 3, torch.Generator().manual_seed(0))
    assert drawn.tolist() == [0, 0, 0, 2, 2, 2]


def test_each_epoch_is_a_fresh_permutation_cut_into_batches():
    batches = minibatches(10, 4, 2, torch.Generator().manual_seed(0))
    assert [len(batch) for batch in batches] == [4, 4, 2, 4, 4, 2]
    for epoch in (batches[:3], batches[3:]):
        assert sorted(torch.cat(epoch).tolist()) == list(range(10))
    assert minibatches(10, 4, 0, torch.Generator()) == []


def test_no_calibration_serves_the_received_model_and_trains_as_fedavg(tmp_path):
    data = federation()
    served, engine = run_engine(tmp_path, "ccvr", data, model=TanhNet(), calib_epochs=0)
    after_one, _ = run_engine(tmp_path / "one", "fedavg", data, rounds=1, model=TanhNet())
    after_two, _ = run_engine(tmp_path / "two", "fedavg", data, rounds=2, model=TanhNet())
    assert all(torch.equal(served[key], after_one[key]) for key in after_one)  # x_2, the model round 2 received
    assert all(torch.equal(engine.server.models["global"][key], after_two[key]) for key in after_two)


def test_a_round_without_statistics_keeps_the_calibrated_model(tmp_path):
    _, engine = run_engine(tmp_path, "ccvr", federation(), rounds=1, model=TanhNet(), **SETTINGS)
    server = engine.server
    delta = {key: torch.full_like(value, 0.1) for key, value in server.models["global"].items()}
    new = engine.algorithm.aggregate(server, [Upload("0", {"delta": delta, "stats": {}}, 7),
                                              Upload("1", {"delta": delta, "stats": {"count.1": torch.tensor(0)}}, 12)])
    assert new.models["calibrated"] is server.models["calibrated"]
    assert torch.allclose(new.models["global"]["head.bias"], server.models["global"]["head.bias"] + 0.08)  # η_g·Δ
    assert int(new.tensors["ccvr/round"]) == 2


def test_a_client_uploads_delta_and_per_class_moments_only_with_labels_read_from_the_task_loss():
    algorithm, model = build_algorithm("ccvr", TanhNet(), {"0": 7})
    start = {key: value.clone() for key, value in model.state_dict().items()}
    batches = federation()["0"]
    batches[0]["label"][3] = -1  # a sample the task loss ignores is in no class's moments

    def ignoring_loss(model, batch, reduction="mean"):
        return nn.functional.cross_entropy(model(batch["x"]), batch["label"], ignore_index=-1, reduction=reduction)

    cfg = ClientConfig(lr=0.1, loss_fn=ignoring_loss, device=CPU, num_samples=7, local_steps=2)
    result = algorithm.client_update(model, {"global": start}, {}, batches, cfg)
    assert set(result.upload) == {"delta", "stats"} and result.client_state == {}
    stats = result.upload["stats"]
    assert {key: int(value) for key, value in stats.items() if key.startswith("count.")} == {"count.0": 3, "count.1": 2,
                                                                                           "count.2": 1}
    assert all(value.shape in ((), (HIDDEN,), (HIDDEN, HIDDEN)) for value in stats.values())  # no per-sample tensor
    z = torch.tanh(batches[0]["x"] @ start["body.weight"].T + start["body.bias"])  # the RECEIVED model's features
    torch.testing.assert_close(stats["mean.1"], z[batches[0]["label"] == 1].mean(0), rtol=0, atol=1e-14)
    features, labels = labelled_features(model, batches, cfg)
    assert len(features) == len(labels) == 6 and model.training  # the mode is restored


def test_every_setting_and_situation_outside_the_methods_scope_is_one_refusal():
    for overrides, message in (({"num_virtual": 0}, "setting num_virtual must be >= 1, got 0"),
                               ({"calib_epochs": -1}, "setting calib_epochs must be >= 0, got -1"),
                               ({"calib_batch": 0}, "setting calib_batch must be >= 1, got 0"),
                               ({"calib_lr": 0.0}, "setting calib_lr must be > 0, got 0.0"),
                               ({"calib_momentum": 1.0}, r"setting calib_momentum must be in \[0, 1\), got 1.0"),
                               ({"covariance": "low_rank"}, "covariance must be one of full, diagonal, got 'low_rank'")):
        with pytest.raises(TaskHetError, match=message):
            build_algorithm("ccvr", TanhNet(), {"0": 1}, overrides)
    dense = nn.Module()
    dense.task, dense.head = SimpleNamespace(kind="dense", name="normal"), nn.Conv2d(3, 3, 1)
    with pytest.raises(TaskHetError, match="ccvr trains classifier heads, but --task normal is a dense task"):
        build_algorithm("ccvr", dense, {"0": 1})
    regressor = nn.Module()
    regressor.head = nn.Linear(4, 1)
    with pytest.raises(TaskHetError, match="ccvr needs a model whose output layer 'head' is a Linear classifier"):
        build_algorithm("ccvr", regressor, {"0": 1})
