"""Step 4's side of the per-client skews (``partitioning/skews.py``): which dataset and which collate a client gets.

Where a skew applies:

* images (feature skews) and targets (concept shifts) are transformed per batch, in the client's
  loaders' ``collate_fn``: one transform of a ``[B, 3, H, W]`` batch is far cheaper than B
  transforms of single images, and the client's train and client-test loaders are the only
  loaders that get it: the global test and validation loaders are built without one;
* a target variant also changes the dataset a client reads: the same rows, loaded for the
  variant's domain (``depth_zbuffer`` for ``depth_euclidean``);
* with ``--cache_features`` the model never sees an image, only the frozen encoder's maps. A
  feature skew then applies to the image *before* encoding: the client gets its own store of
  maps of its transformed rows, keyed by the transform's parameters (so a resumed or re-run
  step 4 finds the same maps), while every unskewed client and split keeps sharing the one store
  of the untransformed images. Concept shifts change targets only and need no store of their own.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Callable

import pandas as pd
from torch.utils.data import Dataset

from datasets.encoded import EncodedDataset, encoded_dataset
from datasets.family import DataFamily
from models.tasks import get_task
from partitioning.assignments import read_meta, sidecar_path
from partitioning.skew_record import client_skews, read_skews
from partitioning.skew_transforms import ClientSkew
from partitioning.skews import SKEWS_KEY, BatchKeys, SkewContext
from utils.errors import TaskHetError


def run_skews(args, manifest: pd.DataFrame, table: pd.DataFrame, task, family: DataFamily) -> dict[int, ClientSkew]:
    """The recorded skews of the run's assignments file, validated against the data and the task: client id ->
    :class:`ClientSkew` (clients no skew changes are left out; no record: ``{}``)."""
    assignments = getattr(args, "assignments", None)
    if assignments is None:
        return {}
    meta = read_meta(assignments)
    if SKEWS_KEY not in meta:
        return {}
    sidecar = sidecar_path(assignments)
    n_clients = meta.get("n_clients") or int(table["client_id"].max()) + 1
    context = SkewContext(family.name, family.num_classes(manifest), tuple(family.tasks), int(n_clients))
    keys = BatchKeys(family.input_key, task.name, task.domain, task.kind, family.label_column, context.num_classes)
    skews = client_skews(read_skews(sidecar, meta, context), keys)
    if getattr(args, "cache_features", False) and getattr(args, "local_test", "assigned") == "proportional" \
            and any(skew.feature for skew in skews.values()):
        raise TaskHetError(f"{sidecar}: feature skews with --cache_features need each client's own encoded rows; "
                           "--local_test proportional draws client tests from the global test split: use "
                           "--local_test assigned, or --no-cache_features")
    return skews


def variant_dataset(build: Callable[..., Dataset], variants: dict[str, Dataset], variant: str) -> Dataset:
    """The assignment rows loaded for ``variant``'s target domain, built once per variant (``variants`` memoises)."""
    if variant not in variants:
        variants[variant] = build(get_task(variant))
    return variants[variant]


def encoded_client_dataset(args, manifest: pd.DataFrame, rows: pd.DataFrame, task, skew: ClientSkew, family: DataFamily,
                           feature_model) -> Dataset:
    """One client's rows with its feature transforms applied to the images and then encoded (``--cache_features``).

    The store's key holds the transforms' parameters and the client's samples, so two runs with the same
    recorded skew share it and a changed record can never reuse stale maps.
    """
    target_task = get_task(skew.variant) if skew.variant else task
    # EncodedDataset reads its base item at every access (for the targets): the skew's memo keeps the
    # transform to one computation per image.
    base = SkewedImages(family.dataset(args.data_path, rows, target_task, args.image_size, args.cache_dir), skew,
                        family.input_key)
    fingerprint = hashlib.sha256(repr(skew.feature).encode()).hexdigest()[:16]
    sample_ids = rows["sample_id"].astype(str).tolist()
    return EncodedDataset(base, sample_ids, feature_model.encoder, feature_model.normalise, family.input_key, args.image_size,
                          f"{family.name}:{Path(args.data_path).resolve()}:skew:{fingerprint}", args.cache_dir,
                          next(feature_model.parameters()).device)


class SkewedImages(Dataset):
    """``base``'s items with a client's feature transforms applied to the image (the cached-feature path)."""

    def __init__(self, base: Dataset, skew: ClientSkew, input_key: str) -> None:
        self.base, self.skew, self.input_key = base, skew, input_key

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> dict:
        item = dict(self.base[index])
        item[self.input_key] = self.skew.image(item[self.input_key], item["sample_id"])
        return item


def without_features(skew: ClientSkew) -> ClientSkew:
    """The collate of a client whose images were transformed before encoding: its concept steps only."""
    return dataclasses.replace(skew, feature=())


def client_rows_dataset(args, manifest: pd.DataFrame, rows: pd.DataFrame, task, family: DataFamily, skew: ClientSkew | None,
                        feature_model=None) -> tuple[Dataset, ClientSkew | None]:
    """One client's ``rows`` as a dataset plus the collate its loader needs (step 3c's per-client gradients).

    Returns:
        ``(dataset, collate_fn)``: the family's dataset (for the variant's domain under target_variant; the encoder's
        maps with ``feature_model``, of the transformed images under a feature skew) and the client's skew (None: torch's).
    """
    if skew is not None and feature_model is not None and skew.feature:
        return encoded_client_dataset(args, manifest, rows, task, skew, family, feature_model), without_features(skew)
    target = get_task(skew.variant) if skew is not None and skew.variant else task
    dataset = family.dataset(args.data_path, rows, target, args.image_size, args.cache_dir)
    if feature_model is not None:
        dataset = encoded_dataset(dataset, rows, family, feature_model, args.data_path, args.image_size, args.cache_dir,
                                  manifest)
    return dataset, skew
