"""The sequential engine: resume, client state, NaN stop, spilling, sampling (network/engine_sequential.py)."""

from __future__ import annotations

import dataclasses
import math

import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader

from network.algorithms import build_algorithm, list_algorithms
from network.algorithms.base import ALGORITHMS
from network import engine_sequential as engine_module
from network.algorithms.fedavg import FedAvg
from network.algorithms.scaffold import Scaffold
from network.client import CLIENT_TEST_SPLIT, GLOBAL_TEST_SPLIT, PERSONAL_TEST_SPLIT, ClientData, ClientFailure
from network.engine_sequential import EngineConfig, SequentialEngine
from network.run_outputs import GLOBAL_CLIENT, SKIPPED_CLIENT
from network.lr_schedule import make_lr_schedule
from network.local_train import NonFiniteLossError
from network.sampling import client_seed, clients_per_round, sample_clients
from utils.errors import TaskHetError
from utils.run_dir import load_checkpoint
from tests.tiny_models import FAST_SETTINGS, class_counts, client_samples, evaluate, loss_fn, tiny_model_for

CPU = torch.device("cpu")
NUM_CLIENTS = 5


class Batches(list):
    """A client's batches, tagged with the client so a spy can tell clients apart."""

    client_id: str = ""


def make_clients(poison_after_calls: int | None = None, kill_after_calls: int | None = None) -> list[ClientData]:
    calls = {"count": 0}
    clients = []
    for index in range(NUM_CLIENTS):
        samples = client_samples(index, 20 + 4 * index)

        def train_loader(seed: int, samples=samples[:-6], client_id=str(index)) -> Batches:
            calls["count"] += 1
            if kill_after_calls is not None and calls["count"] > kill_after_calls:
                raise KeyboardInterrupt("killed")
            loader = DataLoader(samples, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(seed))
            batches = Batches(loader)
            if poison_after_calls is not None and calls["count"] > poison_after_calls:
                batches[0]["y"] = torch.full_like(batches[0]["y"], math.nan)
            batches.client_id = client_id
            return batches

        test = list(DataLoader(samples[-6:], batch_size=6))
        clients.append(ClientData(str(index), len(samples) - 6, train_loader, test, class_counts(samples[:-6])))
    return clients


def global_test() -> list[dict]:
    return list(DataLoader([sample for index in range(NUM_CLIENTS) for sample in client_samples(index, 30)[20:]],
                           batch_size=16))


def make_engine(out_dir, name="scaffold", rounds=5, clients=None, algorithm_class=None, settings=None,
                **overrides) -> SequentialEngine:
    torch.manual_seed(0)
    task_model = tiny_model_for(name)  # before make_clients: iterating a DataLoader draws from the global RNG
    clients = clients or make_clients()
    algorithm, model = build_algorithm(name, task_model, {client.client_id: client.num_samples for client in clients},
                                       settings if settings is not None else FAST_SETTINGS.get(name), seed=7)
    if algorithm_class is not None:  # a spy subclass of the same algorithm
        algorithm = algorithm_class(algorithm.settings, algorithm.federation)
    engine_settings = dict(out_dir=out_dir, n_rounds=rounds, lr_schedule=make_lr_schedule("cosine", 0.05, rounds), seed=7,
                           local_steps=3, client_fraction=0.6, eval_every=2, momentum=0.5, progress=False,
                           plots=False)  # curves.png: only the test that reads it draws it
    return SequentialEngine(model, algorithm, clients, loss_fn, evaluate, global_test(),
                            EngineConfig(**{**engine_settings, **overrides}), CPU, model_config={"name": "tiny"})


def assert_same_weights(first: dict, second: dict) -> None:
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key


def assert_same_states(first: dict, second: dict) -> None:
    assert first.keys() == second.keys()
    for client_id in first:
        assert_same_weights(first[client_id], second[client_id])


def kill_before_checkpoint_of_round(monkeypatch, round_index: int) -> None:
    """Make the engine die after writing round ``round_index``'s metrics, before its checkpoint."""
    save = engine_module.atomic_torch_save

    def dying_save(obj, path):
        if path.name == "checkpoint.pt" and obj["round"] == round_index:
            raise KeyboardInterrupt("killed")
        save(obj, path)

    monkeypatch.setattr(engine_module, "atomic_torch_save", dying_save)


@pytest.mark.parametrize("name, kill", [*((name, "mid_round") for name in list_algorithms()),
                                        ("scaffold", "before_checkpoint")])
@pytest.mark.kernels
def test_killed_and_resumed_run_is_bit_identical(tmp_path, monkeypatch, name, kill):
    reference = make_engine(tmp_path / "full", name).run()
    with pytest.raises(KeyboardInterrupt), monkeypatch.context() as patch:
        if kill == "mid_round":  # 3 clients per round: call 8 is round 3's second client
            make_engine(tmp_path / "resumed", name, clients=make_clients(kill_after_calls=7)).run()
        else:
            kill_before_checkpoint_of_round(patch, 3)
            make_engine(tmp_path / "resumed", name).run()
    assert load_checkpoint(tmp_path / "resumed" / "checkpoint.pt")["round"] == 2
    resumed = make_engine(tmp_path / "resumed", name).run()
    assert_same_weights(reference, resumed)
    assert (tmp_path / "full" / "metrics.csv").read_bytes() == (tmp_path / "resumed" / "metrics.csv").read_bytes()
    full, again = (load_checkpoint(tmp_path / run / "checkpoint.pt") for run in ("full", "resumed"))
    assert_same_states(full["client_states"], again["client_states"])
    assert_same_states(full["server"]["models"], again["server"]["models"])
    assert_same_weights(full["server"]["tensors"], again["server"]["tensors"])
    assert full["round"] == again["round"] == 5


def test_a_resumed_run_takes_its_server_from_the_checkpoint_without_building_one(tmp_path, monkeypatch):
    """init_server can be expensive (FedLoGe refines SSE-C with 10,000 Adam steps): a resume must not pay it again."""
    make_engine(tmp_path, "fedloge", rounds=2).run()
    calls = []
    original = ALGORITHMS.get("fedloge").init_server
    monkeypatch.setattr(ALGORITHMS.get("fedloge"), "init_server", lambda self, weights: calls.append(1) or original(self, weights))
    resumed = make_engine(tmp_path, "fedloge", rounds=3)
    resumed.run()
    assert calls == []
    make_engine(tmp_path / "fresh", "fedloge", rounds=1).run()
    assert calls == [1]


class SpyScaffold(Scaffold):
    """Records, per call, the client, the state it was given and the state it returned."""

    def __init__(self, settings, federation) -> None:
        super().__init__(settings, federation)
        self.calls: list[tuple[str, dict, dict]] = []

    def client_update(self, model, broadcast, client_state, loader, cfg):
        result = super().client_update(model, broadcast, client_state, loader, cfg)
        self.calls.append((loader.client_id, dict(client_state), dict(result.client_state)))
        return result


def test_scaffold_client_control_variates_persist_across_rounds_and_through_resume(tmp_path):
    full = make_engine(tmp_path / "full", algorithm_class=SpyScaffold)
    full.run()
    spy = full.algorithm
    last_state: dict[str, dict] = {}
    for client_id, given, returned in spy.calls:
        if client_id in last_state:
            assert_same_weights(given, last_state[client_id])
        else:
            assert given == {}
        assert any(value.abs().sum() > 0 for value in returned.values())
        last_state[client_id] = returned
    assert len(last_state) > 1

    with pytest.raises(KeyboardInterrupt):
        make_engine(tmp_path / "resumed", clients=make_clients(kill_after_calls=7)).run()
    resumed = make_engine(tmp_path / "resumed", algorithm_class=SpyScaffold)
    resumed.run()
    resumed_spy = resumed.algorithm
    tail = spy.calls[-len(resumed_spy.calls):]
    assert len(resumed_spy.calls) == 9  # rounds 3–5, 3 clients each
    for (client_id, given, returned), (same_id, given_again, returned_again) in zip(tail, resumed_spy.calls):
        assert client_id == same_id
        assert_same_weights(given, given_again)
        assert_same_weights(returned, returned_again)


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    engine = make_engine(tmp_path, "fedavg", clients=make_clients(poison_after_calls=6), client_fraction=1.0)
    with pytest.raises(NonFiniteLossError, match=r"round 2, client 1: .*nan.*last good checkpoint .*round 1"):
        engine.run()
    checkpoint = load_checkpoint(tmp_path / "checkpoint.pt")
    assert checkpoint["round"] == 1
    assert all(torch.isfinite(value).all() for value in checkpoint["model"].values() if value.is_floating_point())
    assert pd.read_csv(tmp_path / "metrics.csv")["round"].max() == 1
    assert isinstance(NonFiniteLossError("x"), TaskHetError)  # the CLI prints it as one line


@pytest.mark.parametrize("budget", [dict(local_steps=None), dict(local_epochs=2)], ids=["neither", "both"])
def test_an_engine_needs_exactly_one_local_budget(tmp_path, budget):
    """A library caller's EngineConfig with no local budget, or with both, is refused by the engine with the flags'
    names (the CLI defaults --local_steps and refuses both earlier), before the run folder is made."""
    with pytest.raises(TaskHetError) as refused:
        make_engine(tmp_path / "run", "fedavg", **budget)
    assert str(refused.value) == "set exactly one of --local_steps and --local_epochs"
    assert not (tmp_path / "run").exists()


def test_a_resumed_runs_progress_bar_starts_at_the_finished_rounds(tmp_path, capsys):
    """--progress on a resumed run: the bar counts the rounds of the whole run, starting at the checkpoint's round."""
    make_engine(tmp_path, "fedavg", rounds=4, n_rounds=2).run()
    capsys.readouterr()
    make_engine(tmp_path, "fedavg", rounds=4, resume=True, progress=True).run()
    bars = capsys.readouterr().err
    assert "fedavg rounds:  50%" in bars and "| 2/4 [" in bars and "| 4/4 [" in bars, bars
    assert "| 0/4 [" not in bars and "| 1/4 [" not in bars, bars
    assert load_checkpoint(tmp_path / "checkpoint.pt")["round"] == 4


def test_non_finite_aggregate_stops_before_its_checkpoint(tmp_path):
    def overflowing(settings, federation):  # built in code: a user's server_lr is bounded (network/settings.py)
        return FedAvg(dataclasses.replace(settings, server_lr=1e300), federation)

    with pytest.raises(NonFiniteLossError, match="round 1: the aggregated server models are not finite"):
        make_engine(tmp_path, "fedavg", algorithm_class=overflowing).run()
    assert load_checkpoint(tmp_path / "checkpoint.pt")["round"] == 0


STATEFUL = [name for name in list_algorithms()  # the others keep client state
            if name not in ("fedavg", "fedprox", "qfedavg", "fedbabu", "fednova", "feddecorr", "perfedavg", "fedlc", "ccvr")]


@pytest.mark.parametrize("name, limit", [*((name, 0) for name in STATEFUL), ("scaffold", 700)])
def test_spilling_client_state_to_disk_changes_nothing(tmp_path, name, limit):
    in_memory = make_engine(tmp_path / "memory", name).run()
    engine = make_engine(tmp_path / "disk", name, max_state_memory_bytes=limit)
    spilled = engine.run()
    assert_same_weights(in_memory, spilled)
    assert len(list((tmp_path / "disk" / "client_states").glob("client_*.pt"))) > 0
    assert engine.store.memory_bytes <= limit
    memory_states, disk_states = (load_checkpoint(tmp_path / run / "checkpoint.pt")["client_states"]
                                  for run in ("memory", "disk"))
    assert_same_states(memory_states, disk_states)


def test_a_run_without_plots_draws_no_picture_and_computes_the_same_numbers(tmp_path):
    """``plots=False`` (benchmarks, tests of numbers) skips curves.png, diagnostics.png and the cosine heatmaps, and
    nothing else: metrics.csv is the same file."""
    make_engine(tmp_path / "drawn", "fedavg", plots=True, diagnostics=True).run()
    make_engine(tmp_path / "bare", "fedavg", diagnostics=True).run()
    drawn = sorted(path.relative_to(tmp_path / "drawn").as_posix() for path in (tmp_path / "drawn").rglob("*.png"))
    assert {"curves.png", "diagnostics.png"} <= set(drawn) and any(name.startswith("diagnostics/") for name in drawn)
    assert not list((tmp_path / "bare").rglob("*.png"))
    assert (tmp_path / "bare" / "metrics.csv").read_bytes() == (tmp_path / "drawn" / "metrics.csv").read_bytes()


def test_metrics_file_has_round_zero_eval_rounds_and_client_summaries(tmp_path):
    make_engine(tmp_path, "fedrep", plots=True).run()
    metrics = pd.read_csv(tmp_path / "metrics.csv", dtype={"client": str})
    assert list(metrics.columns) == ["round", "split", "client", "metric", "value"]
    tested = metrics[(metrics.split == GLOBAL_TEST_SPLIT) & (metrics.client == GLOBAL_CLIENT)]
    assert sorted(tested["round"].unique()) == [0, 2, 4, 5]
    assert set(tested.metric) == {"loss", "mae"}
    for split in (CLIENT_TEST_SPLIT, PERSONAL_TEST_SPLIT):
        rows = metrics[(metrics.split == split) & (metrics["round"] == 5)]
        per_client = rows[rows.client.isin([str(index) for index in range(NUM_CLIENTS)]) & (rows.metric == "loss")]
        assert len(per_client) == NUM_CLIENTS
        summary = rows[rows.metric == "loss"].set_index("client").value
        assert summary["mean"] == pytest.approx(per_client.value.mean())
        assert summary["worst_decile"] == pytest.approx(per_client.value.max())
    personal = metrics[(metrics.split == PERSONAL_TEST_SPLIT) & (metrics.client == "mean") & (metrics.metric == "loss")]
    assert personal.value.iloc[-1] != metrics[(metrics.split == CLIENT_TEST_SPLIT) & (metrics.client == "mean")
                                              & (metrics.metric == "loss")].value.iloc[-1]
    assert not (tmp_path / "best.pt").exists()  # no validation rows: nothing may be chosen on the test split
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_best_pt_is_the_round_of_the_lowest_validation_loss_never_the_lowest_test_loss(tmp_path):
    engine = make_engine(tmp_path, "fedavg", rounds=6, eval_every=1)
    # validation rows that disagree with the test split: the first client's samples only
    engine.val_loader = list(DataLoader(client_samples(0, 30)[20:], batch_size=16))
    engine.run()
    metrics = pd.read_csv(tmp_path / "metrics.csv", dtype={"client": str})
    losses = metrics[(metrics.client == GLOBAL_CLIENT) & (metrics.metric == "loss")]
    val = losses[losses.split == "val"].set_index("round").value
    test = losses[losses.split == GLOBAL_TEST_SPLIT].set_index("round").value
    best = load_checkpoint(tmp_path / "best.pt")
    assert best["model_config"] == {"name": "tiny"} and best["round"] == val.idxmin()
    assert best["val_loss"] == val.min() and best["test_loss"] == test[val.idxmin()]


def test_resume_refuses_another_runs_checkpoint_and_no_resume_starts_over(tmp_path):
    make_engine(tmp_path, "fedavg", rounds=2).run()
    with pytest.raises(TaskHetError, match="different run"):
        make_engine(tmp_path, "fedprox", rounds=2).run()
    make_engine(tmp_path, "fedprox", rounds=1, resume=False).run()
    metrics = pd.read_csv(tmp_path / "metrics.csv")
    assert metrics["round"].max() == 1 and load_checkpoint(tmp_path / "checkpoint.pt")["run"]["algorithm"] == "fedprox"


class RecordingFedAvg(FedAvg):
    def __init__(self, settings, federation) -> None:
        super().__init__(settings, federation)
        self.uploads: dict[str, dict] = {}

    def client_update(self, model, broadcast, client_state, loader, cfg):
        result = super().client_update(model, broadcast, client_state, loader, cfg)
        self.uploads[loader.client_id] = result.upload
        return result


@pytest.mark.kernels
def test_a_client_trains_identically_whoever_else_is_sampled(tmp_path):
    runs = {}
    for fraction in (0.4, 1.0):
        engine = make_engine(tmp_path / str(fraction), "fedavg", algorithm_class=RecordingFedAvg, rounds=1,
                             client_fraction=fraction)
        engine.run()
        runs[fraction] = {client_id: upload["delta"] for client_id, upload in engine.algorithm.uploads.items()}
    shared = set(runs[0.4]) & set(runs[1.0])
    assert len(runs[0.4]) == 2 and shared == set(runs[0.4])
    for client_id in shared:
        assert_same_weights(runs[0.4][client_id], runs[1.0][client_id])


def test_client_sampling_is_seeded_per_round():
    ids = [str(index) for index in range(100)]
    first = sample_clients(ids, 0.1, seed=3, round_index=1)
    assert first == sample_clients(ids, 0.1, seed=3, round_index=1) and len(first) == 10
    assert first != sample_clients(ids, 0.1, seed=3, round_index=2)
    assert first != sample_clients(ids, 0.1, seed=4, round_index=1)
    assert first == sorted(first, key=ids.index)
    assert sample_clients(ids, 1.0, seed=3, round_index=1) == ids
    assert clients_per_round(3, 0.01) == 1 and clients_per_round(10, 0.25) == 2
    assert client_seed(3, 1, "a") == client_seed(3, 1, "a") != client_seed(3, 2, "a")
    # each run seed, round and client draws its own stream
    assert len({client_seed(seed, round_index, client) for seed in (0, 1, 2) for round_index in (1, 2, 3)
                for client in ("a", "b", "c")}) == 27
    for fraction in (0.0, 1.5):
        with pytest.raises(TaskHetError, match="--client_fraction"):
            sample_clients(ids, fraction, seed=3, round_index=1)


def test_lr_schedules_are_functions_of_the_round():
    assert make_lr_schedule("constant", 0.1, 10)(7) == 0.1
    cosine = make_lr_schedule("cosine", 0.1, 10)
    assert cosine(1) == pytest.approx(0.1) and cosine(6) == pytest.approx(0.05)
    assert make_lr_schedule("exponential:0.5", 0.1, 10)(3) == pytest.approx(0.025)
    assert make_lr_schedule("step:2:0.1", 1.0, 10)(4) == pytest.approx(0.1)
    step = make_lr_schedule("step:2:0.5", 1.0, 10)  # γ^⌊(r−1)/2⌋, not γ·⌊(r−1)/2⌋ nor shifted by a round
    assert [step(round_index) for round_index in range(1, 8)] == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.125]
    for bad in ("linear", "exponential", "step:0:0.1", "exponential:x"):
        with pytest.raises(TaskHetError, match="--lr_schedule"):
            make_lr_schedule(bad, 0.1, 10)


@pytest.mark.kernels
@pytest.mark.parametrize("name", ["scaffold", "ditto"])  # server tensors; client state kept between rounds
def test_checkpoint_every_resumes_from_the_last_one_and_redoes_the_rest_bit_for_bit(tmp_path, name):
    reference = make_engine(tmp_path / "full", name, rounds=7, checkpoint_every=3).run()
    assert load_checkpoint(tmp_path / "full" / "checkpoint.pt")["round"] == 7  # the last round always checkpoints
    written = []
    with pytest.raises(KeyboardInterrupt):  # 3 clients per round: call 17 is round 6's second client
        engine = make_engine(tmp_path / "resumed", name, rounds=7, checkpoint_every=3,
                             clients=make_clients(kill_after_calls=16))
        save = engine_module.atomic_torch_save
        engine_module.atomic_torch_save = lambda obj, path: (written.append((path.name, obj["round"])), save(obj, path))
        try:
            engine.run()
        finally:
            engine_module.atomic_torch_save = save
    assert [round_index for file, round_index in written if file == "checkpoint.pt"] == [0, 3]  # rounds 1-5 ran
    resumed = make_engine(tmp_path / "resumed", name, rounds=7, checkpoint_every=3).run()
    assert_same_weights(reference, resumed)
    assert (tmp_path / "full" / "metrics.csv").read_bytes() == (tmp_path / "resumed" / "metrics.csv").read_bytes()


def test_a_stopped_run_names_the_round_of_its_last_checkpoint(tmp_path):
    engine = make_engine(tmp_path / "run", "fedavg", rounds=6, checkpoint_every=2,
                         clients=make_clients(poison_after_calls=10))  # round 4's first client sees NaN
    with pytest.raises(NonFiniteLossError, match=r"round 4, .*last good checkpoint is .*checkpoint.pt \(round 2\)"):
        engine.run()
    assert load_checkpoint(tmp_path / "run" / "checkpoint.pt")["round"] == 2


def test_the_flower_engine_refuses_a_sparser_checkpoint(tmp_path):
    from network.run_config import RunConfig

    assert RunConfig(task="normal", out=tmp_path, checkpoint_every=5).checkpoint_every == 5  # sequential: taken
    with pytest.raises(TaskHetError, match="--checkpoint_every 5: the Flower engine"):
        RunConfig(task="normal", out=tmp_path, engine="flower", checkpoint_every=5)
