"""CIFAR-10 and CIFAR-100 as torchvision stores them on disk: the file table, the download, and a reader that
runs no code the files carry.

The files are torchvision's: ``<data_path>/cifar-10-batches-py/`` (``data_batch_1..5``,
``test_batch``, ``batches.meta``) and ``<data_path>/cifar-100-python/`` (``train``,
``test``, ``meta``), with the names, md5s and download that torchvision's ``CIFAR10/CIFAR100`` classes
give (:data:`DATASET_CLASSES`, checked against them by a test). The files are read here with a restricted
unpickler (:func:`load_split`), never through those classes, which unpickle them with plain ``pickle``:
this module does not import them at all. The ``cifar`` family (its manifest and dataset) is datasets/cifar.py.
"""

from __future__ import annotations

import urllib.error
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from utils.errors import TaskHetError
from utils.loaders import load_data_pickle

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
    files = DATASET_CLASSES[check_dataset(dataset)]
    names = [name for name, _ in files.split_files(True) + files.split_files(False)] + [files.meta[0]]
    return [Path(root) / files.folder_name / name for name in names]


def check_dataset(dataset: str) -> str:
    if dataset not in DATASET_CLASSES:
        raise TaskHetError(f"--dataset must be one of {', '.join(DATASET_CLASSES)}, got {dataset!r}")
    return dataset


def download(root: Path, dataset: str) -> None:
    """Fetch ``dataset`` into ``root`` with torchvision's downloader (md5-checked); a TaskHetError when it cannot.

    Only torchvision's download-and-extract is used: its dataset classes would unpickle the files.
    """
    files = DATASET_CLASSES[check_dataset(dataset)]
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
    files = DATASET_CLASSES[check_dataset(dataset)]
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
