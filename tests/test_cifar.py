"""The cifar family: torchvision's on-disk format, long-tail counts, the validation split, missing files, step 1."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from datasets.cifar import CifarDataset, select_cifar, validation_rows
from datasets.cifar_files import load_split
from datasets.family import load_manifest
from datasets.long_tail import long_tail_counts
from steps import select
from tests.fixtures import write_tiny_cifar
from utils.errors import TaskHetError

CIFAR10_TRAIN = [30] * 10


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cifar")
    write_tiny_cifar(root, "cifar10", CIFAR10_TRAIN, test_per_class=3)
    write_tiny_cifar(root, "cifar100", [6] * 100, test_per_class=1)
    return root


def test_fixture_files_are_the_real_pickle_format(root):
    with open(root / "cifar-10-batches-py" / "data_batch_1", "rb") as file:
        batch = pickle.load(file, encoding="bytes")  # how the CIFAR page says to read the files in Python 3
    assert batch[b"data"].dtype == np.uint8 and batch[b"data"].shape[1] == 3072 and isinstance(batch[b"labels"], list)
    with open(root / "cifar-100-python" / "meta", "rb") as file:
        assert len(pickle.load(file, encoding="bytes")[b"fine_label_names"]) == 100


@pytest.mark.parametrize("dataset, num_train, num_test", [("cifar10", 300, 30), ("cifar100", 600, 100)])
def test_files_load_as_torchvision_reads_them(root, dataset, num_train, num_test):
    images, labels = load_split(root, dataset, True, verify_checksums=False)
    assert images.shape == (num_train, 32, 32, 3) and images.dtype == np.uint8 and labels.dtype == np.int64
    with open(next((root / ("cifar-100-python" if dataset == "cifar100" else "cifar-10-batches-py")).glob("*test*")), "rb") as file:
        raw = pickle.load(file, encoding="bytes")
    test_images, test_labels = load_split(root, dataset, False, verify_checksums=False)
    assert len(test_labels) == num_test
    # Pixel layout: torchvision's HWC image is the file's row reshaped to CHW, then transposed.
    np.testing.assert_array_equal(test_images[0], raw[b"data"][0].reshape(3, 32, 32).transpose(1, 2, 0))
    assert test_labels.tolist() == raw[b"labels" if dataset == "cifar10" else b"fine_labels"]


def test_hand_made_files_fail_the_md5_check_unless_told(root):
    with pytest.raises(TaskHetError, match="fail torchvision's md5 check.*make download-cifar DATASET=cifar10"):
        load_split(root, "cifar10", True)


@pytest.mark.parametrize("dataset, names", [("cifar10", "data_batch_1, data_batch_2, data_batch_3, data_batch_4, data_batch_5, "
                                                        "test_batch, batches.meta"), ("cifar100", "train, test, meta")])
def test_missing_files_name_the_files_and_the_command(tmp_path, dataset, names):
    with pytest.raises(TaskHetError, match=f"{dataset} files missing under .*: {names}; fetch them with "
                                           f"`make download-cifar DATASET={dataset}` \\(step 1 with --download\\)"):
        select_cifar(tmp_path, dataset, 1.0, 0.1, seed=0)


def test_one_missing_file_is_named(tmp_path):
    write_tiny_cifar(tmp_path, "cifar10", CIFAR10_TRAIN)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(TaskHetError, match=r"cifar-10-batches-py: data_batch_3; fetch them with `make download-cifar"):
        load_split(tmp_path, "cifar10", False, verify_checksums=False)


@pytest.mark.parametrize("dataset, imbalance_factor", [("cifar10", 0.1), ("cifar10", 0.5), ("cifar100", 0.2)])
def test_long_tail_counts_are_exact(root, dataset, imbalance_factor):
    manifest = select_cifar(root, dataset, imbalance_factor, 0.1, seed=4, verify_checksums=False)
    train = manifest[manifest["split"] == "train"]
    num_classes, n_max = (10, 30) if dataset == "cifar10" else (100, 6)
    expected = long_tail_counts(n_max, num_classes, imbalance_factor)
    np.testing.assert_array_equal(np.bincount(train["label"], minlength=num_classes), expected)
    # The test set stays whole and balanced; the kept images are the files' own labels.
    test = manifest[manifest["split"] == "test"]
    assert len(test) == len(load_split(root, dataset, False, verify_checksums=False)[1])
    _, labels = load_split(root, dataset, True, verify_checksums=False)
    assert (labels[train["image_index"]] == train["label"].to_numpy()).all()


def test_long_tail_draw_and_validation_are_seeded(root):
    first = select_cifar(root, "cifar10", 0.1, 0.2, seed=1, verify_checksums=False)
    pd.testing.assert_frame_equal(first, select_cifar(root, "cifar10", 0.1, 0.2, seed=1, verify_checksums=False))
    other = select_cifar(root, "cifar10", 0.1, 0.2, seed=2, verify_checksums=False)
    assert not first["image_index"].equals(other["image_index"]) or not first["val"].equals(other["val"])


@pytest.mark.parametrize("val_fraction", [0.0, 0.1, 0.25])
def test_validation_is_stratified_inside_the_training_set(root, val_fraction):
    manifest = select_cifar(root, "cifar10", 1.0, val_fraction, seed=0, verify_checksums=False)
    assert set(manifest["split"]) == {"train", "test"} and (manifest.loc[manifest["split"] == "test", "val"] == 0).all()
    per_class = manifest[manifest["split"] == "train"].groupby("label")["val"].sum()
    assert (per_class == int(np.floor(val_fraction * 30 + 0.5))).all()


def test_validation_keeps_a_training_image_of_every_class():
    labels = np.array([0] * 5 + [1] * 4 + [2] * 1)
    val = validation_rows(labels, 0.1, seed=0)
    assert [int(val[labels == label].sum()) for label in range(3)] == [1, 0, 0]
    assert validation_rows(labels, 0.5, seed=0)[labels == 2].sum() == 0
    np.testing.assert_array_equal(val, validation_rows(labels, 0.1, seed=0))
    with pytest.raises(TaskHetError, match="--val_fraction must be in \\[0, 1\\), got 1.0"):
        validation_rows(labels, 1.0, seed=0)


def test_dataset_items_and_label_check(root):
    manifest = select_cifar(root, "cifar100", 1.0, 0.1, seed=0, verify_checksums=False)
    rows = manifest.iloc[[len(manifest) - 1, 0]]
    dataset = CifarDataset(root, rows, image_size=24)
    images, _ = load_split(root, "cifar100", False, verify_checksums=False)
    item = dataset[0]
    assert item["image"].shape == (3, 24, 24) and item["image"].dtype == torch.float32
    assert item["cifar_class"] == item["label"] == rows["label"].iloc[0] and item["sample_id"] == rows["sample_id"].iloc[0]
    unresized = CifarDataset(root, rows, image_size=32)[0]["image"]
    torch.testing.assert_close(unresized, torch.from_numpy(images[rows["image_index"].iloc[0]]).permute(2, 0, 1).float() / 255)
    edited = rows.copy()
    edited.iloc[0, edited.columns.get_loc("label")] = (int(rows["label"].iloc[0]) + 1) % 100
    with pytest.raises(TaskHetError, match="manifest row 2 .*: label .* but the cifar100 file says"):
        CifarDataset(root, edited, image_size=32)


def test_step1_writes_a_manifest_the_family_reads(root, tmp_path):
    path = select.main(["--family", "cifar", "--dataset", "cifar10", "--data_path", str(root), "--no-verify_checksums",
                        "--imbalance_factor", "0.1", "--val_fraction", "0.1", "--seed", "3", "--out", str(tmp_path / "s1")])
    family, manifest = load_manifest(path)
    assert family.name == "cifar" and family.num_classes(manifest) == 10
    counts = pd.read_csv(tmp_path / "s1" / "class_counts.csv")
    np.testing.assert_array_equal(counts["num_train"] + counts["num_val"], long_tail_counts(30, 10, 0.1))
    assert (counts["num_test"] == 3).all()


def test_step1_rejects_bad_flags(root, tmp_path):
    with pytest.raises(TaskHetError, match="--imbalance_factor: must be a number in \\(0, 1\\], got '0'"):
        select.main(["--family", "cifar", "--data_path", str(root), "--no-verify_checksums", "--imbalance_factor", "0",
                     "--out", str(tmp_path / "bad")])
    with pytest.raises(TaskHetError, match="--dataset: invalid choice: 'cifar20'"):
        select.main(["--family", "cifar", "--dataset", "cifar20", "--out", str(tmp_path / "bad2")])


def test_manifest_rejects_val_on_test_rows(root, tmp_path):
    manifest = select_cifar(root, "cifar10", 1.0, 0.1, seed=0, verify_checksums=False)
    manifest.loc[manifest.index[-1], "val"] = 1
    manifest.to_csv(tmp_path / "manifest.csv", index=False)
    with pytest.raises(TaskHetError, match=f"row {len(manifest) + 1} has val 1, expected 0 or 1 \\(1 only on train rows\\)"):
        load_manifest(tmp_path / "manifest.csv")
