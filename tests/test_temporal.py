"""Temporal skew and the compound partition (partitioning/temporal.py, network/schedule.py; issue 22).

What must hold: a client trains in round t on exactly the rows its schedule gives for t (the sequential
engine, its vectorised path and the Flower engine), with the FedAvg weight of those rows; a run killed
with SIGKILL mid-schedule and resumed ends bit-identical; bad schedules are one error naming file, row and
column; a compound step-3b call gives the label, quantity and temporal skew it was asked for.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from network.algorithms import build_algorithm
from network.algorithms.fedavg import FedAvg
from network.client import ClientData
from network.engine_sequential import EngineConfig, SequentialEngine
from network.lr_schedule import make_lr_schedule
from network.schedule import ClientSchedule, client_at, schedules_of
from partitioning.assignments import load_assignments
from partitioning.partition import get_partitioner
from partitioning.temporal import (NO_END, TemporalSpec, check_horizon, client_phases, parse_temporal, phase_windows,
                                   schedule_rows)
from steps import assign, federated, select
from tests.scripts_in_process import run_script
from tests.test_vectorized import BatchNormNet
from tests.tiny_models import class_counts, client_samples, evaluate, loss_fn
from utils.errors import TaskHetError
from utils.run_dir import load_checkpoint

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
ROUNDS = 5
TRAIN, TEST = 12, 4  # rows per client


# ----- a federation whose clients log every train row they read, and the round it is read in -----
class LoggedRows(Dataset):
    """A client's scheduled train rows; reading one logs ``(round, sample_id)`` (the clock is the engine's round)."""

    def __init__(self, samples: list[dict], log: list, clock: dict) -> None:
        self.samples, self.log, self.clock = samples, log, clock

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        self.log.append((self.clock["round"], self.samples[index]["sample_id"]))
        return self.samples[index]


def expected_rows(client: int, round_index: int) -> list[str]:
    """The schedule of :func:`scheduled_clients`, written out by hand: clients 0-2 rotate three phases of four
    rows (phase (t-1) mod 3 in round t); client 3 holds rows 0-5 in round 1 and rows 6-11 in rounds 3-5."""
    if client < 3:
        phase = (round_index - 1) % 3
        rows = range(4 * phase, 4 * phase + 4)
    else:
        rows = range(0, 6) if round_index == 1 else range(6, 12) if round_index >= 3 else range(0)
    return [f"{client}-{row}" for row in rows]


def scheduled_clients(log: list, clock: dict) -> list[ClientData]:
    clients = []
    for index in range(4):
        samples = client_samples(index, TRAIN + TEST)
        train = samples[:TRAIN]
        if index < 3:
            starts, ends = [], []
            for row in range(TRAIN):  # phase row // 4, held in rounds phase+1, phase+4, ... (rotate:3:1 up to ROUNDS)
                starts.append(row // 4 + 1)
                ends.append(row // 4 + 1)
            # one row per window, as assignments.csv lists them: repeat phase 0 and 1 rows for rounds 4 and 5
            rows = train + train[:8]
            starts += [4] * 4 + [5] * 4
            ends += [4] * 4 + [5] * 4
        else:
            rows, starts, ends = train, [1] * 6 + [3] * 6, [1] * 6 + [NO_END] * 6
        schedule = ClientSchedule(np.array(starts), np.array(ends), LoggedRows(rows, log, clock),
                                  np.array([int(sample["label"]) for sample in rows]), 3, 4, 0)
        whole = partial(lambda data, seed: DataLoader(data, batch_size=5, shuffle=True,
                                                      generator=torch.Generator().manual_seed(seed)), train)
        clients.append(ClientData(str(index), TRAIN, whole, list(DataLoader(samples[TRAIN:], batch_size=4)),
                                  class_counts(train), schedule))
    return clients


class WeightSpy(FedAvg):
    """FedAvg that records the aggregation weight (``num_samples``) each client trains with, per round."""

    weights: dict

    def client_update(self, model, broadcast, client_state, loader, cfg):
        self.weights[(self.clock["round"], len(self.weights))] = cfg.num_samples
        return super().client_update(model, broadcast, client_state, loader, cfg)

    def client_updates(self, model, broadcast, client_states, loaders, cfgs):
        for cfg in cfgs:
            self.weights[(self.clock["round"], len(self.weights))] = cfg.num_samples
        return super().client_updates(model, broadcast, client_states, loaders, cfgs)


def engine_parts(out_dir: Path, chunk: int = 0):
    log, clock = [], {"round": 0}
    clients = scheduled_clients(log, clock)
    torch.manual_seed(0)
    algorithm, model = build_algorithm("fedavg", BatchNormNet(), {c.client_id: c.num_samples for c in clients}, seed=3)
    algorithm = WeightSpy(algorithm.settings, algorithm.federation)
    algorithm.weights, algorithm.clock = {}, clock
    config = EngineConfig(out_dir=out_dir, n_rounds=ROUNDS, lr_schedule=make_lr_schedule("constant", 0.01, ROUNDS),
                          seed=3, local_epochs=1, client_fraction=1.0, eval_every=ROUNDS, progress=False,
                          signature={"test": "temporal"}, vectorize_chunk=chunk, plots=False)
    test = list(DataLoader([s for index in range(4) for s in client_samples(index, 20)[16:]], batch_size=8))
    return model, algorithm, clients, test, config, log, clock


def with_clock(engine, clock: dict) -> None:
    original = engine.train_round

    def train_round(round_index: int):
        clock["round"] = round_index
        return original(round_index)

    engine.train_round = train_round


def assert_trained_the_schedule(log: list, algorithm: WeightSpy) -> None:
    trained = pd.DataFrame(log, columns=["round", "sample_id"])
    trained["client"] = trained.sample_id.str.split("-").str[0].astype(int)
    for round_index in range(1, ROUNDS + 1):
        for client in range(4):
            read = sorted(trained.query("round == @round_index and client == @client").sample_id)
            assert read == sorted(expected_rows(client, round_index)), (round_index, client)
        # one weight per client that trained, each the number of rows it held in that round (FedAvg's n_k(t))
        weights = sorted(w for (r, _), w in algorithm.weights.items() if r == round_index)
        assert weights == sorted(len(expected_rows(c, round_index)) for c in range(4) if expected_rows(c, round_index))


@pytest.mark.parametrize("chunk", [0, 2], ids=["sequential", "vectorized"])
def test_the_sequential_engine_trains_each_client_on_exactly_its_rows_of_the_round(tmp_path, chunk):
    model, algorithm, clients, test, config, log, clock = engine_parts(tmp_path, chunk)
    engine = SequentialEngine(model, algorithm, clients, loss_fn, evaluate, test, config, CPU)
    with_clock(engine, clock)
    engine.run()
    assert_trained_the_schedule(log, algorithm)
    train_rows = pd.read_csv(tmp_path / "metrics.csv", dtype={"client": str}).query("split == 'train' and round == 2")
    assert "3" not in set(train_rows.client)  # holding nothing in round 2, client 3 was not sampled


def test_the_flower_engine_trains_each_client_on_exactly_its_rows_of_the_round(tmp_path):
    pytest.importorskip("flwr")
    pytest.importorskip("ray")
    import copy

    from flwr.supercore.task_identity import TaskIdentity

    from network.flower.node import NodeHost, make_client_app
    from network.flower.server import FlowerEngine
    from network.flower.simulation import node_share
    from tests.test_engine_flower import InProcessGrid, node_contexts

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    try:
        model, algorithm, clients, test, config, log, clock = engine_parts(tmp_path)
        node_algorithm = copy.deepcopy(algorithm)
        node_algorithm.weights, node_algorithm.clock = algorithm.weights, clock  # the nodes' weights, in one log
        host = NodeHost(copy.deepcopy(model), node_algorithm, {c.client_id: c for c in clients}, loss_fn, evaluate, CPU,
                        tmp_path / "node_states")
        grid = InProcessGrid(make_client_app(partial(node_share, host)), node_contexts(2))
        engine = FlowerEngine(grid, model, algorithm, [c.client_id for c in clients], evaluate, test, config, CPU,
                              logger=logging.getLogger("temporal"), node_wait_s=1.0, schedules=schedules_of(clients))
        with_clock(engine, clock)
        engine.run()
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
    assert_trained_the_schedule(log, algorithm)


def test_a_client_as_of_a_round_has_the_rows_weight_and_class_counts_of_that_round():
    client = scheduled_clients([], {"round": 0})[3]
    now = client_at(client, 3)
    labels = [int(s["label"]) for s in client_samples(3, TRAIN + TEST)[6:TRAIN]]
    assert now.num_samples == 6 and now.class_counts == tuple(np.bincount(labels, minlength=3).tolist())
    assert client_at(client, 2).num_samples == 0 and client.num_samples == TRAIN  # the whole client is unchanged


def test_a_deployment_servers_schedules_count_each_clients_rows_of_a_round():
    """network.schedule.table_schedules (the Flower deployment's server reads only assignments.csv): per client, the
    train rows whose window holds the round; test rows never count; a blank to_round never ends."""
    from network.schedule import table_schedules

    table = pd.DataFrame({"sample_id": list("abcdefg"), "client_id": [0, 0, 0, 1, 1, 1, 1],
                          "subset": ["train", "train", "test", "train", "train", "train", "test"],
                          "from_round": [1, 3, 1, 1, 2, 4, 1], "to_round": [2, NO_END, NO_END, 1, 3, NO_END, 2]})
    schedules = table_schedules(table)
    assert list(schedules) == ["0", "1"] and all(schedule.rows is None for schedule in schedules.values())
    # by hand: client 0 holds a in 1-2 and b from 3; client 1 holds d in 1, e in 2-3 and f from 4
    assert [schedules["0"].count(r) for r in range(1, 6)] == [1, 1, 1, 1, 1]
    assert [schedules["1"].count(r) for r in range(1, 6)] == [1, 1, 1, 1, 1]
    assert list(schedules["0"].held(2)) == [0] and list(schedules["0"].held(3)) == [1]
    table.loc[table["sample_id"] == "e", "to_round"] = 4
    assert [table_schedules(table)["1"].count(r) for r in range(1, 6)] == [1, 1, 1, 2, 1]
    assert table_schedules(table.assign(from_round=1, to_round=NO_END)) == {}  # no real schedule: every row always


# ----- step 3b: the generators and the compound partition -----
@pytest.fixture(scope="module")
def digits_manifest(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("digits")
    return select.main(["--family", "digits", "--n_samples", "300", "--test_fraction", "0.2", "--seed", "0",
                        "--out", str(out), "--no-progress"])


def compound(manifest: Path, out: Path, *extra: str) -> Path:
    return assign.main(["--manifest", str(manifest), "--scheme", "dirichlet_split", "--alpha", "0.5", "--size_skew",
                        "lognormal:1.0", "--n_clients", "6", "--seed", "3", "--out", str(out), "--no-progress", *extra])


def test_the_compound_partition_has_the_label_quantity_and_temporal_skew_asked_for(digits_manifest, tmp_path):
    static = pd.read_csv(compound(digits_manifest, tmp_path / "static"), dtype={"sample_id": str})
    path = compound(digits_manifest, tmp_path / "compound", "--temporal", "rotate:3:2", "--n_rounds", "10")
    table = pd.read_csv(path, dtype={"sample_id": str})
    # label + quantity: exactly the partition of the same call without --temporal (its own generator), whose
    # sizes are the lognormal draw of dirichlet_split
    pairs = table.drop_duplicates("sample_id")[["sample_id", "client_id", "subset"]].sort_values("sample_id")
    assert pairs.values.tolist() == static[["sample_id", "client_id", "subset"]].sort_values("sample_id").values.tolist()
    manifest = pd.read_csv(digits_manifest, dtype={"sample_id": str})
    train = manifest[(manifest.split == "train") & (manifest.val == 0)].reset_index(drop=True)
    partition = get_partitioner("dirichlet_split", 6, alpha=0.5, size_skew="lognormal:1.0", seed=3).split(train.label.to_numpy())
    stats = pd.read_csv(tmp_path / "compound" / "client_stats.csv")
    assert stats["size"].tolist() == partition.sizes.tolist() and partition.sizes.max() > 2 * partition.sizes.min()
    # label JS divergence (base 2) of each client, by hand
    counts = stats[[f"count_{g}" for g in range(10)]].to_numpy(float)
    p, q = counts / counts.sum(1, keepdims=True), counts.sum(0) / counts.sum()
    m = (p + q) / 2
    kl = lambda a, b: np.where(a > 0, a * np.log2(np.where(a > 0, a, 1) / b), 0).sum(1)  # noqa: E731
    assert stats.js_divergence.to_numpy() == pytest.approx((kl(p, m) + kl(q[None], m)) / 2)
    # temporal: rows per window as asked (phase p in rounds 2p+1..2p+2, again 6 rounds later, up to round 10)
    rows = table[table.subset == "train"]
    windows = sorted(set(zip(rows.from_round.fillna(1).astype(int), rows.to_round.astype(int))))
    assert windows == [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10)]
    assert table.loc[table.subset == "test", ["from_round", "to_round"]].isna().all(axis=None)
    for client, held in rows.groupby("client_id"):
        phase = {(1, 2): 0, (7, 8): 0, (3, 4): 1, (9, 10): 1, (5, 6): 2}
        phase_of = held.assign(phase=[phase[(int(f) if f == f else 1, int(t))] for f, t in zip(held.from_round, held.to_round)])
        per_sample = phase_of.groupby("sample_id").phase.nunique()
        assert (per_sample == 1).all()  # a sample stays in its phase
        sizes = phase_of.drop_duplicates("sample_id").phase.value_counts().reindex(range(3), fill_value=0)
        assert sizes.max() - sizes.min() <= 1
        assert stats.loc[client, "phase_sizes"] == ";".join(map(str, sizes.tolist()))
        # the mixture moves through the groups: a group's phases are one contiguous run
        for _, phases in phase_of.drop_duplicates("sample_id").groupby("group").phase:
            ranks = sorted(set(phases))
            assert ranks == list(range(ranks[0], ranks[-1] + 1))
    loaded, meta = load_assignments(path, manifest)
    assert meta["temporal"] == {"kind": "rotate", "phases": 3, "phase_rounds": 2, "change_round": 0, "n_rounds": 10}
    assert (tmp_path / "compound" / "client_schedule_heatmap.png").stat().st_size > 0


def test_abrupt_changes_every_clients_rows_at_the_chosen_round(digits_manifest, tmp_path):
    table = pd.read_csv(compound(digits_manifest, tmp_path, "--temporal", "abrupt:4", "--no-plots"), dtype={"sample_id": str})
    assert not list(tmp_path.glob("*.png"))  # --no-plots: neither the group heatmap nor the schedule's
    train = table[table.subset == "train"]
    assert sorted(set(zip(train.from_round.fillna(1), train.to_round.fillna(-1)))) == [(1, 3), (4, -1)]
    assert not train.sample_id.duplicated().any()
    before = train[train.to_round == 3].groupby("client_id").size()
    after = train[train.from_round == 4].groupby("client_id").size()
    assert ((before - after).abs() <= 1).all() and len(before) == 6


def test_phases_cut_each_client_into_near_equal_contiguous_group_blocks():
    client_of = np.repeat([0, 1], [7, 3])
    groups = np.array([2, 0, 1, 2, 0, 1, 2, 0, 0, 1])
    phase = client_phases(client_of, groups, 3, np.random.default_rng(0))
    assert np.bincount(phase[:7], minlength=3).tolist() in ([3, 2, 2], [2, 3, 2], [2, 2, 3])
    assert sorted(phase[7:].tolist()) == [0, 1, 2]
    source, starts, ends = schedule_rows(np.array([0, 1, 2]), TemporalSpec("rotate", 3, phase_rounds=2), 9)
    assert list(zip(source, starts, ends)) == [(0, 1, 2), (0, 7, 8), (1, 3, 4), (1, 9, 9), (2, 5, 6)]
    assert phase_windows(TemporalSpec("rotate", 2, phase_rounds=3), None) == [[(1, 3)], [(4, NO_END)]]


# ----- bad input: one error naming the file, the row and the column -----
@pytest.fixture(scope="module")
def scheduled(digits_manifest, tmp_path_factory) -> Path:
    """A valid scheduled assignments file of the digits manifest, made once: the tests below edit copies of it."""
    return compound(digits_manifest, tmp_path_factory.mktemp("scheduled") / "base", "--temporal", "abrupt:3")


def write_schedule(tmp_path: Path, scheduled: Path, edit) -> Path:
    """A copy of the ``scheduled`` step-3b folder whose assignments file has one edit applied to its rows."""
    path = Path(shutil.copytree(scheduled.parent, tmp_path / "base")) / scheduled.name
    table = pd.read_csv(path, dtype=str, keep_default_na=False)
    edit(table)
    table.to_csv(path, index=False)
    return path


def first_train(table: pd.DataFrame) -> int:
    return int(np.flatnonzero(table.subset.to_numpy() == "train")[0])


def set_cell(column: str, value: str, test_row: bool = False):
    def edit(table):
        row = int(np.flatnonzero(table.subset.to_numpy() == "test")[0]) if test_row else first_train(table)
        table.loc[row, column] = value
    return edit


def duplicate_first_train(table: pd.DataFrame) -> None:
    row = first_train(table)
    table.loc[len(table)] = table.loc[row]
    table.loc[len(table) - 1, ["from_round", "to_round"]] = ["2", "5"]
    table.loc[row, ["from_round", "to_round"]] = ["", "2"]


@pytest.mark.parametrize("edit, named", [
    (set_cell("from_round", "soon"), "column from_round: not an integer"),
    (set_cell("to_round", "nan"), "column to_round: not an integer"),
    (set_cell("to_round", "2.5"), "column to_round: not an integer"),
    (set_cell("from_round", "0"), "column from_round: not an integer in [1, 10000]"),
    (set_cell("to_round", "10001"), "column to_round: not an integer in [1, 10000]"),
    (set_cell("from_round", "inf"), "column from_round: not an integer"),
    (lambda table: table.loc.__setitem__((first_train(table), ["from_round", "to_round"]), ["5", "4"]), "empty window"),
    (set_cell("to_round", "4", test_row=True), "a window on a client-test row"),
    (duplicate_first_train, "duplicated sample id (held twice in one round)"),
])
def test_a_bad_schedule_is_one_error_naming_the_file_row_and_column(digits_manifest, scheduled, tmp_path, edit, named):
    path = write_schedule(tmp_path, scheduled, edit)
    with pytest.raises(TaskHetError) as caught:
        load_assignments(path, pd.read_csv(digits_manifest, dtype={"sample_id": str}))
    message = str(caught.value)
    assert str(path) in message and named in message and "row " in message, message


def test_a_schedule_round_beyond_n_rounds_is_refused_by_step4_in_one_error_line(digits_manifest, scheduled, tmp_path,
                                                                                 capsys, monkeypatch):
    path = write_schedule(tmp_path, scheduled, set_cell("to_round", "40"))
    table, _ = load_assignments(path, pd.read_csv(digits_manifest, dtype={"sample_id": str}))
    with pytest.raises(TaskHetError, match=r"column to_round: round beyond --n_rounds 12: row \d+"):
        check_horizon(table, 12, str(path))
    check_horizon(table, 40, str(path))
    result = run_script("test_fed.py", fed_argv(digits_manifest, path, tmp_path / "run", 6), capsys, monkeypatch)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert str(path) in result.stderr and "to_round: round beyond --n_rounds 6" in result.stderr
    assert not (tmp_path / "run" / "metrics.csv").exists()


@pytest.mark.parametrize("flag, named", [("rotate:1:2", r"PHASES must be an integer in \[2, 1000\]"),
                                         ("abrupt:1", r"change ROUND .* must be an integer in \[2, 10000\]"),
                                         ("spin:3", "use rotate"), ("rotate:3:x", "ROUNDS_PER_PHASE must be an integer")])
def test_a_bad_temporal_flag_is_refused_before_anything_is_written(digits_manifest, tmp_path, flag, named):
    with pytest.raises(TaskHetError, match=named):
        compound(digits_manifest, tmp_path / "out", "--temporal", flag)
    with pytest.raises(TaskHetError, match="after --n_rounds 4"):
        compound(digits_manifest, tmp_path / "out", "--temporal", "rotate:3:2", "--n_rounds", "4")
    assert not (tmp_path / "out").exists()
    assert parse_temporal(None) is None


# ----- kill -9 mid-schedule, then --resume -----
def fed_argv(manifest: Path, assignments: Path, out: Path, rounds: int) -> list[str]:
    return ["--task", "digit_class", "--manifest", str(manifest), "--assignments", str(assignments), "--out", str(out),
            "--data_path", str(manifest.parent), "--encoder", "small_cnn", "--weights", "none", "--image_size", "8",
            "--n_rounds", str(rounds), "--local_steps", "3", "--batch_size", "8", "--method", "fedavg",
            "--client_fraction", "0.5", "--eval_every", "4", "--no-use_accelerator", "--no-progress", "--no-plots", "--threads", "1",
            "--rand_seed", "5"]


@pytest.mark.slow
def test_a_run_killed_mid_schedule_resumes_bit_identical(digits_manifest, tmp_path):
    rounds = 12
    path = compound(digits_manifest, tmp_path / "a", "--temporal", "rotate:3:2", "--n_rounds", str(rounds))
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    # Only the killed run needs a process of its own; the uninterrupted run and the resume run here.
    federated.main(fed_argv(digits_manifest, path, clean, rounds))
    process = subprocess.Popen([sys.executable, "test_fed.py", *fed_argv(digits_manifest, path, killed, rounds)], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint, deadline, reached = killed / "checkpoint.pt", time.time() + 300, 0
    while process.poll() is None and time.time() < deadline:
        if checkpoint.exists():
            try:
                reached = load_checkpoint(checkpoint)["round"]
            except Exception:  # noqa: BLE001  (being replaced at this instant: read it again)
                reached = 0
            if reached >= 3:  # in the second phase: its rows differ from the first's
                break
        time.sleep(0.02)
    assert process.poll() is None and 3 <= reached < rounds, "the run ended before it could be killed mid-schedule"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    federated.main([*fed_argv(digits_manifest, path, killed, rounds), "--resume"])
    assert (killed / "metrics.csv").read_bytes() == (clean / "metrics.csv").read_bytes()
    first, second = load_checkpoint(clean / "checkpoint.pt"), load_checkpoint(killed / "checkpoint.pt")
    assert first["round"] == second["round"] == rounds
    for key, value in first["model"].items():
        assert torch.equal(value, second["model"][key]), key


# ----- experiment files -----
@pytest.mark.slow
def test_an_experiment_file_runs_a_compound_partition_through_steps_3b_and_4(tmp_path):
    import yaml

    import run_pipeline
    from tests.test_digits import tiny_digits_experiment

    config = tiny_digits_experiment(tmp_path)
    config["partition"].update(size_skew="lognormal:0.5", temporal="abrupt:2")
    experiment = tmp_path / "health.yaml"
    experiment.write_text(yaml.safe_dump(config))
    run_pipeline.main([str(experiment), "--results", str(tmp_path / "results"), "--no-run_plots"])
    out = tmp_path / "results" / "tinydigits"
    sidecars = [pd.read_json(path, typ="series") for path in out.rglob("assignments/**/assignments.json")]
    assert sidecars and all(meta["temporal"]["change_round"] == 2 and meta["temporal"]["n_rounds"] == 2
                            and meta["parameters"]["size_skew"] == "lognormal:0.5" for meta in sidecars)
    assert len(list(out.rglob("federated/**/metrics.csv"))) == 2  # both groupings trained on their schedules


def test_a_scheduled_client_reads_its_rows_of_the_round_through_its_feature_skew(digits_manifest, tmp_path):
    import argparse

    from models.tasks import get_task
    from network.client_data import make_clients

    path = compound(digits_manifest, tmp_path / "a", "--temporal", "abrupt:3", "--feature_noise", "0.5")
    manifest = pd.read_csv(digits_manifest, dtype={"sample_id": str})
    table, _ = load_assignments(path, manifest)
    args = argparse.Namespace(data_path=digits_manifest.parent, image_size=8, cache_dir=None, batch_size=64,
                              num_workers=0, local_test="assigned", rand_seed=0, assignments=path, cache_features=False)
    plain_args = argparse.Namespace(**{**vars(args), "assignments": None})  # no sidecar: no skews
    noisy, plain = (make_clients(a, manifest, table, get_task("digit_class")) for a in (args, plain_args))
    last = noisy[-1]  # σ_i = 0.5·i/(N−1): the last client is the noisiest
    now, clean = client_at(last, 3), client_at(plain[-1], 3)
    expected = set(table[(table.client_id == 5) & (table.subset == "train") & (table.from_round == 3)].sample_id)
    batches, clean_batches = list(now.train_loader(1)), list(clean.train_loader(1))
    assert {s for batch in batches for s in batch["sample_id"]} == expected
    assert not torch.allclose(batches[0]["image"], clean_batches[0]["image"])  # the skew's noise reached these rows
