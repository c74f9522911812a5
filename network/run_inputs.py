"""What a federated run reads beside its config: where its assignment file is by default, the held-out (unseen)
clients and recorded skews of the file's sidecar (both enter the run's signature, so a resume after an edit is
refused), and the manifest's head/middle/tail classes a classifier's evaluation reports."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from datasets.family import validation_mask
from datasets.long_tail import class_groups
from partitioning.assignments import UNSEEN_KEY
from partitioning.groupings import EMBEDDING_BASED
from utils.errors import TaskHetError

if TYPE_CHECKING:  # annotations only: network.run imports this module
    from network.run_config import RunConfig


def default_assignments(config: RunConfig) -> Path:
    if config.alpha is None or config.type is None:
        raise TaskHetError("pass --assignments FILE, or --type and --alpha to find it under --assignment_files_path")
    owner = Path(config.task, f"k{config.n_clusters}") if config.type == EMBEDDING_BASED else Path("labels")
    return config.assignment_files_path / config.type / owner / f"a{config.alpha:g}" / "assignments.csv"


def split_unseen(table: pd.DataFrame, meta: dict) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """``(the federation's rows, the unseen clients' rows or None)`` of the assignments, by the sidecar's checked
    ``unseen_clients``; without any, ``table`` itself comes back untouched."""
    unseen = meta.get(UNSEEN_KEY) or []
    if not unseen:
        return table, None
    held_out = table["client_id"].isin(unseen)
    return table[~held_out], table[held_out]


def unseen_signature(meta: dict) -> dict[str, str]:
    """The unseen clients, in the run's signature (only when there are any, so other signatures are unchanged)."""
    unseen = meta.get(UNSEEN_KEY) or []
    return {UNSEEN_KEY: ",".join(map(str, unseen))} if unseen else {}


def skews_signature(meta: dict) -> dict[str, str]:
    """The recorded per-client skews' hash (partitioning/skews.py): a resume after an edited record is refused."""
    if "skews" not in meta:
        return {}
    return {"skews": hashlib.sha256(json.dumps(meta["skews"], sort_keys=True).encode()).hexdigest()}


def train_class_groups(family, manifest: pd.DataFrame) -> dict[str, list[int]]:
    """Head/middle/tail classes by both conventions (datasets.long_tail.class_groups) of the manifest's training
    rows (validation rows left out): every classifier's evaluation reports each group's top-1."""
    train = manifest[(manifest["split"] == "train") & ~validation_mask(manifest)]
    counts = np.bincount(train[family.label_column].to_numpy(dtype=np.int64), minlength=family.num_classes(manifest))
    return class_groups(counts)
