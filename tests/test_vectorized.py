"""Vectorised clients (network/vectorized.py, ``--vectorize_clients``) equal the sequential engine.

Generic over ``list_algorithms()``: every algorithm that declares ``vectorizable`` trains to the
same server models, client states and metrics.csv (allclose in float32) with unequal client
sizes (short last batches, so clients take differently shaped batches at the same step and,
with ``local_epochs``, different numbers of steps), partial participation, chunks that split
a round, momentum with weight decay and a BatchNorm model; every other algorithm is refused
with one line naming it. The functional SGD is checked against ``torch.optim.SGD`` for every
option combination.
"""

from __future__ import annotations

import itertools
import json
from functools import partial
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from network.algorithms import build_algorithm, list_algorithms
from network.algorithms.base import ALGORITHMS
from network.client import ClientData, ClientFailure
from network.engine_sequential import EngineConfig, SequentialEngine, check_vectorizable
from network.lr_schedule import make_lr_schedule
from network.sampling import client_seed, sample_clients
from network.algorithms.base import ClientConfig
from network.functional_sgd import SGDOptions, sgd_step
from network.vectorized import stack_weights, train_lockstep
import test_fed
from tests.fixtures import tiny_data_root, tiny_manifest  # noqa: F401  (session fixtures)
from tests.test_step4 import argv as step4_argv, assignments  # noqa: F401  (the step-4 fixture)
from tests.tiny_models import client_samples, evaluate, loss_fn, tiny_model_for
from utils.errors import NonFiniteLossError, TaskHetError
from utils.run_dir import load_checkpoint

CPU = torch.device("cpu")
LR = 0.01
SIZES = (9, 14, 22, 27, 34)  # training samples per client; batches of 6 leave short last batches of 3, 2, 4, 3, 4
SUPPORTED = [name for name in list_algorithms() if ALGORITHMS.get(name).vectorizable]
REFUSED = [name for name in list_algorithms() if not ALGORITHMS.get(name).vectorizable]
# Non-default settings whose client side differs from the defaults' (each needs its own functional form).
VARIANTS = [("fedprox", {"mu": 0.5}), ("fedrep", {"head_epochs": 2, "body_epochs": 1}),
            ("ditto", {"lam": 0.5, "prox_step": "implicit"}), ("ditto", {"lam": 0.5}), ("scaffold", {"option": "I"})]


class BatchNormNet(nn.Module):
    """tests.tiny_models.TinyNet without its dropout (a model with dropout is refused: see below)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, width),
                                  nn.BatchNorm1d(width), nn.ReLU())
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def head_keys(self) -> list[str]:
        return [key for key in self.state_dict() if key.startswith("head.")]


def train_batches(data: list[dict], seed: int) -> DataLoader:
    # A DataLoader, not a list: each new pass draws the next shuffle from the loader's own generator.
    return DataLoader(data, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(seed))


def cast(sample: dict, dtype: str) -> dict:
    """The sample's tensors in ``dtype`` (other values, such as its id, unchanged)."""
    return {key: value.to(getattr(torch, dtype)) if torch.is_tensor(value) else value for key, value in sample.items()}


def make_clients(dtype: str = "float32") -> list[ClientData]:
    clients = []
    for index, size in enumerate(SIZES):
        data = [cast(sample, dtype) for sample in client_samples(index, size + 4)]
        clients.append(ClientData(str(index), size, partial(train_batches, data[:size]),
                                  list(DataLoader(data[size:], batch_size=4))))
    return clients


def make_engine(out_dir: Path, name: str, settings: dict, chunk: int, rounds: int = 3, budget: str = "steps",
                model: nn.Module | None = None, dtype: str = "float32") -> SequentialEngine:
    torch.manual_seed(0)
    clients = make_clients(dtype)
    model = model or BatchNormNet().to(getattr(torch, dtype))
    algorithm, worker = build_algorithm(name, model, {c.client_id: c.num_samples for c in clients},
                                        settings, seed=3)
    local = {"local_steps": 4} if budget == "steps" else {"local_epochs": 1}
    config = EngineConfig(out_dir=out_dir, n_rounds=rounds, lr_schedule=make_lr_schedule("constant", LR, rounds),
                          seed=3, client_fraction=0.6, momentum=0.9, weight_decay=0.01, progress=False,
                          signature={"test": name}, vectorize_chunk=chunk, plots=False, **local)
    test = list(DataLoader([cast(sample, dtype) for index in range(len(SIZES)) for sample in client_samples(index, 8)],
                           batch_size=8))
    return SequentialEngine(worker, algorithm, clients, loss_fn, evaluate, test, config, CPU)


# float32: batched and unbatched kernels sum in different orders, and BatchNorm over batches of 2-6 samples
# with momentum 0.9 amplifies that rounding over 3 rounds to ~1e-4 at most. float64 shows the two paths
# compute the same function: they agree to ~1e-11 there, where any real difference stays large.
TOLERANCE = {"float32": dict(rtol=1e-4, atol=3e-4), "float64": dict(rtol=1e-9, atol=1e-9)}


def assert_close(first, second, where: str, tolerance: dict) -> None:
    assert first.keys() == second.keys(), where
    for key in first:
        if isinstance(first[key], dict):
            assert_close(first[key], second[key], f"{where}/{key}", tolerance)
        else:
            assert torch.allclose(first[key].double(), second[key].double(), **tolerance), f"{where}/{key}"


def assert_same_runs(sequential: SequentialEngine, vectorized: SequentialEngine, dtype: str = "float32") -> None:
    tolerance = TOLERANCE[dtype]
    assert_close(sequential.server.models, vectorized.server.models, "models", tolerance)
    assert_close(sequential.server.tensors, vectorized.server.tensors, "server tensors", tolerance)
    assert_close(sequential.store.snapshot(), vectorized.store.snapshot(), "client states", tolerance)
    first, second = (pd.read_csv(engine.out_dir / "metrics.csv", dtype={"client": str}) for engine in (sequential, vectorized))
    assert first[["round", "split", "client", "metric"]].equals(second[["round", "split", "client", "metric"]])
    assert first["value"].to_numpy() == pytest.approx(second["value"].to_numpy(), rel=tolerance["rtol"],
                                                     abs=tolerance["atol"])


CASES = [(name, {}) for name in SUPPORTED] + VARIANTS


@pytest.mark.kernels
@pytest.mark.parametrize("name, settings", CASES, ids=[f"{name}{settings or ''}" for name, settings in CASES])
@pytest.mark.parametrize("budget", ["steps", "epochs"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_every_supporting_algorithm_trains_vectorised_as_it_trains_sequentially(tmp_path, name, settings, budget, dtype):
    sequential = make_engine(tmp_path / "sequential", name, settings, chunk=0, budget=budget, dtype=dtype)
    sequential.run()
    vectorized = make_engine(tmp_path / "vectorized", name, settings, chunk=2, budget=budget, dtype=dtype)
    vectorized.run()
    assert_same_runs(sequential, vectorized, dtype)
    steps = pd.read_csv(vectorized.out_dir / "metrics.csv", dtype={"client": str})
    taken = steps[(steps.metric == "local_steps") & (steps.client != "mean")]["value"]
    if budget == "epochs":  # unequal clients took unequal numbers of steps in one chunk: padding was exercised
        assert taken.nunique() > 1


@pytest.mark.parametrize("name", REFUSED)
def test_an_algorithm_that_does_not_declare_support_is_refused_by_name(tmp_path, name):
    with pytest.raises(TaskHetError, match=rf"algorithm {name} does not train vectorised \(those that do: "):
        if ALGORITHMS.get(name).needs_classifier:  # the BatchNorm regressor below has no classifier head for them
            algorithm, worker = build_algorithm(name, tiny_model_for(name), {"a": 1, "b": 1})
            check_vectorizable(worker, algorithm)
        make_engine(tmp_path, name, {}, chunk=4)


def test_the_supporting_algorithms_are_the_skeleton_family():
    assert set(SUPPORTED) >= {"fedavg", "fedprox", "fedper", "fedrep", "fedbn", "ditto", "scaffold", "ifca", "sparse_ft"}


@pytest.mark.parametrize("mask_source", ["client", "server"])
def test_sparse_ft_vectorised_moves_only_each_clients_mask_and_equals_sequential(tmp_path, mask_source):
    """Each client's mask (its own, calibrated under its own seed on its own loader; or the server's) gates its
    lock-step update: one round from θ_0 leaves every entry outside the mask at its exact bits, the run equals
    the sequential one, and training did move the masked entries."""
    settings = {"density": 0.3, "mask_source": mask_source, "keep_local_models": True}
    engines = {}
    for name, chunk in (("sequential", 0), ("vectorized", 5)):
        engine = make_engine(tmp_path / name, "sparse_ft", settings, chunk=chunk, rounds=1)
        engine.calibration_loader = make_clients()[0].train_loader(0)  # held-out data for the server's mask
        engine.run()
        engines[name] = engine
    assert_same_runs(engines["sequential"], engines["vectorized"])
    vectorized = engines["vectorized"]
    states = vectorized.store.snapshot()
    assert len(states) == 3  # client_fraction 0.6 of 5 clients
    server_masks = {key[len("mask/"):]: value for key, value in vectorized.server.tensors.items()
                    if key.startswith("mask/")}
    for client_id, state in states.items():
        masks = server_masks or {key[len("mask/"):]: value for key, value in state.items() if key.startswith("mask/")}
        assert masks and bool(server_masks) == (mask_source == "server")
        masked, entries, moved_inside = 0, 0, 0
        for key, mask in masks.items():
            moved = state["local/" + key] != vectorized.server.tensors["base/" + key]
            assert not (moved & ~mask.bool()).any(), (client_id, key)  # nothing outside the mask moved
            masked, entries, moved_inside = masked + int(mask.sum()), entries + mask.numel(), moved_inside + int(moved.sum())
        assert 0 < masked < entries and moved_inside > 0, client_id  # a real sparse mask, and training moved it


def test_a_model_with_dropout_is_refused_naming_the_module(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.Linear(4, 1))
    with pytest.raises(TaskHetError, match=r"the model cannot train vectorised: its module 1 \(Dropout, p=0.1\)"):
        make_engine(tmp_path, "fedavg", {}, chunk=4, model=model)


def test_a_cumulative_batchnorm_is_refused(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None), nn.Linear(4, 1))
    with pytest.raises(TaskHetError, match=r"its BatchNorm 1 keeps a cumulative average"):
        make_engine(tmp_path, "fedavg", {}, chunk=4, model=model)


class ConvNormNet(nn.Module):
    """Convolutions with GroupNorm and BatchNorm2d over each sample's 4 features seen as a 2x2 image."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 4, 2, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Conv2d(4, 4, 2),
                                  nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x.view(-1, 1, 2, 2)))


def test_a_channels_last_model_trains_vectorised_as_the_default_layout_trains_sequentially(tmp_path):
    # On CUDA utils.device.prepare_model hands the engine a channels_last model; vmap cannot ask such a tensor
    # whether it is contiguous (GroupNorm and BatchNorm do), so the engine turns its model back.
    torch.manual_seed(0)
    model = ConvNormNet()
    twin = ConvNormNet()
    twin.load_state_dict(model.state_dict())
    for net in (model, twin):  # a frozen layer runs inside vmap with the model's own weights (a frozen encoder)
        net.body[0].requires_grad_(False)
    vectorized = make_engine(tmp_path / "vectorized", "fedavg", {}, chunk=2,
                             model=model.to(memory_format=torch.channels_last))
    vectorized.run()
    sequential = make_engine(tmp_path / "sequential", "fedavg", {}, chunk=0, model=twin)
    sequential.run()
    assert_same_runs(sequential, vectorized)
    # the run trained the convolutions: equal runs that never moved would prove nothing
    assert not torch.allclose(sequential.global_weights["body.3.weight"], vectorized.initial_weights["body.3.weight"])


def test_stacked_entries_are_contiguous_whatever_the_clients_layout():
    # A sequential CUDA run's checkpoint holds channels_last entries; a vectorised resume stacks them.
    weight = torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last)
    stacked = stack_weights([{"w": weight}, {"w": weight + 1}], ["w"])["w"]
    assert stacked.is_contiguous() and torch.equal(stacked[1], weight + 1)


@pytest.mark.kernels
def test_a_resumed_vectorised_run_is_bit_identical(tmp_path):
    whole = make_engine(tmp_path / "whole", "scaffold", {}, chunk=2, rounds=4)
    whole.run()
    first = make_engine(tmp_path / "split", "scaffold", {}, chunk=2, rounds=2)
    first.run()
    second = make_engine(tmp_path / "split", "scaffold", {}, chunk=2, rounds=4)
    second.run()
    for name, weights in whole.server.models.items():
        for key, value in weights.items():
            assert torch.equal(value, second.server.models[name][key]), key
    assert (whole.out_dir / "metrics.csv").read_text() == (second.out_dir / "metrics.csv").read_text()


# ----- the lock-step loop on hand-made cases -----
def linear_clients(count: int) -> tuple[nn.Linear, list[list[dict]]]:
    generator = torch.Generator().manual_seed(0)
    model = nn.Linear(3, 1)
    loaders = [[{"x": torch.randn(4, 3, generator=generator), "y": torch.randn(4, generator=generator)}
                for _ in range(index + 1)] for index in range(count)]  # client i has i + 1 batches
    return model, loaders


def regression(model: nn.Module, batch: dict, reduction: str = "mean") -> torch.Tensor:
    return ((model(batch["x"]).squeeze(-1) - batch["y"]) ** 2).mean()


def test_a_client_without_a_batch_takes_masked_steps_that_change_nothing():
    model, loaders = linear_clients(3)
    state = {key: value.detach().unsqueeze(0).repeat(3, *([1] * value.dim())) for key, value in model.state_dict().items()}
    cfg = ClientConfig(lr=0.1, loss_fn=regression, device=CPU, num_samples=4, local_epochs=1, momentum=0.9)
    result = train_lockstep(model, state, list(state), loaders, cfg, cfg.budget())
    assert [outcome.steps for outcome in result.results] == [1, 2, 3]
    for index, loader in enumerate(loaders):  # each client alone, with torch's SGD
        single = nn.Linear(3, 1)
        single.load_state_dict(model.state_dict())
        optimizer = torch.optim.SGD(single.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for batch in loader:
            optimizer.zero_grad()
            loss = regression(single, batch)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        for key, value in single.state_dict().items():
            assert torch.allclose(result.state[key][index], value, atol=1e-6), (index, key)
        assert result.results[index].mean_loss == pytest.approx(sum(losses) / len(losses), rel=1e-6)


class WithUnusedLayer(nn.Module):
    """A linear model with a parameter no loss reaches (e.g. a head another phase trains)."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(3, 1), nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_a_parameter_without_gradient_is_left_alone_as_torch_sgd_leaves_it():
    """torch's SGD skips a parameter whose .grad is None: no weight decay, no momentum. The lock-step does the same
    (vmap(grad) gave it zeros, so weight decay shrank it)."""
    model, loaders = WithUnusedLayer(), linear_clients(2)[1]
    state = {key: value.detach().unsqueeze(0).repeat(2, *([1] * value.dim())) for key, value in model.state_dict().items()}
    cfg = ClientConfig(lr=0.1, loss_fn=regression, device=CPU, num_samples=4, local_epochs=1, momentum=0.9,
                       weight_decay=0.5)
    result = train_lockstep(model, state, list(state), loaders, cfg, cfg.budget())
    for key in ("unused.weight", "unused.bias"):
        assert torch.equal(result.state[key], state[key]), key
    assert not torch.equal(result.state["used.weight"], state["used.weight"])


def test_a_non_finite_loss_names_the_client_of_the_chunk(tmp_path):
    engine = make_engine(tmp_path, "fedavg", {}, chunk=2)
    poisoned = engine.clients["1"]
    engine.clients["1"] = ClientData("1", poisoned.num_samples, lambda seed: [
        {"x": torch.full((6, 4), float("inf")), "y": torch.zeros(6)}], poisoned.test_loader)
    with pytest.raises((NonFiniteLossError, ClientFailure), match=r"client 1: the local training loss is (inf|nan)"):
        for round_index in range(1, 6):
            engine.train_round(round_index)


def test_a_chunk_that_fails_names_its_clients_and_the_last_good_checkpoint(tmp_path):
    """A failure inside a lock-step chunk (here every loader of round 2 raises) stops the run with one message naming
    the round, the chunk's clients, the error, and the checkpoint the run can resume from (round 1's, on disk)."""
    engine = make_engine(tmp_path, "fedavg", {}, chunk=2)
    failing = {client_seed(3, 2, client_id) for client_id in engine.clients}  # round 2's seeds (make_engine's seed 3)

    def failing_in_round_2(loader):
        def train_loader(seed):
            if seed in failing:
                raise RuntimeError("disk gone")
            return loader(seed)
        return train_loader

    for client_id, client in engine.clients.items():
        engine.clients[client_id] = ClientData(client_id, client.num_samples, failing_in_round_2(client.train_loader),
                                               client.test_loader)
    sampled = sample_clients(list(engine.clients), 0.6, 3, 2)
    with pytest.raises(ClientFailure) as failure:
        engine.run()
    assert str(failure.value) == (f"round 2, the vectorised chunk of clients {', '.join(sampled[:2])} failed: RuntimeError: "
                                  f"disk gone; the run stopped; the last good checkpoint is {tmp_path / 'checkpoint.pt'} "
                                  "(round 1)")
    assert load_checkpoint(tmp_path / "checkpoint.pt")["round"] == 1


# ----- the functional SGD against torch.optim.SGD -----
OPTION_GRID = [dict(momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                    maximize=maximize)
               for momentum, dampening, weight_decay, nesterov, maximize
               in itertools.product((0.0, 0.9), (0.0, 0.3), (0.0, 0.05), (False, True), (False, True))
               if not (nesterov and (momentum == 0 or dampening != 0))]  # torch refuses those nesterov settings


@pytest.mark.kernels
@pytest.mark.parametrize("options", OPTION_GRID, ids=lambda options: ",".join(f"{k}={v}" for k, v in options.items()))
def test_functional_sgd_equals_torch_sgd(options):
    generator = torch.Generator().manual_seed(1)
    start = [torch.randn(3, 4, generator=generator), torch.randn(4, generator=generator)]
    grads = [[torch.randn(3, 4, generator=generator), torch.randn(4, generator=generator)] for _ in range(4)]
    params = [nn.Parameter(value.clone()) for value in start]
    optimizer = torch.optim.SGD(params, lr=0.1, **options)
    functional, buffers = [value.clone() for value in start], [None, None]
    for step, step_grads in enumerate(grads):
        for param, value in zip(params, step_grads):
            param.grad = value.clone()
        optimizer.step()
        functional, buffers = sgd_step(functional, step_grads, buffers, step > 0, SGDOptions(lr=0.1, **options))
        for param, value in zip(params, functional):
            assert torch.allclose(param.detach(), value, rtol=0, atol=1e-7)
        if options["momentum"]:
            for param, buffer in zip(params, buffers):
                assert torch.allclose(optimizer.state[param]["momentum_buffer"], buffer, rtol=0, atol=1e-7)


def test_per_client_first_steps_start_each_buffer_from_the_direction():
    """Stacked clients whose first step comes at different times: each buffer starts at its own first step."""
    options = SGDOptions(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.05)
    param = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    gradient = torch.tensor([[0.5, -1.0], [2.0, 1.0]])
    buffer = torch.tensor([[7.0, 7.0], [0.2, 0.4]])  # client 0: never started (any value), client 1: started
    (new_param,), (new_buffer,) = sgd_step([param], [gradient], [buffer], torch.tensor([False, True]), options)
    direction = gradient + 0.05 * param
    expected_buffer = torch.stack([direction[0], 0.9 * buffer[1] + 0.7 * direction[1]])
    assert torch.allclose(new_buffer, expected_buffer)
    assert torch.allclose(new_param, param - 0.1 * expected_buffer)


# ----- test_fed.py end to end: a TaskModel on cached encoder maps (the demo's path) -----
def test_fed_vectorised_on_cached_encoder_maps_equals_sequential(tiny_data_root, tiny_manifest, assignments,  # noqa: F811
                                                                 tmp_path):
    common = step4_argv(tiny_data_root, tiny_manifest, assignments, tmp_path / "unused", "--method", "fedprox",
                        "--freeze_encoder", "--cache_features", "--cache_dir", str(tmp_path / "cache"),
                        "--momentum", "0.9", "--client_fraction", "0.67")
    test_fed.main([*common, "--out", str(tmp_path / "sequential")])
    test_fed.main([*common, "--out", str(tmp_path / "vectorized"), "--vectorize_clients", "--vectorize_chunk", "2"])
    sequential, vectorized = (pd.read_csv(tmp_path / name / "metrics.csv", dtype={"client": str})
                              for name in ("sequential", "vectorized"))
    pd.testing.assert_frame_equal(sequential[["round", "split", "client", "metric"]],
                                  vectorized[["round", "split", "client", "metric"]])
    assert sequential["value"].to_numpy() == pytest.approx(vectorized["value"].to_numpy(), rel=1e-4, abs=1e-5)
    weights = [load_checkpoint(tmp_path / name / "checkpoint.pt")["model"] for name in ("sequential", "vectorized")]
    for key, value in weights[0].items():
        torch.testing.assert_close(weights[1][key], value, rtol=1e-4, atol=1e-5)
    assert json.loads((tmp_path / "vectorized" / "config.json").read_text())["args"]["vectorize_clients"] is True


@pytest.mark.parametrize("extra, message", [
    (["--method", "qfedavg"], r"--vectorize_clients: algorithm qfedavg does not train vectorised"),
    (["--engine", "flower"], r"--vectorize_clients needs --engine sequential"),
])
def test_fed_refuses_what_cannot_train_vectorised_before_writing_anything(tiny_data_root, tiny_manifest,  # noqa: F811
                                                                           assignments, tmp_path, extra, message):
    out = tmp_path / "run"
    with pytest.raises(TaskHetError, match=message):
        test_fed.main(step4_argv(tiny_data_root, tiny_manifest, assignments, out, "--vectorize_clients", *extra))
    assert not out.exists()


def test_a_chunk_refuses_an_algorithm_that_tailors_each_clients_message(tmp_path):
    engine = make_engine(tmp_path, "fedavg", {}, chunk=2)
    engine.algorithm.client_broadcast = lambda server, broadcast, client_id: dict(broadcast)  # a per-client message
    with pytest.raises(TaskHetError, match=r"fedavg sends each client its own message \(client_broadcast\)"):
        engine.train_round(1)
