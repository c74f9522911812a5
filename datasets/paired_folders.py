"""The ``paired_folders`` family: a user's images, each with dense targets in folders beside them.

Layout::

    <root>/images/<stem>.<ext>           the inputs (any of datasets.folder_files.IMAGE_EXTENSIONS)
    <root>/<target>/<stem>.png | .npy    one folder per target, one file per image, the image's size
    <root>/targets.yaml                  each target's kind and keys (datasets/paired_targets.py)
    <root>/groups.csv                    optional: stem,label and/or stem,source

A target's kind gives its task: ``regression`` -> ``folder_regression``, ``segmentation`` ->
``folder_segmentation``, ``edges`` -> ``folder_edges`` (one target of each kind per manifest). groups.csv gives
each image a label (label-based partitions; any text, numbered 0..K-1 in sorted order, numerically when every
label is a whole number) and a source (its natural owner: the ``natural`` scheme). Without a label there is no
label-based partition: step 3b says so (:meth:`PairedFoldersFamily.require_values`).

The step-1 manifest has :data:`BASE_COLUMNS` and, for each kind it holds, :func:`target_columns`: the target's
file and, the same on every row, its name, channels (classes), scale and ignore value, so that steps 2-4 read
the targets and size the model's head from the manifest alone. ``sample_id`` is the image's file name.
Step 1 (reading the folders into a manifest) is datasets/paired_selection.py; this module holds the manifest's
checks, the dataset and the family.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset

from datasets.family import (DATASETS, FAMILY_COLUMN, VAL_COLUMN, DataFamily, refuse_repeated_images,
                             with_family_column)
from datasets.folder_files import (INPUT_KEY, SPLIT_EXPECTED, FolderDataset, image_array, integers, named_files,
                                   read_rgb, refuse_bad_cells, relative_paths, split_checks)
from datasets.imagefolder import rows_digest
from datasets.paired_targets import KINDS, TARGETS_FILE, TargetSpec, decode_target, make_spec, read_target
from datasets.taskonomy import resize
from utils.errors import TaskHetError
from utils.loaders import inside_root, read_csv

if TYPE_CHECKING:
    from models.tasks import TaskSpec

FAMILY = "paired_folders"
IMAGES = "images"
GROUPS_FILE = "groups.csv"
TASK_OF_KIND = {"regression": "folder_regression", "segmentation": "folder_segmentation", "edges": "folder_edges"}
BASE_COLUMNS = (FAMILY_COLUMN, "sample_id", "image_path", "label", "label_name", "source", "split", VAL_COLUMN)
GROUP_COLUMNS = ("label", "source")


def target_columns(kind: str) -> tuple[str, ...]:
    """The manifest columns of a kind's target: its file, then its name, channels, scale and ignore (constant)."""
    return tuple(f"{kind}_{part}" for part in ("path", "target", "channels", "scale", "ignore"))


def check_size(raw: np.ndarray, size: tuple[int, int], path: Path, image: str) -> None:
    """A target ``[C, H, W]`` must have its image's height and width."""
    if tuple(raw.shape[1:]) != tuple(size):
        raise TaskHetError(f"target {path} is {raw.shape[2]}x{raw.shape[1]} pixels but its image {image} is "
                           f"{size[1]}x{size[0]}: a target must have its image's size")


# ----- the manifest -----
def kinds_in(manifest: pd.DataFrame) -> list[str]:
    """The target kinds a manifest holds (those with a ``<kind>_path`` column)."""
    return [kind for kind in KINDS if target_columns(kind)[0] in manifest.columns]


def spec_of(manifest: pd.DataFrame, kind: str, source: str) -> TargetSpec:
    """The target of ``kind`` a manifest records (its constant columns, checked like targets.yaml)."""
    _, name, channels, scale, ignore = (str(manifest[column].iloc[0]) for column in target_columns(kind))
    fields = {"kind": kind, "ignore": ignore or None}  # read as text: numbers are parsed as targets.yaml's are
    if kind == "regression":
        fields.update(channels=channels, scale=scale)
    elif kind == "segmentation":
        fields["classes"] = channels
    return make_spec(str(name), fields, f"{source}: columns {kind}_*")


def validate_manifest(manifest: pd.DataFrame, source: str = "manifest") -> pd.DataFrame:
    """Check a paired_folders manifest; returns it with a fresh 0..N-1 index and int64 numbers.

    Raises:
        TaskHetError: naming ``source`` and the first bad column or row.
    """
    kinds = kinds_in(manifest)
    expected_columns = [*BASE_COLUMNS, *(column for kind in kinds for column in target_columns(kind))]
    missing = [column for column in expected_columns if column not in manifest.columns]
    if missing or not kinds:
        raise TaskHetError(f"{source}: missing column(s) {', '.join(missing) or 'of a target'}; expected "
                           f"{', '.join(BASE_COLUMNS)} and <kind>_path, _target, _channels, _scale, _ignore per target")
    if manifest.empty:
        raise TaskHetError(f"{source}: has no rows")
    manifest = with_family_column(manifest.reset_index(drop=True), FAMILY, source)
    paths = relative_paths(manifest, "image_path", source)
    names = manifest["label_name"].astype(str)
    unlabelled = (names == "").all()
    checks = {"sample_id": ~manifest["sample_id"].duplicated(),
              "label": integers(manifest["label"], 0, 1 if unlabelled else 2**31),
              "label_name": names != "" if not unlabelled else names == "", **split_checks(manifest)}
    expected = {"sample_id": "a sample_id not seen before", "label": "0 (no label_name)" if unlabelled else "an integer >= 0",
                "label_name": "a label, as every other row has", **SPLIT_EXPECTED}
    for kind in kinds:
        for column in target_columns(kind)[1:]:
            checks[column] = manifest[column].astype(str) == str(manifest[column].iloc[0])
            expected[column] = f"{manifest[column].iloc[0]!r} as on row 2 (one {kind} target per manifest)"
    refuse_bad_cells(manifest, checks, expected, source)
    for kind in kinds:
        spec_of(manifest, kind, source)
        relative_paths(manifest, target_columns(kind)[0], source)
    manifest = manifest.astype({"label": np.int64, VAL_COLUMN: np.int64, "label_name": str, "source": str})
    for one, other in (("label", "label_name"), ("label_name", "label")):
        counts = manifest.groupby(one)[other].transform("nunique")
        if (counts > 1).any():
            row = int(np.flatnonzero(counts.to_numpy() > 1)[0])
            raise TaskHetError(f"{source}: row {row + 2}: {one} {manifest.at[row, one]!r} goes with more than one {other}")
    refuse_repeated_images(pd.DataFrame({"image_path": paths}), manifest["sample_id"], source)
    return manifest


def read_manifest(path: Path) -> pd.DataFrame:
    """Read and validate a paired_folders ``manifest.csv`` (every column as text first, numbers checked after)."""
    return validate_manifest(read_csv(path, "manifest", finished=True, dtype=str, keep_default_na=False), str(path))


def task_target(manifest: pd.DataFrame, task: str, source: str = "manifest") -> TargetSpec:
    """The manifest's target of ``task``'s kind; one error naming the task when it has none."""
    kind = next((kind for kind, name in TASK_OF_KIND.items() if name == task), None)
    kinds = kinds_in(manifest)
    if kind not in kinds:
        held = ", ".join(f"{spec_of(manifest, one, source).name} ({one}: {TASK_OF_KIND[one]})" for one in kinds)
        raise TaskHetError(f"task {task}: the paired_folders manifest has no {kind} target (its targets: {held}); "
                           f"declare one in {TARGETS_FILE} and rerun step 1")
    return spec_of(manifest, kind, source)


# ----- the dataset -----
def target_layout(spec: TargetSpec, size: int) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of a decoded target at ``size`` (segmentation: uint8 class ids, returned as int64)."""
    if spec.kind == "segmentation":
        return (size, size), np.dtype(np.uint8)
    return (spec.channels, size, size), np.dtype(np.float32)


class PairedDataset(FolderDataset):
    """The images of some paired_folders manifest rows, with one task's target.

    An item is ``{"image": float32 [3, S, S] in [0, 1], <task>: the target, "mask": bool [1, S, S] (pixels with a
    target), "label": int64 scalar, "sample_id": str}``, the target being float32 ``[C, S, S]`` (regression: the
    stored values / scale), int64 ``[S, S]`` (segmentation: class ids, 255 where ignored) or float32 ``[1, S, S]``
    (edges: 0/1). Without a task an item is the image, the label and the sample id. Images resize bilinearly,
    targets and their masks by nearest pixel (ids and ignored pixels never blend), through the decoded-sample
    cache when ``cache_dir`` is given.

    Raises:
        TaskHetError: bad rows, a task the manifest has no target of, a path outside the root, a missing file.
    """

    def __init__(self, root: Path, rows: pd.DataFrame, task: TaskSpec | None, image_size: int,
                 cache_dir: Path | None = None) -> None:
        if image_size < 1:
            raise TaskHetError(f"image_size must be >= 1, got {image_size}")
        rows = validate_manifest(rows, "manifest rows")
        self.spec = None if task is None else task_target(rows, task.name)
        self.domain = None if task is None else task.domain
        self.image_size = image_size
        sample_ids = rows["sample_id"].astype(str).tolist()
        layout = {INPUT_KEY: ((3, image_size, image_size), np.dtype(np.float32))}
        columns = ["image_path"]
        if self.spec is not None:
            layout[self.domain] = target_layout(self.spec, image_size)
            layout["mask"] = ((1, image_size, image_size), np.dtype(np.bool_))
            columns.append(target_columns(self.spec.kind)[0])
        key = {"family": FAMILY, "image_size": image_size, "rows": rows_digest(rows, columns),
               "target": None if self.spec is None else self.spec.as_dict()}
        super().__init__(root, sample_ids, layout, cache_dir, key)
        self.files = {column: [inside_root(self.root, path, f"sample {sample}: manifest {column}")
                               for sample, path in zip(sample_ids, rows[column])] for column in columns}
        missing = [str(path) for paths in self.files.values() for path in paths if not path.is_file()]
        if missing:
            raise TaskHetError(f"file(s) missing under {self.root}: {named_files(missing)} (manifest paths are relative "
                               "to --data_path)")
        self.labels = rows["label"].to_numpy(dtype=np.int64)

    def decode(self, index: int) -> dict[str, np.ndarray]:
        image = self.files["image_path"][index]
        rgb = read_rgb(image, f"sample {self.sample_ids[index]}: image")
        arrays = {INPUT_KEY: image_array(rgb, self.image_size)}
        if self.spec is None:
            return arrays
        path = self.files[target_columns(self.spec.kind)[0]][index]
        raw = read_target(path, self.spec)
        check_size(raw, rgb.shape[:2], path, image.name)
        target, valid = decode_target(raw, self.spec, path)
        arrays[self.domain] = resize(target, self.image_size, "nearest")
        arrays["mask"] = resize(valid.astype(np.float32), self.image_size, "nearest")[None] > 0.5
        return arrays

    def columns(self, stacked: dict[str, np.ndarray], indices: list[int]) -> dict[str, torch.Tensor]:
        columns = {INPUT_KEY: torch.from_numpy(stacked[INPUT_KEY])}
        if self.spec is not None:
            target = torch.from_numpy(stacked[self.domain])
            columns[self.domain] = target.long() if self.spec.kind == "segmentation" else target
            columns["mask"] = torch.from_numpy(stacked["mask"])
        columns["label"] = torch.from_numpy(self.labels[np.asarray(indices, dtype=np.int64)])
        return columns


class PairedFoldersFamily(DataFamily):
    """A user's images with dense targets: one task per target kind, labels and sources from groups.csv."""

    name = FAMILY
    input_key = INPUT_KEY
    label_column = "label"
    source_column = "source"
    tasks = tuple(TASK_OF_KIND.values())

    def read_manifest(self, path: Path) -> pd.DataFrame:
        return read_manifest(path)

    def num_classes(self, manifest: pd.DataFrame) -> int:
        # groups.csv's labels, numbered 0..K-1 by step 1 (1 without labels: every row has label 0).
        return int(manifest[self.label_column].max()) + 1

    def output_channels(self, manifest: pd.DataFrame, task: TaskSpec) -> int | None:
        # The targets' channels (regression) and classes (segmentation) are the user's: recorded in the manifest.
        return task_target(manifest, task.name).channels if task.out_channels is None else None

    def require_values(self, manifest: pd.DataFrame, column: str, where: str) -> None:
        holder = {"label": "label_name", "source": "source"}.get(column)  # label is 0 on every row without labels
        if holder is not None and (manifest[holder].astype(str) == "").all():
            what = "label" if column == "label" else "source (natural owner)"
            hint = ", or partition by embedding clusters (--groups <step 3's clusters.csv>)" if column == "label" else ""
            raise TaskHetError(f"{where}: this paired_folders manifest has no {what}: step 1 found no {column} column in "
                               f"the data root's {GROUPS_FILE}; add one (stem,{column}) and rerun step 1{hint}")

    def dataset(self, root: Path, rows: pd.DataFrame, task: TaskSpec | None, image_size: int,
                cache_dir: Path | None = None) -> Dataset:
        return PairedDataset(root, rows, task, image_size, cache_dir)


DATASETS.register(FAMILY)(PairedFoldersFamily())
