"""Step 4's --diagnostics (network/diagnostics.py) by hand: drift, update norms, the update-cosine matrix, and G², B²
and every client's ‖∇F_k‖² at the global model on a least-squares federation (closed-form gradients in numpy)."""

from __future__ import annotations

from functools import partial

import numpy as np
import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader

from network.algorithms import build_algorithm, list_algorithms
from network.client import ClientData
from network.diagnostics import gradient_seed
from network.engine_sequential import EngineConfig, SequentialEngine
from network.lr_schedule import make_lr_schedule
from tests.fixtures import tiny_data_root, tiny_manifest  # noqa: F401  (session fixtures)
from tests.oracles import (CPU, DIM, TwoLayer, gradient, least_squares_clients, least_squares_loss, linear_model, mean_loss,
                           oracle_clients)
from tests.test_step4 import assignments  # noqa: F401  (a fixture: three round-robin clients of the tiny manifest)
from utils.errors import TaskHetError


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
    assert rows == pytest.approx({("a", "drift"): 5.0, ("b", "drift"): 2.0, ("mean", "update_norm"): 3.5,
                                  ("max", "update_norm"): 5.0, ("min", "update_cosine"): -0.8,
                                  ("median", "update_cosine"): -0.8, ("max", "update_cosine"): -0.8}, rel=1e-6)
    assert np.allclose(np.load(tmp_path / "diagnostics" / "round_4_cosine.npy"), [[1.0, -0.8], [-0.8, 1.0]])
    assert not (tmp_path / "diagnostics" / "round_4_cosine.png").exists()
    assert meter.finish(5, plot=True) == []  # the meter was reset


def test_the_update_cosine_spread_is_over_the_off_diagonal_entries(tmp_path):
    from network.diagnostics import DriftMeter

    meter = DriftMeter(tmp_path, frozenset({"w"}))
    for name, change in (("a", [1.0, 0.0]), ("b", [0.0, 2.0]), ("c", [-3.0, 0.0]), ("d", [1.0, 1.0])):
        meter.add(name, {"delta": {"w": torch.tensor(change)}})
    rows = {(row["client"], row["metric"]): row["value"] for row in meter.finish(1, plot=False)}
    # pairs: ab 0, ac −1, ad 1/√2, bc 0, bd 1/√2, cd −1/√2 (the diagonal's ones are not among them)
    assert rows[("min", "update_cosine")] == pytest.approx(-1.0)
    assert rows[("median", "update_cosine")] == pytest.approx(0.0, abs=1e-7)
    assert rows[("max", "update_cosine")] == pytest.approx(2 ** -0.5)
    meter.add("alone", {"delta": {"w": torch.tensor([1.0, 2.0])}})
    assert not [row for row in meter.finish(2, plot=False) if row["metric"] == "update_cosine"]


# ----- G², B² and ‖∇F_k‖² at the global model -----
SIZES = (10, 30, 20, 45)  # unequal client sizes


def hand_reading(weights: np.ndarray, data, sizes=None) -> tuple[list[np.ndarray], float, float, float]:
    """Closed-form ∇F_k = A_kᵀ(A_k w − b_k)/n_k per client, then G², B² and ‖∇F‖² with p_k = n_k / n."""
    grads = [a.T @ (a @ weights - b) / len(b) for a, b in ((a.numpy(), b.numpy()) for a, b in data)]
    sizes = np.asarray(sizes if sizes is not None else [len(b) for _, b in data], dtype=float)
    p = sizes / sizes.sum()
    mean = sum(weight * grad for weight, grad in zip(p, grads))
    g2 = sum(weight * np.sum((grad - mean) ** 2) for weight, grad in zip(p, grads))
    b2 = sum(weight * grad @ grad for weight, grad in zip(p, grads)) / (mean @ mean)
    return grads, float(g2), float(b2), float(mean @ mean)


def least_squares_engine(out_dir, data, rounds: int, every: int, chunk: int = 0, clients=None, max_samples=None,
                         diagnostics: bool = True, name: str = "fedavg", model=None, plots: bool = False,
                         **extra) -> SequentialEngine:
    clients = clients or oracle_clients(data)
    algorithm, worker = build_algorithm(name, model or linear_model(), {c.client_id: c.num_samples for c in clients})
    config = EngineConfig(out_dir=out_dir, n_rounds=rounds, lr_schedule=make_lr_schedule("constant", 0.02, rounds),
                          seed=5, local_steps=3, client_fraction=0.5, momentum=0.5, progress=False,
                          diagnostics=diagnostics, diagnostics_every=every, diagnostics_max_samples=max_samples,
                          vectorize_chunk=chunk, plots=plots, **extra)
    pooled = [{"x": torch.cat([a for a, _ in data]), "y": torch.cat([b for _, b in data])}]
    return SequentialEngine(worker, algorithm, clients, least_squares_loss, mean_loss, pooled, config, CPU)


def reading_of(metrics: pd.DataFrame, round_index: int) -> tuple[dict[str, float], dict[str, float]]:
    rows = metrics[(metrics["round"] == round_index) & (metrics.split == "diagnostics")]
    federation = rows[rows.client == "all"].set_index("metric").value.to_dict()
    per_client = rows[rows.metric == "grad_norm2"].set_index("client").value.to_dict()
    return federation, per_client


@pytest.mark.parametrize("chunk", [0, 2], ids=["sequential", "vectorised"])
def test_g2_and_b2_at_the_global_model_over_all_clients_equal_a_hand_computation(tmp_path, chunk):
    data = least_squares_clients(sizes=SIZES)
    engine = least_squares_engine(tmp_path, data, rounds=4, every=2, chunk=chunk, plots=True)
    final = engine.run()["weight"].squeeze(0).numpy()
    metrics = pd.read_csv(tmp_path / "metrics.csv", dtype={"client": str})
    assert sorted(metrics[metrics.split == "diagnostics"]["round"].unique()) == [0, 2, 4]  # every 2 rounds, round 0 too
    sampled = metrics[(metrics.split == "train") & (metrics.metric == "train_loss") & (metrics.client != "mean")]
    assert sampled.groupby("round").size().tolist() == [2, 2, 2, 2]  # half the clients train each round ...
    for round_index, weights in ((0, np.zeros(DIM)), (4, final)):
        grads, g2, b2, global_norm2 = hand_reading(weights, data)
        federation, per_client = reading_of(metrics, round_index)
        assert federation["g2"] == pytest.approx(g2, rel=1e-10)
        assert federation["b2"] == pytest.approx(b2, rel=1e-10)
        assert federation["global_grad_norm2"] == pytest.approx(global_norm2, rel=1e-10)
        # ... but every client's gradient counts, each weighted by its size
        assert per_client == pytest.approx({str(k): float(grad @ grad) for k, grad in enumerate(grads)}, rel=1e-10)
    assert (tmp_path / "diagnostics.png").stat().st_size > 0


def shuffled_clients(data, batch_size: int = 4) -> list[ClientData]:
    """The least-squares clients behind shuffling loaders whose rows carry their index (to see which rows are read)."""
    def loader(rows, seed):
        return DataLoader(rows, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))

    clients = []
    for index, (a, b) in enumerate(data):
        rows = [{"x": a[i], "y": b[i], "row": i} for i in range(len(b))]
        clients.append(ClientData(str(index), len(b), partial(loader, rows), [{"x": a, "y": b}]))
    return clients


def test_the_gradient_sample_seed_depends_on_the_run_seed_and_the_client_only():
    assert gradient_seed(5, "3") == gradient_seed(5, "3")
    assert len({gradient_seed(seed, client) for seed in (5, 6) for client in ("3", "4")}) == 4


def test_a_sampled_gradient_reads_a_fixed_seeded_sample_of_each_large_client(tmp_path):
    data, limit = least_squares_clients(sizes=SIZES), 15  # clients 1 and 3 are larger than the limit; 0 and 2 are not
    clients = shuffled_clients(data)
    engine = least_squares_engine(tmp_path, data, rounds=2, every=1, clients=clients, max_samples=limit)
    final = engine.run()["weight"].squeeze(0).numpy()
    picked = {}
    for client, (a, b) in zip(clients, data):  # the first `limit` rows of the client's loader at its diagnostics seed
        order = torch.cat([batch["row"] for batch in client.train_loader(gradient_seed(5, client.client_id))])
        picked[client.client_id] = order[:limit].numpy()
    assert sorted(picked["0"]) == list(range(10)) and len(picked["3"]) == limit
    assert sorted(picked["3"]) != list(range(limit))  # a shuffled sample, not the first rows on disk
    sampled = [(a[picked[str(k)]], b[picked[str(k)]]) for k, (a, b) in enumerate(data)]
    metrics = pd.read_csv(tmp_path / "metrics.csv", dtype={"client": str})
    for round_index, weights in ((0, np.zeros(DIM)), (2, final)):  # the same rows at every round
        grads, g2, b2, _ = hand_reading(weights, sampled, sizes=SIZES)  # p_k still counts every train row
        federation, per_client = reading_of(metrics, round_index)
        assert federation["g2"] == pytest.approx(g2, rel=1e-10) and federation["b2"] == pytest.approx(b2, rel=1e-10)
        assert per_client == pytest.approx({str(k): float(grad @ grad) for k, grad in enumerate(grads)}, rel=1e-10)
    full = hand_reading(final, data)[1]
    assert abs(reading_of(metrics, 2)[0]["g2"] - full) > 1e-3 * full  # the sample is not the full pass


@pytest.mark.kernels
def test_diagnostics_change_no_training_draw_no_global_random_number_and_resume_bit_identically(tmp_path):
    from tests.tiny_models import TinyNet, client_samples, evaluate, loss_fn

    def run(out, rounds, diagnostics):
        torch.manual_seed(0)
        clients = []
        for index, size in enumerate((9, 14, 22, 27)):
            samples = client_samples(index, size)
            # No generator: the loader's shuffle draws from the global torch RNG, as an augmenting dataset would.
            clients.append(ClientData(str(index), size, lambda seed, s=samples: DataLoader(s, batch_size=6, shuffle=True)))
        algorithm, worker = build_algorithm("fedavg", TinyNet(), {c.client_id: c.num_samples for c in clients})
        config = EngineConfig(out_dir=out, n_rounds=rounds, lr_schedule=make_lr_schedule("constant", 0.05, rounds),
                              seed=3, local_steps=3, client_fraction=0.5, momentum=0.9, progress=False,
                              diagnostics=diagnostics, diagnostics_max_samples=10, plots=False)
        test = list(DataLoader(client_samples(0, 8), batch_size=8))
        engine = SequentialEngine(worker, algorithm, clients, loss_fn, evaluate, test, config, CPU)
        return engine, engine.run()

    _, plain = run(tmp_path / "plain", 3, diagnostics=False)
    engine, measured = run(tmp_path / "measured", 3, diagnostics=True)
    assert all(torch.equal(plain[key], measured[key]) for key in plain)  # BatchNorm buffers included
    before = torch.get_rng_state()
    assert engine.diagnose(3)
    assert torch.equal(torch.get_rng_state(), before)
    run(tmp_path / "resumed", 2, diagnostics=True)  # stopped after round 2, then continued
    _, resumed = run(tmp_path / "resumed", 3, diagnostics=True)
    assert all(torch.equal(resumed[key], measured[key]) for key in measured)
    assert (tmp_path / "resumed" / "metrics.csv").read_text() == (tmp_path / "measured" / "metrics.csv").read_text()


def test_a_personalised_algorithm_is_measured_on_its_shared_parameters_at_the_global_model(tmp_path):
    data = least_squares_clients(sizes=SIZES)
    engine = least_squares_engine(tmp_path, data, rounds=1, every=1, name="fedper", model=TwoLayer())
    engine.run()
    body = engine.global_weights["body.weight"].numpy()
    head = engine.global_weights["head.weight"].numpy()  # the server's head: what the global model predicts with
    grads = []
    for a, b in ((a.numpy(), b.numpy()) for a, b in data):
        residual = (a @ body.T @ head.T).squeeze(1) - b  # ∂/∂body of Σ ½ r_i² / n = headᵀ (Σ r_i x_iᵀ) / n
        grads.append((head.T @ (residual @ a)[None, :] / len(b)).ravel())
    metrics = pd.read_csv(tmp_path / "metrics.csv", dtype={"client": str})
    _, per_client = reading_of(metrics, 1)
    assert per_client == pytest.approx({str(k): float(grad @ grad) for k, grad in enumerate(grads)}, rel=1e-10)

    local = least_squares_engine(tmp_path / "local", data, rounds=1, every=1, name="local")
    local.run()  # shares no parameter: no gradient rows, and no error
    assert "diagnostics" not in set(pd.read_csv(tmp_path / "local" / "metrics.csv").split)


@pytest.mark.parametrize("every", [0, -2, float("nan"), 2.5, True])
def test_a_bad_period_is_refused_naming_the_flag(every):
    from network.run_config import RunConfig

    expected = "finite number" if isinstance(every, float) and every != every else "integer >= 1"
    with pytest.raises(TaskHetError, match=f"^--diagnostics_every must be an? {expected}"):
        RunConfig(task="depth_euclidean", diagnostics=True, diagnostics_every=every)
    if every == every:
        with pytest.raises(TaskHetError, match="^--diagnostics_every must be an integer >= 1"):
            EngineConfig(out_dir="x", n_rounds=1, lr_schedule=lambda r: 0.1, diagnostics_every=every)
    with pytest.raises(TaskHetError, match="^--diagnostics_max_samples must be an integer >= 1"):
        RunConfig(task="depth_euclidean", diagnostics=True, diagnostics_max_samples=0)


@pytest.mark.parametrize("value", ["0", "-3", "nan", "10001", "²"])
def test_the_command_line_refuses_a_bad_period_in_one_error_line(tmp_path, capsys, value):
    from steps import federated
    from utils.cli import run_main

    with pytest.raises(SystemExit) as exit_info:
        run_main(federated.main, ["--task", "depth_euclidean", "--diagnostics", "--diagnostics_every", value,
                                  "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: argument --diagnostics_every: must be an integer in [1, 10000], got '{value}'")
    assert not (tmp_path / "out").exists()


# ----- diagnostics.png, read through matplotlib's objects (the `figures` fixture of conftest.py) -----


def test_the_diagnostics_plot_shows_g2_b2_drift_and_the_cosine_spread_over_rounds(tmp_path, figures):
    from network.diagnostics import plot_diagnostics

    rows = []
    for r in (1, 2, 3):
        rows += [(r, "train", "mean", "update_norm", 0.5 * r), (r, "train", "max", "update_norm", r),
                 (r, "train", "min", "update_cosine", -0.5), (r, "train", "median", "update_cosine", 0.1 * r),
                 (r, "train", "max", "update_cosine", 0.9), (r, "train", "0", "drift", 0.5 * r)]
    for r in (0, 2):
        rows += [(r, "diagnostics", "all", "g2", 4.0 - r), (r, "diagnostics", "all", "b2", 3.0 - r / 2),
                 (r, "diagnostics", "0", "grad_norm2", 9.0)]
    pd.DataFrame(rows, columns=["round", "split", "client", "metric", "value"]).to_csv(tmp_path / "metrics.csv", index=False)
    assert plot_diagnostics(tmp_path / "metrics.csv", tmp_path / "diagnostics.png", "fedavg: a/b/c") == \
        tmp_path / "diagnostics.png"
    assert (tmp_path / "diagnostics.png").stat().st_size > 0
    figure = figures[-1]
    assert figure.get_suptitle() == "fedavg: a/b/c"
    g2_axis, b2_axis, drift_axis, cosine_axis = figure.axes
    assert [axis.get_title() for axis in figure.axes] == [
        "gradient dissimilarity at the global model", "FedProx's B² at the global model",
        "client drift of the sampled clients", "cosine of client updates (off-diagonal)"]
    assert [axis.get_ylabel() for axis in figure.axes] == ["G²", "B²", "‖y_k − x‖", "cos(Δ_j, Δ_k)"]
    assert drift_axis.get_xlabel() == cosine_axis.get_xlabel() == "round"
    legends = [[text.get_text() for text in axis.get_legend().get_texts()] for axis in figure.axes]
    assert legends == [["G² = Σ p_k ‖∇F_k − ∇F‖²"], ["B² = Σ p_k ‖∇F_k‖² / ‖∇F‖²", "B² = 1: identical gradients"],
                       ["mean drift ‖y_k − x‖", "max drift"], ["min to max", "median"]]
    assert g2_axis.lines[0].get_xydata().tolist() == [[0, 4.0], [2, 2.0]]
    assert b2_axis.lines[0].get_xydata().tolist() == [[0, 3.0], [2, 2.0]]
    assert drift_axis.lines[0].get_xydata().tolist() == [[1, 0.5], [2, 1.0], [3, 1.5]]
    assert cosine_axis.lines[0].get_ydata().tolist() == pytest.approx([0.1, 0.2, 0.3])
    band = cosine_axis.collections[0].get_paths()[0].vertices
    assert band[:, 1].min() == -0.5 and band[:, 1].max() == 0.9  # the min-to-max band
    assert cosine_axis.get_ylim() == (-1.05, 1.05)


def test_the_plot_says_which_panels_a_run_has_no_rows_for(tmp_path, figures):
    from network.diagnostics import plot_diagnostics

    rows = [(0, "diagnostics", "all", "g2", 1.0), (0, "diagnostics", "all", "b2", 2.0), (0, "test", "global", "loss", 1.0)]
    pd.DataFrame(rows, columns=["round", "split", "client", "metric", "value"]).to_csv(tmp_path / "metrics.csv", index=False)
    plot_diagnostics(tmp_path / "metrics.csv", tmp_path / "diagnostics.png")
    drift_axis, cosine_axis = figures[-1].axes[2:]
    for axis in (drift_axis, cosine_axis):
        assert [text.get_text() for text in axis.texts] == ["no rows in this run"] and axis.get_legend() is None
    pd.DataFrame(rows[2:], columns=["round", "split", "client", "metric", "value"]).to_csv(tmp_path / "m2.csv", index=False)
    assert plot_diagnostics(tmp_path / "m2.csv", tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


def test_test_fed_records_the_options_and_measures_every_client_of_a_real_run(tiny_data_root, tiny_manifest,  # noqa: F811
                                                                              assignments, tmp_path):
    import json

    import test_fed
    from tests.test_step4 import argv

    out = tmp_path / "run"
    test_fed.main(argv(tiny_data_root, tiny_manifest, assignments, out, "--client_fraction", "0.34", "--diagnostics",
                       "--diagnostics_every", "2", "--diagnostics_max_samples", "3"))
    args = json.loads((out / "config.json").read_text())["args"]
    assert (args["diagnostics"], args["diagnostics_every"], args["diagnostics_max_samples"]) == (True, 2, 3)
    metrics = pd.read_csv(out / "metrics.csv", dtype={"client": str})
    trained = metrics[(metrics.split == "train") & (metrics.metric == "drift")]
    assert trained.groupby("round").size().tolist() == [1, 1]  # one client of three trains per round ...
    measured = metrics[metrics.split == "diagnostics"]
    assert measured.groupby("round").client.apply(sorted).to_dict() == {0: ["0", "1", "2", "all", "all", "all"],
                                                                        2: ["0", "1", "2", "all", "all", "all"]}
    assert np.isfinite(measured.value).all() and (measured[measured.metric == "b2"].value >= 1 - 1e-9).all()
    assert (out / "diagnostics.png").stat().st_size > 0


# ----- every algorithm of the registry -----
@pytest.mark.parametrize("name", list_algorithms())
def test_every_algorithm_is_measured_on_every_client_without_changing_its_training(tmp_path, name):
    from tests.tiny_models import FAST_SETTINGS, class_counts, client_samples, evaluate, loss_fn, tiny_model_for

    def run(out, diagnostics):
        torch.manual_seed(0)
        clients = []
        for index, size in enumerate((9, 14, 22, 27)):
            samples = client_samples(index, size + 6)
            clients.append(ClientData(str(index), size, lambda seed, s=samples[:size]: DataLoader(
                s, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(seed)),
                list(DataLoader(samples[size:], batch_size=6)), class_counts(samples[:size])))
        algorithm, worker = build_algorithm(name, tiny_model_for(name), {c.client_id: c.num_samples for c in clients},
                                            FAST_SETTINGS.get(name), seed=3)
        config = EngineConfig(out_dir=out, n_rounds=1, lr_schedule=make_lr_schedule("constant", 0.05, 1), seed=3,
                              local_steps=2, client_fraction=0.5, progress=False, diagnostics=diagnostics,
                              diagnostics_max_samples=12, plots=False)
        engine = SequentialEngine(worker, algorithm, clients, loss_fn, evaluate,
                                  list(DataLoader(client_samples(0, 8), batch_size=8)), config, CPU)
        return engine, engine.run()

    _, plain = run(tmp_path / "plain", diagnostics=False)
    engine, measured = run(tmp_path / "measured", diagnostics=True)
    assert plain.keys() == measured.keys() and all(torch.equal(plain[key], measured[key]) for key in plain)
    metrics = pd.read_csv(tmp_path / "measured" / "metrics.csv", dtype={"client": str})
    rows = metrics[metrics.split == "diagnostics"]
    if not engine.shares_parameters:  # local: every trainable entry is private
        assert rows.empty
        return
    for round_index in (0, 1):
        federation, per_client = reading_of(metrics, round_index)
        assert sorted(per_client) == ["0", "1", "2", "3"]  # two trained, all four measured
        assert federation["g2"] >= 0 and federation["b2"] >= 1 - 1e-9
        p = np.array([9, 14, 22, 27]) / 72
        # Σ p_k ‖∇F_k‖² = ‖∇F‖² + G²: the per-client rows and the federation's agree
        assert p @ np.array([per_client[str(k)] for k in range(4)]) == pytest.approx(
            federation["global_grad_norm2"] + federation["g2"], rel=1e-6)


def test_a_sample_cuts_the_last_batch_in_every_kind_of_value():
    from network.diagnostics import first_samples

    def batch(start):
        return {"maps": [torch.arange(start, start + 4).view(4, 1), torch.zeros(4, 3)],  # one tensor per scale
                "x": torch.arange(start, start + 4), "sample_id": [f"s{i}" for i in range(start, start + 4)]}

    batches = [batch(0), batch(4), batch(8)]
    taken = list(first_samples(batches, 6))
    assert len(taken) == 2 and taken[0] is batches[0]
    cut = taken[1]
    assert cut["x"].tolist() == [4, 5] and cut["sample_id"] == ["s4", "s5"]
    assert cut["maps"][0].view(-1).tolist() == [4, 5] and cut["maps"][1].shape == (2, 3)
    assert list(first_samples(batches, 8)) == batches[:2] and list(first_samples(batches, None)) == batches
    with pytest.raises(TaskHetError, match="no tensor to count its samples by"):
        list(first_samples([{"sample_id": ["a"]}], 1))


def test_under_temporal_skew_each_gradient_is_over_the_rows_its_client_holds_in_that_round(tmp_path):
    """Each client holds the first half of its rows in rounds 1-2 and the second half from round 3: the diagnostics
    after round r read the rows of round max(r, 1), with p_k ∝ the number held then (unequal halves)."""
    from network.schedule import ClientSchedule

    data = least_squares_clients(sizes=(10, 31, 20, 45))
    clients = []
    for client, (a, b) in zip(oracle_clients(data), data):
        half = len(b) // 2
        rows = [{"x": a[i], "y": b[i]} for i in range(len(b))]
        schedule = ClientSchedule(np.array([1] * half + [3] * (len(b) - half)),
                                  np.array([2] * half + [10**9] * (len(b) - half)), rows, batch_size=64)
        clients.append(ClientData(client.client_id, client.num_samples, client.train_loader, client.test_loader,
                                  schedule=schedule))
    engine = least_squares_engine(tmp_path, data, rounds=3, every=1, clients=clients)
    engine.run()
    metrics = pd.read_csv(tmp_path / "metrics.csv", dtype={"client": str})
    first = [(a[:len(b) // 2], b[:len(b) // 2]) for a, b in data]
    second = [(a[len(b) // 2:], b[len(b) // 2:]) for a, b in data]
    for round_index, rows in ((0, first), (3, second)):
        start = np.zeros(DIM) if round_index == 0 else engine.global_weights["weight"].squeeze(0).numpy()
        grads, g2, b2, _ = hand_reading(start, rows)
        federation, per_client = reading_of(metrics, round_index)
        assert federation["g2"] == pytest.approx(g2, rel=1e-10) and federation["b2"] == pytest.approx(b2, rel=1e-10)
        assert per_client == pytest.approx({str(k): float(grad @ grad) for k, grad in enumerate(grads)}, rel=1e-10)
