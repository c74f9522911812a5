"""Aggregation arithmetic against hand-computed values (network/aggregation.py)."""

import math

import pytest
import torch

from network.aggregation import (ADAM_M_PREFIX, ADAM_V_PREFIX, MOMENTUM_PREFIX, ServerOptSettings, WeightedMean,
                                 apply_update, client_summary, init_server_optimizer, server_step, subtract,
                                 weighted_average)
from network.algorithms import build_algorithm
from network.algorithms.base import Upload
from tests.tiny_models import TinyNet
from utils.errors import TaskHetError


def test_weighted_average_matches_hand_computed_mean():
    uploads = [({"w": torch.tensor([1.0, 2.0])}, 1), ({"w": torch.tensor([3.0, 6.0])}, 3)]
    mean, count = weighted_average(uploads)
    # (1·1 + 3·3) / 4 = 2.5 and (1·2 + 3·6) / 4 = 5
    assert torch.equal(mean["w"], torch.tensor([2.5, 5.0]))
    assert count == 2


def test_weighted_average_reads_a_generator_once():
    consumed = []

    def uploads():
        for value, weight in ((1.0, 2), (4.0, 1)):
            consumed.append(value)
            yield {"w": torch.tensor([value], dtype=torch.float64)}, weight

    mean, count = weighted_average(uploads())
    assert consumed == [1.0, 4.0] and count == 2
    assert mean["w"].item() == pytest.approx((2 * 1.0 + 4.0) / 3)
    assert mean["w"].dtype == torch.float64


def test_integer_entries_take_the_rounded_mean_and_keep_their_dtype():
    mean, _ = weighted_average([({"count": torch.tensor(1)}, 1), ({"count": torch.tensor(4)}, 2)])
    assert mean["count"].dtype == torch.int64 and mean["count"].item() == 3  # (1 + 8) / 3
    mean, _ = weighted_average([({"count": torch.tensor(2)}, 2), ({"count": torch.tensor(3)}, 3)])
    assert mean["count"].item() == 3  # (4 + 9) / 5 = 2.6 rounds to 3 (truncating would give 2)


def test_weighted_mean_rejects_mismatched_keys_negative_weights_and_nothing():
    accumulator = WeightedMean()
    accumulator.add({"a": torch.zeros(2)}, 1.0)
    with pytest.raises(ValueError, match=r"keys differ from the first upload's: \['a', 'b'\]$"):  # the differing keys
        accumulator.add({"b": torch.zeros(2)}, 1.0)
    with pytest.raises(ValueError, match=r": \['a', 'k0', 'k1', 'k2', 'k3'\]$"):  # at most 5 of them
        accumulator.add({f"k{index}": torch.zeros(2) for index in range(6)}, 1.0)
    with pytest.raises(ValueError, match=">= 0"):
        accumulator.add({"a": torch.zeros(2)}, -1.0)
    with pytest.raises(TaskHetError, match="^nothing to aggregate: no client upload with a positive weight this round$"):
        WeightedMean().mean()
    with pytest.raises(TaskHetError, match="nothing to aggregate"):
        weighted_average([({"a": torch.ones(1)}, 0)])


def test_subtract_and_apply_update():
    a = {"x": torch.tensor([5.0, 7.0]), "y": torch.tensor([1.0])}
    b = {"x": torch.tensor([1.0, 2.0]), "y": torch.tensor([9.0])}
    assert torch.equal(subtract(a, b, ["x"])["x"], torch.tensor([4.0, 5.0]))
    updated = apply_update(a, {"x": torch.tensor([2.0, -2.0])}, scale=0.5)
    assert torch.equal(updated["x"], torch.tensor([6.0, 6.0]))
    assert updated["y"] is a["y"] and torch.equal(a["x"], torch.tensor([5.0, 7.0]))  # inputs untouched


def test_server_sgd_step_scales_parameters_only():
    weights = {"x": torch.tensor([1.0]), "buffer": torch.tensor([1.0])}
    new, state = server_step(weights, {"x": torch.tensor([2.0]), "buffer": torch.tensor([2.0])}, {},
                             ServerOptSettings(server_lr=0.5), param_keys=["x"])
    assert new["x"].item() == 2.0 and new["buffer"].item() == 3.0 and state == {}


def test_server_momentum_accumulates_velocity():
    settings = ServerOptSettings(server_opt="momentum", server_momentum=0.9)
    weights = {"x": torch.tensor([1.0])}
    state = init_server_optimizer(settings, weights, ["x"])
    assert torch.equal(state[MOMENTUM_PREFIX + "x"], torch.zeros(1))
    weights, state = server_step(weights, {"x": torch.tensor([2.0])}, state, settings, ["x"])
    assert weights["x"].item() == pytest.approx(3.0)  # v = 2
    weights, state = server_step(weights, {"x": torch.tensor([1.0])}, state, settings, ["x"])
    assert state[MOMENTUM_PREFIX + "x"].item() == pytest.approx(2.8)  # v = 0.9·2 + 1
    assert weights["x"].item() == pytest.approx(5.8)


def test_server_adam_matches_reddi_et_al():
    settings = ServerOptSettings(server_opt="adam", server_lr=0.1, server_beta1=0.9, server_beta2=0.99, server_tau=1e-3)
    weights = {"x": torch.tensor([0.0], dtype=torch.float64)}
    state = init_server_optimizer(settings, weights, ["x"])
    new, state = server_step(weights, {"x": torch.tensor([2.0], dtype=torch.float64)}, state, settings, ["x"])
    # m = 0.1·2 = 0.2, v = 0.01·4 = 0.04, x = 0 + 0.1 · 0.2 / (0.2 + 0.001)
    assert state[ADAM_M_PREFIX + "x"].item() == pytest.approx(0.2)
    assert state[ADAM_V_PREFIX + "x"].item() == pytest.approx(0.04)
    assert new["x"].item() == pytest.approx(0.1 * 0.2 / 0.201)


def test_server_step_moves_only_updated_keys_and_buffers_take_the_plain_mean():
    settings = ServerOptSettings(server_opt="adam", server_lr=0.5)
    weights = {"body": torch.tensor([1.0]), "head": torch.tensor([5.0]), "count": torch.tensor(10),
               "running_var": torch.tensor([1.0])}
    state = init_server_optimizer(settings, weights, ["body", "head"])
    assert set(state) == {ADAM_M_PREFIX + "body", ADAM_M_PREFIX + "head", ADAM_V_PREFIX + "body", ADAM_V_PREFIX + "head"}
    new, new_state = server_step(weights, {"body": torch.tensor([1.0]), "count": torch.tensor(3),
                                           "running_var": torch.tensor([-0.25])}, state, settings, ["body", "head"])
    assert new["head"].item() == 5.0 and new["count"].item() == 13 and new["count"].dtype == torch.int64
    assert new["running_var"].item() == 0.75  # x + Δ, neither Adam nor η_g
    assert new["body"].item() != 1.0
    assert torch.equal(new_state[ADAM_M_PREFIX + "head"], state[ADAM_M_PREFIX + "head"])


@pytest.mark.parametrize("field, value", [("server_opt", "lamb"), ("server_lr", 0.0), ("server_momentum", 1.0),
                                          ("server_beta2", -0.1), ("server_tau", 0.0)])
def test_bad_server_optimizer_settings_are_rejected_naming_the_setting(field, value):
    with pytest.raises(TaskHetError, match=f"setting {field} must be"):
        ServerOptSettings(**{field: value})


def test_client_summary_mean_std_and_worst_decile():
    summary = client_summary([1.0, 2.0, 3.0, 4.0])
    assert summary["mean"] == 2.5
    assert summary["std"] == pytest.approx(math.sqrt(1.25))  # population std
    assert summary["worst_decile"] == 4.0  # ceil(10 % of 4) = 1 client
    assert client_summary([float(value) for value in range(1, 21)])["worst_decile"] == 19.5  # mean(20, 19)


def test_apply_update_rounds_a_fractional_update_into_an_integer_entry():
    updated = apply_update({"count": torch.tensor(10), "x": torch.tensor([1.0])},
                           {"count": torch.tensor(2.6), "x": torch.tensor([0.5])}, scale=1.0)
    assert updated["count"].dtype == torch.int64 and updated["count"].item() == 13  # 10 + 2.6, rounded
    assert updated["x"].item() == 1.5


def test_server_step_keeps_each_weights_dtype_whatever_the_uploads_dtype():
    weights = {"x": torch.tensor([1.0], dtype=torch.float32), "count": torch.tensor(4)}
    new, _ = server_step(weights, {"x": torch.tensor([0.25], dtype=torch.float64), "count": torch.tensor(2)}, {},
                         ServerOptSettings(server_lr=2.0), param_keys=["x"])
    assert new["x"].dtype == torch.float32 and new["x"].item() == 1.5
    assert new["count"].dtype == torch.int64 and new["count"].item() == 6


def test_client_summary_in_double_precision_and_its_worst_decile_rounds_up():
    values = [0.1, 0.2, 0.4]
    summary = client_summary(values)
    assert summary["mean"] == pytest.approx(sum(values) / 3, rel=1e-15, abs=0)  # float32 would be off by ~1e-8
    assert summary["std"] == pytest.approx(math.sqrt(sum((v - sum(values) / 3) ** 2 for v in values) / 3), rel=1e-14)
    assert client_summary([float(value) for value in range(1, 12)])["worst_decile"] == 10.5  # ceil(1.1) = 2: mean(11, 10)
    with pytest.raises(ValueError, match="^client_summary needs at least one value$"):
        client_summary([])


def test_server_step_moves_parameters_that_follow_a_buffer():
    weights = {"body": torch.tensor([1.0]), "running_mean": torch.tensor([0.0]), "head": torch.tensor([2.0])}
    mean_delta = {key: torch.tensor([1.0]) for key in weights}  # the model's order: a buffer between parameters
    for settings in (ServerOptSettings(server_lr=0.5), ServerOptSettings(server_opt="momentum", server_lr=0.5)):
        new, _ = server_step(weights, mean_delta, init_server_optimizer(settings, weights, ["body", "head"]), settings,
                             param_keys=["body", "head"])
        assert new["body"].item() == 1.5 and new["head"].item() == 2.5 and new["running_mean"].item() == 1.0


# ----- aggregation weighting (issue 21) -----
def test_capped_shares_water_fill_to_hand_computed_values():
    from network.aggregation import client_weights

    # n = (70, 20, 6, 4): 0.7 > 0.4 is capped; 0.6 left in proportion 20:6:4 gives 0.4, 0.12, 0.08 (0.4 is not above).
    shares = client_weights({"a": 70, "b": 20, "c": 6, "d": 4}, "capped", cap=0.4)
    assert shares == pytest.approx({"a": 0.4, "b": 0.4, "c": 0.12, "d": 0.08}, abs=1e-15)
    # Two rounds of water-filling: (50, 30, 15, 5) with cap 0.3: a capped, 0.7·30/50 = 0.42 > 0.3 caps b,
    # then 0.4 in proportion 15:5 = 0.3, 0.1.
    shares = client_weights({"a": 50, "b": 30, "c": 15, "d": 5}, "capped", cap=0.3)
    assert shares == pytest.approx({"a": 0.3, "b": 0.3, "c": 0.3, "d": 0.1}, abs=1e-15)
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-15) and max(shares.values()) <= 0.3 + 1e-15
    assert client_weights({"a": 3, "b": 1}, "uniform") == {"a": 0.5, "b": 0.5}
    assert client_weights({"a": 3, "b": 1}, "samples") == {"a": 0.75, "b": 0.25}
    assert client_weights({"a": 3, "b": 1}, "capped", cap=0.9) == {"a": 0.75, "b": 0.25}  # no one above: samples


@pytest.mark.parametrize("seed", range(20))
def test_capped_shares_sum_to_one_with_none_above_the_cap_on_random_federations(seed):
    from network.aggregation import client_weights

    generator = torch.Generator().manual_seed(seed)
    count = int(torch.randint(2, 30, (1,), generator=generator))
    sizes = {str(index): int(value) for index, value in enumerate(torch.randint(1, 1000, (count,), generator=generator)
                                                                   ** 2)}
    cap = 1 / count + float(torch.rand(1, generator=generator)) * (1 - 1 / count)
    shares = client_weights(sizes, "capped", cap)
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-12) and max(shares.values()) <= cap + 1e-12
    uncapped = [client for client in sizes if shares[client] < cap - 1e-12]
    ratios = {shares[client] / sizes[client] for client in uncapped}  # the others keep proportional shares
    assert max(ratios) - min(ratios) <= 1e-12 * max(ratios) if ratios else True


def test_shares_at_the_edges_by_hand():
    from network.aggregation import client_weights

    # No training rows at all (a check-only build): every client counts the same, whatever the weighting.
    for weighting in ("samples", "capped"):
        assert client_weights({"a": 0, "b": 0, "c": 0, "d": 0}, weighting, cap=0.5) == dict.fromkeys("abcd", 0.25)
    assert client_weights({"a": 1, "b": 0}, "samples") == {"a": 1.0, "b": 0.0}  # one row is still by size
    # A cap of exactly 1/N is feasible: (0.5, 0.3) are capped, then 0.5 in proportion 1:1 gives the cap to all.
    assert client_weights({"a": 5, "b": 3, "c": 1, "d": 1}, "capped", cap=0.25) == dict.fromkeys("abcd", 0.25)
    # The excess goes to clients without rows equally when no uncapped client has any: (1, 0, 0), cap 0.5.
    assert client_weights({"a": 10, "b": 0, "c": 0}, "capped", cap=0.5) == {"a": 0.5, "b": 0.25, "c": 0.25}


def test_an_infeasible_cap_is_one_error_naming_the_setting():
    from network.aggregation import client_weights

    with pytest.raises(TaskHetError, match=r"^setting cap must be >= 1/N = 0.25 for N = 4 clients .*got 0.2$"):
        client_weights({"a": 1, "b": 1, "c": 1, "d": 1}, "capped", cap=0.2)
    with pytest.raises(TaskHetError, match="setting cap must be >= 1/N"):
        build_algorithm("fedavg", TinyNet(), {str(index): 10 for index in range(5)}, {"weighting": "capped", "cap": 0.1})


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "ditto", "fedrep", "fedper", "fedbn", "scaffold", "sparse_ft"])
def test_every_model_averaging_method_takes_the_uniform_and_capped_means(name):
    sizes = {"0": 70, "1": 20, "2": 6, "3": 4}
    deltas = {"0": 1.0, "1": 2.0, "2": 4.0, "3": 8.0}
    expected = {"samples": 0.7 * 1 + 0.2 * 2 + 0.06 * 4 + 0.04 * 8, "uniform": (1 + 2 + 4 + 8) / 4,
                "capped": 0.4 * 1 + 0.4 * 2 + 0.12 * 4 + 0.08 * 8}
    sampled = ["0", "2", "3"]  # partial participation: the mean over S of the shares, renormalised
    expected_partial = {"samples": (70 * 1 + 6 * 4 + 4 * 8) / 80, "uniform": (1 + 4 + 8) / 3,
                        "capped": (0.4 * 1 + 0.12 * 4 + 0.08 * 8) / 0.6}
    for weighting in ("samples", "uniform", "capped"):
        algorithm, worker = build_algorithm(name, TinyNet(), sizes, {"weighting": weighting, "cap": 0.4})
        server = algorithm.init_server({key: value.clone() for key, value in worker.state_dict().items()})
        key = "body.0.weight"
        for clients, value in ((list(sizes), expected[weighting]), (sampled, expected_partial[weighting])):
            uploads = [Upload(client, _uniform_upload(algorithm, server, deltas[client]), sizes[client])
                       for client in clients]
            new = algorithm.aggregate(server, uploads).models["global"][key]
            assert torch.allclose(new - server.models["global"][key], torch.full_like(new, value), rtol=1e-6), \
                (weighting, clients)


def _uniform_upload(algorithm, server, value):
    """An upload of the algorithm's own shape whose every Δ entry equals ``value`` (masks: all trained)."""
    weights = server.models["global"]
    params = algorithm.federation.layout.param_keys
    delta = {key: torch.full_like(weights[key], value) for key in params if key in weights}
    if algorithm.name == "scaffold":
        return {"delta": delta, "control_delta": {key: torch.zeros_like(tensor) for key, tensor in delta.items()}}
    if algorithm.name == "sparse_ft":
        keys = algorithm.maskable
        return {"delta": {key: delta[key] for key in keys}, "mask": {key: torch.ones_like(delta[key]) for key in keys}}
    shared = set(algorithm.shared_keys())
    return {"delta": {key: tensor for key, tensor in delta.items() if key in shared}}


def test_client_summary_gives_the_fairness_measures_by_hand():
    losses = [1.0, 2.0, 3.0, 6.0]
    summary = client_summary(losses)
    assert summary["worst"] == 6.0 and summary["best"] == 1.0
    assert summary["worst_decile"] == 6.0 and summary["best_decile"] == 1.0
    assert summary["variance"] == pytest.approx(3.5)  # mean 3: (4 + 1 + 0 + 9) / 4
    assert summary["jain"] == pytest.approx(12 ** 2 / (4 * 50))  # (Σx)² / (N·Σx²) = 144 / 200
    accuracies = [float(value) / 20 for value in range(1, 21)]
    summary = client_summary(accuracies, higher_is_better=True)
    assert summary["worst"] == 0.05 and summary["best"] == 1.0
    assert summary["worst_decile"] == pytest.approx(0.075) and summary["best_decile"] == pytest.approx(0.975)
    assert client_summary([0.5, 0.5, 0.5])["jain"] == 1.0
    assert "jain" not in client_summary([-1.0, 1.0]) and "jain" not in client_summary([0.0, 0.0])
