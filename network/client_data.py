"""Client data of a federated run: each client's train/test loaders over the assignment rows, the global test loader
and, when the manifest has validation rows, the global validation loader.

Shared by step 4 (all clients) and a Flower SuperNode (``network/flower/app.py``: only
the clients whose data that machine holds). ``args`` is the run's ``network.run_config.RunConfig`` (data_path,
image_size, cache_dir, cache_features, batch_size, num_workers). With ``cache_features`` the datasets
hold the frozen encoder's maps of the images instead of the images (``datasets/encoded.py``).
"""

from __future__ import annotations

import argparse
from functools import partial

import pandas as pd
from torch.utils.data import DataLoader, Dataset, Subset

import numpy as np

from datasets.encoded import encoded_dataset
from datasets.family import family_of, validation_mask
from datasets.long_tail import proportional_test_indices
from network.client import ClientData
from network.schedule import ClientSchedule
from partitioning.temporal import FROM_ROUND, TO_ROUND, has_schedule
from network.client_skews import encoded_client_dataset, run_skews, variant_dataset, without_features
from training.loop import make_loader
from utils.errors import TaskHetError
from utils.seeding import numpy_rng

LOCAL_TEST_ASSIGNED = "assigned"  # each client's own held-out test rows of assignments.csv
LOCAL_TEST_PROPORTIONAL = "proportional"  # FedLoGe's: drawn from the test split in the client's train proportions
LOCAL_TESTS = (LOCAL_TEST_ASSIGNED, LOCAL_TEST_PROPORTIONAL)


def task_dataset(args: argparse.Namespace, manifest: pd.DataFrame, task, sample_ids, feature_model=None) -> Dataset:
    """The samples ``sample_ids`` (in that order) as the manifest's data family builds them for ``task``;
    with ``feature_model`` (a TaskModel with a frozen encoder), its encoder's cached maps replace the images."""
    rows = manifest.set_index("sample_id").loc[list(sample_ids)].reset_index()
    family = family_of(manifest)
    dataset = family.dataset(args.data_path, rows, task, args.image_size, args.cache_dir)
    if feature_model is None:
        return dataset
    return encoded_dataset(dataset, rows, family, feature_model, args.data_path, args.image_size, args.cache_dir, manifest)


def make_clients(args: argparse.Namespace, manifest: pd.DataFrame, table: pd.DataFrame, task,
                 feature_model=None) -> list[ClientData]:
    """The clients of ``table`` (all of the assignments, or a Flower node's share): train rows train, test rows evaluate.

    Only the files of these clients are opened, in the same sample order and with the same loader seeds
    whichever rows of the assignments ``table`` holds. For a classification task each client carries its
    training class counts (the evaluation's absent-class mask). With ``args.local_test == "proportional"``
    (the Fed-LT protocol) a client's test set is drawn from the manifest's test split in its training class
    proportions (``datasets.long_tail.proportional_test_indices``) instead of its own test rows.
    With a schedule (``from_round``/``to_round``, temporal skew) each client carries a
    ``network.schedule.ClientSchedule`` over its train rows; its plain ``train_loader``, ``num_samples`` and
    class counts then cover each of its train samples once.
    """
    table = table.reset_index(drop=True)
    # One dataset item per sample: a schedule may list a sample on several rows (partitioning/temporal.py).
    unique_ids = table["sample_id"].drop_duplicates()
    position = table["sample_id"].map(pd.Series(np.arange(len(unique_ids)), index=unique_ids.to_numpy()))  # row -> item
    assigned, clients = task_dataset(args, manifest, task, unique_ids, feature_model), []
    family = family_of(manifest)
    classifier = task.kind == "classification"
    labels = manifest.set_index("sample_id")[family.label_column] if classifier else None
    num_classes = family.num_classes(manifest) if classifier else 0
    proportional = getattr(args, "local_test", LOCAL_TEST_ASSIGNED) == LOCAL_TEST_PROPORTIONAL
    if proportional and not classifier:
        raise TaskHetError(f"--local_test {LOCAL_TEST_PROPORTIONAL} draws test sets by class proportions; "
                           f"--task {task.name} is not a classification task")
    test_ids = manifest.loc[manifest["split"] == "test", "sample_id"].tolist() if proportional else []
    global_test = task_dataset(args, manifest, task, test_ids, feature_model) if proportional else None
    scheduled = has_schedule(table)
    skews, variants = run_skews(args, manifest, table, task, family), {}  # the recorded per-client skews (client_skews.py)
    for client_id, rows in table.groupby("client_id", sort=True):
        train_rows = rows[rows["subset"] == "train"]
        distinct = train_rows.index[~train_rows["sample_id"].duplicated()]  # each sample once
        counts = None
        if classifier:
            counts = tuple(np.bincount(labels.loc[table.loc[distinct, "sample_id"]].to_numpy(dtype=np.int64),
                                       minlength=num_classes).tolist())
        # Every loader of this client, its schedule's included, reads its rows from ``source``, item ``where[row]`` for
        # the table's row ``row``.
        source, skew, where = assigned, skews.get(int(client_id)), position
        if skew is not None and feature_model is not None and skew.feature:  # transformed before encoding
            own = table.loc[rows.index, "sample_id"].drop_duplicates()
            source = encoded_client_dataset(args, manifest, manifest.set_index("sample_id").loc[own].reset_index(), task,
                                            skew, family, feature_model)
            where = pd.Series(np.arange(len(own)), index=own.to_numpy()).loc[rows["sample_id"]].set_axis(rows.index)
            skew = without_features(skew)
        elif skew is not None and skew.variant:
            source = variant_dataset(lambda spec: task_dataset(args, manifest, spec, unique_ids, feature_model),
                                     variants, skew.variant)
        train = where.loc[distinct].tolist()
        test = where.loc[rows.index[rows["subset"] == "test"]].tolist()
        train_loader = partial(make_loader, Subset(source, train), args.batch_size, True, num_workers=args.num_workers,
                               collate_fn=skew)
        if proportional:
            picked = proportional_test_indices(np.array(counts), labels.loc[test_ids].to_numpy(),
                                               numpy_rng(args.rand_seed, "local_test", str(client_id)), str(client_id))
            test_set = Subset(global_test, picked.tolist())
        else:
            test_set = Subset(source, test)
        test_loader = make_loader(test_set, args.batch_size, False, 0, args.num_workers, skew) if len(test_set) else None
        counts = skew.counts(counts) if skew is not None and counts is not None else counts
        schedule = None
        if scheduled:
            schedule = ClientSchedule(
                train_rows[FROM_ROUND].to_numpy(np.int64), train_rows[TO_ROUND].to_numpy(np.int64),
                Subset(source, where.loc[train_rows.index].tolist()),
                labels.loc[train_rows["sample_id"]].to_numpy(dtype=np.int64) if classifier else None, num_classes,
                args.batch_size, args.num_workers, skew)
        clients.append(ClientData(str(client_id), len(train), train_loader, test_loader, counts, schedule))
    return clients


def global_test_loader(args: argparse.Namespace, manifest: pd.DataFrame, task, feature_model=None) -> DataLoader:
    test_ids = manifest.loc[manifest["split"] == "test", "sample_id"]
    return make_loader(task_dataset(args, manifest, task, test_ids, feature_model), args.batch_size, False, 0,
                       args.num_workers)


def global_val_loader(args: argparse.Namespace, manifest: pd.DataFrame, task, feature_model=None) -> DataLoader | None:
    """The manifest's validation rows (train rows with ``val = 1``, e.g. cifar's), or None when it has none."""
    val_ids = manifest.loc[validation_mask(manifest), "sample_id"]
    if val_ids.empty:
        return None
    return make_loader(task_dataset(args, manifest, task, val_ids, feature_model), args.batch_size, False, 0,
                       args.num_workers)
