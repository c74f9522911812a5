"""SCAFFOLD (network/algorithms/scaffold.py) against its equations, by hand and on the least-squares oracle."""

from __future__ import annotations

import pytest
import torch

from network.algorithms import build_algorithm
from network.algorithms import scaffold as scaffold_module
from network.algorithms.base import ServerState, Upload, make_optimizer
from network.algorithms.scaffold import CONTROL, CONTROL_DELTA, DELTA
from network.engine_sequential import EngineConfig, SequentialEngine
from network.local_train import local_train
from network.lr_schedule import make_lr_schedule
from tests.oracles import (CPU, DIM, client_config, gradient, least_squares_clients, least_squares_loss, linear_model,
                           max_curvature, mean_loss, oracle_clients, pooled_optimum, relative_error, run_oracle,
                           uniform_optimum)
from tests.tiny_models import TinyNet
from utils.errors import TaskHetError

SIZES = {"0": 10, "1": 20, "2": 30, "3": 40}  # n = 100


def vec(value: float) -> torch.Tensor:
    return torch.full((1, DIM), value, dtype=torch.float64)


def scaffold(**settings):
    algorithm, _ = build_algorithm("scaffold", linear_model(), SIZES, settings)
    return algorithm


def two_uploads() -> list[Upload]:
    return [Upload("0", {DELTA: {"weight": vec(1.0)}, CONTROL_DELTA: {"weight": vec(2.0)}}, 10),
            Upload("3", {DELTA: {"weight": vec(4.0)}, CONTROL_DELTA: {"weight": vec(-1.0)}}, 40)]


def test_sample_weighted_server_step_by_hand():
    algorithm = scaffold(server_lr=0.5)
    server = ServerState({"global": {"weight": vec(1.0)}}, {"weight": vec(0.25)})
    new = algorithm.aggregate(server, two_uploads())
    # p = (0.1, 0.4): x + η_g·(0.1·1 + 0.4·4)/(0.1 + 0.4) = 1 + 0.5·3.4; c + (0.1·2 + 0.4·(−1)) = 0.25 − 0.2
    assert torch.allclose(new.models["global"]["weight"], vec(1.0 + 0.5 * 3.4), rtol=0, atol=1e-14)
    assert torch.allclose(new.tensors["weight"], vec(0.05), rtol=0, atol=1e-14)


def test_uniform_server_step_by_hand():
    algorithm = scaffold(server_lr=0.5, weighting="uniform")
    server = ServerState({"global": {"weight": vec(1.0)}}, {"weight": vec(0.25)})
    new = algorithm.aggregate(server, two_uploads())
    # x + η_g·mean(1, 4); c + (|S|/N)·mean(2, −1) = 0.25 + (2/4)·0.5
    assert torch.allclose(new.models["global"]["weight"], vec(1.0 + 0.5 * 2.5), rtol=0, atol=1e-14)
    assert torch.allclose(new.tensors["weight"], vec(0.5), rtol=0, atol=1e-14)


@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_server_control_stays_the_weighted_mean_of_all_client_controls(weighting):
    data = least_squares_clients(sizes=tuple(SIZES.values()))
    algorithm = scaffold(weighting=weighting)
    model = linear_model()
    server = algorithm.init_server({"weight": torch.zeros(1, DIM, dtype=torch.float64)})
    states = {client: {} for client in SIZES}
    for sampled in (["0", "2"], ["1", "2", "3"], ["3"]):
        uploads = []
        for client in sampled:
            a, b = data[int(client)]
            result = algorithm.client_update(model, algorithm.broadcast(server), states[client], [{"x": a, "y": b}],
                                             client_config(len(b)))
            states[client] = result.client_state
            uploads.append(Upload(client, result.upload, len(b)))
        server = algorithm.aggregate(server, uploads)
    shares = {client: (size / 100 if weighting == "samples" else 0.25) for client, size in SIZES.items()}
    expected = sum(shares[client] * state.get("weight", torch.zeros(1, DIM, dtype=torch.float64))
                   for client, state in states.items())
    assert torch.allclose(server.tensors["weight"], expected, rtol=0, atol=1e-13)


def test_option_two_is_the_mean_raw_gradient_and_equals_the_papers_formula_under_plain_sgd():
    a, b = least_squares_clients(sizes=(30,))[0]
    algorithm = scaffold()
    model = linear_model()
    x = torch.linspace(-1, 1, DIM, dtype=torch.float64).unsqueeze(0)
    c, c_i = vec(0.3), vec(-0.2)
    batches = [{"x": a[:10], "y": b[:10]}, {"x": a[10:20], "y": b[10:20]}, {"x": a[20:], "y": b[20:]}]
    lr = 0.01
    result = algorithm.client_update(model, {"global": {"weight": x}, CONTROL: {"weight": c}}, {"weight": c_i},
                                     batches, client_config(30, lr=lr, steps=None, local_epochs=2))
    assert result.metrics["local_steps"] == 6
    w, raw = x.squeeze(0).clone(), []
    for batch in batches * 2:  # corrected steps, recording the raw minibatch gradients
        g = gradient(w, batch["x"], batch["y"])
        raw.append(g)
        w = w - lr * (g - c_i.squeeze(0) + c.squeeze(0))
    assert torch.allclose(result.upload[DELTA]["weight"].squeeze(0), w - x.squeeze(0), rtol=0, atol=1e-14)
    assert torch.allclose(result.client_state["weight"].squeeze(0), torch.stack(raw).mean(0), rtol=0, atol=1e-14)
    formula = c_i - c + (x - w.unsqueeze(0)) / (6 * lr)  # the paper's option II
    assert torch.allclose(result.client_state["weight"], formula, rtol=0, atol=1e-10)
    assert torch.allclose(result.upload[CONTROL_DELTA]["weight"], result.client_state["weight"] - c_i, atol=1e-15)


def test_option_one_uses_the_full_gradient_at_the_server_model():
    a, b = least_squares_clients()[1]
    algorithm = scaffold(option="I")
    x = torch.linspace(0, 1, DIM, dtype=torch.float64).unsqueeze(0)
    result = algorithm.client_update(linear_model(), {"global": {"weight": x}, CONTROL: {}}, {}, [{"x": a, "y": b}],
                                     client_config(len(b)))
    assert torch.allclose(result.client_state["weight"].squeeze(0), gradient(x.squeeze(0), a, b), atol=1e-13)


@pytest.mark.parametrize("weighting, optimum", [("samples", pooled_optimum), ("uniform", uniform_optimum)])
def test_converges_to_the_optimum_of_its_weighting_with_unequal_clients(tmp_path, weighting, optimum):
    data = least_squares_clients(sizes=(10, 80, 20, 50))
    weights, _ = run_oracle(tmp_path, "scaffold", rounds=150, steps=10, lr=0.3 / max_curvature(data), data=data,
                            weighting=weighting)
    assert relative_error(weights, optimum(data)) < 1e-6
    other = uniform_optimum if optimum is pooled_optimum else pooled_optimum
    assert relative_error(weights, other(data)) > 1e-2  # the two objectives really differ here


def pooled_loss(weights: torch.Tensor, data) -> float:
    a, b = torch.cat([a for a, _ in data]), torch.cat([b for _, b in data])
    return float(0.5 * ((a @ weights - b) ** 2).mean())


@pytest.mark.parametrize("scale, n_clients, rounds", [(0.2, 20, 100), (0.5, 4, 170)])
@pytest.mark.slow
def test_option_two_with_momentum_converges_at_the_issue_setting(tmp_path, scale, n_clients, rounds):
    # issue 19: 20 heterogeneous clients, K = 10, μ = 0.9. The plain mean of the raw gradients (the
    # earlier option II) diverged from lr 0.15/L_max; this rule contracts by 0.83 per round at 0.2/L_max
    # (docs/DESIGN.md): 2.5e-6 of the start is left after 60 rounds, ~1e-9 after 100. At 0.5/L_max it
    # contracts by 0.96 with 20 clients (550 rounds to pass 1e-7); 4 such clients at that lr contract by
    # 0.90 (5e-4 left after 60 rounds, ~6e-9 after 170) while the old rule grows 46-fold in 60 rounds there.
    data = least_squares_clients(sizes=(30,) * n_clients)
    weights, _ = run_oracle(tmp_path, "scaffold", rounds=rounds, steps=10, lr=scale / max_curvature(data), data=data,
                            momentum=0.9)
    optimum = pooled_optimum(data)
    assert relative_error(weights, optimum) < 1e-7
    assert pooled_loss(weights, data) - pooled_loss(optimum, data) < 1e-12


def heavy_ball_round(x, c, c_i, batches, lr, momentum, steps):
    """One client's corrected heavy-ball steps written out: returns y_K."""
    w, v = x.clone(), torch.zeros_like(x)
    for k in range(steps):
        batch = batches[k % len(batches)]
        d = gradient(w, batch["x"], batch["y"]) - c_i + c
        v = d if k == 0 else momentum * v + d
        w = w - lr * v
    return w


def test_one_round_with_momentum_unequal_clients_partial_participation_and_server_lr_by_hand():
    data = least_squares_clients(sizes=tuple(SIZES.values()), seed=3)
    algorithm = scaffold(server_lr=0.5)
    model = linear_model()
    x = torch.linspace(-1, 1, DIM, dtype=torch.float64)
    c = torch.linspace(0.2, -0.3, DIM, dtype=torch.float64)
    c_i = {"1": torch.full((DIM,), 0.1, dtype=torch.float64), "3": torch.linspace(-0.4, 0.4, DIM, dtype=torch.float64)}
    server = ServerState({"global": {"weight": x.unsqueeze(0)}}, {"weight": c.unsqueeze(0)})
    lr, momentum, steps = 0.05, 0.9, 3
    s_total = 1 + 1.9 + 2.71  # S = Σ_{k=1..3} (1 − 0.9^k)/(1 − 0.9)
    uploads, expected_c_i, expected_delta = [], {}, {}
    for client in ("1", "3"):  # clients 0 and 2 are not sampled this round
        a, b = data[int(client)]
        batches = [{"x": a[:7], "y": b[:7]}, {"x": a[7:], "y": b[7:]}]  # two unequal batches, cycled
        result = algorithm.client_update(model, algorithm.broadcast(server), {"weight": c_i[client].unsqueeze(0)},
                                         batches, client_config(len(b), lr=lr, steps=steps, momentum=momentum))
        y = heavy_ball_round(x, c, c_i[client], batches, lr, momentum, steps)
        expected_c_i[client] = c_i[client] - c + (x - y) / (lr * s_total)
        expected_delta[client] = y - x
        assert torch.allclose(result.upload[DELTA]["weight"].squeeze(0), y - x, rtol=0, atol=1e-13)
        assert torch.allclose(result.client_state["weight"].squeeze(0), expected_c_i[client], rtol=0, atol=1e-12)
        uploads.append(Upload(client, result.upload, len(b)))
    new = algorithm.aggregate(server, uploads)
    p = {"1": 0.2, "3": 0.4}  # n_i / n with n = 100
    x_new = x + 0.5 * (p["1"] * expected_delta["1"] + p["3"] * expected_delta["3"]) / (p["1"] + p["3"])
    c_new = c + sum(p[client] * (expected_c_i[client] - c_i[client]) for client in p)
    assert torch.allclose(new.models["global"]["weight"].squeeze(0), x_new, rtol=0, atol=1e-13)
    assert torch.allclose(new.tensors["weight"].squeeze(0), c_new, rtol=0, atol=1e-12)


def old_option_two(model, x, c, c_i, batches, cfg):
    """The option II before issue 19 (the plain mean of the raw gradients), as it was written."""
    model.weight.data.copy_(x)
    targets = [model.weight]
    correction = torch._foreach_sub([c], [c_i])
    gradient_sum = [torch.zeros_like(model.weight)]

    def correct(_):
        grads = [param.grad for param in targets]
        torch._foreach_add_(gradient_sum, grads)
        torch._foreach_add_(grads, correction)

    result = local_train(model, batches, cfg.loss_fn, make_optimizer(targets, cfg), cfg.device, **cfg.budget(),
                         grad_hook=correct)
    return torch._foreach_div(gradient_sum, result.steps)[0]


@pytest.mark.kernels
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_without_momentum_option_two_is_bit_for_bit_the_plain_mean_gradient(weight_decay):
    a, b = least_squares_clients(sizes=(30,))[0]
    batches = [{"x": a[:10], "y": b[:10]}, {"x": a[10:], "y": b[10:]}]
    x, c, c_i = torch.linspace(-1, 1, DIM, dtype=torch.float64).unsqueeze(0), vec(0.3), vec(-0.2)
    cfg = client_config(30, lr=0.02, steps=5, weight_decay=weight_decay)
    result = scaffold().client_update(linear_model(), {"global": {"weight": x}, CONTROL: {"weight": c}},
                                      {"weight": c_i}, batches, cfg)
    assert torch.equal(result.client_state["weight"], old_option_two(linear_model(), x, c, c_i, batches, cfg))


@pytest.mark.parametrize("options, s_total", [
    ({"momentum": 0.9, "nesterov": True}, (1 + 0.9 * 1) + (1 + 0.9 * 1.9) + (1 + 0.9 * 2.71) + (1 + 0.9 * 3.439)),
    ({"momentum": 0.9, "dampening": 0.5}, 1 + 1.4 + 1.76 + 2.084),  # b_1 = 1, b_k = 0.9·b_{k−1} + 0.5
])
def test_option_two_divides_by_the_total_step_of_nesterov_or_dampened_momentum(monkeypatch, options, s_total):
    # make_optimizer offers momentum and weight decay only; the rule follows torch SGD's other options too
    monkeypatch.setattr(scaffold_module, "make_optimizer",
                        lambda params, cfg: torch.optim.SGD(list(params), lr=cfg.lr, **options))
    a, b = least_squares_clients(sizes=(30,))[0]
    batches = [{"x": a[:10], "y": b[:10]}, {"x": a[10:], "y": b[10:]}]
    x, c, c_i = torch.linspace(-1, 1, DIM, dtype=torch.float64).unsqueeze(0), vec(0.3), vec(-0.2)
    lr = 0.02
    result = scaffold().client_update(linear_model(), {"global": {"weight": x}, CONTROL: {"weight": c}},
                                      {"weight": c_i}, batches, client_config(30, lr=lr, steps=4))
    y = x + result.upload[DELTA]["weight"]
    assert torch.allclose(result.client_state["weight"], c_i - c + (x - y) / (lr * s_total), rtol=0, atol=1e-12)


def test_a_local_optimizer_other_than_sgd_is_refused(monkeypatch):
    monkeypatch.setattr(scaffold_module, "make_optimizer", lambda params, cfg: torch.optim.Adam(list(params)))
    a, b = least_squares_clients(sizes=(10,))[0]
    with pytest.raises(TaskHetError, match="^scaffold option II needs plain torch SGD as the local optimizer, got Adam$"):
        scaffold().client_update(linear_model(), {"global": {"weight": vec(0.0)}, CONTROL: {}}, {}, [{"x": a, "y": b}],
                                 client_config(10))


def test_momentum_and_weight_decay_converge_to_the_regularised_optimum(tmp_path):
    data = least_squares_clients(sizes=(10, 80, 20, 50))
    decay = 0.05
    a, b = torch.cat([a for a, _ in data]), torch.cat([b for _, b in data])
    optimum = torch.linalg.solve(a.T @ a / len(b) + decay * torch.eye(DIM, dtype=torch.float64), a.T @ b / len(b))
    clients = oracle_clients(data)
    algorithm, worker = build_algorithm("scaffold", linear_model(), {c.client_id: c.num_samples for c in clients}, {})
    rounds = 150  # the round map contracts by 0.86 here (lr 0.2/L_max)
    config = EngineConfig(out_dir=tmp_path, n_rounds=rounds, local_steps=10, eval_every=rounds, momentum=0.9,
                          lr_schedule=make_lr_schedule("constant", 0.2 / max_curvature(data), rounds),
                          weight_decay=decay, progress=False, plots=False)
    final = SequentialEngine(worker, algorithm, clients, least_squares_loss, mean_loss, [{"x": a, "y": b}], config,
                             CPU).run()
    assert relative_error(final["weight"].squeeze(0), optimum) < 1e-7


def test_partial_participation_and_a_server_lr_still_reach_the_optimum(tmp_path):
    data = least_squares_clients(sizes=(10, 80, 20, 50))
    weights, _ = run_oracle(tmp_path, "scaffold", rounds=400, steps=10, lr=0.3 / max_curvature(data), data=data,
                            fraction=0.5, server_lr=0.8)
    assert relative_error(weights, pooled_optimum(data)) < 1e-4


def test_batchnorm_buffers_are_not_scaled_by_the_server_lr():
    torch.manual_seed(0)
    algorithm, model = build_algorithm("scaffold", TinyNet(), {"a": 1, "b": 3}, {"server_lr": 0.5})
    server = algorithm.init_server({key: value.clone() for key, value in model.state_dict().items()})
    ones = {key: torch.ones_like(value) for key, value in server.models["global"].items()}
    controls = {name: torch.zeros_like(param) for name, param in model.named_parameters()}
    new = algorithm.aggregate(server, [Upload("a", {DELTA: ones, CONTROL_DELTA: controls}, 1)])
    before, after = server.models["global"], new.models["global"]
    assert torch.equal(after["body.1.running_mean"], before["body.1.running_mean"] + 1)
    assert torch.equal(after["body.0.weight"], before["body.0.weight"] + 0.5)


def test_option_one_weights_unequal_batches_by_size_and_gives_unused_parameters_a_zero_control():
    a, b = least_squares_clients(sizes=(30,))[0]
    algorithm = scaffold(option="I")
    model = linear_model()
    model.register_parameter("unused", torch.nn.Parameter(torch.ones(2, dtype=torch.float64)))  # no loss reaches it
    x = torch.linspace(0, 1, DIM, dtype=torch.float64).unsqueeze(0)
    batches = [{"x": a[:10], "y": b[:10]}, {"x": a[10:], "y": b[10:]}]  # 10 and 20 rows
    c = {"unused": torch.full((2,), 0.5, dtype=torch.float64)}
    result = algorithm.client_update(model, {"global": {"weight": x, "unused": torch.ones(2, dtype=torch.float64)},
                                             CONTROL: c}, {}, batches, client_config(30, lr=0.01, steps=2))
    assert torch.allclose(result.client_state["weight"].squeeze(0), gradient(x.squeeze(0), a, b), rtol=0, atol=1e-13)
    assert torch.equal(result.client_state["unused"], torch.zeros(2, dtype=torch.float64))
    # no loss gradient reaches it, yet each of the K = 2 steps moves it by −η_l·(c − c_i)
    assert torch.allclose(result.upload[DELTA]["unused"], torch.full((2,), -2 * 0.01 * 0.5, dtype=torch.float64),
                          rtol=0, atol=1e-15)


def test_no_local_step_is_the_named_error():
    a, b = least_squares_clients(sizes=(10,))[0]
    with pytest.raises(TaskHetError, match=r"^scaffold needs at least one local step \(K >= 1\) per client$"):
        scaffold().client_update(linear_model(), {"global": {"weight": vec(0.0)}, CONTROL: {}}, {}, [{"x": a, "y": b}],
                                 client_config(10, steps=0))


def test_option_one_needs_training_data_and_one_sample_is_enough():
    a, b = least_squares_clients(sizes=(1,))[0]
    algorithm = scaffold(option="I")
    x = torch.zeros(1, DIM, dtype=torch.float64)
    result = algorithm.client_update(linear_model(), {"global": {"weight": x}, CONTROL: {}}, {}, [{"x": a, "y": b}],
                                     client_config(1, steps=1))
    assert torch.allclose(result.client_state["weight"].squeeze(0), gradient(x.squeeze(0), a, b), rtol=0, atol=1e-13)
    with pytest.raises(TaskHetError, match="^scaffold option I needs a client with training data$"):
        algorithm.client_update(linear_model(), {"global": {"weight": x}, CONTROL: {}}, {}, [], client_config(1))


def test_a_frozen_parameter_has_no_control_variate_and_never_moves():
    a, b = least_squares_clients(sizes=(20,))[0]
    model = linear_model()
    model.register_parameter("frozen", torch.nn.Parameter(torch.ones(2, dtype=torch.float64), requires_grad=False))
    start = {"weight": vec(0.5), "frozen": torch.ones(2, dtype=torch.float64)}
    result = scaffold().client_update(model, {"global": start, CONTROL: {}}, {}, [{"x": a, "y": b}],
                                      client_config(20, steps=3))
    assert set(result.client_state) == set(result.upload[CONTROL_DELTA]) == {"weight"}
    assert torch.equal(result.upload[DELTA]["frozen"], torch.zeros(2, dtype=torch.float64))
