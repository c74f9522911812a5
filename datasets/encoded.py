"""Cached features of a frozen encoder: the model input computed once, not once per step.

With a frozen pretrained encoder (``--freeze_encoder``) only the decoder and the
head train, and the encoder's feature maps of a sample never change. A federated
sweep runs hundreds of runs over the same images; recomputing the encoder in each
local step of each run is most of the work. :class:`EncodedDataset` wraps a data
family's dataset and replaces its image (the family's ``input_key``) by the
encoder's maps (``ENCODED_KEY``: a list of ``[C_i, H_i, W_i]`` float32 tensors,
finest first), which ``TaskModel.forward`` accepts in place of an image.

The maps are computed in one batched pass the first time a sample is asked for a
given encoder and resolution, in eval mode and without autocast (the encoder's
output in float32, as an uncached forward on the CPU computes it). With a
``cache_dir`` they live in memory maps (:class:`datasets.cache.DecodedSampleCache`)
shared by every later run; the key holds a hash of the encoder's weights and
buffers, the resolution and the *set* of samples (sorted), so runs over the same
samples in another order (another partition) share one cache. Without a
``cache_dir`` they are kept in memory for the life of the dataset.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, default_collate
from tqdm.auto import tqdm

from datasets.cache import DecodedSampleCache, cache_rows
from utils.errors import TaskHetError

ENCODED_KEY = "encoded"
FEATURE_FORMAT_VERSION = 2  # 2: disk space reserved when the maps are made (datasets/cache.py, no SIGBUS on a full disk)
ENCODE_BATCH = 64


def encoder_fingerprint(encoder: nn.Module) -> str:
    """sha256 over the encoder's class, every state-dict name, shape, dtype and value."""
    digest = hashlib.sha256(type(encoder).__qualname__.encode())
    for name, tensor in encoder.state_dict().items():
        value = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(value.shape)}:{value.dtype}".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def feature_key(fingerprint: str, sample_ids: Sequence[str], image_size: int, data_key: str) -> str:
    """What a cached map depends on: the encoder, the samples (as a set), the resolution and the data's origin."""
    header = {"version": FEATURE_FORMAT_VERSION, "encoder": fingerprint, "image_size": int(image_size), "data": data_key}
    digest = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    digest.update("\n".join(sorted(sample_ids)).encode())
    return digest.hexdigest()


def check_frozen(encoder: nn.Module, what: str) -> None:
    """Cached maps are only right for an encoder that never changes."""
    if any(parameter.requires_grad for parameter in encoder.parameters()):
        raise TaskHetError(f"{what}: cached encoder features need a frozen encoder (pass --freeze_encoder)")


class EncodedDataset(Dataset):
    """A family dataset whose image input is replaced by a frozen encoder's feature maps.

    Args:
        base: the family's dataset (items are dicts with ``input_key`` and ``"sample_id"``).
        sample_ids: the base dataset's sample ids, in its row order (unique).
        encoder: the frozen encoder (``encoder(normalised images) -> list of maps``).
        normalise: maps a ``[B, 3, H, W]`` batch in [0, 1] to the encoder's input (the TaskModel's mean/std).
        input_key: the base items' image key (the family's ``input_key``).
        image_size: the images' side length (part of the cache key).
        data_key: names where the images come from (family, data root): part of the cache key.
        cache_dir: folder of the shared memory-mapped cache, or None to keep the maps in memory.
        device: where the encoder runs for the one pass.
        universe: every sample id the store covers (e.g. the whole manifest, so that every subset of it,
            a client's or a split's, shares one store); default ``sample_ids``.
    """

    def __init__(self, base: Dataset, sample_ids: Sequence[str], encoder: nn.Module, normalise, input_key: str,
                 image_size: int, data_key: str, cache_dir: Path | None, device: torch.device,
                 universe: Sequence[str] | None = None) -> None:
        check_frozen(encoder, "EncodedDataset")
        self.base, self.input_key = base, input_key
        universe = list(sample_ids if universe is None else universe)
        ranks = pd.Series(cache_rows(universe), index=universe)  # store rows in sample-id order
        missing = sorted(set(sample_ids) - set(ranks.index))
        if missing:
            raise TaskHetError(f"EncodedDataset: sample {missing[0]} is not among the samples its store covers")
        self.rows = ranks.loc[list(sample_ids)].to_numpy(dtype=np.int64)  # base row i is store row rows[i]
        layout = self._layout(encoder, normalise, device)
        key = feature_key(encoder_fingerprint(encoder), universe, image_size, data_key)
        self.store = (DecodedSampleCache(Path(cache_dir), key, len(universe), layout, prefix="encoded")
                      if cache_dir is not None else InMemoryStore(len(universe), layout))
        self._fill(encoder, normalise, device)

    def _layout(self, encoder: nn.Module, normalise, device: torch.device) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Per map: its per-sample shape (from one sample's forward)."""
        if len(self.base) == 0:
            return {}
        image = self.base[0][self.input_key][None].to(device)
        with torch.inference_mode():
            maps = encoder.eval()(normalise(image))
        return {f"map{index}": (tuple(feature.shape[1:]), np.dtype(np.float32)) for index, feature in enumerate(maps)}

    def _fill(self, encoder: nn.Module, normalise, device: torch.device) -> None:
        """Encode every sample whose row is not filled yet, in batches."""
        missing = [index for index in range(len(self.base)) if not self.store.filled(int(self.rows[index]))]
        if not missing:
            return
        loader = DataLoader(Subset(self.base, missing), batch_size=ENCODE_BATCH, shuffle=False)
        position = 0
        encoder.eval()
        with torch.inference_mode():
            # disable=None: no bar when stderr is not a terminal. The cache is built deep inside steps 2, 3c and 4,
            # where their --no-progress does not reach; a TTY check is what a pipeline log needs.
            for batch in tqdm(loader, desc="encode (frozen encoder, once)", leave=False, dynamic_ncols=True, disable=None):
                maps = encoder(normalise(batch[self.input_key].to(device)))
                for offset in range(len(batch["sample_id"])):
                    row = int(self.rows[missing[position + offset]])
                    self.store.put(row, {f"map{index}": feature[offset].float().cpu().numpy() for index, feature in enumerate(maps)})
                position += len(batch["sample_id"])

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> dict:
        arrays = self.store.get(int(self.rows[index]))
        return self._encoded(self.base[index], [torch.from_numpy(arrays[name]) for name in map_names(arrays)])

    def __getitems__(self, indices: list[int]) -> list[dict]:
        """``[self[i] for i in indices]`` with one store read per map, and the base's batched read where it has one.

        torch's DataLoader calls this for a batch (through ``Subset``); see ``TaskonomyDataset.__getitems__``.
        """
        maps = self._stored_maps(indices)
        if maps is None:  # a row another process has not filled yet: one by one, as __getitem__ reads it
            return [self[index] for index in indices]
        read_many = getattr(self.base, "__getitems__", None)
        items = read_many(indices) if callable(read_many) else [self.base[index] for index in indices]
        return [self._encoded(item, [batch[position] for batch in maps]) for position, item in enumerate(items)]

    def read_batch(self, indices: list[int]) -> dict:
        """The collated items ``indices`` with one store read per map (``datasets.batch_reads``), and the base's
        batch read where it has one; collated one by one while a row is not filled yet."""
        maps = self._stored_maps(indices)
        if maps is None:
            return default_collate(self.__getitems__(indices))
        read_batch = getattr(self.base, "read_batch", None)
        batch = read_batch(indices) if callable(read_batch) else default_collate([self.base[index] for index in indices])
        return self._encoded(batch, maps)

    def _stored_maps(self, indices: list[int]) -> list[torch.Tensor] | None:
        """Rows ``indices``' maps, each stacked ``[len(indices), ...]`` in one store read; None while a row is unfilled."""
        arrays = self.store.get_many(self.rows[np.asarray(indices, dtype=np.int64)])
        return None if arrays is None else [torch.from_numpy(arrays[name]) for name in map_names(arrays)]

    def _encoded(self, item: dict, maps: list[torch.Tensor]) -> dict:
        """A base item (or batch) with its image replaced by the encoder's maps."""
        item = dict(item)
        del item[self.input_key]
        item[ENCODED_KEY] = maps
        return item


def map_names(arrays: dict[str, np.ndarray]) -> list[str]:
    """A store row's map names, finest first (``map0``, ``map1``, ...; numeric order past ``map9``)."""
    return sorted(arrays, key=lambda name: int(name[3:]))


def encoded_dataset(dataset: Dataset, rows: pd.DataFrame, family, model: nn.Module, data_path: Path, image_size: int,
                    cache_dir: Path | None, manifest: pd.DataFrame) -> EncodedDataset:
    """``dataset`` (the family's, over ``rows`` of ``manifest`` in order) with ``model``'s frozen encoder's maps as
    input; the store covers the whole manifest, so every split, client and partition of it shares one."""
    return EncodedDataset(dataset, rows["sample_id"].astype(str).tolist(), model.encoder, model.normalise, family.input_key,
                          image_size, f"{family.name}:{Path(data_path).resolve()}", cache_dir, next(model.parameters()).device,
                          universe=manifest["sample_id"].astype(str).tolist())


def model_input_key(family, cache_features: bool) -> str:
    """The batch key a model reads: the encoder's cached maps, or the family's image."""
    return ENCODED_KEY if cache_features else family.input_key


class InMemoryStore:
    """The in-memory counterpart of :class:`datasets.cache.DecodedSampleCache` (same get/put/filled)."""

    def __init__(self, num_samples: int, layout: dict[str, tuple[tuple[int, ...], np.dtype]]) -> None:
        self.layout = layout
        self.arrays = {name: np.zeros((num_samples, *shape), dtype=dtype) for name, (shape, dtype) in layout.items()}
        self.is_filled = np.zeros(num_samples, dtype=bool)

    def filled(self, index: int) -> bool:
        return bool(self.is_filled[index])

    def get(self, index: int) -> dict[str, np.ndarray]:
        return {name: array[index].copy() for name, array in self.arrays.items()}

    def get_many(self, indices: np.ndarray) -> dict[str, np.ndarray] | None:
        if not self.is_filled[indices].all():
            return None
        return {name: array[indices] for name, array in self.arrays.items()}  # fancy indexing copies

    def put(self, index: int, arrays: dict[str, np.ndarray]) -> None:
        for name in self.layout:
            self.arrays[name][index] = arrays[name]
        self.is_filled[index] = True
