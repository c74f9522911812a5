"""Unseen clients (step 3b's --unseen_fraction): held out of all training, evaluated after their own adaptation.

Step 3b records them in assignments.json without changing assignments.csv; step 4 never samples, trains or
aggregates them (a run with them equals, bit for bit, a run on the seen clients alone) and writes the
``unseen_test*`` splits; the heterogeneity study's report gives seen and unseen columns. Bad inputs are one line.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import test_fed
from datasets.taskonomy import read_manifest
from network.algorithms import build_algorithm, list_algorithms
from network.client import (UNSEEN_FINETUNED_SPLIT, UNSEEN_PERSONAL_SPLIT, UNSEEN_TEST_SPLIT, ClientData,
                            adapts_new_clients)
from network.engine_sequential import EngineConfig, SequentialEngine
from network.lr_schedule import LR_SCHEDULE_HELP, make_lr_schedule
from network.run_outputs import SKIPPED_CLIENT
from partitioning.assignments import (UNSEEN_FRACTION_KEY, UNSEEN_KEY, draw_unseen_clients, load_assignments,
                                      unseen_count, write_assignments)
from steps import assign
from tests.fixtures import tiny_data_root, tiny_manifest  # noqa: F401  (session fixtures)
from tests.tiny_models import FAST_SETTINGS, class_counts, client_samples, evaluate, loss_fn, tiny_model_for
from utils.cli import run_main
from utils.errors import TaskHetError
from utils.run_dir import load_checkpoint

CPU = torch.device("cpu")


# ----- step 3b: the option and its record -----
def step3b(manifest, out, *extra):
    return assign.main(["--manifest", str(manifest), "--n_clients", "4", "--scheme", "iid", "--seed", "3",
                        "--no-progress", "--out", str(out), *extra])


def test_fraction_zero_is_the_partition_of_today_and_a_fraction_changes_only_the_sidecar(tiny_manifest, tmp_path):  # noqa: F811
    """F = 0 writes byte for byte what a run without the flag writes; F = 0.5 writes the same assignments.csv and a
    sidecar that differs only by the two unseen keys."""
    without, zero, half = (step3b(tiny_manifest, tmp_path / name, *extra) for name, extra in
                           (("without", ()), ("zero", ("--unseen_fraction", "0")), ("half", ("--unseen_fraction", "0.5"))))
    for name in ("assignments.csv", "assignments.json", "client_stats.csv", "metrics.csv", "unused_samples.csv"):
        assert (without.parent / name).read_bytes() == (zero.parent / name).read_bytes(), name
    assert without.read_bytes() == half.read_bytes()
    plain, held = (json.loads(path.with_suffix(".json").read_text()) for path in (without, half))
    assert UNSEEN_KEY not in plain and UNSEEN_FRACTION_KEY not in plain
    assert {key: value for key, value in held.items() if key not in (UNSEEN_KEY, UNSEEN_FRACTION_KEY)} == plain
    # round(0.5 · 4) = 2 clients, the first two of the seeded permutation of 0..3.
    expected = sorted(np.random.default_rng(_derived(3)).permutation(4)[:2].tolist())
    assert held[UNSEEN_KEY] == expected and held[UNSEEN_FRACTION_KEY] == 0.5
    assert "--unseen_fraction 0.5: clients " + ", ".join(map(str, expected)) in (half.parent / "run.log").read_text()


def _derived(seed: int) -> int:
    """utils.seeding.derive_seed(seed, "unseen_clients"), written out: SHA-256 of "seed/unseen_clients", 63 bits."""
    import hashlib

    return int.from_bytes(hashlib.sha256(f"{seed}/unseen_clients".encode()).digest()[:8], "little") >> 1


def test_the_draw_counts_by_round_is_nested_and_seeded():
    assert [unseen_count(fraction, 10) for fraction in (0.0, 0.1, 0.25, 0.35, 0.9)] == [0, 1, 2, 4, 9]  # half to even
    small, large = draw_unseen_clients(0.2, 50, seed=1), draw_unseen_clients(0.6, 50, seed=1)
    assert len(small) == 10 and len(large) == 30 and set(small) <= set(large)
    assert small == draw_unseen_clients(0.2, 50, seed=1) != draw_unseen_clients(0.2, 50, seed=2)
    assert draw_unseen_clients(0.0, 50, seed=1) == []


@pytest.mark.parametrize("value, words", [("1", "[0, 1)"), ("nan", "[0, 1)"), ("1e30", "[0, 1)"), ("-0.1", "[0, 1)"),
                                          ("0.05", "= 0 clients"), ("0.9", "all 4 of them")])
def test_a_bad_fraction_is_one_error_line_naming_the_flag(tiny_manifest, tmp_path, capsys, value, words):  # noqa: F811
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        run_main(assign.main, ["--manifest", str(tiny_manifest), "--n_clients", "4", "--out", str(out),
                               "--unseen_fraction", value])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and lines[0].startswith("error:")
    assert "--unseen_fraction" in lines[0] and words in lines[0] and not out.exists()


def write_partition(folder, unseen, n_clients=3, rows_per_client=4):
    """Clients 0..n_clients-1 with ``rows_per_client`` train rows and one test row each; ``unseen`` goes to the
    sidecar as it is (None: no key)."""
    ids = [f"s{index}" for index in range(n_clients * (rows_per_client + 1))]
    table = pd.DataFrame({"sample_id": ids, "client_id": [index // (rows_per_client + 1) for index in range(len(ids))],
                          "group": 0, "subset": ["test" if index % (rows_per_client + 1) == rows_per_client
                                                 else "train" for index in range(len(ids))]})
    meta = {"scheme": "hand", "n_clients": n_clients, **({} if unseen is None else {UNSEEN_KEY: unseen})}
    path = folder / "assignments.csv"
    write_assignments(path, table, meta)
    return path, pd.DataFrame({"sample_id": ids, "split": "train"})


@pytest.mark.parametrize("unseen, words", [([3], "3 is not a client id"), ([-1], "-1 is not a client id"),
                                           ([1, 1], "lists client 1 twice"), ([0, 1, 2], "holds out all 3"),
                                           ("1", "must be a list"), ([True], "True is not a client id"),
                                           ([1.0], "1.0 is not a client id"), ([10**30], "is not a client id")])
def test_a_bad_sidecar_list_is_one_error_naming_the_sidecar_and_key(tmp_path, unseen, words):
    path, manifest = write_partition(tmp_path, unseen)
    with pytest.raises(TaskHetError) as error:
        load_assignments(path, manifest)
    message = str(error.value)
    assert "\n" not in message and "assignments.json" in message and UNSEEN_KEY in message and words in message


def test_a_good_sidecar_list_comes_back_sorted(tmp_path):
    path, manifest = write_partition(tmp_path, [2, 0], n_clients=4)
    assert load_assignments(path, manifest)[1][UNSEEN_KEY] == [0, 2]


# ----- step 4's engine: unseen clients never train, and are evaluated after their own adaptation -----
SEEN, UNSEEN = (0, 1, 2, 3), (4, 5)


def tiny_clients(indices, calls: list | None = None, phase: dict | None = None) -> list[ClientData]:
    """The engine tests' regression clients (tests/tiny_models.py); ``calls`` records (client, phase) of every
    train-loader call, ``phase["now"]`` being "training" inside a round's training and "evaluation" otherwise."""
    clients = []
    for index in indices:
        samples = client_samples(index, 20)

        def train_loader(seed, samples=samples[:-6], client_id=str(index)):
            if calls is not None:
                calls.append((client_id, phase["now"]))
            return list(DataLoader(samples, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(seed)))

        clients.append(ClientData(str(index), len(samples) - 6, train_loader, list(DataLoader(samples[-6:], batch_size=6)),
                                  class_counts(samples[:-6])))
    return clients


def tiny_engine(out_dir, name, with_unseen: bool, calls: list | None = None, rounds: int = 2) -> SequentialEngine:
    """4 seen clients (half sampled per round) and, ``with_unseen``, 2 unseen ones; every client is built either way,
    so both engines see the same global RNG."""
    torch.manual_seed(0)
    model = tiny_model_for(name)
    phase = {"now": "evaluation"}
    seen, unseen = tiny_clients(SEEN), tiny_clients(UNSEEN, calls, phase)
    test = list(DataLoader([sample for index in SEEN for sample in client_samples(index, 26)[20:]], batch_size=8))
    algorithm, worker = build_algorithm(name, model, {client.client_id: client.num_samples for client in seen},
                                        FAST_SETTINGS.get(name), seed=7)
    config = EngineConfig(out_dir=out_dir, n_rounds=rounds, lr_schedule=make_lr_schedule("constant", 0.05, rounds),
                          seed=7, local_steps=2, client_fraction=0.5, eval_every=2, finetune_steps=1, progress=False,
                          plots=False)
    engine = SequentialEngine(worker, algorithm, seen, loss_fn, evaluate, test, config, CPU, model_config={"name": "tiny"},
                              unseen_clients=unseen if with_unseen else None)
    training = engine.train_round

    def train_round(round_index):
        phase["now"] = "training"
        try:
            return training(round_index)
        finally:
            phase["now"] = "evaluation"

    engine.train_round = train_round
    return engine


def spy_uploads(engine: SequentialEngine) -> list[str]:
    """The client id of every upload the algorithm aggregates (the stream is passed on as it comes)."""
    seen, aggregate = [], engine.algorithm.aggregate

    def spied(server, uploads):
        def passing():
            for upload in uploads:
                seen.append(upload.client_id)
                yield upload
        return aggregate(server, passing())

    engine.algorithm.aggregate = spied
    return seen


def metric_lines(path, unseen: bool) -> list[str]:
    """metrics.csv's lines of the unseen splits (``unseen``) or of every other split."""
    lines = path.read_text().splitlines()[1:]
    return [line for line in lines if line.split(",")[1].startswith("unseen_test") == unseen]


@pytest.mark.parametrize("name", list_algorithms())
def test_unseen_clients_never_train_and_leave_the_run_bit_identical(tmp_path, name):
    """Every algorithm: no unseen client is sampled, trains in a round, uploads or counts in the federation; the
    server models, client states and every seen row of metrics.csv equal, bit for bit, those of an engine without
    them (the adaptation runs under its own seeds with the global RNG forked, and writes no state); the unseen
    splits have a row per unseen client, a personal one exactly when the algorithm adapts a newcomer."""
    calls: list = []
    with_unseen = tiny_engine(tmp_path / "with", name, True, calls)
    uploads = spy_uploads(with_unseen)
    weights = with_unseen.run()
    alone = tiny_engine(tmp_path / "alone", name, False)
    uploads_alone = spy_uploads(alone)
    assert_equal_weights(weights, alone.run())
    unseen_ids = {str(index) for index in UNSEEN}
    assert uploads == uploads_alone and not unseen_ids & set(uploads)
    assert set(with_unseen.algorithm.federation.client_sizes) == {str(index) for index in SEEN}
    assert [phase for _, phase in calls] and {phase for _, phase in calls} == {"evaluation"}  # adaptation/fine-tuning only
    for model_name, model in with_unseen.server.models.items():
        assert_equal_weights(model, alone.server.models[model_name])
    assert_equal_weights(with_unseen.server.tensors, alone.server.tensors)
    states, states_alone = with_unseen.store.snapshot(), alone.store.snapshot()
    assert set(states) == set(states_alone) and not unseen_ids & set(states)
    for client_id, state in states.items():
        assert_equal_weights(state, states_alone[client_id])
    metrics = tmp_path / "with" / "metrics.csv"
    assert metric_lines(metrics, unseen=False) == metric_lines(tmp_path / "alone" / "metrics.csv", unseen=False)
    rows = pd.read_csv(metrics, dtype={"client": str})
    for split in (UNSEEN_TEST_SPLIT, UNSEEN_FINETUNED_SPLIT) + ((UNSEEN_PERSONAL_SPLIT,) if adapts_new_clients(
            with_unseen.algorithm) else ()):
        per_client = rows[(rows.split == split) & rows.client.isin(unseen_ids)]
        assert per_client.groupby("round").client.apply(set).to_dict() == {0: unseen_ids, 2: unseen_ids}
        assert {"mean", "worst_decile"} <= set(rows[rows.split == split].client)
    personal = rows[rows.split == UNSEEN_PERSONAL_SPLIT]
    if with_unseen.algorithm.personalized:
        skipped = personal[personal.client == SKIPPED_CLIENT].value.tolist()
        assert skipped == [0.0 if adapts_new_clients(with_unseen.algorithm) else 2.0] * 2
    else:
        assert personal.empty


def assert_equal_weights(first: dict, second: dict) -> None:
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key


# ----- hand-checked values on a one-weight least-squares problem -----
def line_loss(model, batch, reduction="mean"):
    squared = 0.5 * (model(batch["x"]).squeeze(-1) - batch["y"]) ** 2
    return squared.mean() if reduction == "mean" else squared


def line_evaluate(model, loader):
    return {"loss": float(sum(line_loss(model, batch) for batch in loader) / len(loader))}


def line_client(client_id: str, train: tuple[list[float], list[float]], test: tuple[list[float], list[float]]):
    def batch(xs, ys):
        return {"x": torch.tensor(xs, dtype=torch.float64).unsqueeze(1), "y": torch.tensor(ys, dtype=torch.float64)}

    return ClientData(client_id, len(train[0]), lambda seed: [batch(*train)], [batch(*test)])


def line_run(tmp_path, method: str) -> pd.DataFrame:
    """One round, one local step at lr 0.1, one fine-tuning step; f(w) = mean ½(w·x − y)², w starts at 0.
    Seen client 0 trains on x = (1, 2), y = (2, 4); unseen client 1 holds x = 1, y = 3 (test x = 2, y = 6), unseen
    client 2 x = 1, y = 1 (test x = 1, y = 1)."""
    model = nn.Linear(1, 1, bias=False, dtype=torch.float64)
    nn.init.zeros_(model.weight)
    seen = [line_client("0", ([1.0, 2.0], [2.0, 4.0]), ([1.0], [2.0]))]
    unseen = [line_client("1", ([1.0], [3.0]), ([2.0], [6.0])), line_client("2", ([1.0], [1.0]), ([1.0], [1.0]))]
    algorithm, worker = build_algorithm(method, model, {"0": 2}, {})
    config = EngineConfig(out_dir=tmp_path / method, n_rounds=1, lr_schedule=make_lr_schedule("constant", 0.1, 1),
                          local_steps=1, finetune_steps=1, progress=False, plots=False)
    SequentialEngine(worker, algorithm, seen, line_loss, line_evaluate, seen[0].test_loader, config, CPU,
                     unseen_clients=unseen).run()
    rows = pd.read_csv(tmp_path / method / "metrics.csv", dtype={"client": str})
    return rows[rows.split.str.startswith("unseen_test") & (rows.metric == "loss")].set_index(["round", "split", "client"]).value


def test_unseen_splits_have_the_hand_computed_values(tmp_path):
    """FedAvg: the global model is w = 0, then w = 0.5 (one step: −0.1·mean((0·x − y)·x) = 0.1·5). Unseen client 1's
    test loss ½(2w − 6)² is 18 and 12.5, client 2's ½(w − 1)² 0.5 and 0.125; fine-tuned, one step on its own row
    moves w by 0.1·(y − w): client 1 to 0.3 and 0.75 (losses 14.58, 10.125), client 2 to 0.1 and 0.55 (0.405,
    0.10125). Summary rows: the mean, and the worst decile is the worst ⌈10% of 2⌉ = 1 client (the highest loss)."""
    loss = line_run(tmp_path, "fedavg")
    expected = {(0, "1"): 18.0, (0, "2"): 0.5, (1, "1"): 12.5, (1, "2"): 0.125}
    finetuned = {(0, "1"): 14.58, (0, "2"): 0.405, (1, "1"): 10.125, (1, "2"): 0.10125}
    for split, values in ((UNSEEN_TEST_SPLIT, expected), (UNSEEN_FINETUNED_SPLIT, finetuned)):
        for (round_index, client), value in values.items():
            assert loss[(round_index, split, client)] == pytest.approx(value, rel=1e-12), (split, round_index, client)
        for round_index in (0, 1):
            pair = [values[(round_index, "1")], values[(round_index, "2")]]
            assert loss[(round_index, split, "mean")] == pytest.approx(sum(pair) / 2, rel=1e-12)
            assert loss[(round_index, split, "worst_decile")] == pytest.approx(max(pair), rel=1e-12)
    assert not any(split == UNSEEN_PERSONAL_SPLIT for _, split, _ in loss.index)


def test_a_personalised_method_adapts_each_unseen_client_with_its_own_step(tmp_path):
    """local: the server model never moves (w = 0), so each evaluation adapts an unseen client from w = 0 with one
    local step (client 1 to 0.3, client 2 to 0.1: personal losses 14.58 and 0.405), and fine-tunes that personal
    model one step further (client 1 to 0.3 + 0.1·2.7 = 0.57: ½(1.14 − 6)² = 11.8098; client 2 to 0.19:
    ½(0.19 − 1)² = 0.32805). Every unseen client has a personal model: ``skipped`` is 0."""
    loss = line_run(tmp_path, "local")
    for round_index in (0, 1):
        assert loss[(round_index, UNSEEN_TEST_SPLIT, "1")] == pytest.approx(18.0, rel=1e-12)
        assert loss[(round_index, UNSEEN_PERSONAL_SPLIT, "1")] == pytest.approx(14.58, rel=1e-12)
        assert loss[(round_index, UNSEEN_PERSONAL_SPLIT, "2")] == pytest.approx(0.405, rel=1e-12)
        assert loss[(round_index, UNSEEN_FINETUNED_SPLIT, "1")] == pytest.approx(11.8098, rel=1e-12)
        assert loss[(round_index, UNSEEN_FINETUNED_SPLIT, "2")] == pytest.approx(0.32805, rel=1e-12)
        assert loss[(round_index, UNSEEN_PERSONAL_SPLIT, "worst_decile")] == pytest.approx(14.58, rel=1e-12)
    rows = pd.read_csv(tmp_path / "local" / "metrics.csv", dtype={"client": str})
    skipped = rows[(rows.split == UNSEEN_PERSONAL_SPLIT) & (rows.client == SKIPPED_CLIENT)]
    assert skipped.value.tolist() == [0.0, 0.0]


# The local rate an unseen client adapts with at each evaluated round 0..4 of a 4-round run at init_lr 0.1, by hand from
# network/lr_schedule.py: round r (r >= 1) adapts at round r's own rate, the rate that round trained at; round 0,
# before any training, at round 1's. cosine: 0.05·(1 + cos(π(r − 1)/4)); exponential: 0.1·0.5^(r − 1); step: 0.1
# halved every 2 rounds.
ADAPTATION_RATES = {
    "constant": [0.1, 0.1, 0.1, 0.1, 0.1],
    "cosine": [0.1, 0.1, 0.08535533905932738, 0.05, 0.014644660940672624],
    "exponential:0.5": [0.1, 0.1, 0.05, 0.025, 0.0125],
    "step:2:0.5": [0.1, 0.1, 0.1, 0.05, 0.05],
}


def test_every_lr_schedule_has_its_hand_computed_adaptation_rates():
    """ADAPTATION_RATES covers every schedule form step 4's --lr_schedule lists."""
    forms = LR_SCHEDULE_HELP.split(" (")[0].split(" | ")  # "constant | cosine | exponential:RATE | step:EVERY:GAMMA"
    assert {form.split(":")[0] for form in forms} == {spec.split(":")[0] for spec in ADAPTATION_RATES}


@pytest.mark.parametrize("spec", sorted(ADAPTATION_RATES))
def test_unseen_clients_adapt_with_the_evaluated_rounds_own_rate(tmp_path, spec):
    """local over 4 rounds, evaluated every round: the server model never moves (w = 0), so each evaluation adapts
    unseen client 1 (x = 1, y = 3) from w = 0 with one step at rate η: w = 3η, and its personal test loss at x = 2,
    y = 6 is ½(6η − 6)² = 18(1 − η)². Under a decaying schedule a newcomer must adapt at the evaluated round's rate,
    neither the base rate nor the last round's. Tolerance: the run's float64 ops differ from 18(1 − η)²'s, so 1e-12
    relative; the nearest other round's rate moves the loss by at least 3%."""
    model = nn.Linear(1, 1, bias=False, dtype=torch.float64)
    nn.init.zeros_(model.weight)
    seen = [line_client("0", ([1.0, 2.0], [2.0, 4.0]), ([1.0], [2.0]))]
    unseen = [line_client("1", ([1.0], [3.0]), ([2.0], [6.0]))]
    algorithm, worker = build_algorithm("local", model, {"0": 2}, {})
    config = EngineConfig(out_dir=tmp_path, n_rounds=4, lr_schedule=make_lr_schedule(spec, 0.1, 4), local_steps=1,
                          eval_every=1, progress=False, plots=False)
    SequentialEngine(worker, algorithm, seen, line_loss, line_evaluate, seen[0].test_loader, config, CPU,
                     unseen_clients=unseen).run()
    rows = pd.read_csv(tmp_path / "metrics.csv", dtype={"client": str})
    personal = rows[(rows.split == UNSEEN_PERSONAL_SPLIT) & (rows.client == "1") & (rows.metric == "loss")]
    assert personal["round"].tolist() == [0, 1, 2, 3, 4]
    expected = [18 * (1 - rate) ** 2 for rate in ADAPTATION_RATES[spec]]
    assert personal.value.tolist() == pytest.approx(expected, rel=1e-12)


# ----- step 4 from files: the run equals one on the seen clients alone, and the Flower engine refuses -----
def step4_assignments(manifest_path, folder, with_unseen: bool):
    """Round-robin clients 0..2 over the manifest's train rows (every third row of a client is client-test); client 2
    is unseen, or (``with_unseen`` False) not in the file at all: a two-client partition of clients 0 and 1."""
    train = read_manifest(manifest_path).query("split == 'train' and val == 0").sort_values("sample_id")
    train = train.reset_index(drop=True)
    table = pd.DataFrame({"sample_id": train["sample_id"], "client_id": train.index % 3, "group": train["scene_class"],
                          "subset": ["test" if (index // 3) % 3 == 2 else "train" for index in train.index]})
    meta = {"scheme": "round_robin", "alpha": 1.0, "groups": "scene_class"}
    if with_unseen:
        meta.update(n_clients=3, **{UNSEEN_KEY: [2]})
    else:
        table, meta["n_clients"] = table[table.client_id < 2], 2
    path = folder / "assignments.csv"
    write_assignments(path, table, meta)
    return path


def step4_argv(data_root, manifest, assignments, out, *extra):
    return ["--task", "depth_euclidean", "--data_path", str(data_root), "--manifest", str(manifest),
            "--assignments", str(assignments), "--out", str(out), "--encoder", "small_cnn", "--image_size", "32",
            "--n_rounds", "2", "--local_steps", "2", "--batch_size", "4", "--no-use_accelerator", "--no-progress", "--no-plots",
            "--rand_seed", "1", "--finetune_steps", "1", *extra]


@pytest.mark.parametrize("method", ["fedavg", "ditto"])
def test_step4_with_an_unseen_client_equals_a_run_without_it(tiny_data_root, tiny_manifest, tmp_path, method):  # noqa: F811
    """The same seeds and client ids: checkpoint.pt's server models and client states, clients.csv and every seen
    row of metrics.csv are byte for byte those of the run whose assignments never had client 2; client 2 alone has
    the unseen rows (ditto: a personal one too)."""
    runs = {}
    for name, with_unseen in (("with", True), ("without", False)):
        assignments = step4_assignments(tiny_manifest, tmp_path / f"{name}_partition", with_unseen)
        test_fed.main(step4_argv(tiny_data_root, tiny_manifest, assignments, tmp_path / name, "--method", method))
        runs[name] = load_checkpoint(tmp_path / name / "checkpoint.pt")
    for part in ("models", "tensors"):
        for key, weights in runs["with"]["server"][part].items():
            assert_equal_weights(weights, runs["without"]["server"][part][key])
    assert runs["with"]["client_states"].keys() == runs["without"]["client_states"].keys()
    assert (tmp_path / "with" / "clients.csv").read_bytes() == (tmp_path / "without" / "clients.csv").read_bytes()
    assert metric_lines(tmp_path / "with" / "metrics.csv", False) == metric_lines(tmp_path / "without" / "metrics.csv", False)
    unseen = pd.read_csv(tmp_path / "with" / "metrics.csv", dtype={"client": str})
    unseen = unseen[unseen.split.str.startswith("unseen_test")]
    per_client = unseen[~unseen.client.isin(["mean", "std", "variance", "worst", "best", "worst_decile", "best_decile",
                                             "jain", SKIPPED_CLIENT])]
    assert set(per_client.client) == {"2"} and set(per_client["round"]) == {0, 1, 2}
    splits = {UNSEEN_TEST_SPLIT, UNSEEN_FINETUNED_SPLIT} | ({UNSEEN_PERSONAL_SPLIT} if method == "ditto" else set())
    assert set(per_client.split) == splits
    assert "1 unseen clients held out of training (2)" in (tmp_path / "with" / "run.log").read_text()


def test_the_flower_engine_refuses_unseen_clients_in_one_line(tiny_data_root, tiny_manifest, tmp_path, capsys):  # noqa: F811
    assignments = step4_assignments(tiny_manifest, tmp_path / "partition", True)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:
        run_main(test_fed.main, step4_argv(tiny_data_root, tiny_manifest, assignments, out, "--engine", "flower"))
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and lines[0].startswith("error:")
    assert "unseen_clients" in lines[0] and "--engine sequential" in lines[0] and not out.exists()


def test_step4_names_an_edited_unseen_list_in_one_line(tiny_data_root, tiny_manifest, tmp_path, capsys):  # noqa: F811
    assignments = step4_assignments(tiny_manifest, tmp_path / "partition", True)
    sidecar = assignments.with_suffix(".json")
    sidecar.write_text(sidecar.read_text().replace('"unseen_clients": [\n    2\n  ]', '"unseen_clients": [7]'))
    with pytest.raises(SystemExit) as stop:
        run_main(test_fed.main, step4_argv(tiny_data_root, tiny_manifest, assignments, tmp_path / "run"))
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and str(sidecar) in lines[0] and "7 is not a client id" in lines[0]
