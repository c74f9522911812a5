"""The ``imagefolder`` family: a user's own images in torchvision's ImageFolder layout, for classification.

Layout: ``<root>/<class>/<image>`` (an image may sit deeper inside its class folder, as torchvision allows).
The classes are the class folders that hold a selected image, numbered 0..K-1 in name order (torchvision's
``find_classes``); an image is a file with one of :data:`datasets.folder_files.IMAGE_EXTENSIONS`. Step 1
(:func:`select_imagefolder`) decodes every image once, so a corrupt file stops it, naming the file.

The step-1 manifest has columns :data:`MANIFEST_COLUMNS`: ``image_path`` is the image relative to the
root (also its ``sample_id``), ``class_name`` its class folder, ``label`` the class number, ``split``
train/test and ``val`` 1 for the training rows set aside for validation. The one task, ``folder_class``,
takes its K from the manifest (:meth:`ImageFolderFamily.num_classes`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from datasets.family import (DATASETS, FAMILY_COLUMN, VAL_COLUMN, DataFamily, refuse_repeated_images,
                             with_family_column)
from datasets.folder_files import (IMAGE_EXTENSIONS, INPUT_KEY, SPLIT_EXPECTED, FolderDataset, image_array, integers,
                                   list_folder, named_files, normalised_key, read_rgb, read_split_csv, refuse_bad_cells,
                                   relative_paths, require_both_splits, seeded_split, split_checks, split_from_csv)
from utils.errors import TaskHetError
from utils.loaders import inside_root, read_csv

if TYPE_CHECKING:
    from models.tasks import TaskSpec

FAMILY = "imagefolder"
TASK = "folder_class"
MANIFEST_COLUMNS = (FAMILY_COLUMN, "sample_id", "image_path", "class_name", "label", "split", VAL_COLUMN)


@dataclass
class ImageFolderSelection:
    """Step 1's result: the manifest, and what it left out (for its log).

    Attributes:
        manifest: :data:`MANIFEST_COLUMNS`, rows in ``image_path`` order.
        skipped: entries under the root that are not images in a class folder (relative paths).
        unlisted: images on disk that the split CSV does not list (left out).
    """

    manifest: pd.DataFrame
    skipped: list[str] = field(default_factory=list)
    unlisted: int = 0


def find_images(root: Path) -> tuple[list[str], list[str], list[str]]:
    """``(images, skipped, class folders)`` under ``root``: every image inside a class folder, every other entry, as
    paths relative to ``root``, and the class folders' names.

    Raises:
        TaskHetError: no root, or no image in any class folder.
    """
    root = Path(root)
    if not root.is_dir():
        raise TaskHetError(f"data root {root} does not exist (--data_path: a folder of class folders, root/<class>/<image>)")
    _, entries = list_folder(root, root, (), recursive=False)  # a file at the top is in no class folder
    folders = [entry.rstrip("/") for entry in entries if entry.endswith("/")]
    images, skipped = [], [entry for entry in entries if not entry.endswith("/")]
    seen = {root.resolve()}  # shared: a link back to the root or to a folder listed already is not followed again
    for folder in folders:
        found, others = list_folder(root, root / folder, IMAGE_EXTENSIONS, recursive=True, seen=seen)
        images += found
        skipped += others
    if not images:
        raise TaskHetError(f"{root}: no image in any class folder (expected root/<class>/<image>, images ending in "
                           f"{', '.join(IMAGE_EXTENSIONS)})")
    return images, sorted(skipped), folders


def select_imagefolder(root: Path, test_fraction: float, val_fraction: float, seed: int, split_csv: Path | None = None,
                       progress: bool = False) -> ImageFolderSelection:
    """Step 1 for imagefolder: every image (or those a split CSV lists), labelled by class folder and split.

    Args:
        root: the folder of class folders.
        test_fraction: without a split CSV, the share of each class's images in the test split, in (0, 1).
        val_fraction: without a split CSV, the share of each class's training images set aside for validation, [0, 1).
        seed: root seed of the split.
        split_csv: ``path,split`` (path relative to ``root``, split train, val or test); None for the seeded split.
        progress: show a bar while every image is decoded.

    Raises:
        TaskHetError: one line naming the file, row or flag (a class folder without an image, a path in the
            split CSV that leaves the root or is no image in a class folder, a corrupt image, fewer than two classes).
    """
    root = Path(root)
    images, skipped, folders = find_images(root)
    unlisted = 0
    if split_csv is None:
        empty = sorted(set(folders) - {path.split("/", 1)[0] for path in images})
        if empty:
            raise TaskHetError(f"class folder {root / empty[0]} holds no image (torchvision's ImageFolder refuses it "
                               "too); remove it or add images")
        paths = images
    else:
        table = read_split_csv(split_csv, "path")
        keys = normalised_key(split_csv, table, "path", root, "split CSV")
        known = set(images)
        for key, row in zip(keys, table["row"]):
            if key not in known:
                raise TaskHetError(f"split CSV {split_csv}: row {row} names {key!r}, {_why_not_an_image(root, key)}")
        paths, unlisted = keys.tolist(), len(known - set(keys))
        skipped = [entry for entry in skipped if (root / entry).resolve() != Path(split_csv).resolve()]  # not a stray
    classes = sorted({path.split("/", 1)[0] for path in paths})
    if len(classes) < 2:
        raise TaskHetError(f"{root}: {len(classes)} class folder(s) with images ({', '.join(classes)}); classification "
                           "needs at least 2")
    labels = np.array([classes.index(path.split("/", 1)[0]) for path in paths], dtype=np.int64)
    if split_csv is None:
        split, val = seeded_split(labels, test_fraction, val_fraction, seed, FAMILY)
        hint = "raise --test_fraction or add images: each class keeps one training image"
    else:
        split, val = split_from_csv(keys, table)
        hint = f"split CSV {split_csv}"
    require_both_splits(split, val, root, hint)
    for path in tqdm(paths, desc="step 1: checking images", unit="image", disable=not progress):
        read_rgb(root / path, "image")  # a corrupt file stops step 1 here, not an epoch of step 2
    manifest = pd.DataFrame({FAMILY_COLUMN: FAMILY, "sample_id": paths, "image_path": paths,
                             "class_name": [classes[label] for label in labels], "label": labels, "split": split,
                             VAL_COLUMN: val}, columns=list(MANIFEST_COLUMNS))
    return ImageFolderSelection(manifest.sort_values("image_path", ignore_index=True), skipped, unlisted)


def _why_not_an_image(root: Path, key: str) -> str:
    """Why a split CSV's path is not one of the images step 1 found (the end of an error line)."""
    path = root / key
    if not path.exists():
        return f"which does not exist under {root}"
    if "/" not in key:
        return "which is not inside a class folder (root/<class>/<image>)"
    if path.is_dir():
        return "which is a folder, not an image"
    return f"which is not an image (extensions {', '.join(IMAGE_EXTENSIONS)}, in any case)"


def validate_manifest(manifest: pd.DataFrame, source: str = "manifest") -> pd.DataFrame:
    """Check an imagefolder manifest; returns it with a fresh 0..N-1 index and int64 numbers.

    Raises:
        TaskHetError: naming ``source`` and the first bad column or row.
    """
    missing = [column for column in MANIFEST_COLUMNS if column not in manifest.columns]
    if missing:
        raise TaskHetError(f"{source}: missing column(s) {', '.join(missing)}; expected {', '.join(MANIFEST_COLUMNS)}")
    if manifest.empty:
        raise TaskHetError(f"{source}: has no rows")
    manifest = with_family_column(manifest.reset_index(drop=True), FAMILY, source)
    paths = relative_paths(manifest, "image_path", source)
    first_folder = paths.str.split("/", n=1).str[0]
    checks = {"sample_id": ~manifest["sample_id"].duplicated(), "label": integers(manifest["label"], 0, 2**31),
              "class_name": (manifest["class_name"].astype(str) == first_folder) & paths.str.contains("/", regex=False),
              **split_checks(manifest)}
    expected = {"sample_id": "a sample_id not seen before", "label": "an integer >= 0",
                "class_name": "the first folder of its image_path (root/<class>/<image>)", **SPLIT_EXPECTED}
    refuse_bad_cells(manifest, checks, expected, source)
    manifest = manifest.astype({"label": np.int64, VAL_COLUMN: np.int64, "class_name": str})
    for one, other in (("label", "class_name"), ("class_name", "label")):
        counts = manifest.groupby(one)[other].transform("nunique")
        if (counts > 1).any():
            row = int(np.flatnonzero(counts.to_numpy() > 1)[0])
            raise TaskHetError(f"{source}: row {row + 2}: {one} {manifest.at[row, one]!r} goes with more than one "
                               f"{other}; each class folder has one label")
    refuse_repeated_images(pd.DataFrame({"image_path": paths}), manifest["sample_id"], source)
    return manifest


def read_manifest(path: Path) -> pd.DataFrame:
    """Read and validate an imagefolder ``manifest.csv``."""
    text = {column: str for column in (FAMILY_COLUMN, "sample_id", "image_path", "class_name", "split")}
    return validate_manifest(read_csv(path, "manifest", finished=True, dtype=text, keep_default_na=False), str(path))


def rows_digest(rows: pd.DataFrame, columns: list[str]) -> str:
    """A hash of the rows' files as a set (sorted by sample id): part of a decoded-sample cache's key."""
    table = rows[["sample_id", *columns]].astype(str).sort_values("sample_id")
    return hashlib.sha256(table.to_csv(index=False).encode()).hexdigest()


class ImageFolderDataset(FolderDataset):
    """The images of some imagefolder manifest rows.

    An item is ``{"image": float32 [3, S, S] in [0, 1], "folder_class": int64 scalar, "label": int64 scalar
    (the same class), "sample_id": str}``: the file converted to RGB and resized to S x S
    (:func:`datasets.folder_files.image_array`), through the decoded-sample cache when ``cache_dir`` is given.

    Raises:
        TaskHetError: bad rows, an image_path outside the root, a missing file (naming the sample).
    """

    def __init__(self, root: Path, rows: pd.DataFrame, image_size: int, cache_dir: Path | None = None) -> None:
        if image_size < 1:
            raise TaskHetError(f"image_size must be >= 1, got {image_size}")
        rows = validate_manifest(rows, "manifest rows")
        sample_ids = rows["sample_id"].astype(str).tolist()
        self.image_size = image_size
        key = {"family": FAMILY, "image_size": image_size, "rows": rows_digest(rows, ["image_path"])}
        super().__init__(root, sample_ids, {INPUT_KEY: ((3, image_size, image_size), np.dtype(np.float32))}, cache_dir, key)
        self.paths = [inside_root(self.root, path, f"sample {sample}: manifest image_path")
                      for sample, path in zip(sample_ids, rows["image_path"])]
        missing = [str(path) for path in self.paths if not path.is_file()]
        if missing:
            raise TaskHetError(f"image file(s) missing under {self.root}: {named_files(missing)} (manifest image_path is "
                               "relative to --data_path)")
        self.labels = rows["label"].to_numpy(dtype=np.int64)

    def decode(self, index: int) -> dict[str, np.ndarray]:
        return {INPUT_KEY: image_array(read_rgb(self.paths[index], f"sample {self.sample_ids[index]}: image"), self.image_size)}

    def columns(self, stacked: dict[str, np.ndarray], indices: list[int]) -> dict[str, torch.Tensor]:
        labels = torch.from_numpy(self.labels[np.asarray(indices, dtype=np.int64)])
        return {INPUT_KEY: torch.from_numpy(stacked[INPUT_KEY]), TASK: labels, "label": labels.clone()}


class ImageFolderFamily(DataFamily):
    """A user's images in class folders: one classification task, no natural owner of a sample."""

    name = FAMILY
    input_key = INPUT_KEY
    label_column = "label"
    source_column = None
    tasks = (TASK,)

    def read_manifest(self, path: Path) -> pd.DataFrame:
        return read_manifest(path)

    def num_classes(self, manifest: pd.DataFrame) -> int:
        # Step 1 numbers the class folders 0..K-1, so the largest label fixes K (a client's share never shrinks it:
        # every step reads the whole manifest).
        return int(manifest[self.label_column].max()) + 1

    def dataset(self, root: Path, rows: pd.DataFrame, task: TaskSpec | None, image_size: int,
                cache_dir: Path | None = None) -> Dataset:
        return ImageFolderDataset(root, rows, image_size, cache_dir)


DATASETS.register(FAMILY)(ImageFolderFamily())
