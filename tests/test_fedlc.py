"""FedLC (network/algorithms/fedlc.py): two rounds of the real engine against a numpy float64 oracle of the paper's
calibrated cross-entropy, the margins by hand, τ = 0 and equal counts as FedAvg, raw logits outside training, and the
one-line refusals. The generic tests over ``list_algorithms()`` cover the engine properties."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from network.algorithms import build_algorithm
from network.algorithms.base import ClientConfig
from network.algorithms.fedlc import calibration_margins
from network.client import ClientData
from network.engine_sequential import EngineConfig, SequentialEngine
from network.lr_schedule import make_lr_schedule
from utils.errors import TaskHetError

CPU = torch.device("cpu")
DIM, CLASSES = 4, 3


class SoftmaxRegression(nn.Module):
    """A float64 linear classifier: its whole model is the Linear ``head`` (logits = W x + b)."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(1)
        self.head = nn.Linear(DIM, CLASSES, dtype=torch.float64)
        with torch.no_grad():
            self.head.weight.copy_(0.4 * torch.randn(CLASSES, DIM, generator=generator, dtype=torch.float64))
            self.head.bias.copy_(0.2 * torch.randn(CLASSES, generator=generator, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)

    def head_keys(self) -> list[str]:
        return ["head.weight", "head.bias"]


def ce_loss(model, batch, reduction="mean"):
    return nn.functional.cross_entropy(model(batch["x"]), batch["label"], reduction=reduction)


def ce_evaluate(model, loader):
    return {"loss": float(sum(ce_loss(model, batch) for batch in loader) / len(loader))}


def labelled_batches(seed: int, labels_per_batch: list[list[int]], shift: float) -> list[dict]:
    """Batches of float64 features (class-dependent means, a client-specific shift) with the given labels."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for labels in labels_per_batch:
        label = torch.tensor(labels)
        x = torch.randn(len(labels), DIM, generator=generator, dtype=torch.float64) + label.unsqueeze(1) * 0.8 + shift
        batches.append({"x": x, "label": label})
    return batches


# Client "0": 7 samples in one batch, every class; client "1": 12 samples in two unequal batches, class 2 missing.
CLIENT_LABELS = {"0": [[0, 1, 0, 2, 0, 1, 0]], "1": [[1, 1, 0, 1, 1, 0, 1, 1], [1, 0, 1, 1]]}


def federation(labels=None) -> dict[str, list[dict]]:
    labels = labels or CLIENT_LABELS
    return {client: labelled_batches(10 + index, batches, shift=index) for index, (client, batches) in
            enumerate(labels.items())}


def counts_of(batches: list[dict]) -> tuple[int, ...]:
    return tuple(torch.bincount(torch.cat([batch["label"] for batch in batches]), minlength=CLASSES).tolist())


def run_engine(tmp_path, name, data, rounds=2, steps=3, lr=0.3, momentum=0.5, model=None, **settings):
    """``rounds`` rounds of ``name`` over ``data`` (client -> batches), every client each round; the served model."""
    clients = [ClientData(client, sum(len(batch["label"]) for batch in batches), lambda seed, b=batches: b,
                          None, counts_of(batches)) for client, batches in data.items()]
    algorithm, worker = build_algorithm(name, model or SoftmaxRegression(),
                                        {client.client_id: client.num_samples for client in clients}, settings, seed=5)
    config = EngineConfig(out_dir=tmp_path / name, n_rounds=rounds, lr_schedule=make_lr_schedule("constant", lr, rounds),
                          seed=5, local_steps=steps, client_fraction=1.0, eval_every=rounds, momentum=momentum,
                          progress=False, plots=False)
    test = [batch for batches in data.values() for batch in batches]
    engine = SequentialEngine(worker, algorithm, clients, ce_loss, ce_evaluate, test, config, CPU)
    return engine.run(), engine


# ----- the numpy oracle, written from the paper's equations -----
def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def local_fedlc(w, b, batches, counts, tau, lr, steps, momentum):
    """J SGD steps (torch.optim.SGD's momentum: v = g at the first step, then v ← βv + g) on the calibrated CE.

    Gradient by hand: with z̃ = Wx + b − m, m_y = τ·max(n_y, 1e-8)^(−1/4) (a constant, unit Jacobian),
    L = −z̃_y + log Σ_j exp z̃_j gives ∂L/∂z_j = softmax(z̃)_j − [j = y]; the batch mean of G = softmax(Z̃) − Y is
    ∂/∂W = Gᵀ X / B and ∂/∂b = Σ_rows G / B.
    """
    margins = tau * np.maximum(np.asarray(counts, dtype=np.float64), 1e-8) ** -0.25
    velocity = None
    for step in range(steps):
        x, labels = batches[step % len(batches)]
        residual = softmax(x @ w.T + b - margins) - np.eye(CLASSES)[labels]
        grads = (residual.T @ x / len(labels), residual.sum(axis=0) / len(labels))
        velocity = grads if velocity is None else tuple(momentum * v + g for v, g in zip(velocity, grads))
        w, b = w - lr * velocity[0], b - lr * velocity[1]
    return w, b


def fedlc_oracle(w, b, data, tau, lr, steps, momentum, server_lr, rounds):
    """FedAvg's server over the calibrated clients: x ← x + η_g Σ_i (n_i/n) (y_i − x)."""
    numpy_data = {client: [(batch["x"].numpy(), batch["label"].numpy()) for batch in batches]
                  for client, batches in data.items()}
    for _ in range(rounds):
        sizes, new = [], []
        for client, batches in numpy_data.items():
            sizes.append(sum(len(labels) for _, labels in batches))
            new.append(local_fedlc(w, b, batches, counts_of(data[client]), tau, lr, steps, momentum))
        shares = np.array(sizes, dtype=np.float64) / sum(sizes)
        w = w + server_lr * sum(p * (wi - w) for p, (wi, _) in zip(shares, new))
        b = b + server_lr * sum(p * (bi - b) for p, (_, bi) in zip(shares, new))
    return w, b


def test_two_rounds_equal_a_numpy_oracle_of_the_calibrated_cross_entropy(tmp_path):
    data = federation()
    assert counts_of(data["1"]) == (3, 9, 0)  # a client without class 2: its margin is 100·τ
    tau, lr, steps, momentum, server_lr = 0.8, 0.3, 3, 0.5, 0.7
    final, _ = run_engine(tmp_path, "fedlc", data, lr=lr, steps=steps, momentum=momentum, lc_tau=tau,
                          server_lr=server_lr)
    start = SoftmaxRegression()
    w, b = fedlc_oracle(start.head.weight.detach().numpy(), start.head.bias.detach().numpy(), data, tau, lr, steps,
                        momentum, server_lr, rounds=2)
    np.testing.assert_allclose(final["head.weight"].numpy(), w, rtol=0, atol=1e-12)
    np.testing.assert_allclose(final["head.bias"].numpy(), b, rtol=0, atol=1e-12)
    plain, _ = fedlc_oracle(start.head.weight.detach().numpy(), start.head.bias.detach().numpy(), data, 0.0, lr, steps,
                            momentum, server_lr, rounds=2)
    assert np.abs(plain - w).max() > 1e-3  # the calibration moves the result: the oracle is not FedAvg's


def test_margins_by_hand_an_absent_class_is_shifted_by_100_tau():
    margins = calibration_margins((16, 1, 0, 81), 0.5)
    assert margins.dtype == torch.float64
    assert margins.tolist() == pytest.approx([0.5 * 0.5, 0.5, 0.5 * 100, 0.5 / 3], rel=1e-15)
    assert calibration_margins((16, 0), 0.0).tolist() == [0.0, 0.0]


def test_tau_zero_is_fedavg_bit_for_bit(tmp_path):
    data = federation()
    fedlc, _ = run_engine(tmp_path, "fedlc", data, lc_tau=0.0)
    fedavg, _ = run_engine(tmp_path, "fedavg", data)
    assert all(torch.equal(fedlc[key], fedavg[key]) for key in fedavg)


def test_one_client_with_equal_counts_shifts_every_logit_alike_so_it_trains_as_fedavg(tmp_path):
    data = federation({"0": [[0, 1, 2, 2, 1, 0]]})  # counts (2, 2, 2): one margin for every class
    fedlc, _ = run_engine(tmp_path, "fedlc", data, lc_tau=3.0)
    fedavg, _ = run_engine(tmp_path, "fedavg", data)
    for key in fedavg:  # softmax is shift-invariant: equal up to rounding, not bit for bit
        torch.testing.assert_close(fedlc[key], fedavg[key], rtol=0, atol=1e-12)


def test_the_upload_is_delta_only_and_evaluation_sees_raw_logits():
    algorithm, model = build_algorithm("fedlc", SoftmaxRegression(), {"0": 7}, {"lc_tau": 2.0})
    start = {key: value.clone() for key, value in model.state_dict().items()}
    batches = federation()["0"]
    cfg = ClientConfig(lr=0.1, loss_fn=ce_loss, device=CPU, num_samples=7, local_steps=2, class_counts=(4, 2, 1))
    result = algorithm.client_update(model, {"global": start}, {}, batches, cfg)
    assert set(result.upload) == {"delta"} and set(result.upload["delta"]) == {"head.weight", "head.bias"}
    assert result.client_state == {}  # the class counts stay on the client, in no state and no upload
    assert not model.head._forward_hooks  # the calibration hook lives only inside the loss call
    x = batches[0]["x"]
    assert torch.equal(model(x), x @ model.head.weight.T + model.head.bias)


def test_every_setting_and_situation_outside_the_methods_scope_is_one_refusal():
    with pytest.raises(TaskHetError, match=r"^setting lc_tau must be >= 0, got -0\.5$"):
        build_algorithm("fedlc", SoftmaxRegression(), {"0": 1}, {"lc_tau": -0.5})
    dense = nn.Module()
    dense.task, dense.head = SimpleNamespace(kind="dense", name="depth_euclidean"), nn.Conv2d(3, 1, 1)
    with pytest.raises(TaskHetError, match="fedlc trains classifier heads, but --task depth_euclidean is a dense task"):
        build_algorithm("fedlc", dense, {"0": 1})
    regressor = nn.Module()
    regressor.head = nn.Linear(4, 1)
    with pytest.raises(TaskHetError, match="fedlc needs a model whose output layer 'head' is a Linear classifier"):
        build_algorithm("fedlc", regressor, {"0": 1})
    algorithm, model = build_algorithm("fedlc", SoftmaxRegression(), {"0": 7})
    broadcast = {"global": {key: value.clone() for key, value in model.state_dict().items()}}
    for counts, got in ((None, "none"), ((4, 3), "2 classes")):
        cfg = ClientConfig(lr=0.1, loss_fn=ce_loss, device=CPU, num_samples=7, local_steps=1, class_counts=counts)
        with pytest.raises(TaskHetError, match=f"fedlc needs each client's training class counts over 3 classes .*got {got}$"):
            algorithm.client_update(model, broadcast, {}, federation()["0"], cfg)
