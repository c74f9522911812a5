"""Step 4's --diagnostics (network/diagnostics.py): drift, update norms and the update-cosine matrix by hand."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from network.algorithms import build_algorithm
from network.engine_sequential import EngineConfig, SequentialEngine
from network.lr_schedule import make_lr_schedule
from tests.oracles import CPU, DIM, gradient, least_squares_clients, least_squares_loss, linear_model, mean_loss, oracle_clients


def test_drift_norms_and_cosines_match_local_gradient_descent(tmp_path):
    data = least_squares_clients(sizes=(10, 30, 20))
    lr, steps = 0.05, 3
    clients = oracle_clients(data)
    algorithm, model = build_algorithm("fedavg", linear_model(), {c.client_id: c.num_samples for c in clients})
    config = EngineConfig(out_dir=tmp_path, n_rounds=1, lr_schedule=make_lr_schedule("constant", lr, 1),
                          local_steps=steps, progress=False, diagnostics=True)
    pooled = [{"x": torch.cat([a for a, _ in data]), "y": torch.cat([b for _, b in data])}]
    SequentialEngine(model, algorithm, clients, least_squares_loss, mean_loss, pooled, config, CPU).run()
    changes = []
    for a, b in data:
        w = torch.zeros(DIM, dtype=torch.float64)
        for _ in range(steps):
            w = w - lr * gradient(w, a, b)
        changes.append(w)
    norms = [float(change.norm()) for change in changes]
    metrics = pd.read_csv(tmp_path / "metrics.csv", dtype={"client": str}).query("round == 1 and split == 'train'")
    drift = metrics.query("metric == 'drift'").set_index("client").value
    assert np.allclose([drift[str(index)] for index in range(3)], norms, rtol=1e-6)
    summary = metrics.query("metric == 'update_norm'").set_index("client").value
    assert np.isclose(summary["mean"], np.mean(norms), rtol=1e-6) and np.isclose(summary["max"], max(norms), rtol=1e-6)
    cosine = np.load(tmp_path / "diagnostics" / "round_1_cosine.npy")
    expected = [[float(x @ y / (x.norm() * y.norm())) for y in changes] for x in changes]
    assert np.allclose(cosine, expected, atol=1e-6)
    assert (tmp_path / "diagnostics" / "round_1_clients.txt").read_text().split() == ["0", "1", "2"]
    assert (tmp_path / "diagnostics" / "round_1_cosine.png").stat().st_size > 0


def test_buffers_and_uploads_without_a_delta_are_left_out(tmp_path):
    from network.diagnostics import DriftMeter

    meter = DriftMeter(tmp_path, frozenset({"w"}))
    meter.add("a", {"delta": {"w": torch.tensor([3.0, 4.0]), "running_var": torch.tensor([100.0])}})
    meter.add("b", {"delta": {"w": torch.tensor([0.0, -2.0]), "running_var": torch.tensor([-7.0])}})
    meter.add("c", {"control_delta": {"w": torch.tensor([1.0, 1.0])}})
    rows = {(row["client"], row["metric"]): row["value"] for row in meter.finish(4, plot=False)}
    assert rows == {("a", "drift"): 5.0, ("b", "drift"): 2.0, ("mean", "update_norm"): 3.5, ("max", "update_norm"): 5.0}
    assert np.allclose(np.load(tmp_path / "diagnostics" / "round_4_cosine.npy"), [[1.0, -0.8], [-0.8, 1.0]])
    assert not (tmp_path / "diagnostics" / "round_4_cosine.png").exists()
    assert meter.finish(5, plot=True) == []  # the meter was reset
