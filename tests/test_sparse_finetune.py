"""sparse_ft (network/algorithms/sparse_finetune.py): frozen entries never move; per-entry aggregation by hand."""

from __future__ import annotations

import pytest
import torch

from network.algorithms import build_algorithm
from network.algorithms.base import GLOBAL_MODEL, ServerState, Upload
from network.algorithms.sparse_finetune import BASE_PREFIX, DELTA, LOCAL_PREFIX, MASK, MASK_PREFIX
from sparse.calibration import mask_density
from tests.test_algorithms import UploadRecorder
from tests.test_engine import global_test, make_engine
from tests.tiny_models import TinyNet
from utils.errors import TaskHetError

MASKABLE = ("body.0.weight", "body.0.bias", "body.1.weight", "body.1.bias")  # the head and BatchNorm buffers are not


def test_client_masks_have_the_density_and_frozen_entries_never_move_through_rounds(tmp_path):
    engine = make_engine(tmp_path, "sparse_ft", rounds=3, client_fraction=1.0, eval_every=3,
                         weight_decay=0.1, settings={"density": 0.25, "calibration_rounds": 2})
    recorder = UploadRecorder(engine)
    start = {key: value.clone() for key, value in engine.server.models[GLOBAL_MODEL].items()}
    engine.run()
    trained_by_anyone = {key: torch.zeros_like(start[key], dtype=torch.bool) for key in MASKABLE}
    for client_id, upload, state in recorder.calls:
        assert set(upload[DELTA]) == set(MASKABLE) and set(upload[MASK]) == set(MASKABLE)
        assert mask_density(upload[MASK]) == round(0.25 * 112) / 112  # TinyNet body: Linear 4·16 + 16, BatchNorm 2·16
        for key, mask in upload[MASK].items():
            assert torch.equal(upload[DELTA][key][~mask], torch.zeros(int((~mask).sum())))  # zero where frozen
            assert torch.equal(state[MASK_PREFIX + key], mask)
            trained_by_anyone[key] |= mask
    final = engine.server.models[GLOBAL_MODEL]
    for key, value in final.items():
        frozen = ~trained_by_anyone[key] if key in trained_by_anyone else torch.ones_like(value, dtype=torch.bool)
        assert torch.equal(value[frozen], start[key][frozen]), key  # the head and BatchNorm buffers too
    masks_per_client = {}
    for client_id, upload, _ in recorder.calls:  # a client's mask is calibrated once, then kept
        masks_per_client.setdefault(client_id, upload[MASK])
        assert all(torch.equal(upload[MASK][key], masks_per_client[client_id][key]) for key in MASKABLE)
    assert any(not torch.equal(first[key], second[key]) for first in masks_per_client.values()
               for second in masks_per_client.values() for key in MASKABLE)  # masks differ between clients


def test_a_server_mask_is_broadcast_and_only_its_entries_move(tmp_path):
    engine = make_engine(tmp_path, "sparse_ft", rounds=2, client_fraction=1.0,
                         settings={"mask_source": "server", "density": 0.1, "mask_rule": "random"})
    engine.calibration_loader = global_test()  # the engine calls calibrate_server with it before round 1
    recorder = UploadRecorder(engine)
    start = {key: value.clone() for key, value in engine.server.models[GLOBAL_MODEL].items()}
    engine.run()
    assert all(state == {} for _, _, state in recorder.calls)  # server masks: clients keep nothing
    assert not any(key.startswith(BASE_PREFIX) for key in engine.server.tensors)  # no keep_local_models
    masks = {key[len(MASK_PREFIX):]: value for key, value in engine.server.tensors.items() if key.startswith(MASK_PREFIX)}
    assert set(masks) == set(MASKABLE) and mask_density(masks) == round(0.1 * 112) / 112
    final = engine.server.models[GLOBAL_MODEL]
    for key, mask in masks.items():
        assert torch.equal(final[key][~mask], start[key][~mask]) and not torch.equal(final[key][mask], start[key][mask])


def test_a_server_mask_without_calibration_data_is_one_clear_error(tmp_path):
    engine = make_engine(tmp_path, "sparse_ft", rounds=1, settings={"mask_source": "server"})
    with pytest.raises(TaskHetError, match="mask_source server needs a held-out calibration split"):
        engine.run()
    client = make_engine(tmp_path / "client", "sparse_ft", rounds=1, settings={"mask_source": "client"})
    assert client.algorithm.calibrate_server(client.server, client.model, None, torch.device("cpu")) is client.server


def test_aggregation_by_hand_two_clients_whose_masks_differ():
    algorithm, _ = build_algorithm("sparse_ft", TinyNet(), {"a": 1, "b": 3})
    weights = {key: torch.zeros_like(value) for key, value in TinyNet().state_dict().items()}
    server = algorithm.init_server(weights)
    shape = weights["body.0.bias"].shape

    def upload(client_id, trained, value, num_samples):
        mask = {key: torch.zeros_like(weights[key], dtype=torch.bool) for key in MASKABLE}
        mask["body.0.bias"][trained] = True
        delta = {key: torch.zeros_like(weights[key]) for key in MASKABLE}
        delta["body.0.bias"][trained] = value
        return Upload(client_id, {DELTA: delta, MASK: mask}, num_samples)

    # a trains entries 0, 1 (Δ = 1, n = 1); b trains entries 1, 2 (Δ = 5, n = 3); nobody trains the rest.
    new = algorithm.aggregate(server, [upload("a", [0, 1], 1.0, 1), upload("b", [1, 2], 5.0, 3)])
    expected = torch.zeros(shape)
    expected[:3] = torch.tensor([1.0, (1 * 1 + 3 * 5) / 4, 5.0])  # entry 0: a only; entry 2: b only, not shrunk
    assert torch.equal(new.models[GLOBAL_MODEL]["body.0.bias"], expected)
    assert all(torch.equal(new.models[GLOBAL_MODEL][key], weights[key]) for key in weights if key != "body.0.bias")
    assert isinstance(new, ServerState)


def test_aggregation_by_hand_three_clients_of_unequal_sizes_and_a_server_learning_rate():
    """Entry j moves by η_g · Σ_i n_i m_ij Δ_ij / Σ_i n_i m_ij over the clients that trained it (none: 0)."""
    algorithm, _ = build_algorithm("sparse_ft", TinyNet(), {"a": 2, "b": 5, "c": 3}, {"server_lr": 0.5})
    weights = {key: torch.ones_like(value) for key, value in TinyNet().state_dict().items()}
    server = algorithm.init_server(weights)

    def upload(client_id, trained, values, num_samples):
        mask = {key: torch.zeros_like(weights[key], dtype=torch.bool) for key in MASKABLE}
        delta = {key: torch.zeros_like(weights[key]) for key in MASKABLE}
        mask["body.0.bias"][trained] = True
        delta["body.0.bias"][trained] = torch.tensor(values)
        return Upload(client_id, {DELTA: delta, MASK: mask}, num_samples)

    # entry 0: a, b, c; entry 1: a, c; entry 2: b only; entry 3: nobody (c's 0 at 0 and 2 is "frozen", no vote).
    new = algorithm.aggregate(server, [upload("a", [0, 1], [1.0, 2.0], 2), upload("b", [0, 2], [4.0, -6.0], 5),
                                       upload("c", [0, 1], [-2.0, 8.0], 3)])
    bias = new.models[GLOBAL_MODEL]["body.0.bias"]
    expected = [1 + 0.5 * (2 * 1 + 5 * 4 + 3 * -2) / 10,  # 1.8
                1 + 0.5 * (2 * 2 + 3 * 8) / 5,  # 3.8: b froze it, so its n = 5 is not in the denominator
                1 + 0.5 * -6.0,  # -2.0: b alone, not shrunk by a's and c's sizes
                1.0]
    assert torch.allclose(bias[:4], torch.tensor(expected)) and torch.equal(bias[4:], torch.ones(bias.numel() - 4))


def test_keep_local_models_keeps_the_base_and_each_clients_local_model(tmp_path):
    engine = make_engine(tmp_path, "sparse_ft", rounds=1, client_fraction=1.0, weight_decay=0.1,
                         settings={"density": 0.25, "calibration_rounds": 1, "keep_local_models": True})
    recorder = UploadRecorder(engine)
    start = {key: value.clone() for key, value in engine.server.models[GLOBAL_MODEL].items()}
    engine.run()
    assert {key[len(BASE_PREFIX):]: value for key, value in engine.server.tensors.items()
            if key.startswith(BASE_PREFIX)}.keys() == start.keys()
    assert all(torch.equal(engine.server.tensors[BASE_PREFIX + key], value) for key, value in start.items())
    for _, upload, state in recorder.calls:  # round 1 starts from θ_0: θ_k = θ_0 + Δ_k, and θ_0 off the mask
        local = {key[len(LOCAL_PREFIX):]: value for key, value in state.items() if key.startswith(LOCAL_PREFIX)}
        assert local.keys() == start.keys() and {key for key in state if key.startswith(MASK_PREFIX)}
        for key, value in local.items():
            if key in upload[DELTA]:
                assert torch.allclose(value, start[key] + upload[DELTA][key], atol=1e-6)
            else:
                assert torch.equal(value, start[key]), key
