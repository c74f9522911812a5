"""Temporal skew in step 4: which of its train rows a client holds in a round (partitioning/temporal.py).

A client of a scheduled assignment carries a :class:`ClientSchedule`; engines ask for the client *as it
is in round t* (:func:`client_at`) and train that: its loader covers exactly the rows held at t, its
``num_samples`` (the FedAvg weight, and the size ``--local_epochs`` passes over) is their number, its
class counts (FedRoD's balanced softmax) are theirs. A client holding no row at t is not sampled at t
(``holding_clients``). Evaluation (:func:`evaluation_view`) keeps the client's fixed test rows and the
absent-class mask of all its train rows; ``--finetune_steps`` fine-tunes on the rows held at t (none
held: no fine-tuning, the client has no ``client_test_finetuned`` row that round).

Everything is a function of (schedule, round), so a resumed run continues the schedule exactly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterable, Mapping

import numpy as np
import pandas as pd
from torch.utils.data import Dataset, Subset

from network.client import ClientData
from partitioning.temporal import FROM_ROUND, TO_ROUND, has_schedule
from training.loop import make_loader
from utils.errors import TaskHetError


@dataclass(frozen=True, eq=False)
class ClientSchedule:
    """One client's schedule.

    Attributes:
        starts, ends: int64 [n], the first and last round (inclusive) each scheduled train row is held.
        rows: the scheduled train rows as a dataset (item i = row i), or None where only counts are needed
            (the Flower server, whose clients' data lives on the nodes).
        labels: int64 [n] class of each row (classification), or None.
        num_classes: length of the class counts.
        batch_size, num_workers: of the loaders it makes.
        skew: the client's per-client skew (``network.client_skews``; None: none): its loaders' collate, and the
            class counts as the client labels them (a concept shift swaps classes).
    """

    starts: np.ndarray
    ends: np.ndarray
    rows: Dataset | None = None
    labels: np.ndarray | None = None
    num_classes: int = 0
    batch_size: int = 1
    num_workers: int = 0
    skew: Any = None

    def held(self, round_index: int) -> np.ndarray:
        """Positions of the rows held in ``round_index``, ascending."""
        return np.flatnonzero((self.starts <= round_index) & (round_index <= self.ends))

    def count(self, round_index: int) -> int:
        return int(np.count_nonzero((self.starts <= round_index) & (round_index <= self.ends)))

    def counting_only(self) -> "ClientSchedule":
        """The same windows without the data (what a server that only samples needs)."""
        return ClientSchedule(self.starts, self.ends)


def client_at(client: ClientData, round_index: int) -> ClientData:
    """``client`` as it trains in ``round_index``: see the module docstring (unscheduled clients unchanged)."""
    schedule: ClientSchedule | None = client.schedule
    if schedule is None:
        return client
    held = schedule.held(round_index)
    counts = client.class_counts
    if schedule.labels is not None:
        counts = tuple(np.bincount(schedule.labels[held], minlength=schedule.num_classes).tolist())
        counts = schedule.skew.counts(counts) if schedule.skew is not None else counts
    loader = client.train_loader
    if schedule.rows is not None:
        loader = partial(make_loader, Subset(schedule.rows, held.tolist()), schedule.batch_size, True,
                         num_workers=schedule.num_workers, collate_fn=schedule.skew)
    return dataclasses.replace(client, num_samples=int(held.size), train_loader=loader, class_counts=counts,
                               schedule=None)


def evaluation_view(client: ClientData, round_index: int) -> ClientData:
    """``client`` as evaluated after ``round_index``: its fixed test rows and whole-schedule class counts, the
    rows held in that round to fine-tune on (round 0: those of round 1)."""
    if client.schedule is None:
        return client
    now = client_at(client, max(round_index, 1))
    return dataclasses.replace(client, num_samples=now.num_samples, train_loader=now.train_loader, schedule=None)


def holding_clients(clients: Mapping[str, ClientData], round_index: int) -> list[str]:
    """The ids (in ``clients``' order) of the clients holding at least one train row in ``round_index``."""
    ids = [client_id for client_id, client in clients.items()
           if client.schedule is None or client.schedule.count(round_index) > 0]
    if not ids:  # partitioning.temporal.check_horizon refuses such a file before a run starts
        raise TaskHetError(f"round {round_index}: no client holds a train row (the assignments' schedule is empty "
                           "there)")
    return ids


def diagnosed_round(round_index: int) -> int:
    """Whose rows the gradient diagnostics after ``round_index`` read: those of the round just trained (after round
    0, the start model: those round 1 trains), as :func:`evaluation_view` fine-tunes on."""
    return max(round_index, 1)


def train_sizes_at(clients: Mapping[str, ClientData], sizes: Mapping[str, int], round_index: int) -> dict[str, int]:
    """n_k in ``round_index``: the rows a scheduled client holds then, else its fixed train size from ``sizes``.

    The gradient diagnostics weigh p_k by these (F_k at round t is the loss over the rows held at t)."""
    return {client_id: client.schedule.count(round_index) if client.schedule is not None else int(sizes[client_id])
            for client_id, client in clients.items()}


def schedules_of(clients: Iterable[ClientData]) -> dict[str, ClientSchedule]:
    """The counting-only schedules of the scheduled clients, by id (what the Flower server samples with)."""
    return {str(client.client_id): client.schedule.counting_only() for client in clients if client.schedule is not None}


def table_schedules(table: pd.DataFrame) -> dict[str, ClientSchedule]:
    """Counting-only schedules straight from an assignments table (a Flower deployment's server, which opens no
    client data); empty when the table has no schedule."""
    if not has_schedule(table):
        return {}
    train = table[table["subset"] == "train"]
    return {str(client_id): ClientSchedule(rows[FROM_ROUND].to_numpy(np.int64), rows[TO_ROUND].to_numpy(np.int64))
            for client_id, rows in train.groupby("client_id", sort=True)}
