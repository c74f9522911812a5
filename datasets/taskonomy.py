"""Taskonomy data in the omnidata layout: finding samples, the manifest, the Dataset and the data family.

Layout (real downloads and the synthetic renderer alike)::

    <root>/<domain>/taskonomy/<building>/point_<p>_view_<v>_domain_<token>.<ext>

A sample is one (building, point, view). The ``<token>`` in a file name is
usually the folder name, but real files spell two domains differently
(``segment_semantic/…_domain_segmentsemantic.png``, ``class_scene/…_domain_class_places.npy``);
:data:`datasets.taskonomy_domains.DOMAIN_SPECS` is the one place that knows the spellings (with
one decoder per domain), and files are matched on point/view, never on the exact token. ``docs/DATA.md`` documents every
decoder (file type, units, scale, invalid code, returned tensor, mask).
"""

from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, default_collate

from datasets.cache import DecodedSampleCache, cache_key, cache_rows
from datasets.family import DATASETS, FAMILY_COLUMN, VAL_COLUMN, DataFamily, refuse_repeated_images, with_family_column
from datasets.taskonomy_domains import DOMAIN_SPECS, NUM_SCENE_SCORES, TASKS, get_domain
from utils import loaders
from utils.errors import TaskHetError

if TYPE_CHECKING:
    from models.tasks import TaskSpec

FAMILY = "taskonomy"
MANIFEST_COLUMNS = (FAMILY_COLUMN, "sample_id", "building", "point", "view", "rgb_path", "scene_class", "scene_name", "split")
SPLITS = ("train", "test")
FILE_PATTERN = re.compile(r".*point_(\d+)_view_(\d+)_domain_(\w+)\.(png|npy)")


def sample_id(building: str, point: int, view: int) -> str:
    """The key of a sample everywhere after step 1."""
    return f"{building}_point_{point}_view_{view}"


def domain_dir(root: Path, domain: str, building: str | None = None) -> Path:
    """``<root>/<domain>/taskonomy[/<building>]``."""
    folder = Path(root) / domain / "taskonomy"
    return folder if building is None else folder / building


def index_building(root: Path, domain: str, building: str) -> dict[tuple[int, int], Path]:
    """Map (point, view) -> file for one building folder of one domain.

    Files are matched on point/view (any spelling of the domain token), so real and
    synthetic spellings both work; other files in the folder (e.g. CSVs) are ignored.

    Raises:
        TaskHetError: the folder is missing, or two files claim the same point/view.
    """
    spec = get_domain(domain)
    folder = domain_dir(root, domain, building)
    if not folder.is_dir():
        raise TaskHetError(f"building {building!r} has no {domain} folder: {folder} does not exist")
    files: dict[tuple[int, int], Path] = {}
    with os.scandir(folder) as entries:
        for entry in entries:
            match = FILE_PATTERN.fullmatch(entry.name)
            if match is None or match.group(4) != spec.extension:
                continue
            key = (int(match.group(1)), int(match.group(2)))
            if key in files:
                raise TaskHetError(f"{folder}: two files for point {key[0]} view {key[1]}: {files[key].name} and {entry.name}")
            files[key] = folder / entry.name
    return files


def check_data_root(root: Path, domains: Sequence[str], buildings: Sequence[str] = ()) -> None:
    """Fail with one clear message if the root, a domain folder or a building folder is missing."""
    root = Path(root)
    if not root.is_dir():
        raise TaskHetError(f"data root {root} does not exist (render synthetic data or download Taskonomy first)")
    for domain in domains:
        get_domain(domain)
        folder = domain_dir(root, domain)
        if not folder.is_dir():
            raise TaskHetError(f"domain folder {folder} is missing: the data root has no {domain!r} data")
        for building in buildings:
            if not (folder / building).is_dir():
                raise TaskHetError(f"building {building!r} is not on disk: {folder / building} does not exist")


def discover_samples(root: Path, domains: Sequence[str], buildings: Sequence[str]) -> pd.DataFrame:
    """Complete samples on disk: those with a file in every one of ``domains``.

    Args:
        root: data root.
        domains: domains a sample must have (rgb is always required).
        buildings: buildings to search, in order.

    Returns:
        DataFrame with columns ``sample_id, building, point, view`` and ``path_<domain>``
        (relative to ``root``, as str) for each domain; sorted by building order, point, view.
    """
    domains = list(dict.fromkeys(["rgb", *domains]))
    check_data_root(root, domains, buildings)
    rows = []
    for building in buildings:
        indices = {domain: index_building(root, domain, building) for domain in domains}
        complete = set.intersection(*(set(index) for index in indices.values()))
        for point, view in sorted(complete):
            row = {"sample_id": sample_id(building, point, view), "building": building, "point": point, "view": view}
            for domain in domains:
                row[f"path_{domain}"] = indices[domain][(point, view)].relative_to(root).as_posix()
            rows.append(row)
    columns = ["sample_id", "building", "point", "view", *(f"path_{domain}" for domain in domains)]
    return pd.DataFrame(rows, columns=columns)


def validate_manifest(manifest: pd.DataFrame, source: str = "manifest") -> pd.DataFrame:
    """Check a manifest's columns and values; returns it with a fresh 0..N-1 index.

    Raises:
        TaskHetError: naming ``source`` and the first bad column or row.
    """
    manifest = with_family_column(manifest, FAMILY, source)
    missing = [column for column in MANIFEST_COLUMNS if column not in manifest.columns]
    if missing:
        raise TaskHetError(f"{source}: missing column(s) {', '.join(missing)}; expected {', '.join(MANIFEST_COLUMNS)}")
    if manifest.empty:
        raise TaskHetError(f"{source}: has no rows")
    manifest = manifest.reset_index(drop=True)
    duplicated = manifest["sample_id"].duplicated()
    if duplicated.any():
        row = int(np.flatnonzero(duplicated)[0])
        raise TaskHetError(f"{source}: row {row + 2} repeats sample_id {manifest.at[row, 'sample_id']!r}")
    bad_split = ~manifest["split"].isin(SPLITS)
    if bad_split.any():
        row = int(np.flatnonzero(bad_split)[0])
        raise TaskHetError(f"{source}: row {row + 2} has split {manifest.at[row, 'split']!r}, expected one of {SPLITS}")
    for column in ("point", "view", "scene_class"):
        manifest[column] = loaders.int_column(manifest, column, source, low=0)  # inf or 1e30 never wrap around
    if VAL_COLUMN in manifest.columns:  # optional: a manifest written without a validation part has none
        manifest[VAL_COLUMN] = loaders.int_column(manifest, VAL_COLUMN, source, low=0, high=1)
        on_test = (manifest[VAL_COLUMN] == 1) & (manifest["split"] != "train")
        if on_test.any():
            row = int(np.flatnonzero(on_test.to_numpy())[0])
            raise TaskHetError(f"{source}: row {row + 2} has {VAL_COLUMN} 1 on a {manifest.at[row, 'split']!r} row; "
                               "validation rows are training rows set aside")
    for row, building in enumerate(manifest["building"]):  # a building names a folder: no path may hide in it
        loaders.plain_name(building, f"{source}: row {row + 2}, column 'building',")
    # The input is the rgb_path file (one file under two spellings, ./ or //, is one image); the targets
    # are found by building, point and view: either repeated means one image under two sample ids.
    rgb_files = manifest["rgb_path"].astype(str).map(posixpath.normpath)
    refuse_repeated_images(pd.DataFrame({"rgb_path": rgb_files}), manifest["sample_id"], source)
    refuse_repeated_images(manifest[["building", "point", "view"]], manifest["sample_id"], source)
    return manifest


def read_scene_names(path: Path) -> list[str]:
    """The 365 Places365 class names in label order.

    Accepts one name per line (``places_class_names.txt``) or the official
    ``categories_places365.txt`` lines (``/b/bedroom 52``).
    """
    if not path.is_file():
        raise TaskHetError(f"scene class file {path} does not exist (--scene_class_file_name)")
    names = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if not parts:
            continue
        name = parts[0]
        if name.startswith("/") and name.count("/") >= 2:
            name = name.split("/", 2)[2]
        names.append(name)
    if len(names) != NUM_SCENE_SCORES:
        raise TaskHetError(f"scene class file {path}: {len(names)} names, expected {NUM_SCENE_SCORES} (Places365)")
    return names


def read_manifest(path: Path) -> pd.DataFrame:
    """Read and validate a step-1 ``manifest.csv`` (columns: :data:`MANIFEST_COLUMNS`)."""
    text_columns = {column: str for column in (FAMILY_COLUMN, "sample_id", "building", "rgb_path", "scene_name", "split")}
    manifest = loaders.read_csv(path, "manifest", finished=True, hint="run step 1, extract_datapoints_for_experiments.py",
                                dtype=text_columns, keep_default_na=False)
    return validate_manifest(manifest, str(path))


def resize(values: np.ndarray, size: int, interpolation: str) -> np.ndarray:
    """Resize a ``[C, H, W]`` (or ``[H, W]``) array to ``size x size``.

    Bilinear with antialiasing (as PIL does when shrinking) for rgb; nearest-exact
    (PIL's NEAREST pixel choice) for labels, so ids and invalid codes never blend.
    """
    if values.shape[-2:] == (size, size):
        return values
    tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    tensor = tensor[None, None] if values.ndim == 2 else tensor[None]
    if interpolation == "bilinear":
        out = F.interpolate(tensor, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
    else:
        out = F.interpolate(tensor, size=(size, size), mode="nearest-exact")
    out = out[0, 0] if values.ndim == 2 else out[0]
    return out.numpy().astype(values.dtype)


def array_layout(domains: Sequence[str], image_size: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shape and storage dtype of each decoded array of a sample (the domains plus "mask")."""
    layout: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    for domain in domains:
        spec = get_domain(domain)
        if domain == "class_scene":
            layout[domain] = ((NUM_SCENE_SCORES,), np.dtype(np.float32))
        elif domain == "segment_semantic":
            layout[domain] = ((image_size, image_size), np.dtype(np.uint8))
        elif domain == "mask_valid":
            layout[domain] = ((1, image_size, image_size), np.dtype(np.bool_))
        else:
            layout[domain] = ((spec.channels, image_size, image_size), np.dtype(np.float32))
    layout["mask"] = ((1, image_size, image_size), np.dtype(np.bool_))
    return layout


class TaskonomyDataset(Dataset):
    """The samples of a manifest, decoded at one resolution.

    A sample is a dict: ``"rgb"`` float32 [3,H,W] in [0,1]; one entry per requested
    domain (shapes and units in ``docs/DATA.md``); ``"mask"`` bool [1,H,W] = mask_valid
    (when on disk) AND each requested domain's own validity; ``"scene_class"`` int64
    scalar (the manifest's label 0..K-1); ``"sample_id"`` str.

    With ``cache_dir``, decoded arrays go to a memory-mapped cache on first read
    (see :mod:`datasets.cache`) and later reads (epochs, workers) come from it.

    Args:
        root: data root (manifest ``rgb_path`` values are relative to it).
        manifest: step-1 manifest (see :func:`read_manifest`).
        domains: domains to load besides rgb.
        image_size: output side length in pixels.
        cache_dir: folder for the decoded-sample cache, or None for no cache.
    """

    def __init__(self, root: Path, manifest: pd.DataFrame, domains: Sequence[str], image_size: int, cache_dir: Path | None = None) -> None:
        if image_size < 1:
            raise TaskHetError(f"image_size must be >= 1, got {image_size}")
        self.root = Path(root)
        self.image_size = int(image_size)
        self.manifest = validate_manifest(manifest)
        # Plain lists: pandas row access would cost more than a cached read.
        self.sample_ids = [str(value) for value in self.manifest["sample_id"]]
        self.scene_classes = self.manifest["scene_class"].to_numpy(dtype=np.int64)
        self.output_domains = tuple(dict.fromkeys(["rgb", *domains]))
        check_data_root(self.root, self.output_domains, sorted(set(self.manifest["building"])))
        self.paths = self._index_files()
        self.layout = array_layout(self.output_domains, self.image_size)
        self.cache = None
        if cache_dir is not None:
            # The decoded set (which includes an optional mask_valid) changes the mask, so it is part of the key.
            key = cache_key(self.root, self.manifest, tuple(self.paths), self.image_size)
            self.cache = DecodedSampleCache(Path(cache_dir), key, len(self.manifest), self.layout)
            self.cache_rows = cache_rows(self.sample_ids)

    def _index_files(self) -> dict[str, list[Path | None]]:
        """Per domain, each manifest row's file; mask_valid is used wherever it is on disk."""
        paths: dict[str, list[Path | None]] = {"rgb": [
            loaders.inside_root(self.root, path, f"sample {sample}: manifest rgb_path")
            for sample, path in zip(self.sample_ids, self.manifest["rgb_path"])]}
        for sample, path in zip(self.sample_ids, paths["rgb"]):
            if not path.is_file():
                raise TaskHetError(f"sample {sample}: rgb file {path} does not exist (manifest rgb_path is relative to {self.root})")
        optional_mask = "mask_valid" not in self.output_domains and domain_dir(self.root, "mask_valid").is_dir()
        wanted = [domain for domain in self.output_domains if domain != "rgb"] + (["mask_valid"] if optional_mask else [])
        for domain in wanted:
            required = domain in self.output_domains
            indices: dict[str, dict[tuple[int, int], Path]] = {}
            column: list[Path | None] = []
            for row in self.manifest.itertuples(index=False):
                if row.building not in indices:
                    folder_exists = domain_dir(self.root, domain, row.building).is_dir()
                    indices[row.building] = index_building(self.root, domain, row.building) if required or folder_exists else {}
                path = indices[row.building].get((row.point, row.view))
                if path is None and required:
                    raise TaskHetError(f"sample {row.sample_id} has no {domain} file in {domain_dir(self.root, domain, row.building)}")
                column.append(path)
            if any(path is not None for path in column):
                paths[domain] = column
        return paths

    def __len__(self) -> int:
        return len(self.manifest)

    def decode(self, index: int) -> dict[str, np.ndarray]:
        """Decode one sample from its files: arrays as laid out by :func:`array_layout`."""
        arrays: dict[str, np.ndarray] = {}
        mask = np.ones((1, self.image_size, self.image_size), dtype=bool)
        for domain, column in self.paths.items():
            path = column[index]
            spec = DOMAIN_SPECS[domain]
            if path is None:
                continue
            values, valid = spec.decode(path)
            if spec.dense:
                values = resize(values.astype(np.float32) if values.dtype == bool else values, self.image_size, spec.interpolation)
                if valid is not None:
                    mask &= resize(valid.astype(np.float32), self.image_size, "nearest")[None] > 0.5
            if domain in self.output_domains:
                shape, dtype = self.layout[domain]
                arrays[domain] = np.asarray(values > 0.5 if dtype == np.bool_ else values).astype(dtype).reshape(shape)
        arrays["mask"] = mask
        return arrays

    def __getitem__(self, index: int) -> dict:
        arrays = None if self.cache is None else self.cache.get(int(self.cache_rows[index]))
        if arrays is None:
            arrays = self.decode(index)
            if self.cache is not None:
                self.cache.put(int(self.cache_rows[index]), arrays)
        return self._samples({name: array[None] for name, array in arrays.items()}, [index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict]:
        """``[self[i] for i in indices]``, read with one cache read per array when every row is decoded already.

        torch's DataLoader calls this for a batch (through ``Subset``); per-sample reads were most of a
        cached federated step's data time (docs/BENCHMARKS.md). The samples are views of one batch
        tensor per array, which the collate function stacks as it stacks separate ones.
        """
        indices = np.asarray(indices, dtype=np.int64).tolist()  # a Subset of a tensor hands 0-dim tensors
        stacked = self._cached(indices)
        if stacked is None:
            return [self[index] for index in indices]
        return self._samples(stacked, indices)

    def read_batch(self, indices: list[int]) -> dict:
        """The collated samples ``indices`` in one cache read per array (``datasets.batch_reads``); decoded and
        collated one by one while a row is not cached yet."""
        stacked = self._cached(indices)
        if stacked is None:
            return default_collate(self.__getitems__(indices))
        return {**self._columns(stacked, indices), "sample_id": [self.sample_ids[index] for index in indices]}

    def _cached(self, indices: list[int]) -> dict[str, np.ndarray] | None:
        """Rows ``indices``' arrays stacked, in one cache read per array; None without a cache or while a row is not
        decoded yet."""
        return None if self.cache is None else self.cache.get_many(self.cache_rows[indices])

    def _samples(self, stacked: dict[str, np.ndarray], indices: list[int]) -> list[dict]:
        """The sample dicts of rows ``indices`` from their arrays stacked ``[len(indices), ...]``, which the samples
        then share (the cache's reads are copies, and decode makes new arrays)."""
        views = {name: column.unbind(0) for name, column in self._columns(stacked, indices).items()}
        return [{**{name: view[position] for name, view in views.items()}, "sample_id": self.sample_ids[index]}
                for position, index in enumerate(indices)]

    def _columns(self, stacked: dict[str, np.ndarray], indices: list[int]) -> dict[str, torch.Tensor]:
        """Rows ``indices``' arrays (stacked ``[len(indices), ...]``) and scene classes as tensors of the sample dtypes."""
        columns = {name: torch.from_numpy(array) for name, array in stacked.items()}
        if "segment_semantic" in columns:
            columns["segment_semantic"] = columns["segment_semantic"].long()
        columns["scene_class"] = torch.from_numpy(self.scene_classes[indices])
        return columns


class TaskonomyFamily(DataFamily):
    """Taskonomy in the omnidata layout: real downloads and synthetic buildings alike.

    The manifest is :data:`MANIFEST_COLUMNS`; the label is the scene class (top-K
    Places365 labels renumbered 0..K-1) and a sample's natural owner its building.
    Items are :class:`TaskonomyDataset` samples (``"rgb"`` input, decoded-sample cache).
    """

    name = FAMILY
    input_key = "rgb"
    label_column = "scene_class"
    source_column = "building"
    tasks = TASKS

    def read_manifest(self, path: Path) -> pd.DataFrame:
        return read_manifest(path)

    def num_classes(self, manifest: pd.DataFrame) -> int:
        # Step 1 renumbers the kept labels 0..K-1, so the largest label fixes K.
        return int(manifest[self.label_column].max()) + 1

    def dataset(self, root: Path, rows: pd.DataFrame, task: TaskSpec | None, image_size: int, cache_dir: Path | None = None) -> Dataset:
        domains = [] if task is None else task.required_domains
        return TaskonomyDataset(root, rows, domains, image_size, cache_dir)


DATASETS.register(FAMILY)(TaskonomyFamily())
