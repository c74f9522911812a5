"""The Taskonomy loader: decoders, spellings, sample dicts, masks, the decoded cache and bad input."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from steps import download as download_taskonomy
from datasets.cache import DecodedSampleCache
from datasets.taskonomy import (MANIFEST_COLUMNS, TaskonomyDataset, check_data_root, discover_samples, domain_dir,
                                index_building, read_manifest)
from datasets.taskonomy_domains import (DOMAINS, NUM_SEMANTIC_CLASSES, SEGMENT_IGNORE_INDEX, SEMANTIC_CLASS_NAMES,
                                        decode_depth, decode_normal, decode_segment_semantic)
from tests.fixtures import tiny_data_root, tiny_manifest  # noqa: F401
from utils.errors import TaskHetError

ALL_DOMAINS = [domain for domain in DOMAINS if domain != "rgb"]


@pytest.fixture
def data_copy(tiny_data_root, tmp_path) -> Path:
    """A writable copy of the tiny data root (for tests that damage it)."""
    return Path(shutil.copytree(tiny_data_root, tmp_path / "data"))


def test_sample_dict_matches_the_shared_interface(tiny_data_root, tiny_manifest):
    manifest = read_manifest(tiny_manifest)
    sample = TaskonomyDataset(tiny_data_root, manifest, ALL_DOMAINS, 32)[0]
    expected = {
        "rgb": ((3, 32, 32), torch.float32), "depth_euclidean": ((1, 32, 32), torch.float32),
        "depth_zbuffer": ((1, 32, 32), torch.float32), "normal": ((3, 32, 32), torch.float32),
        "reshading": ((1, 32, 32), torch.float32), "segment_semantic": ((32, 32), torch.int64),
        "edge_texture": ((1, 32, 32), torch.float32), "edge_occlusion": ((1, 32, 32), torch.float32),
        "keypoints2d": ((1, 32, 32), torch.float32), "keypoints3d": ((1, 32, 32), torch.float32),
        "principal_curvature": ((2, 32, 32), torch.float32), "class_scene": ((365,), torch.float32),
        "mask_valid": ((1, 32, 32), torch.bool), "mask": ((1, 32, 32), torch.bool), "scene_class": ((), torch.int64),
    }
    assert {key: (tuple(value.shape), value.dtype) for key, value in sample.items() if key != "sample_id"} == expected
    assert sample["sample_id"] == manifest.at[0, "sample_id"]
    assert int(sample["scene_class"]) == manifest.at[0, "scene_class"]
    assert 0 <= sample["rgb"].min() and sample["rgb"].max() <= 1
    assert sample["normal"].min() >= -1 and sample["normal"].max() <= 1


def test_default_collate_batches_samples(tiny_data_root, tiny_manifest):
    dataset = TaskonomyDataset(tiny_data_root, read_manifest(tiny_manifest), ["depth_euclidean", "class_scene"], 32)
    batch = next(iter(DataLoader(dataset, batch_size=5)))
    assert batch["rgb"].shape == (5, 3, 32, 32) and batch["class_scene"].shape == (5, 365)
    assert batch["scene_class"].shape == (5,) and batch["sample_id"] == dataset.sample_ids[:5]


def test_resizing_keeps_label_values_and_rgb_range(tiny_data_root, tiny_manifest):
    manifest = read_manifest(tiny_manifest)
    full = TaskonomyDataset(tiny_data_root, manifest, ["segment_semantic", "depth_euclidean"], 32)
    small = TaskonomyDataset(tiny_data_root, manifest, ["segment_semantic", "depth_euclidean"], 16)
    for index in range(4):
        big, little = full[index], small[index]
        assert little["rgb"].shape == (3, 16, 16) and little["segment_semantic"].shape == (16, 16)
        assert set(little["segment_semantic"].unique().tolist()) <= set(big["segment_semantic"].unique().tolist())
        assert set(np.unique(little["depth_euclidean"].numpy())) <= set(np.unique(big["depth_euclidean"].numpy()))
        assert torch.all(little["depth_euclidean"][~little["mask"]] == 0)
        assert 0 <= little["rgb"].min() and little["rgb"].max() <= 1
        # Bilinear shrinking of rgb averages, so its mean stays close to the full-size mean.
        assert abs(float(little["rgb"].mean() - big["rgb"].mean())) < 0.02


def test_mask_valid_is_used_when_on_disk_even_if_not_requested(data_copy, tiny_manifest):
    manifest = read_manifest(tiny_manifest)
    row = manifest.iloc[0]
    path = domain_dir(data_copy, "mask_valid", row["building"]) / f"point_{row['point']}_view_{row['view']}_domain_mask_valid.png"
    Image.fromarray(np.zeros((32, 32), dtype=np.uint8)).save(path)
    sample = TaskonomyDataset(data_copy, manifest, ["reshading"], 32)[0]
    assert "mask_valid" not in sample and not sample["mask"].any()
    shutil.rmtree(data_copy / "mask_valid")
    assert TaskonomyDataset(data_copy, manifest, ["reshading"], 32)[0]["mask"].all()


def test_decoders_units_and_invalid_codes(tmp_path):
    raw = np.array([[0, 512, 1024], [65534, 65535, 256]], dtype=np.uint16)
    Image.fromarray(raw).save(tmp_path / "depth.png")
    metres, valid = decode_depth(tmp_path / "depth.png")
    np.testing.assert_allclose(metres[0], [[0, 1, 2], [65534 / 512, 0, 0.5]])
    np.testing.assert_array_equal(valid, [[True, True, True], [True, False, True]])
    pixels = np.array([[[128, 128, 128], [128, 128, 255]]], dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "normal.png")
    normal, valid = decode_normal(tmp_path / "normal.png")
    np.testing.assert_array_equal(valid, [[False, True]])
    np.testing.assert_allclose(normal[:, 0, 1], [128 / 255 * 2 - 1, 128 / 255 * 2 - 1, 1.0], atol=1e-6)


def test_segment_semantic_decodes_the_real_taskonomy_convention(tmp_path):
    # Real files: raw 0 = unlabelled, raw 1..17 = the 17 classes (background first); Taskonomy's loader uses raw - 1.
    raw = np.array([list(range(0, 10)), list(range(10, 18)) + [18, 255]], dtype=np.uint8)
    path = tmp_path / "point_0_view_0_domain_segmentsemantic.png"
    Image.fromarray(raw).save(path)
    classes, valid = decode_segment_semantic(path)
    assert valid is None and classes.dtype == np.int64
    expected = np.where((raw >= 1) & (raw <= 17), raw.astype(np.int64) - 1, SEGMENT_IGNORE_INDEX)
    np.testing.assert_array_equal(classes, expected)
    assert classes[0, 1] == 0 and SEMANTIC_CLASS_NAMES[0] == "background"  # raw 1 is background, class 0
    assert classes[1, 7] == 16 and SEMANTIC_CLASS_NAMES[16] == "vase"  # raw 17 is the 17th class, not dropped
    assert classes[0, 0] == classes[1, 8] == classes[1, 9] == SEGMENT_IGNORE_INDEX  # raw 0 and raw > 17
    assert len(SEMANTIC_CLASS_NAMES) == NUM_SEMANTIC_CLASSES == 17
    assert SEGMENT_IGNORE_INDEX not in range(NUM_SEMANTIC_CLASSES)


def test_spelling_variants_are_matched_on_point_and_view(tmp_path):
    folder = domain_dir(tmp_path, "segment_semantic", "alpha")
    folder.mkdir(parents=True)
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(folder / "point_3_view_1_domain_segmentsemantic.png")
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(folder / "point_4_view_0_domain_segment_semantic.png")
    (folder / "scene_classes.csv").write_text("ignored")
    assert set(index_building(tmp_path, "segment_semantic", "alpha")) == {(3, 1), (4, 0)}
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(folder / "point_3_view_1_domain_segment_semantic.png")
    with pytest.raises(TaskHetError, match="two files for point 3 view 1"):
        index_building(tmp_path, "segment_semantic", "alpha")


def test_discover_samples_lists_only_complete_samples(data_copy):
    (domain_dir(data_copy, "normal", "synth001") / "point_0_view_2_domain_normal.png").unlink()
    samples = discover_samples(data_copy, ["normal", "class_scene"], ["synth000", "synth001"])
    assert len(samples) == 11 and "synth001_point_0_view_2" not in set(samples["sample_id"])
    assert samples["sample_id"].is_unique
    assert (data_copy / samples.at[0, "path_normal"]).is_file()


def test_corrupt_png_error_names_the_file(data_copy, tiny_manifest):
    manifest = read_manifest(tiny_manifest)
    row = manifest.iloc[2]
    path = domain_dir(data_copy, "depth_euclidean", row["building"]) / f"point_{row['point']}_view_{row['view']}_domain_depth_euclidean.png"
    path.write_bytes(path.read_bytes()[:40])
    dataset = TaskonomyDataset(data_copy, manifest, ["depth_euclidean"], 32)
    with pytest.raises(TaskHetError, match=str(path)):
        dataset[2]
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(path)
    with pytest.raises(TaskHetError, match=f"{path}: PNG mode 'RGB'"):
        dataset[2]


def test_missing_root_domain_and_building_are_named(data_copy, tiny_manifest):
    manifest = read_manifest(tiny_manifest)
    with pytest.raises(TaskHetError, match="data root .*nowhere does not exist"):
        TaskonomyDataset(data_copy / "nowhere", manifest, ["normal"], 32)
    shutil.rmtree(data_copy / "keypoints3d")
    with pytest.raises(TaskHetError, match="domain folder .*keypoints3d"):
        TaskonomyDataset(data_copy, manifest, ["keypoints3d"], 32)
    shutil.rmtree(domain_dir(data_copy, "normal", "synth002"))
    with pytest.raises(TaskHetError, match="building 'synth002' is not on disk"):
        check_data_root(data_copy, ["normal"], ["synth002"])
    (domain_dir(data_copy, "reshading", "synth000") / "point_0_view_0_domain_reshading.png").unlink()
    with pytest.raises(TaskHetError, match="sample synth000_point_0_view_0 has no reshading file"):
        TaskonomyDataset(data_copy, manifest, ["reshading"], 32)
    with pytest.raises(TaskHetError, match="unknown domain 'depth'"):
        TaskonomyDataset(data_copy, manifest, ["depth"], 32)
    (data_copy / manifest.at[4, "rgb_path"]).unlink()
    with pytest.raises(TaskHetError, match=f"sample {manifest.at[4, 'sample_id']}: rgb file .* does not exist"):
        TaskonomyDataset(data_copy, manifest, [], 32)


def test_read_manifest_names_bad_rows(tiny_manifest, tmp_path):
    manifest = pd.read_csv(tiny_manifest)
    assert list(read_manifest(tiny_manifest).columns) == [*MANIFEST_COLUMNS, "val"]
    broken = manifest.drop(columns=["split"])
    broken.to_csv(tmp_path / "a.csv", index=False)
    with pytest.raises(TaskHetError, match="a.csv: missing column\\(s\\) split"):
        read_manifest(tmp_path / "a.csv")
    pd.concat([manifest, manifest.iloc[[3]]]).to_csv(tmp_path / "b.csv", index=False)
    with pytest.raises(TaskHetError, match=f"row {len(manifest) + 2} repeats sample_id"):
        read_manifest(tmp_path / "b.csv")
    manifest.assign(split=["train"] * 5 + ["validation"] + ["train"] * (len(manifest) - 6)).to_csv(tmp_path / "c.csv", index=False)
    with pytest.raises(TaskHetError, match="row 7 has split 'validation'"):
        read_manifest(tmp_path / "c.csv")
    with pytest.raises(TaskHetError, match="does not exist"):
        read_manifest(tmp_path / "missing.csv")


def test_cache_gives_identical_samples_and_skips_decoding(tiny_data_root, tiny_manifest, tmp_path, monkeypatch):
    manifest = read_manifest(tiny_manifest)
    plain = TaskonomyDataset(tiny_data_root, manifest, ALL_DOMAINS, 16)
    cached = TaskonomyDataset(tiny_data_root, manifest, ALL_DOMAINS, 16, cache_dir=tmp_path / "cache")
    assert cached.cache.num_filled() == 0
    for index in range(len(plain)):
        expected, got = plain[index], cached[index]
        for key, value in expected.items():
            assert (value == got[key]) if key == "sample_id" else torch.equal(value, got[key]), key
    assert cached.cache.num_filled() == len(plain)
    reopened = TaskonomyDataset(tiny_data_root, manifest, ALL_DOMAINS, 16, cache_dir=tmp_path / "cache")

    def no_decoding(index):
        raise AssertionError("a filled cache must not decode")

    monkeypatch.setattr(reopened, "decode", no_decoding)
    assert torch.equal(reopened[7]["depth_euclidean"], plain[7]["depth_euclidean"])
    other_size = TaskonomyDataset(tiny_data_root, manifest, ALL_DOMAINS, 8, cache_dir=tmp_path / "cache")
    other_domains = TaskonomyDataset(tiny_data_root, manifest, ["normal"], 16, cache_dir=tmp_path / "cache")
    other_rows = TaskonomyDataset(tiny_data_root, manifest.iloc[1:], ALL_DOMAINS, 16, cache_dir=tmp_path / "cache")
    directories = {dataset.cache.directory for dataset in (cached, other_size, other_domains, other_rows)}
    assert len(directories) == 4 and reopened.cache.directory == cached.cache.directory


def test_cache_is_shared_by_every_order_of_the_same_samples(tiny_data_root, tiny_manifest, tmp_path, monkeypatch):
    # Each partition lists the same samples in its own order; one cache must serve them all.
    manifest = read_manifest(tiny_manifest)
    plain = TaskonomyDataset(tiny_data_root, manifest, ALL_DOMAINS, 16)
    filled = TaskonomyDataset(tiny_data_root, manifest, ALL_DOMAINS, 16, cache_dir=tmp_path / "cache")
    for index in range(len(filled)):
        filled[index]
    shuffled_rows = manifest.iloc[np.random.default_rng(0).permutation(len(manifest))].reset_index(drop=True)
    shuffled = TaskonomyDataset(tiny_data_root, shuffled_rows, ALL_DOMAINS, 16, cache_dir=tmp_path / "cache")
    assert shuffled.cache.directory == filled.cache.directory
    monkeypatch.setattr(shuffled, "decode", lambda index: (_ for _ in ()).throw(AssertionError("must not decode")))
    position = {sample_id: index for index, sample_id in enumerate(plain.sample_ids)}
    for index in range(len(shuffled)):
        item = shuffled[index]
        expected = plain[position[item["sample_id"]]]
        assert torch.equal(item["normal"], expected["normal"]) and torch.equal(item["rgb"], expected["rgb"])


def test_cache_is_shared_by_dataloader_workers(tiny_data_root, tiny_manifest, tmp_path):
    manifest = read_manifest(tiny_manifest)
    dataset = TaskonomyDataset(tiny_data_root, manifest, ["depth_euclidean", "segment_semantic"], 16, cache_dir=tmp_path / "cache")
    ids = [sample_id for batch in DataLoader(dataset, batch_size=4, num_workers=2) for sample_id in batch["sample_id"]]
    assert ids == dataset.sample_ids
    assert dataset.cache.num_filled() == len(dataset)


def assert_same_items(got: list[dict], expected: list[dict]) -> None:
    """Two lists of sample dicts hold the same keys, dtypes, shapes and values."""
    assert len(got) == len(expected)
    for one, other in zip(got, expected):
        assert set(one) == set(other)
        for key, value in other.items():
            if isinstance(value, torch.Tensor):
                assert one[key].dtype == value.dtype and torch.equal(one[key], value), key
            else:
                assert one[key] == value, key


def test_a_batched_read_equals_reading_one_by_one_whatever_the_cache_holds(tiny_data_root, tiny_manifest, tmp_path,
                                                                          monkeypatch):
    # torch's DataLoader reads a batch through __getitems__: it must give what __getitem__ gives, sample by sample.
    manifest = read_manifest(tiny_manifest)
    plain = TaskonomyDataset(tiny_data_root, manifest, ALL_DOMAINS, 16)
    cached = TaskonomyDataset(tiny_data_root, manifest, ALL_DOMAINS, 16, cache_dir=tmp_path / "cache")
    batch = [5, 0, 5, 11, 3]  # a repeated sample and an unsorted order
    expected = [plain[index] for index in batch]
    assert_same_items(plain.__getitems__(batch), expected)  # no cache: decoded one by one
    cached[0]
    assert_same_items(cached.__getitems__(batch), expected)  # partly filled: one by one, filling the rest
    assert all(cached.cache.filled(int(cached.cache_rows[index])) for index in batch)
    monkeypatch.setattr(cached.cache, "get", lambda index: (_ for _ in ()).throw(AssertionError("read one by one")))
    got = cached.__getitems__(batch)  # filled: one read per array
    assert_same_items(got, expected)
    assert got[0]["segment_semantic"].dtype == torch.int64 and got[0]["scene_class"].shape == ()
    assert cached.__getitems__([]) == []
    assert_same_items(cached.__getitems__([torch.tensor(index) for index in batch]), expected)  # Subset(data, tensor)


def test_a_dataloader_batch_is_the_same_with_batched_reads(tiny_data_root, tiny_manifest, tmp_path):
    manifest = read_manifest(tiny_manifest)
    dataset = TaskonomyDataset(tiny_data_root, manifest, ["normal", "segment_semantic"], 16, cache_dir=tmp_path / "cache")
    one_by_one = [dataset[index] for index in range(len(dataset))]  # fills the cache
    subset = torch.utils.data.Subset(dataset, [7, 2, 9, 4, 1])
    batches = list(DataLoader(subset, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(3)))
    order = [position for positions in DataLoader(range(5), batch_size=2, shuffle=True,  # the same draws, on positions
                                                 generator=torch.Generator().manual_seed(3)) for position in positions.tolist()]
    expected = [torch.utils.data.default_collate([one_by_one[subset.indices[i]] for i in order[start:start + 2]])
                for start in range(0, 5, 2)]
    assert len(batches) == len(expected)
    for got, want in zip(batches, expected):
        assert got["sample_id"] == want["sample_id"]
        assert all(torch.equal(got[key], want[key]) for key in ("normal", "segment_semantic", "mask", "scene_class"))


def test_cache_row_is_unfilled_until_written(tmp_path):
    cache = DecodedSampleCache(tmp_path, "k" * 64, 3, {"x": ((2,), np.dtype(np.float32))})
    assert cache.get(1) is None
    cache.put(1, {"x": np.array([1.5, 2.5], np.float32)})
    np.testing.assert_array_equal(cache.get(1)["x"], [1.5, 2.5])
    assert cache.get(0) is None and cache.num_filled() == 1
    assert cache.get_many(np.array([1, 0])) is None
    np.testing.assert_array_equal(cache.get_many(np.array([1, 1]))["x"], [[1.5, 2.5], [1.5, 2.5]])


def test_download_fails_at_once_when_offline(tmp_path, monkeypatch):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    monkeypatch.setattr(download_taskonomy, "DATA_SERVER", ("127.0.0.1", closed_port))
    start = time.perf_counter()
    agreed = ["--agree_all", "--name", "Ada", "--email", "ada@example.org"]
    with pytest.raises(TaskHetError, match="cannot reach the Taskonomy server 127.0.0.1"):
        download_taskonomy.main(["--dest", str(tmp_path / "taskonomy"), "--timeout_s", "2", *agreed])
    assert time.perf_counter() - start < 5
    assert not (tmp_path / "taskonomy").exists()


@pytest.mark.parametrize("flags, message", [
    ([], r"needs --agree_all \(AGREE=yes\), --name \(NAME=...\), --email \(EMAIL=...\)"),
    (["--agree_all", "--name", "Ada"], r"needs --email \(EMAIL=...\)"),
    (["--name", "Ada", "--email", "ada@example.org"], r"needs --agree_all"),
    (["--agree_all", "--name", "Ada", "--email", "not-an-email"], "is not an email address"),
])
def test_download_refuses_to_start_without_an_accepted_licence(tmp_path, capsys, flags, message):
    with pytest.raises(TaskHetError, match=message):
        download_taskonomy.main(["--dest", str(tmp_path / "taskonomy"), *flags])
    assert "non-commercial research" in capsys.readouterr().out
    assert not (tmp_path / "taskonomy").exists()


def test_download_command_names_the_pipeline_domains(tmp_path):
    args = download_taskonomy.build_parser().parse_args(["--subset", "medium", "--dest", str(tmp_path), "--agree_all",
                                                         "--name", "Ada", "--email", "ada@example.org"])
    command = download_taskonomy.downloader_command(args)
    assert command[command.index("--email") + 1] == "ada@example.org" and "--agree_all" in command
    assert command[0].endswith("omnitools.download")
    assert set(DOMAINS) <= set(command) and command[command.index("--subset") + 1] == "medium"
    assert command[command.index("--components") + 1] == "taskonomy"
