"""FedNova (network/algorithms/fednova.py): normalised averaging (Wang et al., NeurIPS 2020) against numpy, by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from network.algorithms import build_algorithm
from network.algorithms.base import Upload
from network.algorithms.fednova import NORM, NORMALISED, momentum_norm
from network.algorithms.skeleton import DELTA
from tests.oracles import DIM, client_config, least_squares_clients, linear_model
from tests.tiny_models import TinyNet
from utils.errors import TaskHetError

SIZES = (15, 40)  # unequal clients
STEPS = (3, 7)  # unequal local work τ_i


def numpy_client(x, batches, lr, steps, momentum, weight_decay):
    """Client i's heavy-ball SGD in float64 numpy (torch SGD's recursion); returns (Δ_i, a_i).

    On a batch (A, b) the loss ‖A w − b‖²/(2 n_b) has gradient Aᵀ(A w − b)/n_b (d/dw ½(a·w − y)² = (a·w − y)·a);
    weight decay adds λ·w. u_1 = g_1, u_k = ρ·u_{k−1} + g_k, w ← w − η·u_k. a_i = ‖a_i‖₁ is the same recursion
    run on the scalar gradient 1 (the coefficient a constant gradient would get), summed over the steps.
    """
    w, u, unit, a_norm = x.copy(), None, 0.0, 0.0
    for step in range(steps):
        a, b = batches[step % len(batches)]
        g = a.T @ (a @ w - b) / len(b) + weight_decay * w
        u = g if u is None else momentum * u + g
        w = w - lr * u
        unit = 1.0 if step == 0 else momentum * unit + 1.0
        a_norm += unit
    return w - x, a_norm


def numpy_server(x, deltas, norms, weights, server_lr):
    """x + η_g·τ_eff·Σ p_i Δ_i/a_i, p_i = w_i/Σ w_j over the participants, τ_eff = Σ p_i a_i."""
    p = np.array(weights, dtype=float) / sum(weights)
    tau_eff = float(p @ np.array(norms))
    return x + server_lr * tau_eff * sum(p_i * delta / a for p_i, delta, a in zip(p, deltas, norms))


@pytest.mark.parametrize("momentum, weight_decay, weighting, server_lr",
                         [(0.0, 0.0, "samples", 1.0), (0.9, 0.01, "uniform", 0.5)])
def test_two_rounds_of_unequal_local_work_equal_the_numpy_oracle(momentum, weight_decay, weighting, server_lr):
    data = least_squares_clients(sizes=SIZES, seed=5)
    lr = 0.03
    algorithm, model = build_algorithm("fednova", linear_model(), {"0": SIZES[0], "1": SIZES[1]},
                                       {"weighting": weighting, "server_lr": server_lr})
    x = np.linspace(-1, 1, DIM)
    server = algorithm.init_server({"weight": torch.tensor(x).unsqueeze(0)})
    weights = list(SIZES) if weighting == "samples" else [1.0, 1.0]
    for _ in range(2):
        uploads, deltas, norms = [], [], []
        for k, ((a, b), size, steps) in enumerate(zip(data, SIZES, STEPS)):
            batches = [(a[:4].numpy(), b[:4].numpy()), (a[4:].numpy(), b[4:].numpy())]  # unequal batches, cycled
            delta, norm = numpy_client(x, batches, lr, steps, momentum, weight_decay)
            deltas.append(delta)
            norms.append(norm)
            result = algorithm.client_update(model, algorithm.broadcast(server), {},
                                             [{"x": torch.tensor(p), "y": torch.tensor(q)} for p, q in batches],
                                             client_config(size, lr=lr, steps=steps, momentum=momentum,
                                                           weight_decay=weight_decay))
            assert float(result.upload[NORM]["a"]) == pytest.approx(norm, rel=1e-14)
            np.testing.assert_allclose(result.upload[NORMALISED]["weight"].squeeze(0).numpy(), delta / norm,
                                       rtol=0, atol=1e-12)
            uploads.append(Upload(str(k), result.upload, size))
        server = algorithm.aggregate(server, uploads)
        x = numpy_server(x, deltas, norms, weights, server_lr)
        np.testing.assert_allclose(server.models["global"]["weight"].squeeze(0).numpy(), x, rtol=0, atol=1e-12)


def test_the_momentum_norm_by_hand():
    assert momentum_norm(5, 0.0) == 5.0
    assert momentum_norm(3, 0.5) == pytest.approx(1 + 1.5 + 1.75, rel=1e-15)  # Σ_{i≤3} (1 − 0.5^i)/(1 − 0.5)
    assert momentum_norm(1, 0.9) == pytest.approx(1.0, rel=1e-15)


def test_a_constant_gradient_is_recovered_exactly_by_the_normalisation():
    """With a constant gradient c every heavy-ball step direction is c·(its coefficient): Δ = −η·‖a‖₁·c, so d = −η·c."""
    c = torch.linspace(-0.5, 1.0, DIM, dtype=torch.float64)

    def linear_loss(model, batch, reduction="mean"):
        return (model.weight.squeeze(0) * c).sum()

    algorithm, model = build_algorithm("fednova", linear_model(), {"0": 5})
    result = algorithm.client_update(model, {"global": {"weight": torch.zeros(1, DIM, dtype=torch.float64)}}, {},
                                     [{"x": torch.zeros(1, DIM)}], client_config(5, lr=0.1, steps=6, momentum=0.9,
                                                                               loss_fn=linear_loss))
    assert torch.allclose(result.upload[NORMALISED]["weight"].squeeze(0), -0.1 * c, rtol=0, atol=1e-14)


def test_local_epochs_count_the_steps_actually_taken():
    a, b = least_squares_clients(sizes=(30,))[0]
    algorithm, model = build_algorithm("fednova", linear_model(), {"0": 30})
    batches = [{"x": a[i:i + 10], "y": b[i:i + 10]} for i in (0, 10, 20)]
    result = algorithm.client_update(model, {"global": {"weight": torch.zeros(1, DIM, dtype=torch.float64)}}, {},
                                     batches, client_config(30, steps=None, local_epochs=2))
    assert result.metrics["local_steps"] == 6 and float(result.upload[NORM]["a"]) == 6.0


def test_equal_work_without_momentum_is_fedavg_exactly():
    data = least_squares_clients(sizes=SIZES, seed=2)
    sizes = {"0": SIZES[0], "1": SIZES[1]}
    nova, model = build_algorithm("fednova", linear_model(), sizes)
    fedavg, _ = build_algorithm("fedavg", linear_model(), sizes)
    start = {"weight": torch.linspace(-1, 1, DIM, dtype=torch.float64).unsqueeze(0)}
    servers = {"nova": nova.init_server(start), "avg": fedavg.init_server(start)}
    for _ in range(2):
        for name, algorithm in (("nova", nova), ("avg", fedavg)):
            uploads = [Upload(str(k), algorithm.client_update(model, algorithm.broadcast(servers[name]), {},
                                                              [{"x": a, "y": b}],
                                                              client_config(len(b), steps=4)).upload, len(b))
                       for k, (a, b) in enumerate(data)]
            servers[name] = algorithm.aggregate(servers[name], uploads)
        # τ = 4 is a power of two: dividing by a_i and multiplying by τ_eff are exact, so the bits agree
        assert torch.equal(servers["nova"].models["global"]["weight"], servers["avg"].models["global"]["weight"])


def upload(delta: float, norm: float, size: int, client: str) -> Upload:
    return Upload(client, {NORMALISED: {"weight": torch.full((1, DIM), delta / norm, dtype=torch.float64)},
                           DELTA: {}, NORM: {"a": torch.tensor(norm, dtype=torch.float64)}}, size)


def test_unequal_work_by_hand_and_one_client_takes_its_own_step():
    algorithm, _ = build_algorithm("fednova", linear_model(), {"a": 10, "b": 30})
    server = algorithm.init_server({"weight": torch.zeros(1, DIM, dtype=torch.float64)})
    new = algorithm.aggregate(server, [upload(6.0, 3.0, 10, "a"), upload(1.0, 1.0, 30, "b")])
    # p = (0.25, 0.75); d = (2, 1); τ_eff = 0.25·3 + 0.75·1 = 1.5; x = 1.5·(0.5 + 0.75) = 1.875 (FedAvg: 2.25)
    assert torch.allclose(new.models["global"]["weight"], torch.full((1, DIM), 1.875, dtype=torch.float64),
                          rtol=0, atol=1e-15)
    alone = algorithm.aggregate(server, [upload(6.0, 4.25, 10, "a")])  # τ_eff = a: x + Δ
    assert torch.allclose(alone.models["global"]["weight"], torch.full((1, DIM), 6.0, dtype=torch.float64),
                          rtol=0, atol=1e-14)


def test_buffers_upload_their_change_and_take_the_plain_weighted_mean():
    algorithm, model = build_algorithm("fednova", TinyNet(), {"a": 1, "b": 3})
    server = algorithm.init_server({key: value.clone() for key, value in model.state_dict().items()})
    batch = {"x": torch.randn(8, 4), "y": torch.randn(8)}
    result = algorithm.client_update(model, algorithm.broadcast(server), {}, [batch],
                                     client_config(1, steps=2, loss_fn=lambda m, b, reduction="mean":
                                                   ((m(b["x"]).squeeze(-1) - b["y"]) ** 2).mean()))
    params = {name for name, _ in model.named_parameters()}
    assert set(result.upload[NORMALISED]) == params and set(result.upload[DELTA]) == set(model.state_dict()) - params
    global_weights = server.models["global"]
    buffers = {key: torch.full_like(value, 1.0 if value.is_floating_point() else 4) for key, value in
               global_weights.items() if key not in params}
    normalised = {key: torch.ones_like(global_weights[key]) for key in params}
    uploads = [Upload(client, {NORMALISED: normalised, DELTA: {key: value * scale for key, value in buffers.items()},
                               NORM: {"a": torch.tensor(2.0, dtype=torch.float64)}}, size)
               for client, size, scale in (("a", 1, 1), ("b", 3, 3))]
    after = algorithm.aggregate(server, uploads).models["global"]
    # buffers: (1·1 + 3·3)/4 = 2.5, not scaled by τ_eff = 2; parameters: + τ_eff·1
    assert torch.equal(after["body.1.running_mean"], global_weights["body.1.running_mean"] + 2.5)
    assert torch.equal(after["body.0.weight"], global_weights["body.0.weight"] + 2)


def test_a_client_without_a_local_step_or_with_momentum_one_is_refused():
    a, b = least_squares_clients(sizes=(10,))[0]
    algorithm, model = build_algorithm("fednova", linear_model(), {"0": 10})
    broadcast = {"global": {"weight": torch.zeros(1, DIM, dtype=torch.float64)}}
    with pytest.raises(TaskHetError, match=r"^fednova needs at least one local step per client \(a_i = 0 cannot"):
        algorithm.client_update(model, broadcast, {}, [{"x": a, "y": b}], client_config(10, steps=0))
    with pytest.raises(TaskHetError, match=r"^fednova needs a local momentum in \[0, 1\), got 1.0$"):
        algorithm.client_update(model, broadcast, {}, [{"x": a, "y": b}], client_config(10, steps=2, momentum=1.0))


def test_a_bad_server_setting_is_refused_naming_it():
    with pytest.raises(TaskHetError, match=r"^setting server_lr must be > 0, got 0.0$"):
        build_algorithm("fednova", linear_model(), {"0": 1}, {"server_lr": 0.0})


def test_nothing_personal_is_kept_or_uploaded():
    a, b = least_squares_clients(sizes=(10,))[0]
    algorithm, model = build_algorithm("fednova", linear_model(), {"0": 10})
    result = algorithm.client_update(model, {"global": {"weight": torch.zeros(1, DIM, dtype=torch.float64)}}, {},
                                     [{"x": a, "y": b}], client_config(10, steps=3))
    assert result.client_state == {} and not algorithm.private_keys() and not algorithm.personalized
    assert set(result.upload) == {NORMALISED, DELTA, NORM} and result.upload[NORM]["a"].dtype == torch.float64


def test_stragglers_set_by_the_engine_are_normalised_as_the_numpy_oracle_says(tmp_path):
    """The engine's unequal local work (EngineConfig.client_steps, what --straggler_fraction sets) reaches FedNova:
    two rounds, full batches, client 0 a straggler at 1 step and client 1 at 3, against the numpy oracle."""
    from network.engine_config import EngineConfig
    from network.engine_sequential import SequentialEngine
    from network.lr_schedule import make_lr_schedule
    from tests.oracles import CPU, least_squares_loss, mean_loss, oracle_clients

    data = least_squares_clients(sizes=SIZES, seed=5)
    budgets, lr, rounds = {"0": 1, "1": 3}, 0.03, 2
    clients = oracle_clients(data)
    algorithm, model = build_algorithm("fednova", linear_model(), {c.client_id: c.num_samples for c in clients})
    config = EngineConfig(out_dir=tmp_path, n_rounds=rounds, lr_schedule=make_lr_schedule("constant", lr, rounds),
                          local_steps=4, client_steps=budgets, progress=False, plots=False)
    pooled = [{"x": torch.cat([a for a, _ in data]), "y": torch.cat([b for _, b in data])}]
    final = SequentialEngine(model, algorithm, clients, least_squares_loss, mean_loss, pooled, config, CPU).run()
    x = np.zeros(DIM)
    for _ in range(rounds):
        results = [numpy_client(x, [(a.numpy(), b.numpy())], lr, budgets[str(k)], 0.0, 0.0)
                   for k, (a, b) in enumerate(data)]
        x = numpy_server(x, [delta for delta, _ in results], [norm for _, norm in results], list(SIZES), 1.0)
    np.testing.assert_allclose(final["weight"].squeeze(0).numpy(), x, rtol=0, atol=1e-12)
    # the setting discriminates: FedAvg's mean of the same updates (no normalisation) lands elsewhere
    first = [numpy_client(np.zeros(DIM), [(a.numpy(), b.numpy())], lr, budgets[str(k)], 0.0, 0.0)
             for k, (a, b) in enumerate(data)]
    fedavg = sum(size * delta for size, (delta, _) in zip(SIZES, first)) / sum(SIZES)
    fednova = numpy_server(np.zeros(DIM), [d for d, _ in first], [n for _, n in first], list(SIZES), 1.0)
    assert np.abs(fedavg - fednova).max() > 1e-3
