"""FedBN (network/algorithms/fedbn.py): BatchNorm layers, found by module type, never leave their client."""

from __future__ import annotations

import pandas as pd
import torch
import torchvision

from network.algorithms import build_algorithm
from network.algorithms.base import ModelLayout
from tests.oracles import linear_model
from tests.test_engine import make_engine
from tests.tiny_models import TinyNet


def test_batchnorm_is_selected_by_module_type_whatever_its_name():
    layout = ModelLayout.of(torchvision.models.resnet18(weights=None))
    assert "layer2.0.downsample.1.running_var" in layout.batchnorm_keys  # a BatchNorm called "1"
    assert "layer2.0.downsample.1.weight" in layout.batchnorm_keys
    assert "layer2.0.downsample.0.weight" not in layout.batchnorm_keys  # the convolution before it
    assert layout.batchnorm_keys == {key for key in layout.state_keys if ".bn" in key or "downsample.1" in key
                                     or key.startswith("bn1.")}


def test_clients_keep_their_own_statistics_and_the_global_model_never_receives_them(tmp_path):
    engine = make_engine(tmp_path, "fedbn", rounds=3, client_fraction=1.0)
    initial = {key: value.clone() for key, value in engine.server.models["global"].items()}
    engine.run()
    bn_keys = engine.algorithm.private_keys()
    assert bn_keys == {key for key in initial if key.startswith("body.1.")}
    states = engine.store.snapshot()
    assert all(set(state) == bn_keys for state in states.values())
    means = [state["body.1.running_mean"] for state in states.values()]
    assert not torch.allclose(means[0], means[1])  # heterogeneous clients, different statistics
    for key in bn_keys:
        assert torch.equal(engine.server.models["global"][key], initial[key]), key
    assert not torch.equal(engine.server.models["global"]["body.0.weight"], initial["body.0.weight"])
    metrics = pd.read_csv(tmp_path / "metrics.csv", dtype={"client": str})
    assert not metrics.query("split == 'client_test_personal'").empty


def test_without_batchnorm_fedbn_is_fedavg():
    algorithm, _ = build_algorithm("fedbn", linear_model(), {"0": 1})
    assert algorithm.private_keys() == frozenset() and not algorithm.personalized


def test_a_model_that_is_a_batchnorm_layer_has_unprefixed_keys():
    assert ModelLayout.of(torch.nn.BatchNorm1d(3)).batchnorm_keys == {"weight", "bias", "running_mean", "running_var",
                                                                       "num_batches_tracked"}


class BatchAndInstanceNorm(torch.nn.Module):
    """A BatchNorm and an InstanceNorm with affine parameters and running statistics (both ``_NormBase``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 1)
        self.batch = torch.nn.BatchNorm2d(2)
        self.instance = torch.nn.InstanceNorm2d(2, affine=True, track_running_stats=True)
        self.lazy = torch.nn.LazyBatchNorm1d()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lazy(self.instance(self.batch(self.conv(x))).mean((2, 3)))


def test_only_batchnorm_is_private_never_an_instancenorm_with_affine_parameters_and_statistics():
    algorithm, _ = build_algorithm("fedbn", BatchAndInstanceNorm(), {"a": 1})
    entries = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    assert algorithm.private_keys() == {f"{layer}.{entry}" for layer in ("batch", "lazy") for entry in entries}
    for layer in (torch.nn.BatchNorm3d(2), torch.nn.SyncBatchNorm(2), torch.nn.LazyBatchNorm2d()):
        assert ModelLayout.of(layer).batchnorm_keys == set(entries), type(layer).__name__
    for layer in (torch.nn.InstanceNorm1d(2, affine=True, track_running_stats=True), torch.nn.GroupNorm(1, 2),
                  torch.nn.LayerNorm(2)):
        assert ModelLayout.of(layer).batchnorm_keys == frozenset(), type(layer).__name__
