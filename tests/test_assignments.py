"""assignments.csv round trip, and an edited file rejected with every problem row named."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from partitioning.assignments import (
    assignments_table,
    load_assignments,
    read_assignments,
    resolve_groups,
    source_record,
    write_assignments,
)
from partitioning.client_tests import client_test_mask
from partitioning.partition import get_partitioner
from utils.errors import TaskHetError


def manifest() -> pd.DataFrame:
    """12 train samples over 3 buildings and 4 test samples."""
    rows = []
    for index in range(16):
        building = f"b{index % 3}"
        rows.append({
            "sample_id": f"{building}_point_{index}_view_0", "building": building, "point": index, "view": 0,
            "rgb_path": f"rgb/taskonomy/{building}/point_{index}_view_0_domain_rgb.png",
            "scene_class": index % 2, "scene_name": ["kitchen", "office"][index % 2], "split": "train" if index < 12 else "test",
        })
    return pd.DataFrame(rows)


def write_example(tmp_path, seed: int = 0):
    table = manifest()
    train = table[table.split == "train"].reset_index(drop=True)
    partition = get_partitioner("dirichlet_mixture", 3, alpha=1.0, seed=seed).split(train.scene_class.to_numpy())
    is_test = client_test_mask(partition.client_of, 0.25, np.random.default_rng(seed))
    tmp_path.mkdir(parents=True, exist_ok=True)
    manifest_path = tmp_path / "manifest.csv"
    table.to_csv(manifest_path, index=False)
    rows = assignments_table(train.sample_id.to_numpy(), train.scene_class.to_numpy(), partition.client_of, is_test)
    path = tmp_path / f"seed{seed}" / "assignments.csv"
    write_assignments(path, rows, {"scheme": "dirichlet_mixture", "alpha": 1.0, "seed": seed, "n_clients": 3,
                                   "sources": {"manifest": source_record(manifest_path)}})
    return path


def test_round_trip_and_sidecar(tmp_path):
    path = write_example(tmp_path)
    table, meta = load_assignments(path, manifest())
    assert list(table.columns) == ["sample_id", "client_id", "group", "subset", "row"]
    assert len(table) == 12 and set(table.client_id) == {0, 1, 2}
    assert set(table.subset) == {"train", "test"}
    assert meta["n_clients"] == 3 and len(meta["sources"]["manifest"]["sha256"]) == 64
    assert json.loads(path.with_suffix(".json").read_text()) == meta


def test_same_seed_same_file(tmp_path):
    first, again = write_example(tmp_path / "a", seed=1), write_example(tmp_path / "b", seed=1)
    other = write_example(tmp_path / "c", seed=2)
    assert first.read_bytes() == again.read_bytes()
    assert first.read_bytes() != other.read_bytes()


def edit(path, change) -> None:
    """Rewrite assignments.csv as a user would, through ``change(table) -> table``."""
    change(pd.read_csv(path, dtype=str, keep_default_na=False)).to_csv(path, index=False)


def test_unknown_duplicated_and_test_split_ids_name_their_rows(tmp_path):
    path = write_example(tmp_path)

    def change(table: pd.DataFrame) -> pd.DataFrame:
        table.loc[0, "sample_id"] = "nowhere_point_0_view_0"
        table.loc[3, "sample_id"] = table.loc[4, "sample_id"]
        table.loc[6, "sample_id"] = "b0_point_12_view_0"  # a manifest test sample
        return table

    edit(path, change)
    with pytest.raises(TaskHetError) as error:
        load_assignments(path, manifest())
    message = str(error.value)
    assert str(path) in message
    assert "unknown sample id" in message and "row 2 ('nowhere_point_0_view_0')" in message
    assert "duplicated sample id" in message and "row 5 " in message and "row 6 " in message
    assert "test split: row 8 ('b0_point_12_view_0')" in message


def test_empty_client_is_named(tmp_path):
    path = write_example(tmp_path)

    def change(table: pd.DataFrame) -> pd.DataFrame:
        return table[table.client_id != "1"]

    edit(path, change)
    with pytest.raises(TaskHetError, match=r"empty clients \(no rows\): 1"):
        load_assignments(path, manifest())


def test_client_with_only_test_rows_is_named(tmp_path):
    path = write_example(tmp_path)

    def change(table: pd.DataFrame) -> pd.DataFrame:
        table.loc[table.client_id == "2", "subset"] = "test"
        return table

    edit(path, change)
    with pytest.raises(TaskHetError, match="client with no train samples: row"):
        load_assignments(path, manifest())


@pytest.mark.parametrize(
    "column, value, expected",
    [("client_id", "x", "client_id is not an integer"), ("client_id", "-1", "client_id is not an integer"),
     ("client_id", "7", r"client_id >= n_clients \(3\)"), ("subset", "val", "subset not in"), ("sample_id", "", "empty sample_id")],
)
def test_bad_cells_name_the_row(tmp_path, column, value, expected):
    path = write_example(tmp_path)

    def change(table: pd.DataFrame) -> pd.DataFrame:
        table.loc[2, column] = value
        return table

    edit(path, change)
    with pytest.raises(TaskHetError, match=f"{expected}.*row 4"):
        load_assignments(path, manifest())


def test_missing_file_and_column(tmp_path):
    with pytest.raises(TaskHetError, match="does not exist"):
        read_assignments(tmp_path / "none.csv")
    (tmp_path / "bad.csv").write_text("sample_id,client\na,0\n")
    with pytest.raises(TaskHetError, match="missing column"):
        read_assignments(tmp_path / "bad.csv")


def test_resolve_groups_from_column_and_clusters_file(tmp_path):
    table = manifest()
    by_label, source = resolve_groups(table, "scene_class")
    assert source is None and by_label.dtype == np.int64 and by_label.tolist() == table.scene_class.tolist()
    clusters = pd.DataFrame({"sample_id": table.sample_id, "cluster": np.arange(16) % 5})
    clusters.to_csv(tmp_path / "clusters.csv", index=False)
    by_cluster, source = resolve_groups(table, str(tmp_path / "clusters.csv"))
    assert source == tmp_path / "clusters.csv" and by_cluster.tolist() == (np.arange(16) % 5).tolist()
    clusters.iloc[1:].to_csv(tmp_path / "partial.csv", index=False)
    with pytest.raises(TaskHetError, match="no cluster for 1 manifest samples"):
        resolve_groups(table, str(tmp_path / "partial.csv"))
    with pytest.raises(TaskHetError, match="neither a manifest column"):
        resolve_groups(table, "no_such_column")
