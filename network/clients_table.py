"""clients.csv: one row per client, one column per final per-client number of a step-4 run.

Everything comes from the run's metrics.csv (the source of truth) and the clients' training sizes,
so the table can be rebuilt from a finished folder. Columns:

* ``client``, ``train_samples`` (n_i);
* ``global_<metric>``, ``personal_<metric>``, ``finetuned_<metric>``: the client's ``client_test``,
  ``client_test_personal`` and ``client_test_finetuned`` rows at the last evaluated round (the global
  model, the client's own model, and after ``--finetune_steps``; empty where the run has none, e.g. a
  client without a personal model);
* ``last_trained_round`` and one column per metric of the client's own training report from the last
  round it was sampled, under the metric's name (``train_loss``; IFCA's ``cluster``: the cluster model it
  chose), empty if never sampled.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from network.client import CLIENT_TEST_SPLIT, FINETUNED_TEST_SPLIT, PERSONAL_TEST_SPLIT

CLIENTS_FILE = "clients.csv"
PREFIX = {CLIENT_TEST_SPLIT: "global", PERSONAL_TEST_SPLIT: "personal", FINETUNED_TEST_SPLIT: "finetuned"}
TRAIN_SPLIT = "train"


def clients_table(metrics: pd.DataFrame, client_sizes: dict[str, int]) -> pd.DataFrame:
    """The table described above from a step-4 ``metrics`` frame (columns round, split, client, metric, value)."""
    metrics = metrics.assign(client=metrics["client"].astype(str))
    table = pd.DataFrame({"client": list(client_sizes), "train_samples": list(client_sizes.values())}).set_index("client")
    for split, prefix in PREFIX.items():
        rows = metrics[(metrics.split == split) & metrics.client.isin(table.index)]
        if rows.empty:
            continue
        last = rows[rows["round"] == rows["round"].max()]
        wide = last.pivot_table(index="client", columns="metric", values="value", aggfunc="first")
        table = table.join(wide.add_prefix(f"{prefix}_"))
    trained = metrics[(metrics.split == TRAIN_SPLIT) & metrics.client.isin(table.index)]
    if not trained.empty:
        last_round = trained.groupby("client")["round"].max().rename("last_trained_round")
        latest = trained.merge(last_round, left_on="client", right_index=True)
        latest = latest[latest["round"] == latest["last_trained_round"]]
        table = table.join(last_round).join(
            latest.pivot_table(index="client", columns="metric", values="value", aggfunc="first"))
    return table.reset_index()


def write_clients_table(metrics_csv: Path, client_sizes: dict[str, int], out_path: Path) -> Path:
    """Read ``metrics_csv`` and write :func:`clients_table` to ``out_path`` atomically."""
    from utils.run_dir import atomic_write_text

    metrics = pd.read_csv(metrics_csv, dtype={"client": str})
    atomic_write_text(Path(out_path), clients_table(metrics, client_sizes).to_csv(index=False))
    return Path(out_path)
