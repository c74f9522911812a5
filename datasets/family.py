"""Data families: everything the pipeline needs to know about one kind of data, behind one interface.

A family owns its step-1 manifest (columns, validation), its label column (the
label-based groups of step 3b), the tasks it supports, the batch key of the
model input and how to build a ``torch.utils.data.Dataset`` for a task over
some manifest rows. Steps 2-4 and the pipeline talk to a family only through
:class:`DataFamily`, and pick it from the manifest's ``family`` column, never
from a flag a user could get wrong.

Families register themselves in :data:`DATASETS` (``datasets/taskonomy.py``,
``datasets/digits.py``); ``datasets/__init__.py`` imports them explicitly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from torch.utils.data import Dataset

from utils.errors import TaskHetError
from utils.loaders import read_csv
from utils.registry import Registry

if TYPE_CHECKING:
    from models.tasks import TaskSpec

# The manifest column that names the family of every row (one value per file).
FAMILY_COLUMN = "family"
# Manifests written before families existed were all Taskonomy: they have no family column.
LEGACY_FAMILY = "taskonomy"
SPLITS = ("train", "test")
# Optional manifest column: 1 marks a training row set aside for validation (model selection), 0 otherwise.
# The split stays train/test for every family; a family without the column has no validation part.
VAL_COLUMN = "val"
# The share of the training data every family's step 1 sets aside for validation unless told otherwise.
DEFAULT_VAL_FRACTION = 0.1


class DataFamily(ABC):
    """One kind of data, seen by the pipeline.

    Attributes:
        name: registry name, written into the manifest's ``family`` column.
        input_key: batch key of the model input: float32 ``[B, 3, H, W]`` in [0, 1].
        label_column: manifest column of the integer class label 0..K-1 (the
            label-based groups of step 3b; also what step 3 compares clusters with).
        source_column: manifest column of a sample's natural owner (the ``natural``
            partition scheme), or None when the data has none.
        tasks: names of the registered tasks (``models.tasks``) this family can feed.
    """

    name: str
    input_key: str
    label_column: str
    source_column: str | None
    tasks: tuple[str, ...]

    @abstractmethod
    def read_manifest(self, path: Path) -> pd.DataFrame:
        """Read and validate a step-1 manifest of this family.

        Returns:
            The rows with a 0..N-1 index; columns include ``family`` (= :attr:`name`),
            ``sample_id`` (unique str), ``split`` ("train"/"test") and :attr:`label_column` (int64).

        Raises:
            TaskHetError: naming the file and the first bad column or row.
        """

    @abstractmethod
    def num_classes(self, manifest: pd.DataFrame) -> int:
        """K, the classes of the family's classification task(s) given its manifest."""

    @abstractmethod
    def dataset(self, root: Path, rows: pd.DataFrame, task: TaskSpec | None, image_size: int,
                cache_dir: Path | None = None) -> Dataset:
        """The samples of ``rows`` (manifest rows: a split or a client's share), in row order.

        Args:
            root: data root of families that read files (ignored by families whose data ships with a package).
            rows: manifest rows of this family.
            task: the task whose target each item carries; None for the input alone (step 3's embedding).
            image_size: side length of the square input.
            cache_dir: folder for a decoded-sample cache where the family has one; None for none.

        Returns:
            A Dataset whose items are dicts: :attr:`input_key` -> float32 ``[3, H, W]`` in [0, 1],
            ``task.domain`` -> the target (int64 scalar for classification, ``[C, H, W]`` for dense
            tasks, with an optional bool ``"mask"`` ``[1, H, W]``), :attr:`label_column` -> int64
            scalar, ``"sample_id"`` -> str.
        """

    def output_channels(self, manifest: pd.DataFrame, task: TaskSpec) -> int | None:
        """The model head's outputs for ``task`` (``build_task_model``'s ``num_classes``): K for a classification
        task; for a dense task, None (its own ``out_channels``), but where the family's data declares them (the
        folder families: a target's channels or classes, recorded in the manifest)."""
        return self.num_classes(manifest) if task.kind == "classification" else None

    def require_values(self, manifest: pd.DataFrame, column: str, where: str) -> None:
        """Refuse, naming ``where``, a partition over ``column`` (the label or source column) of a manifest that holds
        none there; every row of the built-in families has both (a family without a source has no source column)."""

    def check_task(self, task: str, source: str) -> None:
        """Raise a :class:`TaskHetError` naming ``source`` unless the family supports ``task``."""
        if task not in self.tasks:
            raise TaskHetError(f"{source}: task {task!r} is not a task of data family {self.name!r}; "
                               f"its tasks: {', '.join(self.tasks)}")


DATASETS: Registry[DataFamily] = Registry("data family")


def get_family(name: str) -> DataFamily:
    """The family called ``name``; a :class:`TaskHetError` listing the families otherwise."""
    return DATASETS.get(name)


def list_families() -> list[str]:
    """Registered family names, sorted."""
    return DATASETS.names()


def family_of(manifest: pd.DataFrame, source: str = "manifest") -> DataFamily:
    """The family of a manifest already read (its ``family`` column; Taskonomy without one)."""
    if FAMILY_COLUMN not in manifest.columns or manifest.empty:
        return get_family(LEGACY_FAMILY)
    name = str(manifest[FAMILY_COLUMN].iloc[0])
    if name not in DATASETS:
        raise TaskHetError(f"{source}: row 2 has family {name!r}; known data families: {', '.join(list_families())}")
    return get_family(name)


def load_manifest(path: Path) -> tuple[DataFamily, pd.DataFrame]:
    """Read a step-1 manifest of any family: ``(its family, its validated rows)``."""
    head = read_csv(path, "manifest", finished=True, hint="run step 1, extract_datapoints_for_experiments.py", nrows=1,
                    dtype=str, keep_default_na=False)
    family = family_of(head, str(path))
    return family, family.read_manifest(path)


def class_counts(manifest: pd.DataFrame) -> pd.DataFrame:
    """``label, num_train, num_val, num_test`` per class of a manifest with ``label`` and ``val`` columns
    (num_train excludes the validation rows): the class_counts.csv of step 1 for cifar and digits."""
    part = np.where(manifest[VAL_COLUMN] == 1, "val", manifest["split"])
    table = pd.crosstab(manifest["label"], part).reindex(columns=["train", "val", "test"], fill_value=0)
    return pd.DataFrame({"label": table.index, "num_train": table["train"].to_numpy(), "num_val": table["val"].to_numpy(),
                         "num_test": table["test"].to_numpy()})


def validation_mask(manifest: pd.DataFrame) -> np.ndarray:
    """bool [rows]: the train rows set aside for validation (``val = 1``); all False without a ``val`` column.

    Partitions (step 3b) leave them out and step 4 evaluates the global model on them (split ``val``).
    """
    if VAL_COLUMN not in manifest.columns:
        return np.zeros(len(manifest), dtype=bool)
    return ((manifest["split"] == "train") & (pd.to_numeric(manifest[VAL_COLUMN], errors="coerce") == 1)).to_numpy()


def refuse_repeated_images(identity: pd.DataFrame, sample_ids: pd.Series, source: str) -> None:
    """Refuse a manifest in which two rows name the same image file, naming both rows.

    Two sample ids for one image would let it sit in train and in test (or in two clients),
    and no later step could tell. Each family says what identifies its image file.

    Args:
        identity: one row per manifest row (index 0..N-1, row r is line r + 2 of the file, the
            header being line 1), one column per part of the image's identity, already
            normalised by the family (Taskonomy: ``rgb_path`` as a normalised path; cifar:
            ``dataset, split, image_index``; digits: ``image_index``).
        sample_ids: the manifest's ``sample_id`` column (for the message).
        source: the file, for the message.

    Raises:
        TaskHetError: naming the first repeated image's two rows and their sample ids.
    """
    repeated = identity.duplicated(keep="first").to_numpy()
    if not repeated.any():
        return
    second = int(np.flatnonzero(repeated)[0])
    first = int(np.flatnonzero((identity == identity.iloc[second]).all(axis=1).to_numpy())[0])
    image = ", ".join(f"{column} {value!r}" if isinstance(value, str) else f"{column} {value}"
                      for column, value in identity.iloc[second].items())
    raise TaskHetError(f"{source}: rows {first + 2} and {second + 2} (sample_id {sample_ids.iloc[first]!r} and "
                       f"{sample_ids.iloc[second]!r}) name the same image ({image}); each image may have one row "
                       "only, else it could sit in train and in test")


def with_family_column(manifest: pd.DataFrame, family: str, source: str) -> pd.DataFrame:
    """``manifest`` with a ``family`` column first (added for legacy files); every row must name ``family``."""
    if FAMILY_COLUMN not in manifest.columns:
        manifest = manifest.copy()
        manifest.insert(0, FAMILY_COLUMN, family)
    wrong = manifest[FAMILY_COLUMN].astype(str) != family
    if wrong.any():
        row = int(np.flatnonzero(wrong)[0])
        raise TaskHetError(f"{source}: row {row + 2} has family {manifest[FAMILY_COLUMN].iloc[row]!r}, "
                           f"but the file is a {family!r} manifest (one family per manifest)")
    return manifest


def stratified_validation(labels: np.ndarray, val_fraction: float, rng: np.random.Generator) -> np.ndarray:
    """A bool mask over ``labels``: the stratified validation part of a training set, drawn with ``rng``.

    Class c with n_c images gives ``min(round_half_up(val_fraction * n_c), n_c - 1)`` of them, so every
    class keeps at least one training image (a tail class of 5 at 10% gives 1, of 4 gives 0). Written
    here rather than with scikit-learn's ``train_test_split``, which refuses a validation part smaller
    than the number of classes (tiny or long-tailed sets).

    Raises:
        TaskHetError: ``val_fraction`` outside [0, 1), naming ``--val_fraction``.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise TaskHetError(f"--val_fraction must be in [0, 1), got {val_fraction}")
    mask = np.zeros(len(labels), dtype=bool)
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        count = min(int(np.floor(val_fraction * members.size + 0.5)), members.size - 1)
        mask[rng.choice(members, size=count, replace=False)] = True
    return mask
