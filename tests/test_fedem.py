"""FedEM (network/algorithms/fedem.py): M = 1 is FedAvg, π recovers known mixtures, q is keyed by sample id."""

from __future__ import annotations

import itertools

import pandas as pd
import pytest
import torch
from torch import nn

from network.algorithms import build_algorithm
from network.algorithms.fedem import PI, Mixture
from network.algorithms.skeleton import DELTA
from network.client import ClientData
from network.engine_sequential import EngineConfig, SequentialEngine
from network.lr_schedule import make_lr_schedule
from tests.oracles import CPU, DIM, client_config, least_squares_loss, linear_model, mean_loss
from tests.test_engine import make_engine
from tests.tiny_models import TinyNet
from utils.errors import TaskHetError


@pytest.mark.kernels
def test_one_component_is_fedavg_bit_for_bit(tmp_path):
    """BatchNorm, dropout, momentum, partial participation, unequal clients: the same weights and metrics."""
    fedavg = make_engine(tmp_path / "fedavg", "fedavg").run()
    engine = make_engine(tmp_path / "fedem", "fedem", settings={"n_components": 1})
    fedem = engine.run()
    assert {f"components.0.{key}" for key in fedavg} | {PI} == set(fedem)
    for key, value in fedavg.items():
        assert torch.equal(fedem[f"components.0.{key}"], value), key
    read = [pd.read_csv(tmp_path / run / "metrics.csv", dtype={"client": str}) for run in ("fedavg", "fedem")]
    tests = [frame[frame.split.isin(["test", "client_test"])].reset_index(drop=True) for frame in read]
    assert tests[0].equals(tests[1])


def two_regimes(proportions, size=60, seed=0):
    """Clients whose rows follow y = x·a (a share p_i of them) or y = x·b, with sample ids."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.full((DIM,), 2.0, dtype=torch.float64)
    b = -a
    data = []
    for index, share in enumerate(proportions):
        x = torch.randn(size, DIM, generator=generator, dtype=torch.float64)
        first = torch.arange(size) < round(share * size)
        y = torch.where(first, x @ a, x @ b) + 0.1 * torch.randn(size, generator=generator, dtype=torch.float64)
        data.append((x, y, torch.arange(size) + 1000 * index))
    return data


def run_fedem(tmp_path, data, rounds, steps, lr, **settings):
    clients = [ClientData(str(index), len(y), lambda seed, x=x, y=y, ids=ids: [{"x": x, "y": y, "sample_id": ids}],
                          [{"x": x, "y": y, "sample_id": ids}]) for index, (x, y, ids) in enumerate(data)]
    algorithm, worker = build_algorithm("fedem", linear_model(), {client.client_id: client.num_samples
                                                                    for client in clients}, settings, seed=3)
    config = EngineConfig(out_dir=tmp_path, n_rounds=rounds, lr_schedule=make_lr_schedule("constant", lr, rounds),
                          local_steps=steps, eval_every=rounds, progress=False, plots=False)
    engine = SequentialEngine(worker, algorithm, clients, least_squares_loss, mean_loss, clients[0].test_loader,
                              config, CPU)
    engine.run()
    return engine


def test_pi_recovers_each_clients_regime_proportions(tmp_path):
    proportions = [0.0, 0.25, 0.5, 0.8, 1.0]
    engine = run_fedem(tmp_path, two_regimes(proportions), rounds=25, steps=10, lr=0.3, n_components=2,
                       init_noise=0.5, mix="values")
    learned = [engine.store.get(str(index))[PI] for index in range(len(proportions))]
    errors = [max(abs(float(pi[0]) - share) for pi, share in zip(learned, proportions)),
              max(abs(float(pi[1]) - share) for pi, share in zip(learned, proportions))]  # up to label switching
    assert min(errors) < 0.1, (learned, proportions)
    components = engine.server.models["global"]
    optima = {float(components[f"components.{index}.weight"].mean()) for index in range(2)}
    assert min(abs(value - 2.0) for value in optima) < 0.1 and min(abs(value + 2.0) for value in optima) < 0.1


class Reshuffled:
    """One client's rows as one batch, in a new random order on every pass (as a shuffling DataLoader)."""

    def __init__(self, x, y, ids, seed) -> None:
        self.x, self.y, self.ids = x, y, ids
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self):
        order = torch.randperm(len(self.y), generator=self.generator)
        yield {"x": self.x[order], "y": self.y[order], "sample_id": self.ids[order]}


def test_shuffled_loaders_give_the_same_q_and_the_same_update_as_ordered_ones():
    x, y, ids = two_regimes([0.3], size=40)[0]
    algorithm, model = build_algorithm("fedem", linear_model(), {"0": 40}, {"n_components": 2, "init_noise": 0.5,
                                                                            "mix": "values"})
    server = algorithm.init_server({key: value.clone() for key, value in model.state_dict().items()})
    ordered = [{"x": x, "y": y, "sample_id": ids}]
    load = lambda: model.load_state_dict(server.models["global"])  # noqa: E731
    load()
    q_ordered = algorithm.responsibilities(model, ordered, client_config(40))
    load()
    q_shuffled = algorithm.responsibilities(model, Reshuffled(x, y, ids, seed=1), client_config(40))
    assert q_ordered.keys() == q_shuffled.keys() and len(q_ordered) == 40
    for key in q_ordered:
        assert torch.allclose(q_ordered[key], q_shuffled[key], rtol=0, atol=1e-15)
    assert len({round(float(row[0]), 6) for row in q_ordered.values()}) > 2  # q really differs between samples
    updates = [algorithm.client_update(model, algorithm.broadcast(server), {}, loader, client_config(40, lr=0.1, steps=3))
               .upload[DELTA] for loader in (ordered, Reshuffled(x, y, ids, seed=5))]
    for key in updates[0]:
        assert torch.allclose(updates[0][key], updates[1][key], rtol=0, atol=1e-12), key


def test_the_e_step_and_m_step_by_hand():
    x, y, ids = two_regimes([0.5], size=6)[0]
    algorithm, model = build_algorithm("fedem", linear_model(), {"0": 6}, {"n_components": 2, "mix": "values"})
    weights = {"components.0.weight": torch.full((1, DIM), 1.0, dtype=torch.float64),
               "components.1.weight": torch.full((1, DIM), -1.0, dtype=torch.float64),
               PI: torch.tensor([0.3, 0.7], dtype=torch.float64)}
    result = algorithm.client_update(model, {"global": weights}, {PI: weights[PI]}, [{"x": x, "y": y, "sample_id": ids}],
                                     client_config(6, lr=0.0, steps=1))
    losses = torch.stack([0.5 * (x @ weights[f"components.{index}.weight"][0] - y) ** 2 for index in range(2)], dim=1)
    q = torch.tensor([0.3, 0.7], dtype=torch.float64) * torch.exp(-losses)
    q = q / q.sum(1, keepdim=True)
    assert torch.allclose(result.client_state[PI], q.mean(0), rtol=1e-12, atol=1e-15)
    assert result.metrics["pi_0"] == pytest.approx(float(q.mean(0)[0]), rel=1e-12)


def test_a_client_predicts_with_mixed_probabilities_not_mixed_logits():
    class Classifier(nn.Module):
        def __init__(self, logits):
            super().__init__()
            self.bias = nn.Parameter(torch.tensor(logits))

        def forward(self, x):
            return self.bias.expand(len(x), -1)

    mixture = Mixture(Classifier([3.0, 0.0]), 2, mix_probabilities=True)
    with torch.no_grad():
        mixture.components[1].bias.copy_(torch.tensor([0.0, 3.0]))
        getattr(mixture, PI).copy_(torch.tensor([0.25, 0.75]))
    p0, p1 = torch.softmax(torch.tensor([3.0, 0.0]), 0), torch.softmax(torch.tensor([0.0, 3.0]), 0)
    mixed = torch.softmax(mixture(torch.zeros(1, 1)), dim=1)[0]
    assert torch.allclose(mixed, 0.25 * p0 + 0.75 * p1, atol=1e-7)
    assert not torch.allclose(mixed, torch.softmax(0.25 * torch.tensor([3.0, 0.0]) + 0.75 * torch.tensor([0.0, 3.0]), 0),
                              atol=1e-3)


def test_the_upload_is_m_times_fedavgs():
    sizes = {"0": 10}
    fedavg, _ = build_algorithm("fedavg", TinyNet(), sizes)
    fedem, _ = build_algorithm("fedem", TinyNet(), sizes, {"n_components": 3})
    assert len(fedem.shared_keys()) == 3 * len(fedavg.shared_keys())


def test_more_components_than_memory_holds_is_one_line_before_any_copy(monkeypatch):
    model = linear_model()
    model_bytes = sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())
    monkeypatch.setattr("psutil.virtual_memory", lambda: type("Memory", (), {"available": 10 * model_bytes})())
    build_algorithm("fedem", linear_model(), {"0": 1}, {"n_components": 10})  # exactly fits: accepted
    with pytest.raises(TaskHetError, match=r"^fedem setting n_components=11 needs 11 copies of the model "):
        build_algorithm("fedem", model, {"0": 1}, {"n_components": 11})
    with pytest.raises(TaskHetError, match=r"^fedem setting n_components=64 needs 64 copies"):  # the largest legal
        build_algorithm("fedem", model, {"0": 1}, {"n_components": 64})
    with pytest.raises(TaskHetError, match=r"^fedem setting n_components must be at most 64 in magnitude, got 100000000"):
        build_algorithm("fedem", model, {"0": 1}, {"n_components": 100_000_000})


def test_each_component_starts_from_its_own_perturbation():
    algorithm, model = build_algorithm("fedem", linear_model(), {"0": 4}, {"n_components": 3})
    start = {key: value.clone() for key, value in model.state_dict().items()}
    (model_weights,) = algorithm.init_server(start).models.values()
    components = [model_weights[f"components.{index}.weight"] for index in range(3)]
    assert torch.equal(components[0], start["components.0.weight"])  # the first is the model as given
    assert not torch.equal(components[1], components[0]) and not torch.equal(components[2], components[1])


def test_bad_settings_are_refused_naming_the_setting():
    with pytest.raises(TaskHetError, match=r"^setting n_components must be >= 1, got 0$"):
        build_algorithm("fedem", linear_model(), {"0": 1}, {"n_components": 0})
    with pytest.raises(TaskHetError, match=r"^fedem setting mix probabilities needs a model whose head outputs class "
                                           r"logits \(a classifier head\); Linear does not"):
        build_algorithm("fedem", linear_model(), {"0": 1}, {"mix": "probabilities"})
    algorithm, model = build_algorithm("fedem", linear_model(), {"0": 4}, {"n_components": 2})
    server = algorithm.init_server(model.state_dict())
    with pytest.raises(TaskHetError, match="every batch needs a 'sample_id' entry"):
        algorithm.client_update(model, algorithm.broadcast(server), {}, [{"x": torch.zeros(4, DIM, dtype=torch.float64),
                                                                          "y": torch.zeros(4, dtype=torch.float64)}],
                                client_config(4))


def test_a_task_model_with_a_logit_head_mixes_probabilities_and_one_without_refuses():
    from models.tasks import get_task

    class Fake(nn.Module):
        def __init__(self, task):
            super().__init__()
            self.task, self.head = get_task(task), nn.Linear(2, 2)

    assert build_algorithm("fedem", Fake("class_scene"), {"0": 1})[1].mix_probabilities
    assert not build_algorithm("fedem", Fake("depth_zbuffer"), {"0": 1})[1].mix_probabilities
    with pytest.raises(TaskHetError, match="needs a model whose head outputs class logits"):
        build_algorithm("fedem", Fake("depth_zbuffer"), {"0": 1}, {"mix": "probabilities"})


def test_the_mixtures_head_is_every_components_head():
    """A FedEM model declares the heads of its M components as its head (the TaskModel interface ModelLayout reads):
    ``components.m.<key>`` for each of the base model's head entries, nothing else."""
    base = TinyNet()
    algorithm, model = build_algorithm("fedem", base, {"0": 4}, {"n_components": 3})
    expected = [f"components.{m}.{key}" for m in range(3) for key in TinyNet().head_keys()]
    assert len(expected) == 3 * 2 and model.head_keys() == expected  # the head's weight and bias, per component
    assert algorithm.federation.layout.head_keys == frozenset(expected)
    assert set(expected) <= set(model.state_dict())
