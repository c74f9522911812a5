"""Algorithm settings at their edges, by hand: a setting that starts at a round (the round before, at and after it),
strict thresholds at equality, and non-default values of secondary settings (each checked against a value computed
here, so that ignoring the setting, or reading its default, fails a test)."""

from __future__ import annotations

import math

import pytest
import torch

from network.algorithms import build_algorithm, sparse_finetune
from network.algorithms.base import ServerState, Upload
from network.algorithms.cfl import CLUSTER, MEMBERSHIP, ROUNDS
from network.algorithms.fedloge import SSE_WEIGHT, sse_c_weight
from network.algorithms.skeleton import DELTA
from sparse.calibration import calibrate_mask, fisher_score_fn, mask_density
from tests.oracles import CPU, DIM, linear_model
from tests.test_fedamp import server_with as fedamp_server
from tests.test_fedloge import LinearNet, initial
from tests.tiny_models import TinyClassifier

# ----- CFL: start_round, min_size and the strict ε thresholds -----
CFL_CLIENTS = ("a", "b", "c", "d")
# a, b pull along +x and c, d along −x, all with +0.5 along y: the mean update is (0, 0.5) (norm 0.5) and every
# member's norm is √(2² + 0.5²) = 2.0616: the split criterion ‖mean‖ < ε1, max ‖Δ‖ > ε2 holds for ε1 > 0.5, ε2 < 2.06.
CFL_DIRECTIONS = {"a": 2.0, "b": 2.0, "c": -2.0, "d": -2.0}
MEMBER_NORM = math.hypot(2.0, 0.5)


def cfl_after_one_aggregation(rounds_before: int, **settings) -> set[int]:
    """The cluster ids after aggregating the uploads above in round ``rounds_before + 1``."""
    algorithm, _ = build_algorithm("cfl", linear_model(), {name: 10 for name in CFL_CLIENTS},
                                   {"eps1": 0.6, "eps2": 1.0, "start_round": 0, "min_size": 2, **settings})
    server = algorithm.init_server({"weight": torch.zeros(1, DIM, dtype=torch.float64)})
    server = ServerState(server.models, {**server.tensors, ROUNDS: torch.tensor(rounds_before)})
    uploads = [Upload(name, {DELTA: {"weight": torch.tensor([[value, 0.5, 0, 0, 0]], dtype=torch.float64)},
                             CLUSTER: {"id": torch.tensor(0)}}, 10) for name, value in CFL_DIRECTIONS.items()]
    return set(algorithm.aggregate(server, uploads).models[MEMBERSHIP]["clusters"].tolist())


@pytest.mark.parametrize("round_index, splits", [(2, False), (3, True), (4, True)])
def test_cfl_splits_from_start_round_on_and_not_the_round_before(round_index, splits):
    assert cfl_after_one_aggregation(round_index - 1, start_round=3) == ({1, 2} if splits else {0})


@pytest.mark.parametrize("min_size, splits", [(3, True), (4, True), (5, False)])
def test_cfl_splits_a_cluster_of_exactly_min_size_members(min_size, splits):
    assert cfl_after_one_aggregation(0, min_size=min_size) == ({1, 2} if splits else {0})


@pytest.mark.parametrize("eps1, eps2, splits", [
    (0.5, 1.0, False),  # ‖mean‖ = 0.5 is not below ε1 = 0.5
    (0.5000001, 1.0, True),
    (0.6, MEMBER_NORM, False),  # max ‖Δ‖ = ε2 is not above ε2
    (0.6, MEMBER_NORM - 1e-9, True),
])
def test_cfl_thresholds_are_strict(eps1, eps2, splits):
    assert cfl_after_one_aggregation(0, eps1=eps1, eps2=eps2) == ({1, 2} if splits else {0})


# ----- FedAMP's heuristic variant: a self weight and a cosine scale other than the defaults -----
def test_heurfedamp_row_with_self_weight_and_sigma_by_hand():
    vectors = {"0": [1.0, 0, 0, 0, 0], "1": [2.0, 2.0, 0, 0, 0], "2": [0, 3.0, 0, 0, 0]}  # cos 1/√2 and 0 from "0"
    algorithm, _, server = fedamp_server({client: torch.tensor(vector, dtype=torch.float64)
                                          for client, vector in vectors.items()},
                                         variant="heuristic", self_weight=0.2, sigma=3.0)
    near, far = math.exp(3.0 / math.sqrt(2)), math.exp(0.0)  # softmax of σ·cos over the others
    expected = {"0": 0.2, "1": 0.8 * near / (near + far), "2": 0.8 * far / (near + far)}
    assert algorithm.attention_row(server, "0") == pytest.approx(expected, rel=1e-14)


# ----- FedLoGe: the SSE-C refinement's learning rate -----
def test_fedloge_refines_sse_c_with_its_etf_lr():
    """Adam's first step moves every entry by lr·g/(|g| + 1e-8) = ±lr: one step of etf_lr 0.05 moves each non-zero
    of the sparse ETF by 0.05 exactly (to Adam's ε), and leaves the zeros."""
    torch.manual_seed(0)
    algorithm, worker = build_algorithm("fedloge", LinearNet(dim=6, classes=4), {"0": 6, "1": 4},
                                        {"etf_steps": 1, "etf_lr": 0.05, "beta": 0.25}, seed=3)
    refined = algorithm.init_server(initial(worker)).models["global"][SSE_WEIGHT].double()
    start = sse_c_weight(6, 4, 0.25, 0, 0.05, 3)  # the sparse ETF before refinement, [C, d]
    nonzero = start != 0
    assert int((~nonzero).sum()) == 6 and torch.equal(refined[~nonzero], torch.zeros(6, dtype=torch.float64))
    assert torch.allclose((refined - start)[nonzero].abs(), torch.full((18,), 0.05, dtype=torch.float64), atol=1e-6)


# ----- sparse_ft: every calibration setting reaches the calibration -----
def calibration_batches(count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(11)
    return [{"x": torch.randn(4, 4, generator=generator), "label": torch.tensor([0, 1, 2, 0])} for _ in range(count)]


def calibrate_recording(monkeypatch, **settings) -> dict:
    """Calibrate a TinyClassifier's mask with ``settings``; returns what reached the score and the mask functions."""
    seen = {}

    def score_fn(model, batches, output_fn=None, **kwargs):
        seen["batches"], seen["score"] = batches(0), kwargs
        return fisher_score_fn(model, batches, output_fn, **kwargs)

    def mask_fn(model, score, **kwargs):
        seen["mask"] = kwargs
        return calibrate_mask(model, score, **kwargs)

    monkeypatch.setattr(sparse_finetune, "fisher_score_fn", score_fn)
    monkeypatch.setattr(sparse_finetune, "calibrate_mask", mask_fn)
    torch.manual_seed(0)
    algorithm, worker = build_algorithm("sparse_ft", TinyClassifier(), {"0": 12}, settings)
    seen["masks"] = algorithm.calibrate(worker, calibration_batches(3), torch.Generator().manual_seed(0), CPU)
    return seen


def test_sparse_ft_calibrates_on_its_first_calibration_batches_with_its_rounds_density_and_score(monkeypatch):
    seen = calibrate_recording(monkeypatch, calibration_batches=2, calibration_rounds=3, density=0.3, score="logit")
    first_two = calibration_batches(2)
    assert len(seen["batches"]) == 2 and all(torch.equal(got["x"], want["x"])
                                             for got, want in zip(seen["batches"], first_two))
    assert seen["score"]["variant"] == "logit" and seen["score"]["likelihood"] == "categorical"  # auto: 3 logits
    assert (seen["mask"]["density"], seen["mask"]["rounds"], seen["mask"]["rule"]) == (0.3, 3, "least_sensitive")
    assert mask_density(seen["masks"]) == round(0.3 * 112) / 112  # TinyNet's body: 112 maskable entries


def test_sparse_ft_takes_a_likelihood_other_than_autos_choice(monkeypatch):
    seen = calibrate_recording(monkeypatch, likelihood="gaussian", calibration_rounds=1)
    assert seen["score"]["likelihood"] == "gaussian" and seen["score"]["variant"] == "log_prob"
    assert len(seen["batches"]) == 3  # the default 4 batches, of the 3 there are


@pytest.mark.parametrize("density, kept", [(0.5, 2), (0.7, 4), (0.3, 2), (0.9, 4)])
def test_a_mask_keeps_density_times_entries_rounded_half_to_even(density, kept):
    """round(d·n) as Python rounds: 2.5 -> 2 and 3.5 -> 4 (half to even); 1.5 -> 2, 4.5 -> 4."""
    model = torch.nn.Linear(5, 1, bias=False)
    masks = calibrate_mask(model, None, density=density, rounds=1, rule="random")
    assert int(masks["weight"].sum()) == kept
