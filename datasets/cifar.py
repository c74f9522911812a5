"""The ``cifar`` family: CIFAR-10 and CIFAR-100 (fine labels), optionally long-tailed.

torchvision's on-disk files and their safe reading are datasets/cifar_files.py.
The step-1 manifest has columns :data:`MANIFEST_COLUMNS`: ``dataset`` is cifar10 or
cifar100, ``image_index`` the row of torchvision's train or test array (``split``),
``label`` the class, ``val`` 1 for the validation part of the training set (0
elsewhere). The split stays train/test, as for every family: the validation rows are
training images set aside for model selection, and the test set only gives final numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from datasets.family import (DATASETS, FAMILY_COLUMN, SPLITS, VAL_COLUMN, DataFamily, refuse_repeated_images,
                             stratified_validation, with_family_column)
from datasets.cifar_files import DATASET_CLASSES, check_dataset, load_split
from datasets.long_tail import long_tail_indices
from utils.errors import TaskHetError
from utils.loaders import read_csv
from utils.seeding import numpy_rng

if TYPE_CHECKING:
    from models.tasks import TaskSpec

FAMILY = "cifar"
TASK = "cifar_class"
INPUT_KEY = "image"
MANIFEST_COLUMNS = (FAMILY_COLUMN, "sample_id", "dataset", "image_index", "label", "split", VAL_COLUMN)
def validation_rows(labels: np.ndarray, val_fraction: float, seed: int) -> np.ndarray:
    """A bool mask over ``labels``: the stratified, seeded validation part (:func:`datasets.family.stratified_validation`)."""
    return stratified_validation(labels, val_fraction, numpy_rng(seed, FAMILY, "validation"))


def select_cifar(data_path: Path, dataset: str, imbalance_factor: float, val_fraction: float, seed: int,
                 verify_checksums: bool = True) -> pd.DataFrame:
    """Step 1 for cifar: the (long-tailed) training set with a validation part, and the whole balanced test set.

    Args:
        data_path: folder holding torchvision's CIFAR folder.
        dataset: "cifar10" or "cifar100".
        imbalance_factor: n_min / n_max of the training set (datasets/long_tail.py); 1.0 keeps every image.
        val_fraction: share of each class's kept training images in the validation part, in [0, 1).
        seed: root seed of the long-tail draw and the validation split.
        verify_checksums: check torchvision's md5s.

    Returns:
        The manifest: :data:`MANIFEST_COLUMNS`, train rows first, each split by ``image_index``.
    """
    check_dataset(dataset)
    if not 0.0 < imbalance_factor <= 1.0:
        raise TaskHetError(f"--imbalance_factor must be in (0, 1], got {imbalance_factor}")
    _, train_labels = load_split(data_path, dataset, True, verify_checksums)
    _, test_labels = load_split(data_path, dataset, False, verify_checksums)
    kept = np.arange(len(train_labels))
    if imbalance_factor < 1.0:
        files = DATASET_CLASSES[dataset]
        source = (f"{dataset} training files {', '.join(name for name, _ in files.split_files(True))} under "
                  f"{Path(data_path) / files.folder_name}")
        kept = long_tail_indices(train_labels, imbalance_factor, seed, files.num_classes, source)
    val = validation_rows(train_labels[kept], val_fraction, seed)
    test = np.arange(len(test_labels))
    frames = [_rows(dataset, "train", kept, train_labels[kept], val), _rows(dataset, "test", test, test_labels, np.zeros(len(test), bool))]
    return pd.concat(frames, ignore_index=True)


def _rows(dataset: str, split: str, index: np.ndarray, labels: np.ndarray, val: np.ndarray) -> pd.DataFrame:
    return pd.DataFrame({FAMILY_COLUMN: FAMILY, "sample_id": [f"{dataset}_{split}_{i:05d}" for i in index], "dataset": dataset,
                         "image_index": index.astype(np.int64), "label": labels.astype(np.int64), "split": split,
                         VAL_COLUMN: val.astype(np.int64)}, columns=list(MANIFEST_COLUMNS))


def validate_manifest(manifest: pd.DataFrame, source: str = "manifest") -> pd.DataFrame:
    """Check a cifar manifest; returns it with a fresh 0..N-1 index and int64 numbers.

    Raises:
        TaskHetError: naming ``source`` and the first bad column or row.
    """
    missing = [column for column in MANIFEST_COLUMNS if column not in manifest.columns]
    if missing:
        raise TaskHetError(f"{source}: missing column(s) {', '.join(missing)}; expected {', '.join(MANIFEST_COLUMNS)}")
    if manifest.empty:
        raise TaskHetError(f"{source}: has no rows")
    manifest = with_family_column(manifest.reset_index(drop=True), FAMILY, source)
    dataset = str(manifest["dataset"].iloc[0])
    num_classes = DATASET_CLASSES[dataset].num_classes if dataset in DATASET_CLASSES else 0
    numbers = {column: pd.to_numeric(manifest[column], errors="coerce") for column in ("image_index", "label", VAL_COLUMN)}

    def integral(values: pd.Series, upper: float) -> pd.Series:
        return values.notna() & (values >= 0) & (values < upper) & (values == values.round())

    checks = {"dataset": manifest["dataset"] == dataset if num_classes else manifest["dataset"].isin(DATASET_CLASSES),
              "sample_id": ~manifest["sample_id"].duplicated(), "split": manifest["split"].isin(SPLITS),
              "image_index": integral(numbers["image_index"], np.inf), "label": integral(numbers["label"], num_classes),
              VAL_COLUMN: integral(numbers[VAL_COLUMN], 2) & ((numbers[VAL_COLUMN] == 0) | (manifest["split"] == "train"))}
    expected = {"dataset": f"{dataset!r} like row 2 (one of {', '.join(DATASET_CLASSES)})", "sample_id": "a sample_id not seen before",
                "split": f"one of {SPLITS}", "image_index": "an integer >= 0", "label": f"an integer in 0..{num_classes - 1}",
                VAL_COLUMN: "0 or 1 (1 only on train rows)"}
    for column, good in checks.items():
        if not good.all():
            row = int(np.flatnonzero(~good.to_numpy())[0])
            value = manifest.at[row, column]
            shown = repr(value) if isinstance(value, str) else value  # 1, not np.int64(1)
            raise TaskHetError(f"{source}: row {row + 2} has {column} {shown}, expected {expected[column]}")
    manifest = manifest.astype({"image_index": np.int64, "label": np.int64, VAL_COLUMN: np.int64})
    # train and test are separate arrays in the files: the image is its split's row
    refuse_repeated_images(manifest[["dataset", "split", "image_index"]], manifest["sample_id"], source)
    return manifest


def read_manifest(path: Path) -> pd.DataFrame:
    """Read and validate a cifar ``manifest.csv``."""
    manifest = read_csv(path, "manifest", finished=True, dtype={FAMILY_COLUMN: str, "sample_id": str, "dataset": str, "split": str},
                        keep_default_na=False)
    return validate_manifest(manifest, str(path))


class CifarDataset(Dataset):
    """CIFAR images of some manifest rows as model inputs.

    An item is ``{"image": float32 [3, S, S] in [0, 1], "cifar_class": int64 scalar,
    "label": int64 scalar (the same class), "sample_id": str}``. Images are kept as uint8
    (CIFAR-10's 60,000 images are 184 MB so, 737 MB as float32) and scaled, and resized
    bilinearly when ``S`` is not 32, per item.

    Args:
        root: data path holding torchvision's CIFAR folder.
        rows: cifar manifest rows (one dataset).
        image_size: ``S``.
        verify_checksums: check torchvision's md5s. Off by default: step 1 checked them when it
            wrote the manifest, re-hashing 160 MB for every client's dataset would dominate steps 3-4,
            and every row's label is compared with the file's below.

    Raises:
        TaskHetError: files missing, or a row's label is not the file's label for its image.
    """

    def __init__(self, root: Path, rows: pd.DataFrame, image_size: int, verify_checksums: bool = False) -> None:
        if image_size < 1:
            raise TaskHetError(f"image_size must be >= 1, got {image_size}")
        rows = validate_manifest(rows)
        dataset = str(rows["dataset"].iloc[0])
        images = np.zeros((len(rows), 32, 32, 3), dtype=np.uint8)
        for split in SPLITS:
            chosen = np.flatnonzero(rows["split"].to_numpy() == split)
            if chosen.size == 0:
                continue
            split_images, split_labels = load_split(root, dataset, split == "train", verify_checksums)
            index = rows["image_index"].to_numpy()[chosen]
            if index.max() >= len(split_labels):
                row = int(chosen[np.argmax(index >= len(split_labels))])
                raise TaskHetError(f"manifest row {row + 2} ({rows.at[row, 'sample_id']}): image_index {rows.at[row, 'image_index']} "
                                   f"but the {dataset} {split} set has {len(split_labels)} images")
            wrong = split_labels[index] != rows["label"].to_numpy()[chosen]
            if wrong.any():
                row = int(chosen[np.flatnonzero(wrong)[0]])
                raise TaskHetError(f"manifest row {row + 2} ({rows.at[row, 'sample_id']}): label {rows.at[row, 'label']} but "
                                   f"the {dataset} file says {split_labels[rows.at[row, 'image_index']]}; other files than step 1 read?")
            images[chosen] = split_images[index]
        self.images = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()
        self.labels = torch.from_numpy(rows["label"].to_numpy(copy=True))
        self.sample_ids = rows["sample_id"].astype(str).tolist()
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __getitem__(self, index: int) -> dict:
        label = self.labels[index]
        return {INPUT_KEY: self._scaled(self.images[index][None])[0], TASK: label, "label": label,
                "sample_id": self.sample_ids[index]}

    def read_batch(self, indices: list[int]) -> dict:
        """The collated items ``indices`` in one read (``datasets.batch_reads``)."""
        rows = torch.as_tensor(indices, dtype=torch.long)  # indexing with a list would convert it once per tensor
        labels = self.labels[rows]
        return {INPUT_KEY: self._scaled(self.images[rows]), TASK: labels, "label": labels.clone(),
                "sample_id": [self.sample_ids[index] for index in indices]}

    def _scaled(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 ``[B, 3, 32, 32]`` as float32 in [0, 1] at ``S`` pixels (bilinear, each image on its own)."""
        images = images.float() / 255.0
        if images.shape[-1] == self.image_size:
            return images
        return F.interpolate(images, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False).clamp(0, 1)


class CifarFamily(DataFamily):
    """CIFAR-10 / CIFAR-100 (one per manifest): one classification task, no natural owner of a sample."""

    name = FAMILY
    input_key = INPUT_KEY
    label_column = "label"
    source_column = None
    tasks = (TASK,)

    def read_manifest(self, path: Path) -> pd.DataFrame:
        return read_manifest(path)

    def num_classes(self, manifest: pd.DataFrame) -> int:
        # The dataset's full class count, so a long tail or a client's share never shrinks the head.
        return DATASET_CLASSES[str(manifest["dataset"].iloc[0])].num_classes

    def dataset(self, root: Path, rows: pd.DataFrame, task: TaskSpec | None, image_size: int,
                cache_dir: Path | None = None) -> Dataset:
        return CifarDataset(root, rows, image_size)


DATASETS.register(FAMILY)(CifarFamily())
