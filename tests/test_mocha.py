"""MOCHA's primal regulariser (network/algorithms/mocha.py): Ω in closed form, a live gradient, learned relationships."""

from __future__ import annotations

import math
import re

import pytest
import scipy.linalg
import torch

from network.algorithms import build_algorithm
from network.algorithms.base import load_weights
from network.algorithms import mocha as mocha_module
from network.algorithms.mocha import (COUPLING, HEAD_PREFIX, OMEGA, OMEGA_KK, MochaDivergence, MochaSettings,
                                      check_head, check_local_step, regulariser, task_covariance)
from tests.fixtures import tiny_data_root, tiny_manifest  # noqa: F401  (session fixtures)
from tests.oracles import DIM, TwoLayer, client_config, least_squares_clients, linear_model, run_oracle
from tests.test_step4 import assignments  # noqa: F401  (a fixture)
from tests.tiny_models import TinyNet
from utils.errors import NonFiniteLossError, TaskHetError


def test_sigma_and_omega_are_the_closed_form_of_the_heads_not_a_matrix_of_ones():
    generator = torch.Generator().manual_seed(0)
    heads = torch.randn(4, 3, generator=generator, dtype=torch.float64)  # d = 4, m = 3 tasks
    sigma, omega = task_covariance(heads, eps=1e-9)
    root = torch.from_numpy(scipy.linalg.sqrtm((heads.T @ heads).numpy()).real)
    assert torch.allclose(sigma, root / torch.trace(root), rtol=0, atol=1e-12)
    assert torch.allclose(omega, torch.linalg.inv(root / torch.trace(root)), rtol=0, atol=1e-9)
    assert torch.trace(sigma).item() == pytest.approx(1.0)
    ones = torch.ones(3, 3, dtype=torch.float64)
    assert not torch.allclose(omega / omega.norm(), ones / ones.norm(), atol=0.1)
    # Collinear heads: WᵀW has rank 1; the floor keeps Ω finite (largest eigenvalue 1/eps).
    _, floored = task_covariance(torch.ones(4, 3, dtype=torch.float64), eps=1e-3)
    assert torch.isfinite(floored).all() and torch.linalg.eigvalsh(floored).max().item() == pytest.approx(1e3)


def test_the_clients_regulariser_has_the_full_regularisers_gradient_checked_by_finite_differences():
    """(λ/2)·tr(W Ω Wᵀ) differentiated in w_k, by central differences, equals the client term's autograd gradient."""
    generator = torch.Generator().manual_seed(1)
    m, lam = 3, 0.7
    heads = torch.randn(3, m, generator=generator, dtype=torch.float64)  # TwoLayer's head has 3 entries
    _, omega = task_covariance(heads, eps=1e-6)
    k = 1
    model = TwoLayer()
    with torch.no_grad():
        model.head.weight.copy_(heads[:, k].view(1, 3))
    coupling = {"head.weight": sum(omega[k, j] * heads[:, j] for j in range(m) if j != k).view(1, 3)}
    term = regulariser(model, coupling, float(omega[k, k]), lam)
    value = term(model)
    (gradient,) = torch.autograd.grad(value, [model.head.weight])
    assert gradient.abs().sum() > 0  # a detached regulariser would have none

    def full(w_k):
        w = heads.clone()
        w[:, k] = w_k
        return 0.5 * lam * torch.trace(w @ omega @ w.T)

    step = 1e-6
    numeric = torch.stack([(full(heads[:, k] + step * e) - full(heads[:, k] - step * e)) / (2 * step)
                           for e in torch.eye(3, dtype=torch.float64)])
    assert torch.allclose(gradient.view(3), numeric, rtol=1e-7, atol=1e-9)
    assert torch.allclose(gradient.view(3), lam * (omega @ heads.T)[k], rtol=1e-12, atol=1e-14)


def two_groups(sizes=(20, 25, 30, 20, 25, 30)):
    """Least-squares tasks of two groups with opposite optima (a TwoLayer fits both with one body)."""
    centre = torch.linspace(-1, 1, DIM, dtype=torch.float64) * 2
    shift = [centre if index < len(sizes) // 2 else -centre for index in range(len(sizes))]
    return least_squares_clients(sizes=sizes, shift=shift)


def objective(engine, data, lam):
    server = engine.server
    algorithm = engine.algorithm
    heads = algorithm.head_matrix(server.tensors)
    total = 0.0
    model = TwoLayer()
    load_weights(model, server.models["global"])
    for index, (a, b) in enumerate(data):
        with torch.no_grad():
            model.head.weight.copy_(server.tensors[HEAD_PREFIX.format(str(index)) + "head.weight"])
            total += float(0.5 * ((model(a).squeeze(-1) - b) ** 2).mean())
    return total + 0.5 * lam * float(torch.trace(heads @ server.tensors[OMEGA] @ heads.T))


def test_tasks_of_two_groups_learn_a_sigma_that_correlates_within_groups_and_the_objective_decreases(tmp_path):
    data = two_groups()
    lam = 0.01
    _, early = run_oracle(tmp_path / "early", "mocha", rounds=1, steps=5, lr=0.02, data=data, model=TwoLayer(), lam=lam)
    _, late = run_oracle(tmp_path / "late", "mocha", rounds=30, steps=5, lr=0.02, data=data, model=TwoLayer(), lam=lam)
    assert objective(late, data, lam) < 0.5 * objective(early, data, lam)
    sigma, _ = task_covariance(late.algorithm.head_matrix(late.server.tensors), late.algorithm.settings.eps)
    scale = sigma.diagonal().sqrt()
    correlation = sigma / torch.outer(scale, scale)
    groups = [0, 0, 0, 1, 1, 1]
    within = [float(correlation[i, j]) for i in range(6) for j in range(6) if i != j and groups[i] == groups[j]]
    between = [float(correlation[i, j]) for i in range(6) for j in range(6) if groups[i] != groups[j]]
    assert min(within) > max(between) + 0.5, (within, between)


@pytest.mark.kernels
def test_each_client_gets_its_own_row_of_omega_and_uploads_its_heads_change(tmp_path):
    data = two_groups()
    _, engine = run_oracle(tmp_path, "mocha", rounds=2, steps=3, lr=0.02, data=data, model=TwoLayer(), lam=0.1)
    server, algorithm = engine.server, engine.algorithm
    heads = algorithm.head_matrix(server.tensors)
    for index in range(6):
        message = algorithm.client_broadcast(server, algorithm.broadcast(server), str(index))
        omega = server.tensors[OMEGA]
        expected = sum(omega[index, j] * heads[:, j] for j in range(6) if j != index)
        assert torch.allclose(message[COUPLING]["head.weight"].view(-1), expected, rtol=1e-12, atol=1e-14)
        assert float(message[OMEGA_KK]["value"]) == pytest.approx(float(omega[index, index]))
        personal = algorithm.personal_model(server.models, engine.store.get(str(index)))
        assert torch.equal(personal["head.weight"], server.tensors[HEAD_PREFIX.format(str(index)) + "head.weight"])


def test_a_model_without_a_head_and_bad_settings_are_refused():
    with pytest.raises(TaskHetError, match=r"^mocha couples the clients' classifier heads: the model needs a head"):
        build_algorithm("mocha", linear_model(), {"0": 1})
    with pytest.raises(TaskHetError, match=r"^setting lam must be >= 0, got -1.0$"):
        build_algorithm("mocha", TinyNet(), {"0": 1}, {"lam": -1})


# ----- numerical safety: the local step's stability condition and the divergence guard -----

def mocha_settings(lam, eps=1e-3):
    return MochaSettings(lam=lam, eps=eps)


def step_config(lr, momentum=0.0, weight_decay=0.0):
    return client_config(10, lr=lr, momentum=momentum, weight_decay=weight_decay)


@pytest.mark.parametrize("h_times_lr, grows", [(0.98, False), (1.02, True)])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_heavy_ball_on_a_quadratic_is_stable_exactly_below_two_times_one_plus_momentum(h_times_lr, grows, momentum):
    """The condition itself: torch's SGD on (h/2)·w² contracts for lr·h < 2·(1 + β) and blows up above it."""
    lr = 0.1
    curvature = h_times_lr * 2 * (1 + momentum) / lr
    weight = torch.ones(1, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=lr, momentum=momentum)
    for _ in range(200):
        optimizer.zero_grad()
        (0.5 * curvature * weight.pow(2).sum()).backward()
        optimizer.step()
    assert (weight.abs().item() > 1) == grows


def test_the_local_step_is_refused_from_lr_times_lam_omega_kk_plus_weight_decay_at_two_times_one_plus_momentum():
    # Plain SGD, lr 0.1, λ 0.5: lr·λ·Ω_kk < 2 ⇔ Ω_kk < 40.
    check_local_step(mocha_settings(0.5), 39.99, step_config(0.1))
    for omega_kk in (40.0, 40.01):  # equality is the edge of stability (no contraction): refused
        with pytest.raises(MochaDivergence):
            check_local_step(mocha_settings(0.5), omega_kk, step_config(0.1))
    # Weight decay 0.1 adds to the curvature: 0.1·(0.5·39.7 + 0.1) = 1.995 passes, 0.1·(0.5·39.9 + 0.1) = 2.005 not.
    check_local_step(mocha_settings(0.5), 39.7, step_config(0.1, weight_decay=0.1))
    with pytest.raises(MochaDivergence):
        check_local_step(mocha_settings(0.5), 39.9, step_config(0.1, weight_decay=0.1))
    # Momentum 0.9, lr 0.3, λ 0.05: the bound is 3.8, so Ω_kk < 3.8 / 0.015 = 253.33….
    check_local_step(mocha_settings(0.05), 253.3, step_config(0.3, momentum=0.9))
    with pytest.raises(MochaDivergence):
        check_local_step(mocha_settings(0.05), 253.4, step_config(0.3, momentum=0.9))
    # Without the regulariser (λ = 0) MOCHA has no term of its own to refuse, whatever weight decay does.
    check_local_step(mocha_settings(0.0), 1e3, step_config(1.0, weight_decay=3.0))


def test_the_refusal_names_the_settings_and_values_that_meet_the_worst_case():
    with pytest.raises(MochaDivergence) as refused:
        check_local_step(mocha_settings(0.05), 700.0, step_config(0.3, momentum=0.9))
    # lr·λ·Ω_kk = 0.3·0.05·700 = 10.5. Worst case Ω_kk = 1/eps: λ/eps < 3.8/0.3 = 12.67 ⇔ eps > 0.0039474 (up: 0.00395),
    # λ < 0.012667 (down: 0.0126), lr < 3.8/(0.05/0.001) = 0.076.
    assert str(refused.value) == (
        "mocha: the local step on the heads' regulariser is unstable: lr·(lam·Ω_kk + weight_decay) = 10.5 is not below "
        "2·(1 + momentum) = 3.8 (lam 0.05, eps 0.001, lr 0.3, momentum 0.9, Ω_kk 700; nearly equal heads, as those of "
        "clients not yet picked are, bring Ω_kk up to 1/eps = 1000): raise eps above 0.00395, or lower lam below 0.0126 "
        "or lr below 0.076 (then lr·(lam/eps + weight_decay) < 2·(1 + momentum))")
    # λ 1.5, lr 1, plain SGD, weight decay 0.5: λ/eps < 2 − 0.5 needs eps > 1, which no eps in (0, 1) is: no eps
    # advice; λ < 1.5·0.001, lr < 2/(1500 + 0.5) = 0.0013329.
    with pytest.raises(MochaDivergence, match=r"weight_decay 0\.5, Ω_kk 1; .*\): lower lam below 0\.0015 or lr "
                                              r"below 0\.00133 \(then"):
        check_local_step(mocha_settings(1.5), 1.0, step_config(1.0, weight_decay=0.5))
    # Weight decay 3 at lr 1 leaves no room for any λ: lr·3 ≥ 2; lr < 2/(0.01/0.5 + 3) = 0.66225.
    with pytest.raises(MochaDivergence, match=r": lower lr below 0\.662 or weight_decay \(weight decay alone"):
        check_local_step(mocha_settings(0.01, eps=0.5), 1.0, step_config(1.0, weight_decay=3.0))


def test_a_head_is_diverged_when_not_finite_or_over_a_thousand_times_max_of_its_start_and_one():
    settings, cfg = mocha_settings(0.01), step_config(0.1)
    small = {"head.weight": torch.tensor([[0.3, 0.4]])}  # norm 0.5: the limit is 1000 × max(0.5, 1) = 1000
    check_head({"head.weight": torch.tensor([[600.0, 800.0]])}, small, settings, 2.0, cfg)  # norm 1000: kept
    with pytest.raises(MochaDivergence, match=r"^mocha: a head diverged in local training: its norm is 1001, above "
                                              r"1000 × max\(the starting head's norm 0\.5, 1\) \(lam 0\.01, eps 0\.001, "
                                              r"lr 0\.1, momentum 0, Ω_kk 2\): lower lr \(the regulariser's own step"):
        check_head({"head.weight": torch.tensor([[600.6, 800.8]])}, small, settings, 2.0, cfg)
    large = {"head.weight": torch.tensor([[3.0, 4.0]])}  # norm 5: the limit is 5000
    check_head({"head.weight": torch.tensor([[3000.0, 4000.0]])}, large, settings, 2.0, cfg)
    with pytest.raises(MochaDivergence):
        check_head({"head.weight": torch.tensor([[3000.0, 4000.1]])}, large, settings, 2.0, cfg)
    for bad in (math.nan, math.inf):
        with pytest.raises(MochaDivergence, match=f"its norm is {bad}"):
            check_head({"head.weight": torch.tensor([[bad, 0.0]])}, small, settings, 2.0, cfg)
    # Near the regulariser's bound (lr·λ·Ω_kk = 0.1·0.01·1500 = 1.5 ≥ 2/2) the advice is the worst case's values.
    with pytest.raises(MochaDivergence, match=r"Ω_kk 1500\): raise eps above 0\.0005, or lower lam below 0\.02 or lr"):
        check_head({"head.weight": torch.tensor([[math.nan]])}, small, settings, 1500.0, cfg)


def slow_two_groups():
    """two_groups with features and targets × 0.1: the task's curvature is small, so only the regulariser can diverge."""
    return [(a * 0.1, b * 0.1) for a, b in two_groups()]


def test_the_partial_participation_case_stops_at_the_first_unstable_round_with_one_line(tmp_path):
    """λ 0.05, lr 0.3, momentum 0.9, half the clients a round: clients 1, 2 and 4 are not picked in round 1 and keep
    the starting head, so Ω_kk reaches ≈ 668 (2/3 of 1/eps): lr·λ·Ω_kk ≈ 10 ≥ 3.8 when round 2 picks client 2."""
    with pytest.raises(NonFiniteLossError) as stopped:
        run_oracle(tmp_path, "mocha", rounds=6, steps=5, lr=0.3, data=slow_two_groups(), model=TwoLayer(),
                   momentum=0.9, fraction=0.5, lam=0.05)
    message = str(stopped.value)
    assert "\n" not in message
    assert re.match(r"^round 2, client 2: mocha: the local step on the heads' regulariser is unstable: "
                    r"lr·\(lam·Ω_kk \+ weight_decay\) = 10\.02 is not below 2·\(1 \+ momentum\) = 3\.8 \(lam 0\.05, eps "
                    r"0\.001, lr 0\.3, momentum 0\.9, Ω_kk 667\.7; .*: raise eps above 0\.00395, or lower lam below "
                    r"0\.0126 or lr below 0\.076 .*; the run stopped; the last good checkpoint is .* \(round 1\)$", message)


def test_without_the_condition_the_same_run_is_stopped_by_the_divergence_guard(tmp_path, monkeypatch):
    """What the condition prevents: unguarded, the heads reach norm ≈ 50 in round 2 and ≈ 7e3 in round 3."""
    monkeypatch.setattr(mocha_module, "check_local_step", lambda *_: None)
    with pytest.raises(NonFiniteLossError) as stopped:
        run_oracle(tmp_path, "mocha", rounds=6, steps=5, lr=0.3, data=slow_two_groups(), model=TwoLayer(),
                   momentum=0.9, fraction=0.5, lam=0.05)
    message = str(stopped.value)
    assert "\n" not in message
    assert re.match(r"^round 3, client 0: mocha: a head diverged in local training: its norm is 7109, above "
                    r"1000 × max\(the starting head's norm 0\.2068, 1\) \(lam 0\.05, eps 0\.001, lr 0\.3, momentum 0\.9, "
                    r"Ω_kk 690\.6\): raise eps above 0\.00395, or lower lam below 0\.0126 or lr below 0\.076", message)


@pytest.mark.parametrize("change", [{"eps": 0.00395}, {"lam": 0.0126}, {"lr": 0.076}])
def test_each_suggested_value_runs_the_same_federation_with_bounded_heads(tmp_path, change):
    settings = {"lam": 0.05, "eps": 1e-3, **change}
    lr = settings.pop("lr", 0.3)
    _, engine = run_oracle(tmp_path, "mocha", rounds=3, steps=5, lr=lr, data=slow_two_groups(), model=TwoLayer(),
                           momentum=0.9, fraction=0.5, **settings)
    norms = engine.algorithm.head_matrix(engine.server.tensors).norm(dim=0)
    assert torch.isfinite(norms).all() and norms.max() < 2, norms


def test_a_step4_run_stopped_by_the_guard_writes_its_reason_to_run_log_once(tiny_data_root, tiny_manifest,  # noqa: F811
                                                                            assignments, tmp_path, capsys):
    """Step 4 (steps/federated.py), λ 1000 at lr 0.1: lr·λ·Ω_kk ≥ 100 (Ω's eigenvalues are at least 1) is far above
    2·(1 + 0), so round 1's first client is refused. The console's ``error:`` line (run_main) came alone before:
    run.log, what a later look at the folder finds, said nothing of why the run stopped."""
    from steps import federated
    from tests.test_step4 import argv as step4_argv

    out = tmp_path / "run"
    with pytest.raises(NonFiniteLossError) as stopped:  # the engine's: the round and client in front
        federated.main(step4_argv(tiny_data_root, tiny_manifest, assignments, out, "--method", "mocha", "--lam", "1000",
                                  "--init_lr", "0.1"))
    reason = str(stopped.value)
    assert reason.startswith("round 1, client ") and "mocha: the local step on the heads' regulariser is unstable" in reason
    logged = [line for line in (out / "run.log").read_text().splitlines() if " ERROR " in line]
    assert len(logged) == 1 and logged[0].split(" ERROR ", 1)[1] == reason
    assert reason not in capsys.readouterr().out  # the console's copy is the error: line alone
