"""A decoded-sample cache: memory-mapped arrays filled on first read.

Decoding a Taskonomy sample means opening a dozen PNGs, converting and resizing
them; every epoch would repeat that. The cache keeps each decoded array of a
sample in one ``.npy`` memory map per array name (``[N, ...]``), keyed by the
set of samples (sorted by sample id: runs over the same samples in another
order share one cache; :func:`cache_rows` maps dataset rows to cache rows), the
data root, the decoded domains and the resolution, so changed samples or another
resolution never read stale data. The first pass decodes
and writes a row; later reads (other epochs, other DataLoader workers, later
runs) copy the row from the map, which the OS keeps in its page cache.

A row is marked filled only after its arrays are written, so a run killed mid-row
decodes that row again next time. Workers write disjoint rows of shared maps;
two workers that decode the same row write the same bytes.

The maps' disk space is reserved when they are made (``posix_fallocate``): a write through a
memory map into a file the disk cannot hold kills the process with SIGBUS, so a full disk must
fail up front, as one error naming the cache folder. An existing cache's maps are checked when the cache is opened
(each header's shape and dtype, and exactly that many bytes after it): a damaged map is one error naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from utils.errors import DiskFullError, TaskHetError, disk_full_names, is_disk_full
from utils.loaders import load_npy

# Bump when decoders change what a cached row holds, so old caches are not reused.
# 2: segment_semantic as class = raw - 1, unlabelled = 255; 3: rows sorted by sample id;
# 4: disk space reserved when the maps are made (older, sparse maps could die of SIGBUS on a full disk)
CACHE_FORMAT_VERSION = 4
FILLED = "_filled"


def cache_key(root: Path, manifest: pd.DataFrame, domains: Sequence[str], image_size: int) -> str:
    """A hex digest of everything a cached row depends on; rows are in sample-id order, whatever the manifest's order."""
    digest = hashlib.sha256()
    header = {"version": CACHE_FORMAT_VERSION, "root": str(Path(root).resolve()), "domains": list(domains), "image_size": int(image_size)}
    digest.update(json.dumps(header, sort_keys=True).encode())
    digest.update(manifest[["sample_id", "rgb_path"]].sort_values("sample_id").to_csv(index=False).encode())
    return digest.hexdigest()


def cache_rows(sample_ids: Sequence[str]) -> np.ndarray:
    """``rows[i]``: the cache row of dataset row ``i`` (the rank of its sample id; ids are unique)."""
    order = np.argsort(np.asarray(sample_ids, dtype=str), kind="stable")
    rows = np.empty(len(order), dtype=np.int64)
    rows[order] = np.arange(len(order))
    return rows


class DecodedSampleCache:
    """Memory-mapped storage for decoded samples, one row per manifest row.

    Args:
        cache_dir: parent folder; the cache lives in ``cache_dir/<prefix>_<key prefix>/``.
        key: from :func:`cache_key` (or another content hash).
        num_samples: rows.
        layout: array name -> (per-sample shape, dtype).
        prefix: names what the rows hold (``decoded`` samples, ``encoded`` feature maps).
    """

    def __init__(self, cache_dir: Path, key: str, num_samples: int, layout: Mapping[str, tuple[tuple[int, ...], np.dtype]],
                 prefix: str = "decoded") -> None:
        self.directory = Path(cache_dir) / f"{prefix}_{key[:32]}"
        self.num_samples = int(num_samples)
        self.layout = {name: (tuple(shape), np.dtype(dtype)) for name, (shape, dtype) in layout.items()}
        self._maps: dict[str, np.memmap] | None = None
        if not self.directory.is_dir():
            self._create(key)
        for name in [*self.layout, FILLED]:  # here, in the process that made the dataset: one error line, not a worker's
            self._map(name, "r")

    def _create(self, key: str) -> None:
        """Allocate the (sparse) maps in a temp folder, then rename: readers never see half a cache."""
        with disk_full_names(self.directory, exact=True):
            self.directory.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=self.directory.parent, prefix=f".{self.directory.name}_tmp_"))
        try:
            for name, (shape, dtype) in self.layout.items():
                np.lib.format.open_memmap(staging / f"{name}.npy", mode="w+", dtype=dtype, shape=(self.num_samples, *shape)).flush()
            np.lib.format.open_memmap(staging / f"{FILLED}.npy", mode="w+", dtype=np.uint8, shape=(self.num_samples,)).flush()
            self._reserve(staging)
            layout = {name: [list(shape), dtype.str] for name, (shape, dtype) in self.layout.items()}
            (staging / "key.json").write_text(json.dumps({"key": key, "num_samples": self.num_samples, "layout": layout}, indent=2))
            os.rename(staging, self.directory)
        except DiskFullError:
            raise
        except OSError as error:
            # Another process created the same cache first; its copy is equivalent.
            if not self.directory.is_dir():
                if is_disk_full(error):
                    raise self._full_disk(error) from error
                raise
        finally:
            if staging.exists():
                shutil.rmtree(staging)

    def _reserve(self, folder: Path) -> None:
        """Give every map of ``folder`` its disk blocks now.

        The maps are sparse files: without this, the disk filling up while a row is written through
        the map kills the process with SIGBUS (exit -7) instead of raising. posix_fallocate fails
        with ENOSPC up front instead; where it is missing (macOS) the maps stay sparse.
        """
        if not hasattr(os, "posix_fallocate"):
            return
        for name in [*self.layout, FILLED]:
            path = folder / f"{name}.npy"
            handle = os.open(path, os.O_RDWR)
            try:
                os.posix_fallocate(handle, 0, os.fstat(handle).st_size)
            except OSError as error:
                if is_disk_full(error):
                    raise self._full_disk(error) from error
                raise
            finally:
                os.close(handle)

    def _full_disk(self, error: OSError) -> DiskFullError:
        size = sum(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for shape, dtype in self.layout.values())
        return DiskFullError(f"{self.directory}: no space left on device for the memory-mapped cache "
                             f"({size * self.num_samples / 2**20:.1f} MiB; {os.strerror(error.errno)}): free some space "
                             "or pass a --cache_dir on a disk with room, then rerun")

    def _open(self) -> dict[str, np.memmap]:
        # Opened lazily so each DataLoader worker maps the files itself.
        if self._maps is None:
            self._maps = {name: self._map(name, "r+") for name in [*self.layout, FILLED]}
        return self._maps

    def _map(self, name: str, mode: str) -> np.memmap:
        """The memory map of ``name``, its header checked first (utils/loaders.py: exactly shape x item size bytes, so a
        damaged map is never grown to the shape its header claims) and its shape and dtype the layout's."""
        shape, dtype = self.layout[name] if name in self.layout else ((), np.dtype(np.uint8))
        path = self.directory / f"{name}.npy"
        try:
            array = load_npy(path, "cache map", shape=(self.num_samples, *shape), finite=False, mmap_mode=mode)
            if array.dtype != dtype:
                raise TaskHetError(f"cache map {path} holds {array.dtype} values, expected {dtype}")
        except TaskHetError as error:
            raise TaskHetError(f"{error}; delete the cache folder {self.directory} to rebuild it") from None
        return array

    def __getstate__(self) -> dict:
        # Memory maps pickle as full in-memory copies; workers re-open them instead.
        state = self.__dict__.copy()
        state["_maps"] = None
        return state

    def num_filled(self) -> int:
        """How many rows are decoded already."""
        return int(self._open()[FILLED].sum())

    def filled(self, index: int) -> bool:
        """Whether a row was written."""
        return bool(self._open()[FILLED][index])

    def get(self, index: int) -> dict[str, np.ndarray] | None:
        """Copies of a row's arrays, or None if the row was never filled."""
        maps = self._open()
        if not maps[FILLED][index]:
            return None
        return {name: np.array(maps[name][index]) for name in self.layout}

    def get_many(self, indices: np.ndarray) -> dict[str, np.ndarray] | None:
        """Copies of several rows' arrays, stacked (``[len(indices), ...]``, one read per array), or None if
        any of them was never filled. A DataLoader batch reads this way (``__getitems__``)."""
        maps = self._open()
        if not maps[FILLED][indices].all():
            return None
        return {name: np.asarray(maps[name][indices]) for name in self.layout}  # fancy indexing copies

    def put(self, index: int, arrays: Mapping[str, np.ndarray]) -> None:
        """Write a row (every array of the layout), then mark it filled."""
        maps = self._open()
        for name in self.layout:
            maps[name][index] = arrays[name]
        maps[FILLED][index] = 1
