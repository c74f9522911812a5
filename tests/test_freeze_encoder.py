"""A frozen encoder (--freeze_encoder, model.freeze_encoder): only the decoder and head train, in step 2 and step 4."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models import build_task_model, load_task_model
from network.algorithms import build_algorithm
from network.algorithms.base import ClientConfig, Upload
from utils.run_dir import atomic_torch_save


def batches(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [{"rgb": torch.rand(4, 3, 32, 32, generator=generator),
             "depth_euclidean": torch.rand(4, 1, 32, 32, generator=generator) * 5,
             "mask": torch.ones(4, 1, 32, 32, dtype=torch.bool)} for _ in range(2)]


def depth_loss(model, batch, reduction="mean"):
    return model.task.loss(model(batch["rgb"])[0].float(), batch, reduction)


def test_a_frozen_encoder_keeps_every_entry_and_stays_in_eval_mode_while_the_rest_trains():
    model = build_task_model("depth_euclidean", "resnet18", "none", seed=0, freeze_encoder=True)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    algorithm, worker = build_algorithm("fedavg", model, {"0": 8})
    cfg = ClientConfig(lr=0.05, loss_fn=depth_loss, device=torch.device("cpu"), num_samples=8, local_steps=3,
                       momentum=0.9, weight_decay=0.1)
    result = algorithm.client_update(worker, {"global": before}, {}, batches(), cfg)
    assert not worker.encoder.training and worker.decoder.training
    for key, value in worker.state_dict().items():
        if key.startswith("encoder."):  # weights and BatchNorm statistics (running_mean, running_var, counter)
            assert torch.equal(value, before[key]), key
    # Fixed entries are never uploaded: every party holds them and they cannot change.
    encoder_keys = {key for key in before if key.startswith("encoder.")}
    assert algorithm.federation.layout.fixed_keys == encoder_keys
    assert set(result.upload["delta"]) == set(before) - encoder_keys
    assert any(result.upload["delta"][key].abs().sum() > 0 for key in before if key.startswith("head."))
    assert any(result.upload["delta"][key].abs().sum() > 0 for key in before if key.startswith("decoder."))


@pytest.mark.parametrize("method", ["fedavg", "scaffold", "fedrep", "ifca"])
def test_the_server_keeps_a_frozen_encoder_exactly_and_moves_the_rest_by_the_weighted_mean(method):
    model = build_task_model("depth_euclidean", "resnet18", "none", seed=0, freeze_encoder=True)
    algorithm, worker = build_algorithm(method, model, {"a": 10, "b": 30})
    initial = {key: value.clone() for key, value in model.state_dict().items()}
    server = algorithm.init_server({key: value.clone() for key, value in initial.items()})
    start = {name: dict(weights) for name, weights in server.models.items()}
    cfg = ClientConfig(lr=0.05, loss_fn=depth_loss, device=torch.device("cpu"), num_samples=10, local_steps=2)
    uploads = []
    for client, size, seed in (("a", 10, 0), ("b", 30, 1)):
        broadcast = algorithm.broadcast(server)
        result = algorithm.client_update(worker, broadcast, {}, batches(seed), dataclasses.replace(cfg, num_samples=size))
        assert not any(key.startswith("encoder.") for bundle in result.upload.values() for key in bundle)
        uploads.append(Upload(client, result.upload, size))
    new = algorithm.aggregate(server, uploads)
    for name, weights in new.models.items():
        for key, value in weights.items():
            if key.startswith("encoder."):  # IFCA's perturbed cluster models too: the encoder is everyone's
                assert torch.equal(value, initial[key]), (name, key)
    if method == "fedavg":  # x + (10·Δa + 30·Δb) / 40 on a decoder entry
        key = "head.weight"
        expected = start["global"][key] + (10 * uploads[0].tensors["delta"][key] + 30 * uploads[1].tensors["delta"][key]) / 40
        torch.testing.assert_close(new.models["global"][key], expected)


def test_the_choice_travels_with_the_checkpoint(tmp_path):
    model = build_task_model("depth_euclidean", "small_cnn", "none", seed=0, freeze_encoder=True)
    atomic_torch_save({"model": model.state_dict(), "model_config": model.config}, tmp_path / "best.pt")
    again = load_task_model(tmp_path / "best.pt")
    assert again.config["freeze_encoder"] and not any(param.requires_grad for param in again.encoder.parameters())
    assert all(param.requires_grad for param in again.head.parameters())
    plain = build_task_model("depth_euclidean", "small_cnn", "none", seed=0)
    assert all(param.requires_grad for param in plain.parameters()) and plain.encoder.training
