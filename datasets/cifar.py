"""The ``cifar`` family: CIFAR-10 and CIFAR-100 (fine labels) in torchvision's on-disk format, optionally long-tailed.

The files are torchvision's: ``<data_path>/cifar-10-batches-py/`` (``data_batch_1..5``,
``test_batch``, ``batches.meta``) and ``<data_path>/cifar-100-python/`` (``train``,
``test``, ``meta``), with the names, md5s and download that torchvision's ``CIFAR10/CIFAR100`` classes
give (:data:`DATASET_CLASSES`, checked against them by a test). The files are read here with a restricted
unpickler (:func:`load_split`), never through those classes, which unpickle them with plain ``pickle``:
this module does not import them at all.
The step-1 manifest has columns :data:`MANIFEST_COLUMNS`: ``dataset`` is cifar10 or
cifar100, ``image_index`` the row of torchvision's train or test array (``split``),
``label`` the class, ``val`` 1 for the validation part of the training set (0
elsewhere). The split stays train/test, as for every family: the validation rows are
training images set aside for model selection, and the test set only gives final numbers.
"""

from __future__ import annotations

import urllib.error
from dataclasses import dataclass
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
from utils.loaders import load_data_pickle, read_csv
from utils.seeding import numpy_rng

if TYPE_CHECKING:
    from models.tasks import TaskSpec

FAMILY = "cifar"
TASK = "cifar_class"
INPUT_KEY = "image"
MANIFEST_COLUMNS = (FAMILY_COLUMN, "sample_id", "dataset", "image_index", "label", "split", VAL_COLUMN)
FETCH_COMMAND = "make download-cifar DATASET={dataset}"


@dataclass(frozen=True)
class CifarFiles:
    """One CIFAR's files, as torchvision's ``CIFAR10``/``CIFAR100`` class attributes name them.

    The values are copied here rather than read from those classes so that this module never imports a
    reader that unpickles the batches with plain ``pickle``; tests/test_cifar_files.py checks they equal
    torchvision's.

    Attributes:
        num_classes: C (CIFAR-100: the fine labels).
        label_key: the batch entry holding the labels (``labels`` / ``fine_labels``).
        folder_name: the folder the archive extracts to (``base_folder``).
        train_files, test_files: ``(file name, md5)`` of each split's batches (``train_list`` / ``test_list``).
        meta: ``(file name, md5, key of the class names)`` of the meta file.
        url, archive, archive_md5: the download (``url``, ``filename``, ``tgz_md5``).
    """

    num_classes: int
    label_key: str
    folder_name: str
    train_files: tuple[tuple[str, str], ...]
    test_files: tuple[tuple[str, str], ...]
    meta: tuple[str, str, str]
    url: str
    archive: str
    archive_md5: str

    def split_files(self, train: bool) -> list[tuple[str, str]]:
        """``(file name, md5)`` of the batches of one split."""
        return list(self.train_files if train else self.test_files)


DATASET_CLASSES = {
    "cifar10": CifarFiles(
        10, "labels", "cifar-10-batches-py",
        (("data_batch_1", "c99cafc152244af753f735de768cd75f"), ("data_batch_2", "d4bba439e000b95fd0a9bffe97cbabec"),
         ("data_batch_3", "54ebc095f3ab1f0389bbae665268c751"), ("data_batch_4", "634d18415352ddfa80567beed471001a"),
         ("data_batch_5", "482c414d41f54cd18b22e5b47cb7c3cb")),
        (("test_batch", "40351d587109b95175f43aff81a1287e"),),
        ("batches.meta", "5ff9c542aee3614f3951f8cda6e48888", "label_names"),
        "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", "cifar-10-python.tar.gz",
        "c58f30108f718f92721af3b95e74349a"),
    "cifar100": CifarFiles(
        100, "fine_labels", "cifar-100-python",
        (("train", "16019d7e3df5f24257cddd939b257f8d"),),
        (("test", "f0ef6b0ae62326f3e7ffdfab6717acfc"),),
        ("meta", "7973b15100ade9c7d40fb424638fde48", "fine_label_names"),
        "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz", "cifar-100-python.tar.gz",
        "eb9058c3a382ffc7106e4002c42a8d85"),
}
# Pixels of one image in a batch's data rows: 3 channels x 32 x 32, channel-major.
IMAGE_VALUES = 3 * 32 * 32


def expected_files(root: Path, dataset: str) -> list[Path]:
    """The files of ``dataset`` under ``root`` (torchvision's names)."""
    files = DATASET_CLASSES[_check_dataset(dataset)]
    names = [name for name, _ in files.split_files(True) + files.split_files(False)] + [files.meta[0]]
    return [Path(root) / files.folder_name / name for name in names]


def _check_dataset(dataset: str) -> str:
    if dataset not in DATASET_CLASSES:
        raise TaskHetError(f"--dataset must be one of {', '.join(DATASET_CLASSES)}, got {dataset!r}")
    return dataset


def download(root: Path, dataset: str) -> None:
    """Fetch ``dataset`` into ``root`` with torchvision's downloader (md5-checked); a TaskHetError when it cannot.

    Only torchvision's download-and-extract is used: its dataset classes would unpickle the files.
    """
    files = DATASET_CLASSES[_check_dataset(dataset)]
    if not _failing_md5(Path(root) / files.folder_name, [*files.split_files(True), *files.split_files(False), files.meta[:2]]):
        return
    try:
        download_and_extract_archive(files.url, str(root), filename=files.archive, md5=files.archive_md5)
    except (urllib.error.URLError, OSError, RuntimeError) as error:
        raise TaskHetError(f"--download: could not fetch {dataset} from {files.url} into {root} ({error}); "
                           f"without internet, copy torchvision's {files.folder_name}/ folder there") from None


def download_and_extract_archive(url: str, root: str, filename: str, md5: str) -> None:
    """torchvision's downloader, imported on first use: torchvision takes seconds to import, which a process that
    only reads the files (a Flower node answering one message) should not pay."""
    import utils.tv_compat  # noqa: F401  (before torchvision)
    from torchvision.datasets.utils import download_and_extract_archive as fetch

    fetch(url, root, filename=filename, md5=md5)


def check_integrity(path: str, md5: str) -> bool:
    """torchvision's md5 check, imported on first use (see :func:`download_and_extract_archive`)."""
    import utils.tv_compat  # noqa: F401  (before torchvision)
    from torchvision.datasets.utils import check_integrity as check

    return check(path, md5)


def _failing_md5(folder: Path, files: list[tuple[str, str]]) -> list[str]:
    """Names of the ``(name, md5)`` files under ``folder`` that are missing or fail torchvision's md5 check."""
    return [name for name, md5 in files if not check_integrity(str(folder / name), md5)]


def load_split(root: Path, dataset: str, train: bool, verify_checksums: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """One split of ``dataset``, read from torchvision's on-disk files without running any code they carry.

    Torchvision's ``CIFAR10``/``CIFAR100`` classes read the batches with plain ``pickle.load``, which runs
    whatever a crafted file asks for, and steps 2-4 read files whose md5s step 1 checked long before (or
    never, with ``--no-verify_checksums``). So the files are read here with
    :func:`utils.loaders.load_data_pickle` (dicts, lists, strings, numbers and numpy arrays only), and each
    batch's content is checked as it is read (:func:`_read_batch`).

    Args:
        root: the data path holding torchvision's folder (``cifar-10-batches-py`` / ``cifar-100-python``).
        dataset: "cifar10" or "cifar100" (fine labels).
        train: the training set (else the test set).
        verify_checksums: check torchvision's md5s of the files read (False for test fixtures and files step 1 verified).

    Returns:
        ``(images uint8 [N, 32, 32, 3], labels int64 [N])``, as torchvision's classes give them.

    Raises:
        TaskHetError: files missing (naming them and the command that fetches them), failing the md5
            check, or not CIFAR batches (naming the file: a foreign pickle, truncated, labels that do
            not match the images in number or lie outside 0..C-1).
    """
    files = DATASET_CLASSES[_check_dataset(dataset)]
    folder = Path(root) / files.folder_name
    missing = [path for path in expected_files(root, dataset) if not path.is_file()]
    if missing:
        raise TaskHetError(f"{dataset} files missing under {folder}: {', '.join(path.name for path in missing)}; fetch them "
                           f"with `{FETCH_COMMAND.format(dataset=dataset)}` (step 1 with --download)")
    meta_name, meta_md5, names_key = files.meta
    batches = files.split_files(train)
    if verify_checksums:
        failing = _failing_md5(folder, [*batches, (meta_name, meta_md5)])
        if failing:
            raise TaskHetError(f"{dataset} file(s) {', '.join(failing)} under {folder} fail torchvision's md5 check; "
                               f"delete them and rerun `{FETCH_COMMAND.format(dataset=dataset)}`")
    _read_meta(folder / meta_name, dataset, names_key, files.num_classes)
    parts = [_read_batch(folder / name, dataset, files.label_key, files.num_classes) for name, _ in batches]
    images = np.concatenate([data for data, _ in parts]).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return images, np.concatenate([labels for _, labels in parts])


def _read_meta(path: Path, dataset: str, names_key: str, num_classes: int) -> None:
    """Check the meta file: a dict whose ``names_key`` lists ``num_classes`` class names."""
    meta = load_data_pickle(path, f"{dataset} file")
    names = meta.get(names_key) if isinstance(meta, dict) else None
    if not isinstance(names, list) or len(names) != num_classes or not all(isinstance(name, str) for name in names):
        raise TaskHetError(f"{dataset} file {path} is not {dataset}'s meta file: expected a dict whose {names_key!r} "
                           f"lists {num_classes} class names")


def _read_batch(path: Path, dataset: str, label_key: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """One batch file: ``(data uint8 [n, 3072], labels int64 [n])``, each label in 0..C-1.

    Checked here, at the step that reads the file: torchvision stacks the images and the labels of all
    batches separately, so a batch with one label too many would shift every later label silently.
    """
    what = f"{dataset} file {path}"
    batch = load_data_pickle(path, f"{dataset} file")
    if not isinstance(batch, dict) or "data" not in batch or label_key not in batch:
        raise TaskHetError(f"{what} is not a CIFAR batch: expected a dict with 'data' and {label_key!r} entries")
    data = batch["data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != IMAGE_VALUES:
        found = f"{data.dtype} {list(data.shape)}" if isinstance(data, np.ndarray) else type(data).__name__
        raise TaskHetError(f"{what}: 'data' is {found}, expected a uint8 array [images, {IMAGE_VALUES}]")
    labels = _labels(batch[label_key], what, label_key)
    if len(labels) != len(data):
        raise TaskHetError(f"{what} has {len(labels)} labels for {len(data)} images: every image needs exactly one label")
    outside = [index for index, label in enumerate(labels) if not 0 <= label < num_classes]
    if outside:
        raise TaskHetError(f"{what}: label {labels[outside[0]]} of image {outside[0]} is outside 0..{num_classes - 1} "
                           f"({len(outside)} labels in all)")
    return data, np.array(labels, dtype=np.int64)


def _labels(raw: object, what: str, label_key: str) -> list[int]:
    """A batch's labels as Python ints (any size, so a huge one is reported as out of range, not as an overflow)."""
    if isinstance(raw, np.ndarray) and raw.ndim == 1 and raw.dtype.kind in "iu":
        return raw.tolist()
    if isinstance(raw, list) and all(type(label) is int for label in raw):  # bool is no label
        return raw
    raise TaskHetError(f"{what}: {label_key!r} is not a list of integer labels")


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
    _check_dataset(dataset)
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
