"""clients.csv: one row per client, one column per final per-client number of a step-4 run.

Everything comes from the run's metrics.csv (the source of truth) and the clients' training sizes,
so the table can be rebuilt from a finished folder. Columns:

* ``client``, ``train_samples`` (n_i); ``local_step_budget``, the client's local steps per round, only under
  unequal local work (network/local_work.py);
* ``global_<metric>``, ``personal_<metric>``, ``finetuned_<metric>``: the client's ``client_test``,
  ``client_test_personal`` and ``client_test_finetuned`` rows at the last evaluated round (the global
  model, the client's own model, and after ``--finetune_steps``; empty where the run has none, e.g. a
  client without a personal model);
* ``last_trained_round`` and one column per metric of the client's own training report from the last
  round it was sampled, under the metric's name (``train_loss``; IFCA's ``cluster``: the cluster model it
  chose), empty if never sampled.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping

import pandas as pd

from network.client import CLIENT_TEST_SPLIT, FINETUNED_TEST_SPLIT, PERSONAL_TEST_SPLIT

CLIENTS_FILE = "clients.csv"
PREFIX = {CLIENT_TEST_SPLIT: "global", PERSONAL_TEST_SPLIT: "personal", FINETUNED_TEST_SPLIT: "finetuned"}
TRAIN_SPLIT = "train"


def clients_table(metrics: pd.DataFrame, client_sizes: dict[str, int],
                  client_steps: Mapping[str, int] | None = None) -> pd.DataFrame:
    """The table described above from a step-4 ``metrics`` frame (columns round, split, client, metric, value).

    Built from plain lists, not pandas' pivot_table and joins: every step-4 run ends here, and those cost
    20-30 ms a run for a few hundred rows; the columns, their order and their dtypes are the same.
    """
    clients = [str(client) for client in client_sizes]
    known = set(clients)
    by_split: dict[str, list[tuple]] = {}  # the rows of this run's clients, by split
    for row in zip(metrics["round"].tolist(), metrics["split"].tolist(), metrics["client"].astype(str).tolist(),
                   metrics["metric"].tolist(), metrics["value"].tolist()):
        if row[2] in known:
            by_split.setdefault(row[1], []).append(row)
    columns: dict[str, list] = {"client": clients, "train_samples": list(client_sizes.values())}
    if client_steps is not None:
        columns["local_step_budget"] = [int(client_steps[client]) for client in clients]
    for split, prefix in PREFIX.items():
        if split in by_split:
            last = max(row[0] for row in by_split[split])
            columns.update(first_values(clients, [row for row in by_split[split] if row[0] == last], f"{prefix}_"))
    trained = by_split.get(TRAIN_SPLIT, [])
    if trained:
        last_round: dict[str, int] = {}
        for round_index, _, client, _, _ in trained:
            last_round[client] = max(round_index, last_round.get(client, round_index))
        columns["last_trained_round"] = [last_round.get(client, math.nan) for client in clients]
        columns.update(first_values(clients, [row for row in trained if row[0] == last_round[row[2]]], ""))
    return pd.DataFrame(columns)


def first_values(clients: list[str], rows: list[tuple], prefix: str) -> dict[str, list[float]]:
    """One column per metric of ``rows`` (sorted by name, each named ``prefix + metric``): each client's first
    value that is not missing, NaN where it has none; a metric with no value at all gets no column."""
    first: dict[str, dict[str, float]] = {}
    for _, _, client, metric, value in rows:
        if isinstance(metric, str) and not math.isnan(value):
            first.setdefault(metric, {}).setdefault(client, value)
    return {f"{prefix}{metric}": [float(first[metric].get(client, math.nan)) for client in clients]
            for metric in sorted(first)}


def write_clients_table(metrics_csv: Path, client_sizes: dict[str, int], out_path: Path,
                        client_steps: Mapping[str, int] | None = None) -> Path:
    """Read ``metrics_csv`` and write :func:`clients_table` to ``out_path`` atomically."""
    from utils.run_dir import atomic_write_text

    metrics = pd.read_csv(metrics_csv, dtype={"client": str})
    atomic_write_text(Path(out_path), clients_table(metrics, client_sizes, client_steps).to_csv(index=False))
    return Path(out_path)
