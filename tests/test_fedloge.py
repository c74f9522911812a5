"""FedLoGe (issue 20): SSE-C's construction, the frozen layer, the three-loss gradient routes on a tiny linear
backbone, GLA-FR on hand-made heads and the three inference modes as rows of metrics.csv.

The generic tests over ``list_algorithms()`` cover resume, Flower = sequential and the privacy of uploads."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from torch import nn

from network.algorithms import build_algorithm
from network.algorithms.base import ClientConfig, load_weights
from network.algorithms.fedloge import (MODE, PERSONAL, REALIGNED_MODEL, UNIVERSAL, UNIVERSAL_MODEL, etf, realigned_global,
                                        realigned_local, refine, sparsity_mask, sse_c_bias, sse_c_objective,
                                        sse_c_weight)
from network.client import AbsentClassMask
from utils.errors import TaskHetError

CPU = torch.device("cpu")


def ce_loss(model, batch, reduction="mean"):
    return nn.functional.cross_entropy(model(batch["x"]), batch["label"], reduction=reduction)


class LinearNet(nn.Module):
    """A tiny linear backbone (z = B x) and a Linear head over 3 classes."""

    def __init__(self, dim_in: int = 2, dim: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.body = nn.Linear(dim_in, dim, bias=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        return self.head(self.body(x))

    def head_keys(self):
        return [key for key in self.state_dict() if key.startswith("head.")]


def fedloge(model=None, **settings):
    torch.manual_seed(0)
    return build_algorithm("fedloge", model or LinearNet(), {"0": 6, "1": 4}, {"etf_steps": 5, **settings}, seed=3)


def initial(worker: nn.Module) -> dict:
    """Copies of the worker's entries (as the engine hands them to init_server)."""
    return {key: value.clone() for key, value in worker.state_dict().items()}


# ----- SSE-C -----
def test_the_etf_has_unit_columns_and_every_pairwise_cosine_exactly_minus_one_over_c_minus_one():
    matrix = etf(8, 5, torch.Generator().manual_seed(0))
    norms = matrix.norm(dim=0)
    assert torch.allclose(norms, torch.ones(5, dtype=torch.float64), rtol=0, atol=1e-12)
    cosines = (matrix.T @ matrix) / torch.outer(norms, norms)
    off_diagonal = cosines[~torch.eye(5, dtype=torch.bool)]
    assert torch.allclose(off_diagonal, torch.full_like(off_diagonal, -1 / 4), rtol=0, atol=1e-12)


def test_sparsification_zeroes_exactly_a_beta_fraction_and_refinement_keeps_those_zeros():
    mask = sparsity_mask((10, 5), 0.6, torch.Generator().manual_seed(1))
    assert int((~mask).sum()) == 30  # 0.6 · 50
    weight = sse_c_weight(10, 5, beta=0.6, steps=50, lr=1e-3, seed=2)
    assert weight.shape == (5, 10) and int((weight == 0).sum()) == 30
    assert int((sse_c_weight(10, 5, beta=0.0, steps=0, lr=1e-3, seed=2) == 0).sum()) == 0


def test_the_refinement_lowers_its_own_objective_and_matches_it_by_hand():
    matrix = etf(6, 3, torch.Generator().manual_seed(0))
    mask = sparsity_mask(matrix.shape, 0.5, torch.Generator().manual_seed(0))
    start = matrix * mask
    refined = refine(start, mask, steps=200, lr=1e-3)
    assert sse_c_objective(refined) < sse_c_objective(start)
    # By hand on the columns (1, 0), (1, 1), (0, −3): norms 1, √2, 3; cosines 1/√2 (first, second), 0 (first,
    # third), −1/√2 (second, third), so the nearest are 1/√2, 1/√2, 0 and the arccos mean is (π/4 + π/4 + π/2)/3.
    columns = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, -3.0]], dtype=torch.float64)
    expected = 0.9 ** 2 + (math.sqrt(2) - 0.1) ** 2 + 2.9 ** 2 - math.pi / 3
    assert float(sse_c_objective(columns)) == pytest.approx(expected, abs=1e-9)


def test_the_same_seed_gives_the_same_sse_c_and_another_seed_another():
    first, second = (sse_c_weight(12, 4, 0.6, 30, 1e-4, seed) for seed in (5, 5))
    assert torch.equal(first, second)
    assert not torch.equal(first, sse_c_weight(12, 4, 0.6, 30, 1e-4, 6))
    # the sparsity pattern too comes from the seed (not only the ETF's values)
    patterns = {seed: (sse_c_weight(12, 4, 0.6, 0, 1e-4, seed) == 0) for seed in range(6)}
    assert len({pattern.numpy().tobytes() for pattern in patterns.values()}) > 1


def test_the_fixed_bias_is_uniform_in_plus_minus_one_over_root_d_like_a_linear_layer():
    bias = sse_c_bias(16, 2000, seed=1)
    assert float(bias.abs().max()) <= 0.25 and float(bias.abs().max()) > 0.24  # 1/√16, nearly reached by 2,000 draws
    assert torch.equal(bias, sse_c_bias(16, 2000, seed=1)) and not torch.equal(bias, sse_c_bias(16, 2000, seed=2))


def test_tau_below_one_is_a_valid_norm():
    algorithm, _ = fedloge(tau=0.5)
    assert algorithm.settings.tau == 0.5


def test_the_server_builds_sse_c_from_the_run_seed_and_keeps_it_fixed_and_private_to_nobody():
    algorithm, worker = fedloge()
    server = algorithm.init_server(initial(worker))
    expected = sse_c_weight(4, 3, 0.6, 5, 1e-4, 3).float()
    assert torch.equal(server.models["global"]["head.sse.weight"], expected)
    assert {"head.sse.weight", "head.sse.bias"} <= algorithm.federation.layout.fixed_keys
    assert not {"head.sse.weight", "head.sse.bias", MODE} & set(algorithm.shared_keys())
    assert algorithm.private_keys() == {"head.local.weight", "head.local.bias"}


# ----- the local step -----
def batches(count: int = 3) -> list[dict]:
    generator = torch.Generator().manual_seed(4)
    return [{"x": torch.randn(5, 2, generator=generator), "label": torch.randint(0, 3, (5,), generator=generator)}
            for _ in range(count)]


@pytest.mark.kernels
def test_sse_c_stays_bit_identical_through_training_with_momentum_and_weight_decay():
    algorithm, worker = fedloge()
    server = algorithm.init_server(initial(worker))
    broadcast = algorithm.broadcast(server)
    cfg = ClientConfig(lr=0.5, loss_fn=ce_loss, device=CPU, num_samples=6, local_steps=6, momentum=0.9,
                       weight_decay=0.1)
    result = algorithm.client_update(worker, broadcast, {}, batches(), cfg)
    state = worker.state_dict()
    for key in ("head.sse.weight", "head.sse.bias"):
        assert torch.equal(state[key], broadcast["global"][key]), key
    assert not torch.equal(state["head.aux.weight"], broadcast["global"]["head.aux.weight"])  # the others trained
    assert not torch.equal(state["body.weight"], broadcast["global"]["body.weight"])
    assert set(result.upload["delta"]) == {"body.weight", "head.aux.weight", "head.aux.bias"}
    assert set(result.client_state) == {"head.local.weight", "head.local.bias"}


def test_gradient_routes_by_hand_on_a_linear_backbone():
    """The backbone's gradient is the SSE-C loss's alone; g_aux and l_k get their own CE's gradient on z."""
    algorithm, worker = fedloge()
    load_weights(worker, algorithm.init_server(initial(worker)).models["global"])
    head = worker.head
    batch = batches(1)[0]
    x, y = batch["x"], batch["label"]
    onehot = nn.functional.one_hot(y, 3).float()
    cfg = ClientConfig(lr=0.1, loss_fn=ce_loss, device=CPU, num_samples=6, local_steps=1)
    from network.algorithms.multihead import multi_head_loss

    loss = multi_head_loss(cfg.loss_fn, worker, head, ("sse", "aux", "local"))(worker, batch)
    loss.backward()
    with torch.no_grad():
        z = x @ worker.body.weight.T
        residual = {name: (torch.softmax(layer(z), 1) - onehot) / len(y)  # ∂CE/∂logits
                    for name, layer in (("sse", head.sse), ("aux", head.aux), ("local", head.local))}
        # Backbone: ∂/∂B of CE(W_sse B x) = (r_sse W_sse)ᵀ x; nothing from the other heads.
        assert torch.allclose(worker.body.weight.grad, (residual["sse"] @ head.sse.weight).T @ x, atol=1e-6)
        for name in ("aux", "local"):
            layer = getattr(head, name)
            assert torch.allclose(layer.weight.grad, residual[name].T @ z, atol=1e-6), name
            assert torch.allclose(layer.bias.grad, residual[name].sum(0), atol=1e-6), name
    assert head.sse.weight.grad is None and head.sse.bias.grad is None
    with torch.no_grad():
        expected = sum(float(nn.functional.cross_entropy(layer(z), y)) for layer in (head.sse, head.aux, head.local))
    assert float(loss) == pytest.approx(expected, rel=1e-6)


# ----- GLA-FR -----
def test_gla_fr_global_rows_get_norm_tau_and_local_rows_are_the_aux_direction_times_the_local_norm():
    aux = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, -2.0]])
    local = torch.tensor([[0.0, 5.0], [1.0, 1.0], [0.3, 0.4]])
    assert torch.allclose(realigned_global(aux, 1.7).norm(dim=1), torch.full((3,), 1.7))
    assert torch.allclose(realigned_global(aux, 1.7)[0], torch.tensor([1.02, 1.36]))  # 1.7·(0.6, 0.8)
    assert torch.allclose(realigned_local(aux, local), torch.tensor([[3.0, 4.0], [math.sqrt(2), 0.0], [0.0, -0.5]]))


def test_the_three_inference_modes_serve_sse_c_the_realigned_aux_and_local_plus_realigned():
    algorithm, worker = fedloge(tau=2.0)
    server = algorithm.init_server(initial(worker))
    models = algorithm.evaluated_models(server)
    assert list(models) == [REALIGNED_MODEL, UNIVERSAL_MODEL]
    x = torch.randn(4, 2, generator=torch.Generator().manual_seed(0))
    load_weights(worker, models[UNIVERSAL_MODEL])
    worker.eval()
    z = worker.body(x)
    assert int(worker.head.mode) == UNIVERSAL and torch.allclose(worker(x), worker.head.sse(z))
    load_weights(worker, models[REALIGNED_MODEL])
    assert torch.allclose(worker.head.aux.weight.norm(dim=1), torch.full((3,), 2.0))
    assert torch.allclose(worker(x), worker.head.aux(z))
    local = {"head.local.weight": torch.tensor([[0.0, 5.0, 0, 0], [1.0, 1.0, 0, 0], [0.3, 0.4, 0, 0]]),
             "head.local.bias": torch.tensor([0.1, 0.2, 0.3])}
    personal = algorithm.personal_model(server.models, local)
    load_weights(worker, personal)
    assert int(worker.head.mode) == PERSONAL
    aux = server.models["global"]["head.aux.weight"]
    tilde = aux / aux.norm(dim=1, keepdim=True) * local["head.local.weight"].norm(dim=1, keepdim=True)
    assert torch.allclose(worker(x), z @ local["head.local.weight"].T + local["head.local.bias"] + z @ tilde.T, atol=1e-6)
    assert algorithm.personal_model(server.models, {}) is None  # a client that never trained


def test_a_masked_class_is_never_predicted_by_the_personal_model():
    algorithm, worker = fedloge()
    server = algorithm.init_server(initial(worker))
    favourite = {"head.local.weight": torch.zeros(3, 4), "head.local.bias": torch.tensor([0.0, 0.0, 100.0])}
    load_weights(worker, algorithm.personal_model(server.models, favourite))
    worker.eval()
    x = torch.randn(20, 2, generator=torch.Generator().manual_seed(0))
    assert (worker(x).argmax(1) == 2).all()  # class 2's bias wins everywhere ...
    masked = AbsentClassMask(worker, torch.tensor([False, False, True]))
    assert not (masked(x).argmax(1) == 2).any()  # ... and is never predicted once it is absent


def test_each_inference_mode_is_its_own_row_of_metrics_csv(tmp_path):
    from tests.test_engine import make_engine

    make_engine(tmp_path, "fedloge", rounds=1).run()
    metrics = pd.read_csv(tmp_path / "metrics.csv", dtype={"client": str})
    final = metrics[metrics["round"] == 1]
    assert {"global", "model:realigned", "model:universal"} <= set(final.loc[final.split == "test", "client"])
    assert (final.split == "client_test_personal").any()
    test = final[(final.split == "test") & (final.metric == "top1")].set_index("client")["value"]
    assert test["global"] == test["model:realigned"]


# ----- bad input -----
def test_fedloge_refuses_a_dense_task_and_a_feature_dimension_below_the_classes():
    from models import build_task_model

    dense = build_task_model("depth_euclidean", "small_cnn", "none", seed=0)
    with pytest.raises(TaskHetError, match="^fedloge trains classifier heads, but --task depth_euclidean is a dense task"):
        build_algorithm("fedloge", dense, {"0": 1})
    with pytest.raises(TaskHetError, match=r"SSE-C needs .* a feature dimension >= the number of classes, got d=2, C=3"):
        build_algorithm("fedloge", LinearNet(dim=2), {"0": 1})
