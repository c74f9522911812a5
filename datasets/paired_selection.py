"""Step 1 for the ``paired_folders`` family (datasets/paired_folders.py has the layout): every image with its
targets, groups and split, each file decoded once as steps 2-4 will, into the family's manifest."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from datasets.family import FAMILY_COLUMN, VAL_COLUMN
from datasets.folder_files import (IMAGE_EXTENSIONS, list_folder, read_rgb, read_split_csv, require_both_splits,
                                   seeded_split, split_from_csv)
from datasets.paired_folders import (BASE_COLUMNS, FAMILY, GROUP_COLUMNS, GROUPS_FILE, IMAGES, check_size,
                                     target_columns)
from datasets.paired_targets import TARGET_EXTENSIONS, TARGETS_FILE, TargetSpec, decode_target, read_target, read_targets
from utils.errors import TaskHetError
from utils.loaders import read_csv


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
        require_both_splits(split, val, root,
                            "raise --test_fraction or add images: each label keeps one training image")
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
