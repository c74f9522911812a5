"""The Flower engine reproduces the sequential engine (network/flower/).

Ray takes seconds to start, so only two tests run Flower's real simulation runtime
(FedAvg, and FedRep on two nodes with evaluation-time fine-tuning). Every other test
drives the real ``FlowerEngine`` and the real ``ClientApp`` through :class:`InProcessGrid`:
a Grid that hands each message to the ClientApp in this process, after a round trip
through Flower's wire format (protobuf) in both directions, so the records, the
protocol module and the node code are those of a deployment; only Ray and the
SuperLink are left out. Over that grid, every registered algorithm is compared with the
sequential engine (every server model and metrics.csv), and failures, resume and
min_available_clients are checked.
"""

from __future__ import annotations

import copy
import json
import logging
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Iterable
from uuid import uuid4

import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("flwr")
pytest.importorskip("ray")

from flwr.app import ConfigRecord, Context, Message, RecordDict  # noqa: E402
from flwr.common import serde  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from network.algorithms import build_algorithm, list_algorithms  # noqa: E402
from network.client import CLIENT_TEST_SPLIT, FINETUNED_TEST_SPLIT, PERSONAL_TEST_SPLIT, ClientData, ClientFailure  # noqa: E402
from network.engine_sequential import EngineConfig, SequentialEngine  # noqa: E402
from network.lr_schedule import make_lr_schedule  # noqa: E402
from network.flower import protocol  # noqa: E402
from network.flower.node import NodeHost, NodeStateStore, make_client_app  # noqa: E402
from network.flower.server import FlowerEngine  # noqa: E402
from network.flower.simulation import FlowerOptions, node_share, run_flower  # noqa: E402
from network.sampling import client_seed, sample_clients  # noqa: E402
from tests.fixtures import tiny_data_root, tiny_manifest  # noqa: E402,F401  (session fixtures)
from tests.tiny_models import FAST_SETTINGS, class_counts, client_samples, evaluate, loss_fn, tiny_model_for  # noqa: E402
from utils.errors import TaskHetError  # noqa: E402
from utils.run_dir import load_checkpoint  # noqa: E402

CPU = torch.device("cpu")
NUM_CLIENTS = 4
NO_TEST_CLIENT = "3"  # a client without held-out samples (evaluate_client gives it no rows)
SEED = 11
ROOT = Path(__file__).resolve().parent.parent
LOGGER = "flower_test"


# ----- an in-process Grid over Flower's wire format -----
def over_the_wire(message: Message) -> Message:
    """``message`` as the other side receives it: serialised to Flower's protobuf and back."""
    return serde.message_from_proto(serde.message_to_proto(message))


class InProcessGrid:
    """The Grid calls ``FlowerEngine`` makes, answered at once by ``client_app`` for nodes ``contexts``."""

    def __init__(self, client_app, contexts: dict[int, Context]) -> None:
        self.client_app, self.contexts = client_app, contexts
        self.replies: dict[str, Message] = {}

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = str(uuid4())  # as Flower's InMemoryGrid does
            reply = self.client_app(over_the_wire(message), self.contexts[message.metadata.dst_node_id])
            self.replies[message.metadata.message_id] = over_the_wire(reply)
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self.replies.pop(message_id) for message_id in message_ids if message_id in self.replies]


@pytest.fixture(autouse=True)
def task_identity():
    """Flower's Message reads the sending task's identity from a class; a ServerApp process sets it."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def node_contexts(num_nodes: int, **node_config) -> dict[int, Context]:
    return {100 + index: Context(run_id=1, node_id=100 + index, state=RecordDict(), run_config={},
                                 node_config={protocol.PARTITION_ID: index, protocol.NUM_PARTITIONS: num_nodes,
                                              **node_config})
            for index in range(num_nodes)}


# ----- the federation of the tests -----
def train_batches(data: list[dict], seed: int, fail_seeds: frozenset[int] = frozenset()) -> list[dict]:
    """A client's shuffled batches; raises for the seeds in ``fail_seeds`` (a client that breaks)."""
    if seed in fail_seeds:
        raise RuntimeError("the client's disk is gone")
    return list(DataLoader(data, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(seed)))


def make_clients(failing: dict[str, frozenset[int]] | None = None, only: list[str] | None = None) -> list[ClientData]:
    """Four clients of unequal sizes (14, 18, 22, 26 training samples); client 3 has no test samples."""
    clients = []
    for index in range(NUM_CLIENTS):
        client_id = str(index)
        data = client_samples(index, 20 + 4 * index)
        loader = partial(train_batches, data[:-6], fail_seeds=(failing or {}).get(client_id, frozenset()))
        test = None if client_id == NO_TEST_CLIENT else list(DataLoader(data[-6:], batch_size=6))
        clients.append(ClientData(client_id, len(data) - 6, loader, test, class_counts(data[:-6])))
    return [client for client in clients if only is None or client.client_id in only]


def global_test() -> list[dict]:
    return list(DataLoader([sample for index in range(NUM_CLIENTS) for sample in client_samples(index, 30)[20:]],
                           batch_size=16))


def engine_inputs(out_dir: Path, name: str, rounds: int, clients: list[ClientData], fraction: float,
                  finetune_steps: int = 2, settings: dict | None = None, **config_extra) -> tuple:
    """The sequential engine's arguments: TinyNet (BatchNorm, dropout), momentum, fine-tuning at evaluation."""
    torch.manual_seed(0)
    algorithm, model = build_algorithm(name, tiny_model_for(name), {client.client_id: client.num_samples for client in clients},
                                       settings or FAST_SETTINGS.get(name), seed=SEED)
    config = EngineConfig(out_dir=out_dir, n_rounds=rounds, lr_schedule=make_lr_schedule("constant", 0.05, rounds),
                          seed=SEED, local_steps=3, client_fraction=fraction, momentum=0.5, progress=False,
                          signature={"test": name}, finetune_steps=finetune_steps,
                          **{"plots": False, **config_extra})  # pictures only where a test reads one
    return model, algorithm, clients, loss_fn, evaluate, global_test(), config, CPU


def run_sequential(out_dir: Path, name: str, rounds: int, fraction: float = 0.75,
                   only: list[str] | None = None, **config_extra) -> SequentialEngine:
    engine = SequentialEngine(*engine_inputs(out_dir, name, rounds, make_clients(only=only), fraction, **config_extra))
    engine.run()
    return engine


def run_in_process(out_dir: Path, name: str, rounds: int, fraction: float = 0.75, clients=None, num_nodes: int = 2,
                   min_available_clients: int | None = None, **config_extra) -> FlowerEngine:
    """The FlowerEngine over an InProcessGrid whose nodes host ``clients[p::num_nodes]``."""
    model, algorithm, clients, loss, evaluate_fn, test, config, device = engine_inputs(
        out_dir, name, rounds, clients or make_clients(), fraction, **config_extra)
    # The nodes get their own copies, as Ray workers do: nothing may pass between server and nodes but messages.
    host = NodeHost(copy.deepcopy(model), copy.deepcopy(algorithm), {client.client_id: client for client in clients},
                    loss, evaluate_fn, device, out_dir / "node_states")
    grid = InProcessGrid(make_client_app(partial(node_share, host)), node_contexts(num_nodes))
    engine = FlowerEngine(grid, model, algorithm, [client.client_id for client in clients], evaluate_fn, test, config,
                          device, logger=logging.getLogger(LOGGER), min_available_clients=min_available_clients,
                          node_wait_s=1.0)
    engine.run()
    return engine


# ----- comparisons -----
def assert_close_weights(first: dict, second: dict) -> None:
    assert first.keys() == second.keys()
    for key in first:
        assert torch.allclose(first[key].float(), second[key].float(), rtol=1e-5, atol=1e-6), key


def assert_same_server(first: FlowerEngine | SequentialEngine, second: FlowerEngine | SequentialEngine) -> None:
    """Every server model and every other server tensor agree."""
    assert first.server.models.keys() == second.server.models.keys()
    for name in first.server.models:
        assert_close_weights(first.server.models[name], second.server.models[name])
    assert_close_weights(first.server.tensors, second.server.tensors)


def assert_same_metrics(first: Path, second: Path) -> None:
    one, two = (pd.read_csv(path / "metrics.csv", dtype={"client": str}) for path in (first, second))
    columns = ["round", "split", "client", "metric"]
    assert one[columns].values.tolist() == two[columns].values.tolist()
    assert torch.allclose(torch.tensor(one.value.values), torch.tensor(two.value.values), rtol=1e-5, atol=1e-7,
                          equal_nan=True)  # NaN where a metric is undefined (an empty class group) on both sides


def metrics_of(out_dir: Path) -> pd.DataFrame:
    return pd.read_csv(out_dir / "metrics.csv", dtype={"client": str})


# ----- every algorithm over the real ClientApp and protocol -----
@pytest.mark.kernels
@pytest.mark.parametrize("name", list_algorithms())
def test_every_algorithm_over_flower_messages_equals_the_sequential_engine(tmp_path, name):
    reference = run_sequential(tmp_path / "sequential", name, rounds=3)
    engine = run_in_process(tmp_path / "flower", name, rounds=3)
    assert_same_server(reference, engine)
    assert_same_metrics(tmp_path / "sequential", tmp_path / "flower")
    metrics = metrics_of(tmp_path / "flower")
    finetuned = metrics[metrics.split == FINETUNED_TEST_SPLIT]
    assert set(finetuned.client) >= {"0", "1", "2"} and NO_TEST_CLIENT not in set(metrics[
        metrics.split == CLIENT_TEST_SPLIT].client)
    assert (metrics.split == PERSONAL_TEST_SPLIT).any() == engine.algorithm.personalized
    assert load_checkpoint(tmp_path / "flower" / "checkpoint.pt")["client_states"] == {}  # state stays on nodes


def test_client_level_dp_clips_on_the_nodes_and_both_engines_add_the_same_noise_and_report_the_same_epsilon(tmp_path):
    """The nodes clip (the C they receive with the model), the server adds its one draw: the Flower run's models and
    every metrics.csv row, ε and C's adaptive path included, are the sequential run's."""
    from network.privacy import PrivacySettings

    privacy = PrivacySettings(0.5, 0.8, adaptive_quantile=0.5, count_noise=2.0, delta=1e-3)
    settings = {"weighting": "uniform"}
    reference = run_sequential(tmp_path / "sequential", "scaffold", rounds=2, settings=settings, privacy=privacy)
    engine = run_in_process(tmp_path / "flower", "scaffold", rounds=2, settings=settings, privacy=privacy)
    assert_same_server(reference, engine)
    assert_same_metrics(tmp_path / "sequential", tmp_path / "flower")
    rows = metrics_of(tmp_path / "flower").query("split == 'privacy'")
    assert rows["round"].tolist().count(2) == 4 and rows.query("metric == 'dp_epsilon'")["value"].min() > 0


def test_unequal_local_work_reaches_each_node_and_equals_the_sequential_engine(tmp_path):
    budgets = {"0": 1, "1": 4, "2": 2, "3": 3}  # each client its own steps (network/local_work.py)
    reference = run_sequential(tmp_path / "sequential", "fedavg", rounds=2, client_steps=budgets)
    engine = run_in_process(tmp_path / "flower", "fedavg", rounds=2, client_steps=budgets)
    assert_same_server(reference, engine)
    assert_same_metrics(tmp_path / "sequential", tmp_path / "flower")
    steps = metrics_of(tmp_path / "flower").query("split == 'train' and metric == 'local_steps' and client != 'mean'")
    assert len(steps) >= 3 and all(value == budgets[client] for client, value in zip(steps.client, steps.value))


@pytest.mark.parametrize("name", ["fedavg", "fedper"])
def test_diagnostics_gradients_taken_on_the_nodes_equal_the_sequential_engines(tmp_path, name):
    """--diagnostics over Flower: each node takes its clients' gradients at the global model (fedper: its shared
    body only), every client of the federation, sampled or not, on a fixed sample of 10 rows."""
    options = {"diagnostics": True, "diagnostics_every": 2, "diagnostics_max_samples": 10, "plots": True}
    reference = run_sequential(tmp_path / "sequential", name, rounds=2, **{**options, "plots": False})
    flower = run_in_process(tmp_path / "flower", name, rounds=2, **options)
    assert_same_server(reference, flower)
    assert_same_metrics(reference.out_dir, flower.out_dir)
    metrics = metrics_of(flower.out_dir)
    gradients = metrics[(metrics.split == "diagnostics") & (metrics.metric == "grad_norm2")]
    assert gradients.groupby("round").client.apply(sorted).to_dict() == {0: ["0", "1", "2", "3"], 2: ["0", "1", "2", "3"]}
    assert (flower.out_dir / "diagnostics.png").is_file()


def test_a_bundle_survives_the_wire_with_its_empty_groups():
    bundle = {"global": {"w": torch.randn(2, 3), "n": torch.tensor(4)}, "control": {}, "id": {"id": torch.tensor(1)}}
    records, groups = protocol.bundle_records(protocol.BROADCAST_PREFIX, bundle)
    assert groups == ["global", "control", "id"] and "broadcast/control" not in records
    message = Message(RecordDict({**records, protocol.ORDERS_RECORD: ConfigRecord(
        {protocol.BUNDLE_GROUPS: groups})}), dst_node_id=1, message_type="train")
    message.metadata.__dict__["_message_id"] = "m"
    received = over_the_wire(message).content
    back = protocol.read_bundle(received, protocol.BROADCAST_PREFIX,
                                list(received[protocol.ORDERS_RECORD][protocol.BUNDLE_GROUPS]), CPU)
    assert list(back) == list(bundle) and back["control"] == {}
    for group in ("global", "id"):
        assert all(torch.equal(back[group][key], bundle[group][key]) and back[group][key].dtype == bundle[group][key].dtype
                   for key in bundle[group])
    with pytest.raises(TaskHetError, match="does not name"):
        protocol.read_bundle(received, protocol.BROADCAST_PREFIX, ["global"], CPU)


# ----- failures, resume, min_available_clients -----
def test_a_failed_round_is_named_and_resume_uses_node_state_of_the_checkpoint(tmp_path):
    last = sample_clients([str(index) for index in range(NUM_CLIENTS)], 0.75, SEED, 3)[-1]
    breaking = make_clients(failing={last: frozenset({client_seed(SEED, 3, last)})})
    with pytest.raises(ClientFailure, match=rf"round 3: client {last}: RuntimeError: the client's disk is gone.*"
                                            r"last good checkpoint .*round 2"):
        run_in_process(tmp_path / "flower", "scaffold", rounds=3, clients=breaking)
    assert load_checkpoint(tmp_path / "flower" / "checkpoint.pt")["round"] == 2
    # The clients before the failing one finished round 3 on their nodes; the resumed round must not read that.
    assert list((tmp_path / "flower" / "node_states").glob("*/client_*/round_3.pt"))
    resumed = run_in_process(tmp_path / "flower", "scaffold", rounds=3)
    reference = run_sequential(tmp_path / "sequential", "scaffold", rounds=3)
    assert_same_server(reference, resumed)
    assert_same_metrics(tmp_path / "sequential", tmp_path / "flower")


def test_min_available_clients_leaves_a_failing_client_out_and_logs_its_id(tmp_path, caplog):
    failing = make_clients(failing={"2": frozenset(client_seed(SEED, r, "2") for r in (1, 2))})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        engine = run_in_process(tmp_path / "flower", "fedavg", rounds=2, fraction=1.0, clients=failing,
                                min_available_clients=3)
    warnings = [record.getMessage() for record in caplog.records if record.name == LOGGER]
    assert sum("client 2 failed (RuntimeError: the client's disk is gone)" in text for text in warnings) == 2
    reference = run_sequential(tmp_path / "sequential", "fedavg", rounds=2, fraction=1.0, only=["0", "1", "3"])
    assert_close_weights(reference.global_weights, engine.global_weights)
    metrics = metrics_of(tmp_path / "flower")
    assert "2" not in set(metrics[metrics.split == "train"].client)
    assert "2" in set(metrics[metrics.split == CLIENT_TEST_SPLIT].client)  # it still evaluates
    with pytest.raises(ClientFailure, match=r"round 1: client 2: RuntimeError.*fewer than --min_available_clients 4"):
        run_in_process(tmp_path / "strict", "fedavg", rounds=1, fraction=1.0, clients=failing, min_available_clients=4)


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
                          (FlowerOptions(num_nodes=9), "--flower_num_nodes 9: the simulated nodes must be 1 to the run's 4 clients")):
        with pytest.raises(TaskHetError, match=flag):
            run_flower(*inputs, options=options)
    if not torch.cuda.is_available():
        with pytest.raises(TaskHetError, match="--flower_num_gpus"):
            run_flower(*inputs, options=FlowerOptions(num_gpus=0.5))


# Flower's simulation runtime (Ray): FedRep on 2 simulated nodes for 4 clients under every skew, through
# test_fed.py --flower_num_nodes, in tests/test_skews.py (a simulation starts Ray: about 25 s, so the suite has one).


# ----- the deployment app -----
def tiny_run_argv(tiny_data_root: Path, tiny_manifest: Path, tmp_path: Path) -> list[str]:  # noqa: F811
    """test_fed.py flags of a 3-client run on the tiny synthetic data."""
    from datasets.taskonomy import read_manifest
    from partitioning.assignments import write_assignments

    train = read_manifest(tiny_manifest).query("split == 'train'").sort_values("sample_id").reset_index(drop=True)
    table = pd.DataFrame({"sample_id": train["sample_id"], "client_id": train.index % 3, "group": train["scene_class"],
                          "subset": ["test" if index % 4 == 3 else "train" for index in train.index]})
    write_assignments(tmp_path / "assignments.csv", table, {"scheme": "round_robin", "n_clients": 3,
                                                           "groups": "scene_class"})
    return ["--task", "depth_euclidean", "--method", "fedrep", "--data_path", str(tiny_data_root),
            "--manifest", str(tiny_manifest), "--assignments", str(tmp_path / "assignments.csv"),
            "--encoder", "small_cnn", "--image_size", "32", "--batch_size", "2", "--local_steps", "2",
            "--n_rounds", "2", "--finetune_steps", "1", "--no-use_accelerator", "--no-progress"]


def test_a_deployed_node_builds_only_its_clients_exactly_as_a_local_run_does(tiny_data_root, tiny_manifest,  # noqa: F811
                                                                             tmp_path):
    from network.client_data import make_clients as local_clients
    from network.flower import app
    from network.run import prepare
    from steps.federated import parse_run_config

    argv = tiny_run_argv(tiny_data_root, tiny_manifest, tmp_path) + ["--out", str(tmp_path / "run")]
    moved = parse_run_config(argv).replace(data_path=tmp_path / "elsewhere")  # the server's path, not this node's

    def node(partition_ids: str) -> Context:
        return Context(run_id=1, node_id=7, state=RecordDict(), run_config={protocol.RUN_CONFIG: moved.to_json()},
                       node_config={"partition-ids": partition_ids, "state-dir": str(tmp_path),
                                    "data-path": str(tiny_data_root)})

    host = app.build_node(node("2, 0"))
    assert sorted(host.clients) == ["0", "2"] and host.state_dir == tmp_path
    setup = prepare(parse_run_config(argv))
    reference = {client.client_id: client for client in local_clients(setup.config, setup.manifest, setup.table,
                                                                       setup.task)}
    for client_id, mine in host.clients.items():
        expected = reference[client_id]
        assert mine.num_samples == expected.num_samples > 0
        for first, second in ((mine.train_loader(5), expected.train_loader(5)),
                              (mine.test_loader, expected.test_loader)):
            assert [batch["sample_id"] for batch in first] == [batch["sample_id"] for batch in second]
    with pytest.raises(TaskHetError, match="partition-ids lists client.*9"):
        app.build_node(node("0,9"))
    assert not (tmp_path / "run").exists()  # a node writes nothing into the run folder


def test_the_deployment_app_reproduces_a_local_sequential_run(tiny_data_root, tiny_manifest, tmp_path):  # noqa: F811
    from network.flower import app
    from network.run import prepare, run
    from steps.federated import parse_run_config

    argv = tiny_run_argv(tiny_data_root, tiny_manifest, tmp_path)
    run(prepare(parse_run_config(argv + ["--out", str(tmp_path / "sequential")])))
    config = parse_run_config(argv + ["--out", str(tmp_path / "flower"), "--engine", "flower"])
    line = app.run_config_toml(argv + ["--out", str(tmp_path / "flower"), "--engine", "flower"])
    assert line.startswith(f"{protocol.RUN_CONFIG} = ") and json.loads(line.split(" = ", 1)[1]) == config.to_json()
    server = Context(run_id=1, node_id=0, state=RecordDict(), node_config={},
                     run_config={protocol.RUN_CONFIG: config.to_json(), protocol.NODE_WAIT: 1.0})
    nodes = {node_id: Context(run_id=1, node_id=node_id, state=RecordDict(), run_config=server.run_config,
                              node_config={"partition-ids": ids, "state-dir": str(tmp_path / f"node{node_id}")})
             for node_id, ids in ((1, "0,2"), (2, "1"))}
    engine = app.build_engine(InProcessGrid(app.client_app, nodes), server)
    engine.run()
    assert_same_metrics(tmp_path / "sequential", tmp_path / "flower")
    assert (metrics_of(tmp_path / "flower").split == FINETUNED_TEST_SPLIT).any()


def test_the_sequential_path_never_imports_flower():
    code = ("import sys, test_fed, network.engine_sequential, network.algorithms, network.run; "
            "assert not {'flwr', 'ray'} & set(sys.modules), sorted({'flwr', 'ray'} & set(sys.modules))")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
