"""Unequal local work (network/local_work.py): each client's own local steps, hand-counted, through the engine."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from network.engine_config import EngineConfig
from network.local_work import LocalWork, client_step_budgets, parse_steps_range, straggler_steps
from network.lr_schedule import make_lr_schedule
from tests.oracles import DIM, gradient, least_squares_clients
from utils.errors import TaskHetError

IDS = ["a", "b", "c", "d"]


@pytest.mark.parametrize(("share", "steps", "expected"), [(0.25, 10, 2), (0.5, 3, 1), (0.05, 10, 1), (1.0, 7, 7),
                                                          (0.999, 10, 9)])
def test_a_straggler_takes_the_floor_of_its_share_and_at_least_one_step(share, steps, expected):
    assert straggler_steps(steps, share) == expected


@pytest.mark.parametrize(("fraction", "stragglers"), [(0.0, 0), (0.1, 0), (0.125, 1), (0.25, 1), (0.5, 2), (0.625, 3),
                                                      (1.0, 4)])
def test_the_number_of_stragglers_is_the_fraction_of_the_clients_rounded_half_up(fraction, stragglers):
    budgets = client_step_budgets(LocalWork(straggler_fraction=fraction, straggler_share=0.3), 10, IDS, seed=5)
    if fraction == 0:
        assert budgets is None  # equal work: the engine takes --local_steps for everyone
        return
    assert sorted(budgets.values()) == [3] * stragglers + [10] * (4 - stragglers)


def test_stragglers_and_drawn_steps_depend_on_the_seed_and_ids_only_never_their_order():
    work = LocalWork(straggler_fraction=0.5, straggler_share=0.5)
    assert client_step_budgets(work, 8, IDS, 1) == client_step_budgets(work, 8, IDS[::-1], 1)
    drawn = LocalWork(steps_range=(2, 9))
    assert client_step_budgets(drawn, 5, IDS, 1) == client_step_budgets(drawn, 5, list(reversed(IDS)), 1)
    by_seed = {tuple(client_step_budgets(drawn, 5, [str(i) for i in range(30)], seed).values()) for seed in range(4)}
    assert len(by_seed) == 4  # other seeds draw other budgets
    stragglers = {frozenset(key for key, value in client_step_budgets(work, 8, IDS, seed).items() if value == 4)
                  for seed in range(12)}
    assert len(stragglers) > 1


def test_drawn_steps_cover_both_ends_of_the_range_and_nothing_outside():
    budgets = client_step_budgets(LocalWork(steps_range=(2, 4)), 50, [str(i) for i in range(200)], seed=0)
    assert set(budgets.values()) == {2, 3, 4}  # LOW and HIGH both included; --local_steps plays no part
    single = client_step_budgets(LocalWork(steps_range=(3, 3)), 50, IDS, seed=0)
    assert single == {client: 3 for client in IDS}


@pytest.mark.parametrize(("text", "expected"), [("2:5", (2, 5)), (" 1 : 1 ", (1, 1)), (None, None), ("", None)])
def test_a_range_is_two_whole_numbers(text, expected):
    assert parse_steps_range(text) == expected


@pytest.mark.parametrize(("work", "message"), [
    (lambda: LocalWork(steps_range=(5, 2)), "1 <= LOW <= HIGH, got 5:2"),
    (lambda: LocalWork(steps_range=(0, 2)), "1 <= LOW <= HIGH, got 0:2"),
    (lambda: parse_steps_range("2-5"), "LOW:HIGH .* got '2-5'"),
    (lambda: parse_steps_range("1.5:3"), "LOW:HIGH"),
    (lambda: parse_steps_range("١:٣"), "LOW:HIGH"),  # Arabic-Indic digits are not ASCII whole numbers
    (lambda: LocalWork(straggler_fraction=1.5), "--straggler_fraction must be in \\[0, 1\\], got 1.5"),
    (lambda: LocalWork(straggler_fraction=float("nan")), "--straggler_fraction"),
    (lambda: LocalWork(straggler_share=0.0), "--straggler_share must be in \\(0, 1\\], got 0.0"),
    (lambda: LocalWork(straggler_fraction=0.5, steps_range=(1, 2)), "one of --straggler_fraction and --local_steps_range"),
    (lambda: client_step_budgets(LocalWork(straggler_fraction=0.5), None, IDS, 0), "use --local_steps, not --local_epochs"),
    (lambda: EngineConfig(out_dir=".", n_rounds=1, lr_schedule=lambda r: 0.1, local_steps=2, vectorize_chunk=4,
                          client_steps={"a": 1}), "cannot do unequal local work"),
])
def test_bad_unequal_work_is_one_line_naming_the_flag(work, message):
    with pytest.raises(TaskHetError, match=message):
        work()


def test_each_client_takes_its_own_steps_in_the_engine_and_clients_csv_records_them(tmp_path):
    """FedAvg with budgets {0: 1, 1: 3, 2: 2}, full-batch least squares, two rounds, against a hand-run loop."""
    from tests.oracles import least_squares_loss, linear_model, mean_loss, oracle_clients
    from network.algorithms import build_algorithm
    from network.engine_sequential import SequentialEngine

    data = least_squares_clients(sizes=(10, 20, 30))
    budgets, lr, rounds = {"0": 1, "1": 3, "2": 2}, 0.05, 2
    clients = oracle_clients(data)
    algorithm, worker = build_algorithm("fedavg", linear_model(), {c.client_id: c.num_samples for c in clients})
    config = EngineConfig(out_dir=tmp_path, n_rounds=rounds, lr_schedule=make_lr_schedule("constant", lr, rounds),
                          local_steps=5, client_steps=budgets, progress=False, plots=False)
    pooled = [{"x": torch.cat([a for a, _ in data]), "y": torch.cat([b for _, b in data])}]
    final = SequentialEngine(worker, algorithm, clients, least_squares_loss, mean_loss, pooled, config,
                             torch.device("cpu")).run()["weight"].squeeze(0)
    w = torch.zeros(DIM, dtype=torch.float64)
    for _ in range(rounds):
        updates = []
        for index, (a, b) in enumerate(data):
            local = w.clone()
            for _ in range(budgets[str(index)]):
                local = local - lr * gradient(local, a, b)
            updates.append((len(b), local - w))
        w = w + sum(n * delta for n, delta in updates) / sum(n for n, _ in updates)
    assert torch.allclose(final, w, rtol=0, atol=1e-13)
    table = pd.read_csv(tmp_path / "clients.csv", dtype={"client": str}).set_index("client")
    assert table["local_step_budget"].to_dict() == budgets
    assert table["local_steps"].to_dict() == budgets  # the steps actually taken
