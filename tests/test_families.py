"""Every data family: its manifest, tasks and datasets, tested through the generic interface only."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest
import torch

from datasets.cifar import select_cifar
from datasets.digits import select_digits
from datasets.family import FAMILY_COLUMN, get_family, list_families, load_manifest
from datasets.imagefolder import select_imagefolder
from datasets.paired_selection import select_paired
from models.tasks import get_task, list_tasks
from steps.select import STEP1_MODULES
from tests.fixtures import tiny_data_root, tiny_manifest, write_tiny_cifar  # noqa: F401  (session fixtures)
from tests.folder_fixtures import write_imagefolder, write_paired_folders
from utils.errors import TaskHetError

IMAGE_SIZE = 16


@pytest.fixture(scope="session")
def manifests(tiny_manifest, cifar_root, folder_roots, tmp_path_factory) -> dict[str, Path]:  # noqa: F811
    """A small step-1 manifest of every family."""
    digits = tmp_path_factory.mktemp("digits_step1") / "manifest.csv"
    select_digits(0.25, seed=0, n_samples=40).to_csv(digits, index=False)
    cifar = tmp_path_factory.mktemp("cifar_step1") / "manifest.csv"
    select_cifar(cifar_root, "cifar10", 1.0, 0.1, seed=0, verify_checksums=False).to_csv(cifar, index=False)
    imagefolder = tmp_path_factory.mktemp("imagefolder_step1") / "manifest.csv"
    select_imagefolder(folder_roots["imagefolder"], 0.25, 0.1, seed=0).manifest.to_csv(imagefolder, index=False)
    paired = tmp_path_factory.mktemp("paired_step1") / "manifest.csv"
    select_paired(folder_roots["paired_folders"], 0.25, 0.1, seed=0).manifest.to_csv(paired, index=False)
    return {"taskonomy": tiny_manifest, "digits": digits, "cifar": cifar, "imagefolder": imagefolder, "paired_folders": paired}


@pytest.fixture(scope="session")
def folder_roots(tmp_path_factory) -> dict[str, Path]:
    """A user's tiny folders: 3 classes of 6 images; 12 images with a depth, a segmentation and an edge target."""
    return {"imagefolder": write_imagefolder(tmp_path_factory.mktemp("imagefolder")),
            "paired_folders": write_paired_folders(tmp_path_factory.mktemp("paired_folders"))}


@pytest.fixture(scope="session")
def cifar_root(tmp_path_factory) -> Path:
    """Tiny CIFAR-10 files in torchvision's format (4 training and 2 test images per class)."""
    return write_tiny_cifar(tmp_path_factory.mktemp("cifar"), "cifar10", [4] * 10)


@pytest.fixture(scope="session")
def roots(tiny_data_root, cifar_root, folder_roots) -> dict[str, Path]:  # noqa: F811
    """The data root of every family (digits ignores it)."""
    return {"taskonomy": tiny_data_root, "digits": tiny_data_root, "cifar": cifar_root, **folder_roots}


def test_every_family_has_a_test_manifest_and_a_step1(manifests):
    assert sorted(manifests) == list_families() == sorted(STEP1_MODULES)


def test_every_task_belongs_to_exactly_one_family():
    owners = {task: [name for name in list_families() if task in get_family(name).tasks] for task in list_tasks()}
    assert all(len(names) == 1 for names in owners.values()), owners


@pytest.mark.parametrize("name", list_families())
def test_family_reads_its_manifest(name, manifests):
    family, manifest = load_manifest(manifests[name])
    assert family is get_family(name) and family.name == name
    assert (manifest[FAMILY_COLUMN] == name).all() and manifest["sample_id"].is_unique
    assert set(manifest["split"]) == {"train", "test"}
    assert manifest[family.label_column].dtype == "int64"
    assert family.source_column is None or family.source_column in manifest.columns
    assert 2 <= family.num_classes(manifest) and manifest[family.label_column].max() < family.num_classes(manifest)


@pytest.mark.parametrize("name, task_name", [(name, task) for name in list_families() for task in get_family(name).tasks])
def test_family_dataset_items_hold_the_input_and_the_target(name, task_name, manifests, roots):
    family, manifest = load_manifest(manifests[name])
    task = get_task(task_name)
    rows = manifest.iloc[[2, 0, 1]]
    dataset = family.dataset(roots[name], rows, task, IMAGE_SIZE)
    assert len(dataset) == 3
    for item, row in zip(dataset, rows.itertuples(index=False)):
        image = item[family.input_key]
        assert image.dtype == torch.float32 and image.shape == (3, IMAGE_SIZE, IMAGE_SIZE)
        assert 0.0 <= float(image.min()) and float(image.max()) <= 1.0
        assert item["sample_id"] == row.sample_id  # row order is kept
        assert item[family.label_column].dtype == torch.int64 and item[family.label_column].dim() == 0
        target = item[task.domain]
        if task.kind == "classification":
            assert target.dtype == torch.int64 and target.dim() == 0 and int(target) < family.num_classes(manifest)
        else:
            assert target.shape[-2:] == (IMAGE_SIZE, IMAGE_SIZE)
    batch = next(iter(torch.utils.data.DataLoader(dataset, batch_size=3)))
    assert batch[family.input_key].shape == (3, 3, IMAGE_SIZE, IMAGE_SIZE)


@pytest.mark.parametrize("name", list_families())
def test_family_dataset_without_a_task_is_the_input(name, manifests, roots):
    family, manifest = load_manifest(manifests[name])
    item = family.dataset(roots[name], manifest, None, IMAGE_SIZE)[0]
    assert item[family.input_key].shape == (3, IMAGE_SIZE, IMAGE_SIZE) and isinstance(item["sample_id"], str)


@pytest.mark.parametrize("name", list_families())
def test_family_rejects_a_task_it_cannot_feed(name):
    foreign = next(task for task in list_tasks() if task not in get_family(name).tasks)
    with pytest.raises(TaskHetError, match=f"--task: task {foreign!r} is not a task of data family {name!r}"):
        get_family(name).check_task(foreign, "--task")


@pytest.mark.parametrize("name", list_families())
def test_mixed_family_column_names_the_row(name, manifests, tmp_path):
    manifest = pd.read_csv(manifests[name], dtype=str, keep_default_na=False)
    other = next(family for family in list_families() if family != name)
    manifest.loc[3, FAMILY_COLUMN] = other
    manifest.to_csv(tmp_path / "mixed.csv", index=False)
    with pytest.raises(TaskHetError, match=f"mixed.csv: row 5 has family '{other}'"):
        load_manifest(tmp_path / "mixed.csv")


def test_unknown_family_and_legacy_manifest(manifests, tmp_path):
    manifest = pd.read_csv(manifests["taskonomy"], dtype=str, keep_default_na=False)
    manifest.assign(family="imagenet").to_csv(tmp_path / "unknown.csv", index=False)
    with pytest.raises(TaskHetError, match="unknown.csv: row 2 has family 'imagenet'; known data families: cifar, digits, imagefolder, paired_folders, taskonomy"):
        load_manifest(tmp_path / "unknown.csv")
    # Manifests written before families existed are Taskonomy's.
    manifest.drop(columns=[FAMILY_COLUMN]).to_csv(tmp_path / "legacy.csv", index=False)
    family, legacy = load_manifest(tmp_path / "legacy.csv")
    assert family.name == "taskonomy" and (legacy[FAMILY_COLUMN] == "taskonomy").all()


# Per family: how row 5 (a test row) is edited to name the image of row 2 (a train row) under its own sample_id,
# and what the error shows of that image. Every registered family must have an entry.
def same_rgb_file(manifest: pd.DataFrame) -> str:
    manifest.loc[3, "rgb_path"] = "./" + manifest.loc[0, "rgb_path"].replace("/", "//", 1)  # same file, other spelling
    return f"rgb_path {manifest.loc[0, 'rgb_path']!r}"


def same_cifar_image(manifest: pd.DataFrame) -> str:
    manifest.loc[3, ["split", "image_index", "label", "val"]] = manifest.loc[0, ["split", "image_index", "label", "val"]]
    return f"dataset 'cifar10', split 'train', image_index {manifest.loc[0, 'image_index']}"


def same_digit(manifest: pd.DataFrame) -> str:
    manifest.loc[3, ["image_index", "label"]] = manifest.loc[0, ["image_index", "label"]]
    return f"image_index {manifest.loc[0, 'image_index']}"


def same_image_file(manifest: pd.DataFrame) -> str:
    """A folder family's image is its image_path: here under another spelling, with its class or label."""
    columns = [column for column in ("class_name", "label", "label_name") if column in manifest.columns]
    manifest.loc[3, columns] = manifest.loc[0, columns]
    manifest.loc[3, "image_path"] = "./" + manifest.loc[0, "image_path"].replace("/", "//", 1)
    return f"image_path {manifest.loc[0, 'image_path']!r}"


REPEAT_AN_IMAGE = {"taskonomy": same_rgb_file, "cifar": same_cifar_image, "digits": same_digit,
                   "imagefolder": same_image_file, "paired_folders": same_image_file}


def test_every_family_says_how_an_image_repeats():
    assert sorted(REPEAT_AN_IMAGE) == list_families()


@pytest.mark.parametrize("name", list_families())
def test_two_sample_ids_for_one_image_name_both_rows(name, manifests, tmp_path):
    manifest = pd.read_csv(manifests[name], dtype=str, keep_default_na=False)
    manifest = pd.concat([manifest[manifest["split"] == "train"].head(3), manifest[manifest["split"] == "test"]],
                         ignore_index=True)
    load_manifest_from(manifest, tmp_path / "before.csv")  # the rows are a valid manifest before the edit
    image = REPEAT_AN_IMAGE[name](manifest)
    first, second = manifest.loc[0, "sample_id"], manifest.loc[3, "sample_id"]
    with pytest.raises(TaskHetError, match=f"repeated.csv: rows 2 and 5 \\(sample_id '{first}' and '{second}'\\) name the "
                                           f"same image \\({re.escape(image)}\\)"):
        load_manifest_from(manifest, tmp_path / "repeated.csv")


def load_manifest_from(manifest: pd.DataFrame, path: Path):
    manifest.to_csv(path, index=False)
    return load_manifest(path)


def test_taskonomy_one_view_under_two_sample_ids(manifests, tmp_path):
    """The targets are found by building, point and view: a repeated triple is one sample's files twice."""
    manifest = pd.read_csv(manifests["taskonomy"], dtype=str, keep_default_na=False)
    manifest.loc[4, ["building", "point", "view"]] = manifest.loc[1, ["building", "point", "view"]]
    building, point, view = manifest.loc[1, ["building", "point", "view"]]
    with pytest.raises(TaskHetError, match=f"rows 3 and 6 .* name the same image \\(building '{building}', point {point}, "
                                           f"view {view}\\)"):
        load_manifest_from(manifest, tmp_path / "m.csv")


def test_cifar_train_and_test_images_of_one_index_are_different_images(manifests, tmp_path):
    _, manifest = load_manifest(manifests["cifar"])
    assert set(manifest.loc[manifest["split"] == "train", "image_index"]) & set(manifest.loc[manifest["split"] == "test", "image_index"])
