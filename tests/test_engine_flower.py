"""The Flower engine reproduces the sequential engine (network/engine_flower.py).

Every simulation here starts Ray (a few seconds each), so the file runs five of them and
makes each check several things: the weights and metrics of FedAvg, SCAFFOLD and FedRep
against the sequential engine, a failing client named by id, resuming after a failed round
(node-side client state of the last checkpoint), and the min_available_clients rule.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from functools import partial
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("flwr")
pytest.importorskip("ray")

from network.algorithms import AlgorithmConfig, get_algorithm  # noqa: E402
from network.engine_flower import (ClientFailure, FlowerOptions, NodeStateStore, run_flower)  # noqa: E402
from network.engine_sequential import ClientData, EngineConfig, SequentialEngine, make_lr_schedule  # noqa: E402
from network.sampling import client_seed, sample_clients  # noqa: E402
from tests.fixtures import tiny_data_root, tiny_manifest  # noqa: E402,F401  (session fixtures)
from utils.errors import TaskHetError  # noqa: E402
from utils.run_dir import load_checkpoint  # noqa: E402
from tests.tiny_models import TinyNet, client_samples, evaluate, loss_fn

CPU = torch.device("cpu")
NUM_CLIENTS = 4
SEED = 11
ROOT = Path(__file__).resolve().parent.parent


def train_batches(data: list[dict], seed: int, fail_seeds: frozenset[int] = frozenset()) -> list[dict]:
    """A client's shuffled batches; raises for the seeds in ``fail_seeds`` (a client that breaks)."""
    if seed in fail_seeds:
        raise RuntimeError("the client's disk is gone")
    return list(DataLoader(data, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(seed)))


def make_clients(failing: dict[str, frozenset[int]] | None = None, only: list[str] | None = None) -> list[ClientData]:
    clients = []
    for index in range(NUM_CLIENTS):
        client_id = str(index)
        data = client_samples(index, 20 + 4 * index)
        loader = partial(train_batches, data[:-6], fail_seeds=(failing or {}).get(client_id, frozenset()))
        clients.append(ClientData(client_id, len(data) - 6, loader, list(DataLoader(data[-6:], batch_size=6))))
    return [client for client in clients if only is None or client.client_id in only]


def global_test() -> list[dict]:
    return list(DataLoader([sample for index in range(NUM_CLIENTS) for sample in client_samples(index, 30)[20:]],
                           batch_size=16))


def engine_inputs(out_dir: Path, name: str, rounds: int, clients: list[ClientData], fraction: float) -> tuple:
    torch.manual_seed(0)
    algorithm = get_algorithm(name, AlgorithmConfig(num_clients=NUM_CLIENTS))
    config = EngineConfig(out_dir=out_dir, n_rounds=rounds, lr_schedule=make_lr_schedule("constant", 0.05, rounds),
                          seed=SEED, local_steps=3, client_fraction=fraction, momentum=0.5, progress=False,
                          signature={"test": name})
    return TinyNet(), algorithm, clients, loss_fn, evaluate, global_test(), config, CPU


def run_sequential(out_dir: Path, name: str, rounds: int, fraction: float = 0.75, only: list[str] | None = None):
    return SequentialEngine(*engine_inputs(out_dir, name, rounds, make_clients(only=only), fraction)).run()


def run_simulated(out_dir: Path, name: str, rounds: int, fraction: float = 0.75, clients=None, **options):
    inputs = engine_inputs(out_dir, name, rounds, clients or make_clients(), fraction)
    return run_flower(*inputs, logger=logging.getLogger("flower_test"), options=FlowerOptions(**options))


def assert_close_weights(first: dict, second: dict) -> None:
    assert first.keys() == second.keys()
    for key in first:
        assert torch.allclose(first[key].float(), second[key].float(), rtol=1e-5, atol=1e-6), key


def assert_same_metrics(first: Path, second: Path, last_round: int | None = None) -> None:
    one, two = (pd.read_csv(path / "metrics.csv", dtype={"client": str}) for path in (first, second))
    if last_round is not None:
        one, two = one[one["round"] <= last_round], two[two["round"] <= last_round]
    columns = ["round", "split", "client", "metric"]
    assert one[columns].values.tolist() == two[columns].values.tolist()
    assert torch.allclose(torch.tensor(one.value.values), torch.tensor(two.value.values), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name, num_nodes", [("fedavg", None), ("fedrep", 2)])
def test_simulation_reproduces_the_sequential_engine(tmp_path, name, num_nodes):
    reference = run_sequential(tmp_path / "sequential", name, rounds=2)
    engine = run_simulated(tmp_path / "flower", name, rounds=2, num_nodes=num_nodes)
    assert_close_weights(reference, engine.global_weights)
    assert_same_metrics(tmp_path / "sequential", tmp_path / "flower")
    metrics = pd.read_csv(tmp_path / "flower" / "metrics.csv", dtype={"client": str})
    assert set(metrics.split) >= {"train", "test", "client_test"}
    if name == "fedrep":  # personal heads live on the nodes and were evaluated there
        assert (metrics.split == "client_test_personal").any()
        heads = list((tmp_path / "flower" / "node_states").glob("*/client_*/round_2.pt"))
        assert heads and all(set(load_checkpoint(path)) == {"head.weight", "head.bias"} for path in heads)
    assert load_checkpoint(tmp_path / "flower" / "checkpoint.pt")["client_states"] == {}


def test_scaffold_failed_round_is_named_and_resume_uses_node_state_of_the_checkpoint(tmp_path):
    last = sample_clients([str(index) for index in range(NUM_CLIENTS)], 0.75, SEED, 3)[-1]
    breaking = make_clients(failing={last: frozenset({client_seed(SEED, 3, last)})})
    with pytest.raises(ClientFailure, match=rf"round 3: client {last}: RuntimeError: the client's disk is gone.*"
                                            r"last good checkpoint .*round 2"):
        run_simulated(tmp_path / "flower", "scaffold", rounds=3, clients=breaking, num_nodes=2)
    checkpoint = load_checkpoint(tmp_path / "flower" / "checkpoint.pt")
    assert checkpoint["round"] == 2
    # The first two rounds are the 4-clients × 2-rounds comparison, SCAFFOLD's c and c_i included.
    reference = run_sequential(tmp_path / "sequential_2", "scaffold", rounds=2)
    assert_close_weights(reference, checkpoint["model"])
    assert_same_metrics(tmp_path / "sequential_2", tmp_path / "flower")
    sequential_state = load_checkpoint(tmp_path / "sequential_2" / "checkpoint.pt")
    assert_close_weights(sequential_state["server_state"], checkpoint["server_state"])
    # The clients before the failing one finished round 3 on their nodes; the resumed round must not read that.
    assert list((tmp_path / "flower" / "node_states").glob("*/client_*/round_3.pt"))

    resumed = run_simulated(tmp_path / "flower", "scaffold", rounds=3, num_nodes=2)
    reference = run_sequential(tmp_path / "sequential_3", "scaffold", rounds=3)
    assert_close_weights(reference, resumed.global_weights)
    assert_same_metrics(tmp_path / "sequential_3", tmp_path / "flower")


def test_min_available_clients_drops_a_failing_client_by_name(tmp_path, caplog):
    failing = make_clients(failing={"2": frozenset(client_seed(SEED, r, "2") for r in (1, 2))})
    with caplog.at_level(logging.WARNING, logger="flower_test"):
        engine = run_simulated(tmp_path / "flower", "fedavg", rounds=2, fraction=1.0, clients=failing,
                               min_available_clients=3)
    warnings = [record.getMessage() for record in caplog.records if record.name == "flower_test"]
    assert sum("client 2 failed (RuntimeError: the client's disk is gone)" in text for text in warnings) == 2
    reference = run_sequential(tmp_path / "sequential", "fedavg", rounds=2, fraction=1.0, only=["0", "1", "3"])
    assert_close_weights(reference, engine.global_weights)
    metrics = pd.read_csv(tmp_path / "flower" / "metrics.csv", dtype={"client": str})
    assert "2" not in set(metrics[metrics.split == "train"].client)
    assert "2" in set(metrics[metrics.split == "client_test"].client)  # it still evaluates


def test_node_state_store_reads_the_state_from_before_the_round(tmp_path):
    store = NodeStateStore(tmp_path)
    assert store.latest("a", 5) is None
    store.put("a", 1, {})  # stateless: no file
    assert not (tmp_path / "client_a").exists()
    for round_index in (1, 3, 4):
        store.put("a", round_index, {"c": torch.tensor([float(round_index)])})
    assert store.latest("a", 3)["c"].item() == 3.0 and store.latest("a", 9)["c"].item() == 4.0
    assert store.latest("a", 2) is None  # round 1 was dropped once round 3 had a successor
    store.put("a", 4, {"c": torch.tensor([40.0])})  # round 4 redone: reads round 3, rewrites 4
    assert sorted(path.name for path in (tmp_path / "client_a").iterdir()) == ["round_3.pt", "round_4.pt"]
    store.clear("a")
    assert store.latest("a", 9) is None


def test_bad_options_are_refused_before_anything_starts(tmp_path):
    inputs = engine_inputs(tmp_path, "fedavg", 1, make_clients(), 0.5)
    for options, flag in ((FlowerOptions(mode="deployment"), "--flower_mode"),
                          (FlowerOptions(num_cpus=0), "--flower_num_cpus"),
                          (FlowerOptions(min_available_clients=3), "--min_available_clients"),
                          (FlowerOptions(num_nodes=9), "simulated nodes")):
        with pytest.raises(TaskHetError, match=flag):
            run_flower(*inputs, options=options)
    if not torch.cuda.is_available():
        with pytest.raises(TaskHetError, match="--flower_num_gpus"):
            run_flower(*inputs, options=FlowerOptions(num_gpus=0.5))


def test_a_deployed_node_builds_only_its_clients_exactly_as_test_fed_does(tiny_data_root, tiny_manifest,  # noqa: F811
                                                                          tmp_path):
    import test_fed
    from flwr.app import Context, RecordDict

    from datasets.taskonomy import read_manifest
    from models import get_task
    from network import flower_app
    from partitioning.assignments import load_assignments, write_assignments

    train = read_manifest(tiny_manifest).query("split == 'train'").sort_values("sample_id").reset_index(drop=True)
    table = pd.DataFrame({"sample_id": train["sample_id"], "client_id": train.index % 3, "group": train["scene_class"],
                          "subset": ["test" if index % 4 == 3 else "train" for index in train.index]})
    write_assignments(tmp_path / "assignments.csv", table, {"scheme": "round_robin", "n_clients": 3,
                                                           "groups": "scene_class"})
    argv = ["--task", "depth_euclidean", "--data_path", str(tiny_data_root), "--manifest", str(tiny_manifest),
            "--assignments", str(tmp_path / "assignments.csv"), "--encoder", "small_cnn", "--image_size", "32",
            "--batch_size", "2", "--no-use_accelerator", "--out", str(tmp_path / "run")]

    def node(partition_ids: str) -> Context:
        return Context(run_id=1, node_id=7, node_config={"partition-ids": partition_ids, "state-dir": str(tmp_path)},
                       state=RecordDict(), run_config={"test-fed-args": " ".join(argv)})

    host = flower_app.build_node(node("2, 0"))
    assert sorted(host.clients) == ["0", "2"] and host.state_dir == tmp_path
    args = test_fed.build_parser().parse_args(argv)
    manifest = read_manifest(tiny_manifest)
    reference, _ = test_fed.build_clients(test_fed.resolve(args, load_assignments(args.assignments, manifest)[1]),
                                          manifest, load_assignments(args.assignments, manifest)[0],
                                          get_task("depth_euclidean"))
    reference = {client.client_id: client for client in reference}
    for client_id, mine in host.clients.items():
        expected = reference[client_id]
        assert mine.num_samples == expected.num_samples > 0
        for first, second in ((mine.train_loader(5), expected.train_loader(5)),
                              (mine.test_loader, expected.test_loader)):
            assert [batch["sample_id"] for batch in first] == [batch["sample_id"] for batch in second]
    with pytest.raises(TaskHetError, match="partition-ids lists client.*9"):
        flower_app.build_node(node("0,9"))
    assert not (tmp_path / "run").exists()  # a node writes nothing into the run folder


def test_the_sequential_path_never_imports_flower():
    code = ("import sys, test_fed, network.engine_sequential, network.algorithms; "
            "assert not {'flwr', 'ray'} & set(sys.modules), sorted({'flwr', 'ray'} & set(sys.modules))")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
