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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from datasets.family import (DATASETS, FAMILY_COLUMN, VAL_COLUMN, DataFamily, refuse_repeated_images,
                             with_family_column)
from datasets.folder_files import (IMAGE_EXTENSIONS, INPUT_KEY, SPLIT_EXPECTED, FolderDataset, image_array, integers,
                                   list_folder, named_files, read_rgb, read_split_csv, refuse_bad_cells,
                                   relative_paths, require_both_splits, seeded_split, split_checks, split_from_csv)
from datasets.imagefolder import rows_digest
from datasets.paired_targets import (KINDS, TARGET_EXTENSIONS, TARGETS_FILE, TargetSpec, decode_target, make_spec,
                                     read_target, read_targets)
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


@dataclass
class PairedSelection:
    """Step 1's result: the manifest, its targets and what it left out (for its log).

    Attributes:
        manifest: :data:`BASE_COLUMNS` and each target's :func:`target_columns`, rows in ``image_path`` order.
        targets: the targets, as targets.yaml declares them.
        skipped: entries of the image and target folders that are neither images nor target files.
        unlisted: images that the split CSV does not list (left out).
    """

    manifest: pd.DataFrame
    targets: list[TargetSpec]
    skipped: list[str] = field(default_factory=list)
    unlisted: int = 0


def stems_of(root: Path, folder: str, extensions: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """``({stem: path relative to root}, skipped)`` of one folder; two files of one stem are one error naming both."""
    path = Path(root) / folder
    if not path.is_dir():
        raise TaskHetError(f"{path} does not exist: paired_folders reads root/{IMAGES}/ and one folder per target")
    files, skipped = list_folder(Path(root), path, extensions, recursive=False)
    stems: dict[str, str] = {}
    for file in files:
        stem = PurePosixPath(file).stem
        if stem in stems:
            raise TaskHetError(f"{root}: {stems[stem]} and {file} have the same stem {stem!r}; keep one")
        stems[stem] = file
    return stems, skipped


def pair_targets(root: Path, images: dict[str, str], spec: TargetSpec) -> tuple[dict[str, str], list[str]]:
    """Each image's file of target ``spec``; a stem in one folder only is one error naming the file."""
    files, skipped = stems_of(root, spec.name, TARGET_EXTENSIONS)
    orphans = sorted(set(files) - set(images))
    if orphans:
        raise TaskHetError(f"{Path(root) / files[orphans[0]]} has no image {IMAGES}/{orphans[0]}.* "
                           f"({len(orphans)} {spec.name} file(s) without an image)")
    lacking = sorted(set(images) - set(files))
    if lacking:
        raise TaskHetError(f"{Path(root) / images[lacking[0]]} has no {spec.name} target ({spec.name}/{lacking[0]}.png or "
                           f".npy; {len(lacking)} image(s) without one)")
    return files, skipped


def read_groups(root: Path, images: dict[str, str]) -> pd.DataFrame:
    """groups.csv's ``label`` and ``source`` text per stem (index), ``""`` where the file gives none.

    Raises:
        TaskHetError: a column besides stem, label and source; a stem that is no image; an image without a row; a
            stem twice; an empty cell; each naming the file and row.
    """
    path = Path(root) / GROUPS_FILE
    empty = pd.DataFrame({column: "" for column in GROUP_COLUMNS}, index=sorted(images))
    if not path.is_file():
        return empty
    table = read_csv(path, "groups file", ("stem",), dtype=str, keep_default_na=False)
    extra = [column for column in table.columns if column not in ("stem", *GROUP_COLUMNS)]
    if extra or not any(column in table.columns for column in GROUP_COLUMNS):
        raise TaskHetError(f"groups file {path}: columns must be stem and label and/or source, got {', '.join(table.columns)}")
    table = table.assign(row=np.arange(len(table)) + 2)
    for column in ("stem", *(column for column in GROUP_COLUMNS if column in table.columns)):
        blank = table[column].str.strip() == ""
        if blank.any():
            raise TaskHetError(f"groups file {path}: row {table.loc[blank, 'row'].iloc[0]} has an empty {column}")
    unknown = ~table["stem"].isin(list(images))
    if unknown.any():
        first = table[unknown].iloc[0]
        raise TaskHetError(f"groups file {path}: row {first['row']} has stem {first['stem']!r}, which is no image in "
                           f"{Path(root) / IMAGES}")
    repeated = table["stem"].duplicated()
    if repeated.any():
        raise TaskHetError(f"groups file {path}: row {table.loc[repeated, 'row'].iloc[0]} repeats stem "
                           f"{table.loc[repeated, 'stem'].iloc[0]!r}")
    unlisted = sorted(set(images) - set(table["stem"]))
    if unlisted:
        raise TaskHetError(f"groups file {path} has no row for {len(unlisted)} image(s), e.g. {images[unlisted[0]]}; "
                           "give every image its label and/or source")
    return table.set_index("stem").reindex(columns=list(GROUP_COLUMNS), fill_value="").loc[empty.index]


def label_numbers(names: pd.Series) -> np.ndarray:
    """Labels 0..K-1 of label texts: sorted numerically when every text is a whole number, else as text; 0 for ""."""
    unique = sorted(set(names) - {""})
    numbers = pd.to_numeric(pd.Series(unique, dtype=object), errors="coerce")
    if unique and numbers.notna().all() and (numbers == numbers.round()).all():
        unique = [name for _, name in sorted(zip(numbers, unique))]
    code = {name: number for number, name in enumerate(unique)}
    return np.array([code.get(name, 0) for name in names], dtype=np.int64)


def select_paired(root: Path, test_fraction: float, val_fraction: float, seed: int, split_csv: Path | None = None,
                  targets: list[str] | None = None, require_labels: bool = False,
                  progress: bool = False) -> PairedSelection:
    """Step 1 for paired_folders: every image with its targets, groups and split, each file decoded once.

    Args:
        root: the data root (module docstring).
        test_fraction, val_fraction, seed: the seeded split (stratified by label when groups.csv gives labels).
        split_csv: ``stem,split`` (train, val or test) instead of the seeded split; None for none.
        targets: the target names to keep (targets.yaml's order otherwise: all of them).
        require_labels: refuse a root without labels (groups.csv's label column).
        progress: show a bar while the files are decoded.

    Raises:
        TaskHetError: one line naming the file, row or flag (module docstring; :func:`check_sample`).
    """
    root = Path(root)
    if not root.is_dir():
        raise TaskHetError(f"data root {root} does not exist (--data_path: a folder with {IMAGES}/, the target "
                           f"folders and {TARGETS_FILE})")
    specs = read_targets(root, targets)
    images, skipped = stems_of(root, IMAGES, IMAGE_EXTENSIONS)
    if not images:
        raise TaskHetError(f"{root / IMAGES} holds no image (files ending in {', '.join(IMAGE_EXTENSIONS)})")
    files = {}
    for spec in specs:
        files[spec.name], more = pair_targets(root, images, spec)
        skipped += more
    groups = read_groups(root, images)
    if require_labels and (groups["label"] == "").all():
        raise TaskHetError(f"{root / GROUPS_FILE} gives no label (stem,label): a label-based partition needs one "
                           "(run_pipeline.py's main job compares label- and embedding-based partitions)")
    stems, split, val, unlisted = split_stems(root, sorted(images), label_numbers(groups["label"]), test_fraction,
                                              val_fraction, seed, split_csv)
    for stem in tqdm(stems, desc="step 1: checking images and targets", unit="image", disable=not progress):
        check_sample(root, images[stem], [(spec, files[spec.name][stem]) for spec in specs])
    groups = groups.loc[stems]
    manifest = pd.DataFrame({FAMILY_COLUMN: FAMILY, "sample_id": [PurePosixPath(images[stem]).name for stem in stems],
                             "image_path": [images[stem] for stem in stems], "label": label_numbers(groups["label"]),
                             "label_name": groups["label"].to_numpy(), "source": groups["source"].to_numpy(),
                             "split": split, VAL_COLUMN: val}, columns=list(BASE_COLUMNS))
    for spec in specs:
        path, name, channels, scale, ignore = target_columns(spec.kind)
        manifest[path] = [files[spec.name][stem] for stem in stems]
        manifest[name], manifest[channels], manifest[scale] = spec.name, spec.channels, spec.scale
        manifest[ignore] = "" if spec.ignore is None else number_text(spec.ignore)
    return PairedSelection(manifest, specs, sorted(skipped), unlisted)


def number_text(value: float) -> str:
    """A number as the manifest writes it: whole numbers without a decimal point, others exactly (repr)."""
    return str(int(value)) if value == round(value) and abs(value) < 2**53 else repr(value)


def split_stems(root: Path, stems: list[str], labels: np.ndarray, test_fraction: float, val_fraction: float, seed: int,
                split_csv: Path | None) -> tuple[list[str], np.ndarray, np.ndarray, int]:
    """``(stems kept, split, val, images the split CSV leaves out)``: the seeded split or the split CSV's."""
    if split_csv is None:
        split, val = seeded_split(labels, test_fraction, val_fraction, seed, FAMILY)
        require_both_splits(split, val, root, "raise --test_fraction or add images")
        return stems, split, val, 0
    table = read_split_csv(split_csv, "stem")
    known = set(stems)
    for stem, row in zip(table["stem"], table["row"]):
        if stem not in known:
            raise TaskHetError(f"split CSV {split_csv}: row {row} has stem {stem!r}, which is no image in {root / IMAGES}")
    repeated = table["stem"].duplicated()
    if repeated.any():
        raise TaskHetError(f"split CSV {split_csv}: row {table.loc[repeated, 'row'].iloc[0]} repeats stem "
                           f"{table.loc[repeated, 'stem'].iloc[0]!r}; each image may have one split")
    table = table.sort_values("stem")
    split, val = split_from_csv(table["stem"], table)
    require_both_splits(split, val, root, f"split CSV {split_csv}")
    return table["stem"].tolist(), split, val, len(known) - len(table)


def check_sample(root: Path, image: str, targets: list[tuple[TargetSpec, str]]) -> None:
    """Decode one image and each of its target files as steps 2-4 will; a corrupt file, a target whose size is not
    the image's or whose values its kind cannot take is one error naming the file."""
    height, width = read_rgb(root / image, "image").shape[:2]
    for spec, file in targets:
        raw = read_target(root / file, spec)
        check_size(raw, (height, width), root / file, image)
        decode_target(raw, spec, root / file)


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
