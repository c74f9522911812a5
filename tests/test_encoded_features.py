"""Cached features of a frozen encoder (datasets/encoded.py, --cache_features): same numbers, one encoder pass."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import test_fed
from datasets.encoded import ENCODED_KEY, EncodedDataset
from datasets.taskonomy import TaskonomyDataset, read_manifest
from models import build_task_model
from partitioning.assignments import write_assignments
from tests.fixtures import tiny_data_root, tiny_manifest  # noqa: F401  (session fixtures)
from utils.errors import TaskHetError


def encoded(model, base, cache_dir):
    return EncodedDataset(base, base.sample_ids, model.encoder, model.normalise, "rgb", 32, "test", cache_dir,
                          torch.device("cpu"))


@pytest.mark.parametrize("task,encoder", [("depth_euclidean", "resnet18"), ("normal", "small_cnn"),
                                          ("class_scene", "resnet18")])
def test_the_model_gives_the_same_output_from_maps_as_from_images(task, encoder):
    model = build_task_model(task, encoder, "none", num_classes=5, seed=0, freeze_encoder=True).eval()
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, expected_embedding = model(images)
        got, got_embedding = model(model.encoder(model.normalise(images)))
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_embedding, expected_embedding)


def test_maps_equal_the_encoder_output_and_are_shared_by_any_order_of_the_same_samples(tiny_data_root, tiny_manifest,  # noqa: F811
                                                                                       tmp_path, monkeypatch):
    manifest = read_manifest(tiny_manifest)
    model = build_task_model("depth_euclidean", "resnet18", "none", seed=0, freeze_encoder=True)
    base = TaskonomyDataset(tiny_data_root, manifest, ["depth_euclidean"], 32)
    dataset = encoded(model, base, tmp_path / "cache")
    item = dataset[3]
    assert "rgb" not in item and torch.equal(item["depth_euclidean"], base[3]["depth_euclidean"])
    with torch.no_grad():
        maps = model.encoder.eval()(model.normalise(base[3]["rgb"][None]))
    assert len(item[ENCODED_KEY]) == len(maps)
    for cached, direct in zip(item[ENCODED_KEY], maps):
        # The cache encodes a whole batch and this a single image: the CPU's convolution may pick another
        # algorithm for another batch size (seen on an AMD EPYC: 1.3e-6 apart on maps of size ~1), so float32
        # rounding, not a wrong map, sets the tolerance.
        torch.testing.assert_close(cached, direct[0], rtol=1e-4, atol=1e-5)

    # Another order of the same samples reads the same cache: the encoder runs once, on one image (the shape probe).
    shuffled = manifest.iloc[np.random.default_rng(1).permutation(len(manifest))].reset_index(drop=True)
    batch_sizes, forward = [], model.encoder.forward
    monkeypatch.setattr(model.encoder, "forward", lambda x: batch_sizes.append(len(x)) or forward(x))
    again = EncodedDataset(TaskonomyDataset(tiny_data_root, shuffled, ["depth_euclidean"], 32), shuffled["sample_id"].tolist(),
                           model.encoder, model.normalise, "rgb", 32, "test", tmp_path / "cache", torch.device("cpu"))
    position = list(shuffled["sample_id"]).index(item["sample_id"])
    for cached, first in zip(again[position][ENCODED_KEY], item[ENCODED_KEY]):
        assert torch.equal(cached, first)
    assert batch_sizes == [1] and len(list((tmp_path / "cache").glob("encoded_*"))) == 1


@pytest.mark.kernels
@pytest.mark.parametrize("on_disk", [True, False])
def test_a_batched_read_equals_reading_one_by_one(tiny_data_root, tiny_manifest, tmp_path, monkeypatch, on_disk):  # noqa: F811
    # torch's DataLoader reads a batch through __getitems__ (one store read per map, the base's own batched read).
    manifest = read_manifest(tiny_manifest)
    model = build_task_model("segment_semantic", "small_cnn", "none", seed=0, freeze_encoder=True)
    base = TaskonomyDataset(tiny_data_root, manifest, ["segment_semantic"], 32, cache_dir=tmp_path / "decoded")
    dataset = encoded(model, base, tmp_path / "cache" if on_disk else None)
    batch = [4, 1, 4, 9]
    expected = [dataset[index] for index in batch]
    monkeypatch.setattr(dataset.store, "get", lambda row: (_ for _ in ()).throw(AssertionError("read one by one")))
    got = dataset.__getitems__(batch)
    assert len(got) == len(expected) and dataset.__getitems__([]) == []
    for one, other in zip(got, expected):
        assert set(one) == set(other) and "rgb" not in one and one["sample_id"] == other["sample_id"]
        assert one["segment_semantic"].dtype == torch.int64 and torch.equal(one["segment_semantic"], other["segment_semantic"])
        assert torch.equal(one["mask"], other["mask"]) and torch.equal(one["scene_class"], other["scene_class"])
        assert len(one[ENCODED_KEY]) == len(other[ENCODED_KEY])
        assert all(torch.equal(a, b) for a, b in zip(one[ENCODED_KEY], other[ENCODED_KEY]))


def test_other_weights_get_another_cache_and_a_trainable_encoder_is_refused(tiny_data_root, tiny_manifest, tmp_path):  # noqa: F811
    base = TaskonomyDataset(tiny_data_root, read_manifest(tiny_manifest), ["depth_euclidean"], 32)
    first = build_task_model("depth_euclidean", "small_cnn", "none", seed=0, freeze_encoder=True)
    second = build_task_model("depth_euclidean", "small_cnn", "none", seed=1, freeze_encoder=True)
    a, b = encoded(first, base, tmp_path), encoded(second, base, tmp_path)
    assert a.store.directory != b.store.directory
    assert not torch.equal(a[0][ENCODED_KEY][0], b[0][ENCODED_KEY][0])
    with pytest.raises(TaskHetError, match="--freeze_encoder"):
        encoded(build_task_model("depth_euclidean", "small_cnn", "none", seed=0), base, None)


def test_a_federated_run_on_cached_features_matches_one_on_images(tiny_data_root, tiny_manifest, tmp_path):  # noqa: F811
    train = read_manifest(tiny_manifest).query("split == 'train'").sort_values("sample_id").reset_index(drop=True)
    table = pd.DataFrame({"sample_id": train["sample_id"], "client_id": train.index % 3, "group": train["scene_class"],
                          "subset": ["test" if (index // 3) % 3 == 2 else "train" for index in train.index]})
    assignments = tmp_path / "assignments.csv"
    write_assignments(assignments, table, {"scheme": "round_robin", "alpha": 1.0, "n_clients": 3, "groups": "scene_class"})
    common = ["--task", "normal", "--data_path", str(tiny_data_root), "--manifest", str(tiny_manifest),
              "--assignments", str(assignments), "--encoder", "resnet18", "--freeze_encoder", "--image_size", "32",
              "--n_rounds", "2", "--local_steps", "2", "--batch_size", "4", "--no-use_accelerator", "--no-progress", "--no-plots",
              "--method", "scaffold", "--momentum", "0.9", "--cache_dir", str(tmp_path / "cache")]
    test_fed.main([*common, "--out", str(tmp_path / "images")])
    test_fed.main([*common, "--out", str(tmp_path / "cached"), "--cache_features"])
    images = pd.read_csv(tmp_path / "images" / "metrics.csv", dtype={"client": str})
    cached = pd.read_csv(tmp_path / "cached" / "metrics.csv", dtype={"client": str})
    pd.testing.assert_frame_equal(images[["round", "split", "client", "metric"]], cached[["round", "split", "client", "metric"]])
    assert (images.value - cached.value).abs().max() < 1e-4
    assert list((tmp_path / "cache").glob("encoded_*"))
    with pytest.raises(TaskHetError, match="--freeze_encoder"):
        test_fed.main([arg for arg in common if arg != "--freeze_encoder"] + ["--out", str(tmp_path / "bad"), "--cache_features"])
