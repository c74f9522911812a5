"""The ``digits`` family: scikit-learn's bundled 8x8 handwritten digits (1,797 real images, no download).

A second, tiny family that proves the data seam: the whole pipeline (label- vs
embedding-based partitions over a trained model's embeddings) runs on it in
minutes on a CPU. The step-1 manifest has columns :data:`MANIFEST_COLUMNS`:
``image_index`` is the row of ``sklearn.datasets.load_digits()``, ``label`` the
digit 0..9, ``split`` train/test (stratified by label, seeded), ``val`` 1 for the
validation part of the training set (stratified, seeded; 0 elsewhere), as in the
cifar family: the test split only gives final numbers.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from datasets.family import (DATASETS, FAMILY_COLUMN, SPLITS, VAL_COLUMN, DataFamily, refuse_repeated_images,
                             stratified_validation, with_family_column)
from datasets.long_tail import long_tail_indices
from utils.errors import TaskHetError
from utils.loaders import read_csv
from utils.seeding import derive_seed, numpy_rng

if TYPE_CHECKING:
    from models.tasks import TaskSpec

FAMILY = "digits"
TASK = "digit_class"
INPUT_KEY = "image"
NUM_CLASSES = 10
MAX_PIXEL = 16.0  # load_digits' grey levels are 0..16
MANIFEST_COLUMNS = (FAMILY_COLUMN, "sample_id", "image_index", "label", "split", VAL_COLUMN)


@functools.lru_cache(maxsize=1)
def load_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``(images float64 [1797, 8, 8] in 0..16, labels int64 [1797])``: ``sklearn.datasets.load_digits()``'s arrays.

    Read once per process and read-only: every dataset and check of a run needs them, and parsing the file takes
    about 25 ms a time. The file is read as ``load_digits`` reads it (``np.loadtxt``, the label in the last column)
    but without importing scikit-learn, which costs about 2 s in every worker process that trains on digits.
    """
    data = np.loadtxt(_bundled_digits_file(), delimiter=",")
    images, labels = data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    images.flags.writeable = labels.flags.writeable = False
    return images, labels


def _bundled_digits_file() -> Path:
    """``sklearn/datasets/data/digits.csv.gz``, found without running scikit-learn's ``__init__``."""
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz" if spec else None
    if path is None or not path.is_file():
        raise TaskHetError("the digits family reads scikit-learn's bundled digits.csv.gz, and this Python has no "
                           "scikit-learn with it (make setup installs it)")
    return path


def select_digits(test_fraction: float, seed: int, n_samples: int | None = None, val_fraction: float = 0.1,
                  imbalance_factor: float = 1.0) -> pd.DataFrame:
    """Step 1 for digits: a seeded, label-stratified sample of the images, split into train/test, with a validation part.

    Args:
        test_fraction: share of the kept samples in the test split, in (0, 1); the test
            split holds exactly ``ceil(test_fraction * kept)`` samples (scikit-learn's rule).
        seed: root seed of the subsample and the split.
        n_samples: keep this many images (stratified by label); None keeps all 1,797.
        val_fraction: share of each digit's training images marked ``val`` = 1, in [0, 1)
            (:func:`datasets.family.stratified_validation`); drawn after the train/test split,
            which it leaves unchanged.
        imbalance_factor: digits-LT: after the split, the training images keep CIFAR-LT's profile
            n_c = ⌊n_max·IF^{c/9}⌋ (``datasets.long_tail``, n_max the smallest digit's training count; a
            seeded draw per digit), the test split stays balanced; 1.0 keeps every image.

    Returns:
        The manifest: :data:`MANIFEST_COLUMNS`, rows sorted by ``image_index``.

    Raises:
        TaskHetError: naming the flag (--test_fraction, --n_samples) that cannot be honoured.
    """
    if not 0.0 < test_fraction < 1.0:
        raise TaskHetError(f"--test_fraction must be in (0, 1), got {test_fraction}")
    if not 0.0 < imbalance_factor <= 1.0:
        raise TaskHetError(f"--imbalance_factor must be in (0, 1], got {imbalance_factor}")
    from sklearn.model_selection import train_test_split  # here: scikit-learn takes seconds to import

    _, labels = load_arrays()
    kept = np.arange(len(labels))
    if n_samples is not None and not NUM_CLASSES * 2 <= n_samples <= len(labels):
        raise TaskHetError(f"--n_samples must be between {NUM_CLASSES * 2} and {len(labels)}, got {n_samples}")
    try:
        if n_samples is not None and n_samples < len(labels):
            kept, _ = train_test_split(kept, train_size=n_samples, stratify=labels, random_state=_sklearn_seed(seed, "subsample"))
        _, test = train_test_split(kept, test_size=test_fraction, stratify=labels[kept], random_state=_sklearn_seed(seed, "split"))
    except ValueError as error:
        raise TaskHetError(f"--test_fraction {test_fraction} with {len(kept)} samples: no stratified split over "
                           f"{NUM_CLASSES} digits ({error})") from None
    if imbalance_factor < 1.0:
        train_rows = np.setdiff1d(kept, test)
        train_rows = train_rows[long_tail_indices(labels[train_rows], imbalance_factor, seed)]
        kept = np.concatenate([train_rows, test])
    kept = np.sort(kept)
    split = np.where(np.isin(kept, test), "test", "train")
    val = np.zeros(len(kept), dtype=np.int64)
    train = split == "train"
    val[train] = stratified_validation(labels[kept][train], val_fraction, numpy_rng(seed, FAMILY, "validation"))
    return pd.DataFrame({FAMILY_COLUMN: FAMILY, "sample_id": [f"digit_{index:04d}" for index in kept], "image_index": kept,
                         "label": labels[kept], "split": split, VAL_COLUMN: val}, columns=list(MANIFEST_COLUMNS))


def _sklearn_seed(seed: int, purpose: str) -> int:
    """A derived seed in scikit-learn's accepted range [0, 2**32)."""
    return derive_seed(seed, "digits", purpose) % 2**32


def validate_manifest(manifest: pd.DataFrame, source: str = "manifest") -> pd.DataFrame:
    """Check a digits manifest; returns it with a fresh 0..N-1 index and int64 numbers.

    Raises:
        TaskHetError: naming ``source`` and the first bad column or row.
    """
    if VAL_COLUMN not in manifest.columns:  # written before digits had a validation part: it has none
        manifest = manifest.assign(**{VAL_COLUMN: 0})
    missing = [column for column in MANIFEST_COLUMNS if column not in manifest.columns]
    if missing:
        raise TaskHetError(f"{source}: missing column(s) {', '.join(missing)}; expected {', '.join(MANIFEST_COLUMNS)}")
    if manifest.empty:
        raise TaskHetError(f"{source}: has no rows")
    manifest = with_family_column(manifest.reset_index(drop=True), FAMILY, source)
    checks = {"sample_id": ~manifest["sample_id"].duplicated(), "split": manifest["split"].isin(SPLITS)}
    for column, upper in (("image_index", len(load_arrays()[1])), ("label", NUM_CLASSES)):
        values = pd.to_numeric(manifest[column], errors="coerce")
        checks[column] = values.notna() & (values >= 0) & (values < upper) & (values == values.round())
    val = pd.to_numeric(manifest[VAL_COLUMN], errors="coerce")
    checks[VAL_COLUMN] = val.isin((0, 1)) & ((val == 0) | (manifest["split"] == "train"))
    expected = {"sample_id": "a sample_id not seen before", "split": f"one of {SPLITS}",
                "image_index": "an integer in 0..1796", "label": f"an integer in 0..{NUM_CLASSES - 1}",
                VAL_COLUMN: "0 or 1 (1 only on train rows)"}
    for column, good in checks.items():
        if not good.all():
            row = int(np.flatnonzero(~good.to_numpy())[0])
            value = manifest.at[row, column]
            shown = repr(value) if isinstance(value, str) else value  # 1, not np.int64(1)
            raise TaskHetError(f"{source}: row {row + 2} has {column} {shown}, expected {expected[column]}")
    manifest = manifest.astype({"image_index": np.int64, "label": np.int64, VAL_COLUMN: np.int64})
    # one array holds every digit, whatever the split: the image is its row
    refuse_repeated_images(manifest[["image_index"]], manifest["sample_id"], source)
    return manifest


def read_manifest(path: Path) -> pd.DataFrame:
    """Read and validate a digits ``manifest.csv``."""
    manifest = read_csv(path, "manifest", finished=True, dtype={FAMILY_COLUMN: str, "sample_id": str, "split": str},
                        keep_default_na=False)
    return validate_manifest(manifest, str(path))


class DigitsDataset(Dataset):
    """Digits of some manifest rows as model inputs.

    An item is ``{"image": float32 [3, S, S] in [0, 1], "digit_class": int64 scalar,
    "label": int64 scalar (the same digit, under the manifest's name), "sample_id": str}``.

    Every image is decoded once here (the whole set is ~7 MB at 32 px), so there is
    no cache. The 8x8 grey values 0..16 are scaled to [0, 1], resized bilinearly to
    ``S`` and repeated to three channels: every encoder (small_cnn, the ImageNet
    ResNets, EfficientNet) has a 3-channel RGB stem and too many stride-2 stages for
    8 pixels, so the family adapts to the models rather than each model to the family.

    Args:
        rows: digits manifest rows.
        image_size: ``S``.

    Raises:
        TaskHetError: a row's label is not the digit scikit-learn ships for its image_index.
    """

    def __init__(self, rows: pd.DataFrame, image_size: int) -> None:
        if image_size < 1:
            raise TaskHetError(f"image_size must be >= 1, got {image_size}")
        rows = validate_manifest(rows)
        images, labels = load_arrays()
        index = rows["image_index"].to_numpy()
        wrong = labels[index] != rows["label"].to_numpy()
        if wrong.any():
            row = int(np.flatnonzero(wrong)[0])
            raise TaskHetError(f"manifest row {row + 2} ({rows.at[row, 'sample_id']}): label {rows.at[row, 'label']} but "
                               f"image {index[row]} is a {labels[index[row]]}; was the label column edited?")
        pixels = torch.from_numpy(images[index] / MAX_PIXEL).float().unsqueeze(1)
        self.images = F.interpolate(pixels, size=(image_size, image_size), mode="bilinear", align_corners=False).clamp(0, 1)
        self.labels = torch.from_numpy(labels[index])
        self.sample_ids = rows["sample_id"].astype(str).tolist()

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __getitem__(self, index: int) -> dict:
        label = self.labels[index]
        return {INPUT_KEY: self.images[index].expand(3, -1, -1), TASK: label, "label": label, "sample_id": self.sample_ids[index]}

    def read_batch(self, indices: list[int]) -> dict:
        """The collated items ``indices`` in one read (``datasets.batch_reads``)."""
        rows = torch.as_tensor(indices, dtype=torch.long)  # indexing with a list would convert it once per tensor
        labels = self.labels[rows]
        return {INPUT_KEY: self.images[rows].expand(-1, 3, -1, -1).contiguous(), TASK: labels, "label": labels.clone(),
                "sample_id": [self.sample_ids[index] for index in indices]}


class DigitsFamily(DataFamily):
    """scikit-learn's handwritten digits: one classification task, no natural owner of a sample."""

    name = FAMILY
    input_key = INPUT_KEY
    label_column = "label"
    source_column = None
    tasks = (TASK,)

    def read_manifest(self, path: Path) -> pd.DataFrame:
        return read_manifest(path)

    def num_classes(self, manifest: pd.DataFrame) -> int:
        # Always all ten digits, so a subsample or a client's share never shrinks the head.
        return NUM_CLASSES

    def dataset(self, root: Path, rows: pd.DataFrame, task: TaskSpec | None, image_size: int,
                cache_dir: Path | None = None) -> Dataset:
        return DigitsDataset(rows, image_size)


DATASETS.register(FAMILY)(DigitsFamily())
