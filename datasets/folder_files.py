"""What the folder data families share: listing a user's files, reading images, the split, the cached dataset.

``imagefolder`` (``datasets/imagefolder.py``) and ``paired_folders`` (``datasets/paired_folders.py``) read a
user's own folder of images. Both list files the same way (an image is a file whose extension is one of
:data:`IMAGE_EXTENSIONS`, torchvision's list, in any case; names starting with a dot are not looked at; any
other file is skipped and named in one warning of step 1), read every image with
:func:`utils.loaders.load_image` (a corrupt file is one error naming it), split the samples the same way (a
split CSV, or a seeded split stratified by label that keeps at least one training image of every label:
:func:`datasets.family.stratified_validation`) and decode samples into the shared decoded-sample cache
(:class:`FolderDataset`). Every name that reaches a manifest (a class folder, an image, a target file) must be
UTF-8 text, as the manifest is: one that is not (a file named on a Latin-1 system) is one error naming it
(:func:`require_utf8_path`).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
from abc import abstractmethod
from pathlib import Path
from typing import Mapping

import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset, default_collate

from datasets.cache import CACHE_FORMAT_VERSION, DecodedSampleCache, cache_rows
from datasets.family import SPLITS, VAL_COLUMN, stratified_validation
from datasets.taskonomy import resize
from utils.errors import TaskHetError
from utils.loaders import inside_root, load_image, read_csv
from utils.seeding import numpy_rng

# torchvision's IMG_EXTENSIONS (datasets/folder.py): what ImageFolder takes for an image.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# A split CSV's split values; "val" rows are training rows set aside for validation (the manifest's val = 1).
SPLIT_VALUES = ("train", "val", "test")
INPUT_KEY = "image"
MAX_NAMED = 5  # a message names at most this many files


def has_extension(name: str, extensions: tuple[str, ...]) -> bool:
    """Whether ``name`` ends in one of ``extensions``, in any case (``.JPG`` is a JPEG)."""
    return name.lower().endswith(extensions)


def list_folder(root: Path, folder: Path, extensions: tuple[str, ...], recursive: bool,
                seen: set[Path] | None = None) -> tuple[list[str], list[str]]:
    """The files under ``folder`` with one of ``extensions`` and the others, as sorted paths relative to ``root``.

    Entries whose name starts with a dot (``.DS_Store``, ``.ipynb_checkpoints``) are not looked at. Without
    ``recursive``, subfolders count among the others (they are skipped like a stray file). Symbolic links are
    followed, as torchvision's ImageFolder follows them (a link inside the root is its owner's choice), but a
    folder already listed is not listed again, so a link to a parent folder cannot loop.
    """
    seen = set() if seen is None else seen
    seen.add(Path(folder).resolve())
    require_utf8_path(root, Path(folder), "folder")  # what it holds is named in the manifest through it
    kept, others = [], []
    with os.scandir(folder) as entries:
        for entry in sorted(entries, key=lambda item: item.name):
            if entry.name.startswith("."):
                continue
            relative = Path(entry.path).relative_to(root).as_posix()
            if entry.is_dir():
                if not recursive:
                    others.append(relative + "/")
                elif Path(entry.path).resolve() not in seen:
                    more_kept, more_others = list_folder(root, Path(entry.path), extensions, recursive, seen)
                    kept += more_kept
                    others += more_others
            elif has_extension(entry.name, extensions):
                require_utf8_path(root, Path(entry.path), "file")
                kept.append(relative)
            else:
                others.append(relative)  # skipped: only named in a warning, escaped there (skipped_line)
    return kept, others


def shown_path(path: Path | str) -> str:
    """``path`` as text any console or log can print: bytes of its name that are not UTF-8 (which Python keeps as
    lone surrogates) shown as ``\\xNN`` (Python's backslashreplace)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def require_utf8_path(root: Path, path: Path, what: str) -> None:
    """Refuse ``path`` (a file or folder under ``root``) when its part below ``root`` is not UTF-8 text.

    The manifest is a UTF-8 CSV that names every file by its path relative to the root, so a name with other bytes
    (from a Latin-1 or Windows system) could not be written there, nor read back as the same file.
    """
    try:
        Path(path).relative_to(root).as_posix().encode("utf-8")
    except UnicodeEncodeError:
        raise TaskHetError(f"{what} {shown_path(path)}: its name is not UTF-8 text (the bytes shown as \\xNN); the "
                           "manifest names every file in UTF-8, so rename it (e.g. with convmv)") from None


def skipped_line(root: Path, skipped: list[str], kind: str) -> str | None:
    """The one warning of step 1 about files it skipped under ``root`` (None when there were none)."""
    if not skipped:
        return None
    named = named_files([shown_path(entry) for entry in skipped])  # a skipped name need not be UTF-8: escaped
    return f"skipped {len(skipped)} entr{'y' if len(skipped) == 1 else 'ies'} under {shown_path(root)} that {kind}: {named}"


def named_files(paths: list[str]) -> str:
    """Up to :data:`MAX_NAMED` paths, then how many in all."""
    return ", ".join(paths[:MAX_NAMED]) + (f" ... ({len(paths)} in all)" if len(paths) > MAX_NAMED else "")


def read_rgb(path: Path, what: str) -> np.ndarray:
    """The image at ``path`` as uint8 ``[H, W, 3]`` (PIL's RGB conversion: grey repeated, alpha dropped, palette
    looked up); an unreadable or truncated file is one error naming it."""
    image = load_image(path, what)
    try:
        return np.asarray(image.convert("RGB"))
    except (OSError, ValueError) as error:
        raise TaskHetError(f"{what} {path} cannot be read as an RGB image ({error})") from None


def image_array(rgb: np.ndarray, image_size: int) -> np.ndarray:
    """uint8 ``[H, W, 3]`` as float32 ``[3, S, S]`` in [0, 1]: scaled, then resized bilinearly with antialiasing
    (PIL's shrinking) to a square, whatever the aspect ratio (torchvision's ``Resize((S, S))``)."""
    values = np.ascontiguousarray(rgb.transpose(2, 0, 1), dtype=np.float32) / np.float32(255.0)
    return np.clip(resize(values, image_size, "bilinear"), 0.0, 1.0)


# ----- the split -----
def read_split_csv(path: Path, key: str, what: str = "split CSV") -> pd.DataFrame:
    """A split CSV: ``<key>,split`` with split one of :data:`SPLIT_VALUES`, every key once.

    Returns:
        The rows with a ``row`` column (the line in the file; the header is line 1).
    """
    table = read_csv(path, what, (key, "split"), dtype=str, keep_default_na=False)
    table = table.assign(row=np.arange(len(table)) + 2)
    if table.empty:
        raise TaskHetError(f"{what} {path} has a header but no rows")
    bad = ~table["split"].isin(SPLIT_VALUES)
    if bad.any():
        first = table[bad].iloc[0]
        raise TaskHetError(f"{what} {path}: row {first['row']} has split {first['split']!r}, expected one of "
                           f"{', '.join(SPLIT_VALUES)}")
    return table


def normalised_key(path: Path, table: pd.DataFrame, column: str, root: Path, what: str) -> pd.Series:
    """``table[column]`` as normalised relative paths inside ``root`` (``./a//b.jpg`` is ``a/b.jpg``); a path that
    leaves the root (``..``, absolute, ``~``) names its row, and so does a path listed twice."""
    keys = []
    for value, row in zip(table[column], table["row"]):
        inside_root(root, value, f"{what} {path}: row {row}, {column}")
        keys.append(posixpath.normpath(value))
    keys = pd.Series(keys, index=table.index)
    repeated = keys.duplicated(keep=False)
    if repeated.any():
        rows = table.loc[repeated & (keys == keys[repeated].iloc[0]), "row"].tolist()
        raise TaskHetError(f"{what} {path}: rows {rows[0]} and {rows[1]} both name {keys[repeated].iloc[0]!r}; "
                           "each image may have one split")
    return keys


def seeded_split(labels: np.ndarray, test_fraction: float, val_fraction: float, seed: int,
                 family: str) -> tuple[np.ndarray, np.ndarray]:
    """``(split "train"/"test" [N], val 0/1 [N])``: a seeded test part, then a seeded validation part of the rest.

    Both parts are stratified by label and keep at least one training image of every label
    (:func:`datasets.family.stratified_validation`): label c with n_c images gives
    ``min(round_half_up(test_fraction * n_c), n_c - 1)`` test images, and its training images give the
    validation part the same way.
    """
    test = stratified_validation(labels, test_fraction, numpy_rng(seed, family, "test"))
    val = np.zeros(len(labels), dtype=np.int64)
    train = np.flatnonzero(~test)
    val[train] = stratified_validation(labels[train], val_fraction, numpy_rng(seed, family, "validation"))
    return np.where(test, "test", "train"), val


def require_both_splits(split: np.ndarray, val: np.ndarray, root: Path, hint: str) -> None:
    """Steps 2-4 need training rows (besides validation) and test rows: refuse a split without."""
    for name, count in (("train", int(((split == "train") & (val == 0)).sum())), ("test", int((split == "test").sum()))):
        if count == 0:
            raise TaskHetError(f"{root}: the split gives no {name} image ({len(split)} images; {hint})")


def split_from_csv(keys: pd.Series, table: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """``(split, val)`` of a split CSV's rows, in ``keys``' order: ``val`` rows are training rows with val = 1."""
    given = table["split"].to_numpy()
    return np.where(given == "test", "test", "train"), (given == "val").astype(np.int64)


# ----- manifest checks -----
def refuse_bad_cells(manifest: pd.DataFrame, checks: Mapping[str, pd.Series], expected: Mapping[str, str],
                     source: str) -> None:
    """Raise one error naming the first row of the first column whose check fails (``checks``: column -> good rows)."""
    for column, good in checks.items():
        good = np.asarray(good, dtype=bool)
        if not good.all():
            row = int(np.flatnonzero(~good)[0])
            value = manifest[column].iloc[row]
            shown = repr(value) if isinstance(value, str) else value
            raise TaskHetError(f"{source}: row {row + 2} has {column} {shown}, expected {expected[column]}")


def integers(values: pd.Series, low: int, high: float) -> pd.Series:
    """Which cells are integers in ``[low, high)`` (read as numbers; text, NaN and inf are not)."""
    numbers = pd.to_numeric(values, errors="coerce")
    return numbers.notna() & (numbers >= low) & (numbers < high) & (numbers == numbers.round())


def split_checks(manifest: pd.DataFrame) -> dict[str, pd.Series]:
    """The checks of ``split`` and ``val`` every folder manifest makes (val = 1 only on train rows)."""
    val = pd.to_numeric(manifest[VAL_COLUMN], errors="coerce")
    return {"split": manifest["split"].isin(SPLITS), VAL_COLUMN: val.isin((0, 1)) & ((val == 0) | (manifest["split"] == "train"))}


SPLIT_EXPECTED = {"split": f"one of {SPLITS}", VAL_COLUMN: "0 or 1 (1 only on train rows)"}


def relative_paths(manifest: pd.DataFrame, column: str, source: str) -> pd.Series:
    """A manifest's path column, each cell a relative path inside the data root (checked as written), normalised."""
    normalised = []
    for row, value in enumerate(manifest[column]):
        inside_root(Path("."), value, f"{source}: row {row + 2}, column {column!r},")
        normalised.append(posixpath.normpath(value))
    return pd.Series(normalised, index=manifest.index)


# ----- the dataset -----
class FolderDataset(Dataset):
    """Samples decoded from a user's files, with the decoded-sample cache (:mod:`datasets.cache`).

    A subclass decodes one row (:meth:`decode`, arrays as :attr:`layout` gives them) and turns stacked arrays
    into the batch's tensors (:meth:`columns`); this class reads rows through the cache when there is one, and
    gives items (``__getitem__``, ``__getitems__``) and whole batches (``read_batch``, ``datasets.batch_reads``)
    that are the same values.

    Args:
        root: the data root.
        sample_ids: each row's sample id.
        layout: array name -> (per-sample shape, dtype) of a decoded row.
        cache_dir: folder of the decoded-sample cache, or None.
        key: a JSON-able record of everything a decoded row depends on besides the root (family, files, size).
    """

    def __init__(self, root: Path, sample_ids: list[str], layout: dict[str, tuple[tuple[int, ...], np.dtype]],
                 cache_dir: Path | None, key: dict) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise TaskHetError(f"data root {self.root} does not exist (--data_path: the folder step 1 read)")
        self.sample_ids = sample_ids
        self.layout = layout
        self.cache = None
        if cache_dir is not None:
            digest = hashlib.sha256(json.dumps({"version": CACHE_FORMAT_VERSION, "root": str(self.root.resolve()), **key},
                                               sort_keys=True).encode())
            self.cache = DecodedSampleCache(Path(cache_dir), digest.hexdigest(), len(sample_ids), layout)
            self.cache_rows = cache_rows(sample_ids)

    @abstractmethod
    def decode(self, index: int) -> dict[str, np.ndarray]:
        """Row ``index``'s arrays, as :attr:`layout` gives them."""

    @abstractmethod
    def columns(self, stacked: dict[str, np.ndarray], indices: list[int]) -> dict[str, torch.Tensor]:
        """Rows ``indices``' batch tensors (item keys in item order, but ``sample_id``) from their stacked arrays."""

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __getitem__(self, index: int) -> dict:
        arrays = None if self.cache is None else self.cache.get(int(self.cache_rows[index]))
        if arrays is None:
            arrays = {name: np.asarray(array, dtype=self.layout[name][1]) for name, array in self.decode(index).items()}
            if self.cache is not None:
                self.cache.put(int(self.cache_rows[index]), arrays)
        return self._samples({name: array[None] for name, array in arrays.items()}, [index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict]:
        """``[self[i] for i in indices]``, in one cache read per array once every row is decoded."""
        indices = np.asarray(indices, dtype=np.int64).tolist()
        stacked = self._cached(indices)
        if stacked is None:
            return [self[index] for index in indices]
        return self._samples(stacked, indices)

    def read_batch(self, indices: list[int]) -> dict:
        """The collated items ``indices`` (``datasets.batch_reads``): one cache read per array when filled."""
        stacked = self._empty() if len(indices) == 0 else self._cached(indices)
        if stacked is None:
            return default_collate(self.__getitems__(indices))
        return {**self.columns(stacked, indices), "sample_id": [self.sample_ids[index] for index in indices]}

    def _cached(self, indices: list[int]) -> dict[str, np.ndarray] | None:
        return None if self.cache is None else self.cache.get_many(self.cache_rows[indices])

    def _empty(self) -> dict[str, np.ndarray]:
        return {name: np.zeros((0, *shape), dtype=dtype) for name, (shape, dtype) in self.layout.items()}

    def _samples(self, stacked: dict[str, np.ndarray], indices: list[int]) -> list[dict]:
        views = {name: column.unbind(0) for name, column in self.columns(stacked, indices).items()}
        return [{**{name: view[position] for name, view in views.items()}, "sample_id": self.sample_ids[index]}
                for position, index in enumerate(indices)]
