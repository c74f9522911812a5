"""Step 1 as a library: pick the samples of an experiment and label them with a scene class.

A sample's scene label is the argmax of its ``class_scene`` Places365 scores. The
K most frequent labels are kept and renumbered 0..K-1 (most frequent first), and
the kept samples are split into train/test by sample or by building. The result
is the manifest of DESIGN.md §3. ``extract_datapoints_for_experiments.py`` and
``run_pipeline.py`` both call :func:`select_datapoints` and :func:`write_selection`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm import tqdm

from datasets.family import VAL_COLUMN
from datasets.synthetic import PLACES_FILE, SPLIT_FILE
from datasets.taskonomy import FAMILY, MANIFEST_COLUMNS, check_data_root, discover_samples, domain_dir, read_scene_names
from datasets.taskonomy_domains import DOMAIN_SPECS, get_domain
from utils.errors import TaskHetError
from utils.loaders import plain_name, read_csv
from utils.run_dir import atomic_write_text
from utils.seeding import numpy_rng

SPLIT_BY = ("building", "csv", "sample")
VALIDATION, TRAIN, TEST = "val", "train", "test"
# Always required: the model input and the scene label's scores. Task domains come on top.
ALWAYS_REQUIRED = ("rgb", "class_scene")
SPLIT_CSV_COLUMNS = ("id", "train", "val", "test")


@dataclass(frozen=True)
class SelectionConfig:
    """Arguments of step 1 (names as in the original ``extract_datapoints_for_experiments.py``).

    Attributes:
        data_path: data root in the omnidata layout.
        client_file_name: split CSV (``id,train,val,test``), relative to ``data_path`` unless absolute.
        scene_class_file_name: Places365 class-name list, relative to ``data_path`` unless absolute.
        taskonomy_clients_to_include: an int N uses the first N buildings of the split CSV (as
            the original script); a tuple of building ids uses those; None uses all.
        domains: domains every kept sample must have besides rgb and class_scene (always required):
            those the experiment's tasks need, nothing more.
        top_k_classes: keep the K most frequent scene labels.
        test_fraction: share of samples (or buildings) in the test split, in (0, 1) (split_by csv: unused).
        val_fraction: share of samples (or buildings) set aside from training for validation, in [0, 1)
            (split_by csv: unused).
        split_by: "building" (no building in two splits), "csv" (the split CSV's train/val/test columns) or
            "sample".
        seed: root seed of the split.
    """

    data_path: Path
    client_file_name: str = SPLIT_FILE
    scene_class_file_name: str = PLACES_FILE
    taskonomy_clients_to_include: int | tuple[str, ...] | None = None
    domains: tuple[str, ...] = ()
    top_k_classes: int = 16
    test_fraction: float = 0.2
    val_fraction: float = 0.0
    split_by: str = "sample"
    seed: int = 0

    def validate(self) -> None:
        """Raise :class:`TaskHetError` naming the first bad argument."""
        if self.top_k_classes < 1:
            raise TaskHetError(f"--top_k_classes must be >= 1, got {self.top_k_classes}")
        if not 0.0 < self.test_fraction < 1.0:
            raise TaskHetError(f"--test_fraction must be in (0, 1), got {self.test_fraction}")
        if not 0.0 <= self.val_fraction < 1.0 or self.test_fraction + self.val_fraction >= 1.0:
            raise TaskHetError(f"--val_fraction must be in [0, 1) and leave training rows beside --test_fraction "
                               f"{self.test_fraction}, got {self.val_fraction}")
        if self.split_by not in SPLIT_BY:
            raise TaskHetError(f"--split_by must be one of {', '.join(SPLIT_BY)}, got {self.split_by!r}")
        include = self.taskonomy_clients_to_include
        if (isinstance(include, int) and include < 1) or (isinstance(include, tuple) and not include):
            raise TaskHetError(f"--taskonomy_clients_to_include must be a count >= 1 or building ids, got {include!r}")
        for domain in self.domains:
            get_domain(domain)


@dataclass
class Selection:
    """What step 1 selected.

    Attributes:
        manifest: one row per kept sample, columns :data:`MANIFEST_COLUMNS`.
        class_counts: one row per kept class: ``scene_class, scene_name, places_index, num_samples, num_train, num_val,
            num_test`` (num_train without the validation rows).
        buildings: buildings searched, in split-CSV order (those on disk).
        missing_buildings: buildings of the split CSV that were asked for but are not on disk
            (each as ``"<building> (no <domain> folder)"``), skipped.
        num_complete: complete samples found before the top-K filter.
        num_labels_found: distinct scene labels among them.
        config: the arguments.
    """

    manifest: pd.DataFrame
    class_counts: pd.DataFrame
    buildings: list[str]
    num_complete: int
    num_labels_found: int
    config: SelectionConfig = field(repr=False)
    missing_buildings: list[str] = field(default_factory=list)


def _resolve(root: Path, name: str) -> Path:
    return Path(name) if Path(name).is_absolute() else Path(root) / name


def read_split_csv(path: Path) -> list[str]:
    """Building ids of a Taskonomy split CSV (``id,train,val,test``), in file order.

    The official CSVs end their lines with a bare CR; pandas reads CR, LF and CRLF alike.
    """
    table = read_csv(path, "split CSV", SPLIT_CSV_COLUMNS, hint="--client_file_name", dtype={"id": str}, keep_default_na=False)
    ids = [building.strip() for building in table["id"]]
    for row, building in enumerate(ids):
        if not building:
            raise TaskHetError(f"split CSV {path}: row {row + 2} has an empty id")
        plain_name(building, f"split CSV {path}: row {row + 2}, column 'id',")  # a building names a folder
    duplicated = pd.Series(ids).duplicated()
    if duplicated.any():
        row = int(np.flatnonzero(duplicated)[0])
        raise TaskHetError(f"split CSV {path}: row {row + 2} repeats building {ids[row]!r}")
    return ids


def scene_labels(root: Path, paths: pd.Series, progress: bool = True) -> np.ndarray:
    """Places365 label (argmax of the class_scene scores) of each file."""
    decode = DOMAIN_SPECS["class_scene"].decode
    labels = [int(np.argmax(decode(Path(root) / path)[0])) for path in tqdm(paths, desc="reading scene scores", unit="sample", disable=not progress)]
    return np.asarray(labels, dtype=np.int64)


def split_samples(samples: pd.DataFrame, config: "SelectionConfig", split_csv: Path | None = None) -> pd.Series:
    """"train"/"val"/"test" per row of ``samples`` (columns building, scene_class) as ``config.split_by`` says.

    ``building``: whole buildings per split, stratified by each building's majority scene class (the buildings are
    ordered by that class and drawn systematically, so every split spreads over the classes), with
    ``max(1, round(fraction × buildings))`` buildings in test and (when ``val_fraction`` > 0) in val. ``csv``: the
    split CSV's own columns (real Taskonomy's official split). ``sample``: rows drawn at random.

    Raises:
        TaskHetError: a split left empty, naming the split and the counts.
    """
    rng = numpy_rng(config.seed, "step1_split", config.split_by)
    if config.split_by == "csv":
        membership = read_split_membership(split_csv)
        split = samples["building"].map(membership)
        _refuse_empty(split, samples["building"], "buildings", f"split CSV {split_csv}", config)
        return split
    units = samples["building"] if config.split_by == "building" else pd.Series(np.arange(len(samples)), index=samples.index)
    labels = samples.groupby(units)["scene_class"].agg(lambda values: values.value_counts().index[0])
    order = labels.sample(frac=1.0, random_state=rng).sort_values(kind="stable").index.to_numpy()
    chosen = {TEST: _systematic(order, config.test_fraction, rng)}
    rest = order[~np.isin(order, chosen[TEST])]
    wanted_val = config.val_fraction and len(rest)  # no rest: training is empty, which _refuse_empty names
    chosen[VALIDATION] = _systematic(rest, config.val_fraction * len(order) / len(rest), rng) if wanted_val else rest[:0]
    split_of = pd.Series(TRAIN, index=order, dtype=object)
    for name, members in chosen.items():
        split_of[members] = name
    split = units.map(split_of)
    _refuse_empty(split, units, "buildings" if config.split_by == "building" else "samples", "--split_by", config)
    return split


def _systematic(order: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """``max(1, round(fraction × len(order)))`` items of ``order`` (at most all), evenly spaced from a random start:
    over a class-sorted order, a stratified draw."""
    count = min(len(order), max(1, int(np.floor(fraction * len(order) + 0.5))))
    positions = np.floor((np.arange(count) + rng.random()) * len(order) / count).astype(np.int64)
    return order[positions]


def _refuse_empty(split: pd.Series, units: pd.Series, unit: str, where: str, config: "SelectionConfig") -> None:
    """One line naming the split a selection leaves empty (validation only when it was asked for)."""
    wanted = [TRAIN, TEST] + ([VALIDATION] if config.split_by == "csv" or config.val_fraction else [])
    counts = {name: int(units[split == name].nunique()) for name in wanted}
    empty = [name for name in wanted if counts[name] == 0]
    if empty:
        shown = ", ".join(f"{name} {counts[name]}" for name in wanted)
        # the split CSV's own columns decide there: the fractions are not used, so they are no way out
        hint = (f"mark one of them {empty[0]} in the split CSV" if config.split_by == "csv"
                else f"use more {unit} or other --test_fraction/--val_fraction")
        raise TaskHetError(f"{where}: split {empty[0]!r} would hold 0 of the {units.nunique()} {unit} with kept samples "
                           f"({shown}); {hint} (split by {config.split_by})")


def read_split_membership(path: Path) -> dict[str, str]:
    """building -> "train" | "val" | "test" from a split CSV's 0/1 columns (exactly one 1 per building)."""
    table = read_csv(path, "split CSV", SPLIT_CSV_COLUMNS, hint="--client_file_name", dtype={"id": str},
                     keep_default_na=False)
    membership = {}
    for row, record in enumerate(table.itertuples(index=False)):
        flags = {name: str(getattr(record, name)).strip() for name in (TRAIN, VALIDATION, TEST)}
        if any(value not in ("0", "1") for value in flags.values()) or sum(value == "1" for value in flags.values()) != 1:
            raise TaskHetError(f"split CSV {path}: row {row + 2} (building {record.id!r}) must have exactly one 1 among "
                               f"train, val, test (0 or 1 each), got {flags}")
        membership[record.id] = next(name for name, value in flags.items() if value == "1")
    return membership


def missing_domain(root: Path, domains: list[str], building: str) -> str | None:
    """The first of ``domains`` with no folder for ``building``, or None when it is on disk in all of them."""
    return next((domain for domain in domains if not domain_dir(root, domain, building).is_dir()), None)


def buildings_on_disk(root: Path, domains: list[str], listed: list[str], include: int | tuple[str, ...] | None,
                      split_csv: Path) -> tuple[list[str], list[str]]:
    """The buildings to search and those skipped because they are not on disk.

    The official split CSVs list buildings that ``omnitools.download`` does not fetch
    (the tiny subset lists 35 and downloads 34), so a building without a folder in one
    of ``domains`` is skipped rather than fatal. An int ``include`` takes the first N
    buildings of the CSV that are on disk; a tuple takes the named ones that are.

    Returns:
        (buildings to search in order, skipped buildings as ``"<building> (no <domain> folder)"``).
    """
    if isinstance(include, tuple):
        unknown = [building for building in include if building not in listed]
        if unknown:
            raise TaskHetError(f"--taskonomy_clients_to_include: building(s) {', '.join(unknown)} not in split CSV {split_csv}")
        listed = list(include)
    kept, missing = [], []
    for building in listed:
        if isinstance(include, int) and len(kept) == include:
            break
        domain = missing_domain(root, domains, building)
        if domain is None:
            kept.append(building)
        else:
            missing.append(f"{building} (no {domain} folder)")
    if not kept:
        raise TaskHetError(f"no building of split CSV {split_csv} is on disk in {root}: {', '.join(missing)}")
    return kept, missing


def select_datapoints(config: SelectionConfig, progress: bool = True) -> Selection:
    """Find complete samples, label them, keep the top-K labels and split them.

    Buildings of the split CSV that are not on disk are skipped and listed in
    ``Selection.missing_buildings`` (:func:`log_selection` warns once, naming them all).

    Raises:
        TaskHetError: missing data root, domain folder, split CSV or name list; no
            building of the split CSV on disk; a corrupt class_scene file; bad arguments; no samples.
    """
    config.validate()
    root = Path(config.data_path)
    domains = list(dict.fromkeys([*ALWAYS_REQUIRED, *config.domains]))
    check_data_root(root, domains)
    split_csv = _resolve(root, config.client_file_name)
    buildings, missing = buildings_on_disk(root, domains, read_split_csv(split_csv), config.taskonomy_clients_to_include, split_csv)
    names = read_scene_names(_resolve(root, config.scene_class_file_name))
    samples = discover_samples(root, domains, buildings)
    if samples.empty:
        raise TaskHetError(f"empty selection: no sample in {root} has every domain ({', '.join(domains)}) in buildings {', '.join(buildings)}")
    samples["places_index"] = scene_labels(root, samples["path_class_scene"], progress)
    counts = samples["places_index"].value_counts()
    # Most frequent first; ties by Places365 index, so the order never depends on hashing.
    ranked = sorted(counts.index, key=lambda label: (-counts[label], label))
    kept = ranked[: config.top_k_classes]
    remap = {label: rank for rank, label in enumerate(kept)}
    chosen = samples[samples["places_index"].isin(kept)].reset_index(drop=True)
    chosen["scene_class"] = chosen["places_index"].map(remap).astype(np.int64)
    chosen["scene_name"] = [names[label] for label in chosen["places_index"]]
    chosen["rgb_path"] = chosen["path_rgb"]
    chosen["family"] = FAMILY
    part = split_samples(chosen, config, split_csv)
    chosen["split"] = np.where(part == TEST, TEST, TRAIN)
    chosen[VAL_COLUMN] = (part == VALIDATION).astype(np.int64).to_numpy()
    manifest = chosen[[*MANIFEST_COLUMNS, VAL_COLUMN]].copy()
    class_counts = pd.DataFrame(
        {
            "scene_class": range(len(kept)),
            "scene_name": [names[label] for label in kept],
            "places_index": kept,
            "num_samples": [int((chosen["places_index"] == label).sum()) for label in kept],
            "num_train": [int(((chosen["places_index"] == label) & (part == TRAIN)).sum()) for label in kept],
            "num_val": [int(((chosen["places_index"] == label) & (part == VALIDATION)).sum()) for label in kept],
            "num_test": [int(((chosen["places_index"] == label) & (part == TEST)).sum()) for label in kept],
        }
    )
    return Selection(manifest, class_counts, buildings, len(samples), len(counts), config, missing)


def plot_class_distribution(class_counts: pd.DataFrame, path: Path) -> None:
    """Bar chart of kept samples per scene class (train, validation and test stacked), as a PNG."""
    from matplotlib.figure import Figure  # here: matplotlib takes a second to import, and only the plot needs it
    from utils.plots import save_figure

    # The object-oriented Figure renders with Agg and never touches pyplot's global state.
    figure = Figure(figsize=(max(4.0, 0.5 * len(class_counts) + 2), 4.0))
    axis = figure.subplots()
    positions = np.arange(len(class_counts))
    axis.bar(positions, class_counts["num_train"], label="train", color="#3b6ea5")
    axis.bar(positions, class_counts["num_val"], bottom=class_counts["num_train"], label="validation", color="#7aa95c")
    axis.bar(positions, class_counts["num_test"], bottom=class_counts["num_train"] + class_counts["num_val"], label="test",
             color="#e0a030")
    axis.set_xticks(positions, [f"{row.scene_class}: {row.scene_name}" for row in class_counts.itertuples()], rotation=90)
    axis.set_ylabel("samples")
    axis.set_title("Samples per scene class")
    axis.grid(axis="y", alpha=0.4)
    axis.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save_figure(figure, path, dpi=100)


def write_selection(selection: Selection, out_dir: Path) -> dict[str, Path]:
    """Write ``manifest.csv``, ``class_counts.csv`` and ``class_distribution.png`` into ``out_dir``.

    Returns:
        {"manifest": ..., "class_counts": ..., "plot": ...} paths.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"manifest": out_dir / "manifest.csv", "class_counts": out_dir / "class_counts.csv", "plot": out_dir / "class_distribution.png"}
    atomic_write_text(paths["manifest"], selection.manifest.to_csv(index=False))
    atomic_write_text(paths["class_counts"], selection.class_counts.to_csv(index=False))
    plot_class_distribution(selection.class_counts, paths["plot"])
    return paths


def summary_line(selection: Selection) -> str:
    """One line: what was kept, from what, and how it is split."""
    manifest, config = selection.manifest, selection.config
    val = manifest[VAL_COLUMN] == 1
    train, test = (manifest["split"] == TRAIN) & ~val, manifest["split"] == TEST
    counts = " / ".join(f"{int(rows.sum())} {name} ({_buildings(manifest.loc[rows, 'building'].nunique())})"
                        for name, rows in ((TRAIN, train), ("validation", val), (TEST, test)))
    return (
        f"step 1: kept {len(manifest)} of {selection.num_complete} complete samples from "
        f"{manifest['building'].nunique()} of {len(selection.buildings)} buildings; "
        f"{len(selection.class_counts)} scene classes (top {config.top_k_classes} of {selection.num_labels_found} found); "
        f"split by {config.split_by}: {counts}"
    )


def _buildings(count: int) -> str:
    return f"{count} building{'' if count == 1 else 's'}"


def log_selection(selection: Selection, logger: logging.Logger) -> None:
    """Log one warning naming every skipped building (if any), the summary line and the kept classes."""
    if selection.missing_buildings:
        missing = selection.missing_buildings
        logger.warning(f"step 1: skipped {len(missing)} building(s) of split CSV {selection.config.client_file_name} "
                       f"that are not on disk: {', '.join(missing)}")
    logger.info(summary_line(selection))
    for row in selection.class_counts.itertuples():
        logger.info(f"  class {row.scene_class}: {row.scene_name} (Places365 {row.places_index}): {row.num_samples} samples")
