"""Private aggregation weights (network/aggregation.py): ``bucketed`` and ``noisy`` sizes by hand, the server means
they give every model-averaging method, and what leaves a client in both engines: the bucketed or noisy size, never
the exact one (the sequential engine's uploads, and the Flower replies after a trip through Flower's wire format)."""

from __future__ import annotations

import copy
import logging
from functools import partial

import numpy as np
import pytest
import torch

from network.aggregation import (WeightingSettings, bucketed_size, client_weights, federation_shares, noisy_size,
                                 reported_size)
from network.algorithms import build_algorithm
from network.algorithms.base import Upload
from network.engine_sequential import EngineConfig, SequentialEngine
from network.lr_schedule import make_lr_schedule
from tests.test_aggregation import _uniform_upload
from tests.tiny_models import TinyNet, evaluate, loss_fn
from utils.errors import TaskHetError
from utils.seeding import derive_seed

# The methods whose uploads tests.test_aggregation builds; every other one is checked by
# test_every_algorithm_with_a_weighting_reports_and_weighs_the_bucketed_sizes (and CFL by hand below).
METHODS = ["fedavg", "fedprox", "ditto", "fedrep", "fedper", "fedbn", "scaffold", "sparse_ft"]
SIZES = {"0": 70, "1": 20, "2": 6, "3": 4}
# buckets 5, 10, 50: reported 50, 10, 5, 5 (4 is below the smallest edge)
BUCKETS, BUCKETED = "5,10,50", {"0": 50, "1": 10, "2": 5, "3": 5}


def test_bucketed_sizes_round_down_to_a_published_edge_by_hand():
    edges = (10, 100, 1000, 10000)
    sizes = [1, 9, 10, 11, 99, 100, 999, 5000, 10000, 123456]
    # below the smallest edge: the smallest edge; else the largest edge <= the size
    assert [bucketed_size(size, edges) for size in sizes] == [10, 10, 10, 10, 10, 100, 100, 1000, 10000, 10000]
    assert bucketed_size(0, edges) == 0  # a client that holds nothing this round reports nothing
    settings = WeightingSettings(weighting="bucketed", buckets="5,50")
    assert settings.bucket_edges == (5, 50)
    assert [reported_size(settings, 0, "a", size) for size in (3, 7, 49, 50, 51)] == [5, 5, 5, 50, 50]


def test_noisy_sizes_are_laplace_draws_seeded_by_run_client_and_size():
    settings = WeightingSettings(weighting="noisy", noise_scale=10.0)
    draw = np.random.default_rng(derive_seed(3, "noisy_size", "a", 500)).laplace(0.0, 10.0)
    assert reported_size(settings, 3, "a", 500) == max(1, round(500 + draw))
    # the same every call (every round, both engines, a resume); another client, size or seed draws anew
    assert reported_size(settings, 3, "a", 500) == reported_size(settings, 3, "a", 500)
    others = {reported_size(settings, 3, "b", 500), reported_size(settings, 4, "a", 500),
              reported_size(settings, 3, "a", 501) - 1}
    assert len(others | {reported_size(settings, 3, "a", 500)}) > 1
    # the floor keeps every weight positive; nothing stays nothing
    assert noisy_size(1, 1e6, np.random.default_rng(0)) >= 1 and noisy_size(0, 10.0, np.random.default_rng(0)) == 0
    assert reported_size(WeightingSettings(weighting="noisy", noise_scale=1e-6), 0, "a", 77) == 77


def test_noisy_sizes_spread_as_laplace_of_the_given_scale():
    """Laplace(0, b) has mean 0 and mean absolute value b (a Gaussian of σ = b would give 0.80·b): over 4,000
    clients the sample means are within 4 standard errors (b·√2/√4000 and b/√4000)."""
    settings = WeightingSettings(weighting="noisy", noise_scale=20.0)
    noise = np.array([reported_size(settings, 1, str(client), 10_000) - 10_000 for client in range(4000)], dtype=float)
    assert abs(noise.mean()) < 4 * 20.0 * np.sqrt(2) / np.sqrt(4000)
    assert abs(np.abs(noise).mean() - 20.0) < 4 * 20.0 / np.sqrt(4000)


@pytest.mark.parametrize("settings, message", [
    (dict(buckets="100,10"), r"setting buckets must be 1 to 64 increasing integers .* got '100,10'"),
    (dict(buckets="ten"), r"setting buckets must be .* got 'ten'"),
    (dict(noise_scale=-1.0), r"setting noise_scale must be > 0, got -1.0"),
    (dict(weighting="rounded"), r"setting weighting must be one of samples, uniform, capped, bucketed, noisy"),
])
def test_bad_private_weighting_settings_are_one_error_naming_the_setting(settings, message):
    with pytest.raises(TaskHetError, match=message):
        build_algorithm("fedavg", TinyNet(), {"a": 10}, settings)


def test_a_bad_buckets_value_from_the_command_line_names_the_algorithm():
    from network.settings import build_settings
    from network.aggregation import ServerOptSettings

    with pytest.raises(TaskHetError, match=r"^fedavg setting noise_scale must be a finite float, got 'inf'$"):
        build_settings(ServerOptSettings, {"noise_scale": "inf"}, "fedavg")
    with pytest.raises(TaskHetError, match=r"^fedavg setting buckets must be a str, got 10$"):
        build_settings(ServerOptSettings, {"buckets": 10}, "fedavg")


def test_shares_of_the_reported_sizes_by_hand():
    sizes = {"a": 5, "b": 50, "c": 500, "d": 5000, "e": 20000}
    shares = federation_shares(WeightingSettings(weighting="bucketed"), sizes, seed=0)
    # reported: 10, 10, 100, 1000, 10000 (sum 11,120)
    assert shares == pytest.approx({"a": 10 / 11120, "b": 10 / 11120, "c": 100 / 11120, "d": 1000 / 11120,
                                    "e": 10000 / 11120}, rel=1e-15)
    assert federation_shares(WeightingSettings(), sizes, seed=0) == client_weights(sizes, "samples")  # exact


@pytest.mark.parametrize("name", METHODS)
def test_every_model_averaging_method_weighs_uploads_by_the_reported_sizes(name):
    deltas = {"0": 1.0, "1": 2.0, "2": 4.0, "3": 8.0}
    expected = {"all": (50 * 1 + 10 * 2 + 5 * 4 + 5 * 8) / 70, "partial": (50 * 1 + 5 * 4 + 5 * 8) / 60}
    algorithm, worker = build_algorithm(name, TinyNet(), SIZES, {"weighting": "bucketed", "buckets": BUCKETS})
    server = algorithm.init_server({key: value.clone() for key, value in worker.state_dict().items()})
    key = "body.0.weight"
    for clients, value in ((list(SIZES), expected["all"]), (["0", "2", "3"], expected["partial"])):
        uploads = [Upload(client, _uniform_upload(algorithm, server, deltas[client]), BUCKETED[client])
                   for client in clients]
        new = algorithm.aggregate(server, uploads).models["global"][key]
        assert torch.allclose(new - server.models["global"][key], torch.full_like(new, value), rtol=1e-6), clients


def weighted_algorithms() -> list[str]:
    from network.algorithms import list_algorithms
    from network.algorithms.base import get_settings_class
    from network.settings import describe

    return [name for name in list_algorithms() if "weighting" in {info.name for info in describe(get_settings_class(name))}]


@pytest.mark.parametrize("name", weighted_algorithms())
def test_every_algorithm_with_a_weighting_reports_and_weighs_the_bucketed_sizes(name):
    from tests.tiny_models import tiny_model_for

    algorithm, _ = build_algorithm(name, tiny_model_for(name), SIZES, {"weighting": "bucketed", "buckets": BUCKETS})
    assert {client: algorithm.reported_num_samples(client, size) for client, size in SIZES.items()} == BUCKETED
    assert algorithm.shares == pytest.approx({client: size / 70 for client, size in BUCKETED.items()}, rel=1e-15)
    if hasattr(algorithm, "upload_weight"):  # the model-averaging skeleton: the upload's own (reported) size
        assert [algorithm.upload_weight(Upload(client, {}, size)) for client, size in BUCKETED.items()] == [50, 10, 5, 5]


def test_the_list_of_weighted_algorithms_is_every_model_averaging_one():
    assert {"fedavg", "scaffold", "cfl", "sparse_ft", "fedem", "pfedme", "mocha", "fedloge", "fedrod",
            "fedbabu"} <= set(weighted_algorithms())


def test_cfl_weighs_a_clusters_members_by_their_bucketed_sizes_by_hand():
    from network.algorithms.cfl import CLUSTER, MODEL
    from network.algorithms.skeleton import DELTA
    from tests.oracles import DIM, linear_model

    algorithm, _ = build_algorithm("cfl", linear_model(), {"0": 70, "1": 20},
                                   {"weighting": "bucketed", "buckets": BUCKETS, "start_round": 100})
    server = algorithm.init_server({"weight": torch.zeros(1, DIM, dtype=torch.float64)})
    uploads = [Upload(client, {DELTA: {"weight": torch.full((1, DIM), value, dtype=torch.float64)},
                               CLUSTER: {"id": torch.tensor(0)}}, BUCKETED[client]) for client, value in (("0", 1.0), ("1", 3.0))]
    cluster = algorithm.client_broadcast(algorithm.aggregate(server, uploads), {}, "0")[MODEL]["weight"]
    assert torch.allclose(cluster, torch.full((1, DIM), (50 * 1.0 + 10 * 3.0) / 60, dtype=torch.float64))


def test_noisy_weights_by_hand_for_fedavg():
    sizes = {"0": 70, "1": 20}
    algorithm, worker = build_algorithm("fedavg", TinyNet(), sizes, {"weighting": "noisy", "noise_scale": 3.0}, seed=9)
    noisy = {client: max(1, round(size + np.random.default_rng(derive_seed(9, "noisy_size", client, size))
                                  .laplace(0.0, 3.0))) for client, size in sizes.items()}
    server = algorithm.init_server({key: value.clone() for key, value in worker.state_dict().items()})
    uploads = [Upload(client, _uniform_upload(algorithm, server, delta), algorithm.reported_num_samples(client, sizes[client]))
               for client, delta in (("0", 1.0), ("1", 2.0))]
    assert [upload.num_samples for upload in uploads] == [noisy["0"], noisy["1"]]
    new = algorithm.aggregate(server, uploads).models["global"]["body.0.weight"]
    expected = (noisy["0"] * 1.0 + noisy["1"] * 2.0) / (noisy["0"] + noisy["1"])
    assert torch.allclose(new - server.models["global"]["body.0.weight"], torch.full_like(new, expected), rtol=1e-6)


# ----- what leaves a client: both engines, instrumented -----
PRIVATE = {"samples": {}, "bucketed": {"buckets": "10,20"}, "noisy": {"noise_scale": 10.0}}
SEED = 2  # its noisy draws move every size of the four clients (expected_sizes checks it)


def federation(weighting: str, out_dir, vectorize_chunk: int = 0):
    """The engine tests' four clients (14, 18, 22, 26 training samples), FedAvg under ``weighting``, 2 rounds."""
    from tests.test_engine_flower import global_test, make_clients

    clients = make_clients()
    torch.manual_seed(0)
    net = TinyNet()
    if vectorize_chunk:  # lock-step clients cannot draw dropout as the sequential engine does (network/vectorized.py)
        net.body[3] = torch.nn.Identity()
    algorithm, model = build_algorithm("fedavg", net, {client.client_id: client.num_samples for client in clients},
                                       {"weighting": weighting, **PRIVATE[weighting]}, seed=SEED)
    config = EngineConfig(out_dir=out_dir, n_rounds=2, lr_schedule=make_lr_schedule("constant", 0.05, 2), seed=SEED,
                          local_steps=3, client_fraction=1.0, progress=False, signature={"test": weighting},
                          vectorize_chunk=vectorize_chunk, plots=False)
    return model, algorithm, clients, config, global_test()


def spy_on_aggregate(algorithm) -> list[tuple[str, int]]:
    """Every (client, size) the server half receives."""
    seen, aggregate = [], algorithm.aggregate

    def recording(server, uploads):
        def passing():
            for upload in uploads:
                seen.append((upload.client_id, upload.num_samples))
                yield upload
        return aggregate(server, passing())

    algorithm.aggregate = recording
    return seen


def expected_sizes(algorithm, clients) -> dict[str, int]:
    exact = {client.client_id: client.num_samples for client in clients}
    reported = {client_id: reported_size(algorithm.settings, SEED, client_id, size) for client_id, size in exact.items()}
    if algorithm.settings.weighting != "samples":  # this seed moves every size (the check below could not tell else)
        assert all(reported[client_id] != exact[client_id] for client_id in exact), reported
    return reported


@pytest.mark.parametrize("weighting", list(PRIVATE))
@pytest.mark.parametrize("vectorize_chunk", [0, 2])
def test_the_sequential_engine_uploads_only_the_reported_size(tmp_path, weighting, vectorize_chunk):
    model, algorithm, clients, config, test = federation(weighting, tmp_path, vectorize_chunk)
    seen = spy_on_aggregate(algorithm)
    SequentialEngine(model, algorithm, clients, loss_fn, evaluate, test, config, torch.device("cpu")).run()
    reported = expected_sizes(algorithm, clients)
    assert len(seen) == 2 * len(clients) and all(size == reported[client] for client, size in seen)
    if weighting != "samples":
        exact = {client.client_id: client.num_samples for client in clients}
        assert not any(size == exact[client] for client, size in seen)


@pytest.mark.parametrize("weighting", list(PRIVATE))
def test_a_flower_reply_carries_only_the_reported_size(tmp_path, weighting):
    pytest.importorskip("flwr")
    from flwr.app import ConfigRecord

    from network.flower import protocol
    from network.flower.node import NodeHost, make_client_app
    from network.flower.server import FlowerEngine
    from network.flower.simulation import node_share
    from tests.test_engine_flower import InProcessGrid, node_contexts

    class RecordingGrid(InProcessGrid):
        """Keeps the size of every train reply (``sizes``), as it crossed Flower's wire format."""

        def push_messages(self, messages):
            ids = super().push_messages(messages)
            for message_id in ids:
                content = self.replies[message_id].content
                reply = content.get(protocol.REPLY_RECORD)
                if isinstance(reply, ConfigRecord) and protocol.NUM_SAMPLES in reply:
                    self.sizes.append((str(reply[protocol.CLIENT_ID]), int(reply[protocol.NUM_SAMPLES])))
                    assert set(content[protocol.TRAIN_METRICS_RECORD]) == {"train_loss", "local_steps"}
            return ids

    with _task_identity():
        model, algorithm, clients, config, test = federation(weighting, tmp_path)
        host = NodeHost(copy.deepcopy(model), copy.deepcopy(algorithm), {client.client_id: client for client in clients},
                        loss_fn, evaluate, torch.device("cpu"), tmp_path / "node_states")
        grid = RecordingGrid(make_client_app(partial(node_share, host)), node_contexts(2))
        grid.sizes = []
        seen = spy_on_aggregate(algorithm)
        FlowerEngine(grid, model, algorithm, [client.client_id for client in clients], evaluate, test, config,
                     torch.device("cpu"), logger=logging.getLogger("private_weights")).run()
    reported = expected_sizes(algorithm, clients)
    assert len(grid.sizes) == 2 * len(clients) and all(size == reported[client] for client, size in grid.sizes)
    assert sorted(seen) == sorted(grid.sizes)  # the server aggregates exactly what crossed the wire
    if weighting != "samples":
        exact = {client.client_id: client.num_samples for client in clients}
        assert not any(size == exact[client] for client, size in grid.sizes)


def _task_identity():
    """Flower's Message reads the sending task's identity from a class that a ServerApp process sets."""
    import contextlib

    from flwr.supercore.task_identity import TaskIdentity

    @contextlib.contextmanager
    def identity():
        saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
        try:
            yield
        finally:
            TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved

    return identity()
