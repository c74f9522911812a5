"""Step 3b's ``--client_tests test_split``: client test rows dealt from the manifest's test split.

Each client trains on all of its rows, and its test rows follow its own share of every group.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from partitioning.allocation import UNUSED
from partitioning.assignments import load_assignments
from partitioning.client_tests import deal_test_split
from pipeline.experiment import load_experiment
from pipeline.argv import flags
from pipeline.studies.main_job.config import assignment_params
from steps import assign
from tests.test_assignments import manifest
from utils.errors import TaskHetError


def test_test_rows_follow_each_clients_share_of_its_groups():
    # Train: client 0 holds 3 rows of group "a", client 1 holds 1 of "a" and 2 of "b"; one "a" row is unused.
    train_client_of = np.array([0, 0, 0, 1, 1, 1, UNUSED])
    train_groups = np.array(["a", "a", "a", "a", "b", "b", "a"])
    # Test: 8 rows of "a", 3 of "b", 2 of "c" (a group no client trains on).
    test_groups = np.array(["a"] * 8 + ["b"] * 3 + ["c"] * 2)
    client_of = deal_test_split(train_client_of, train_groups, test_groups, np.random.default_rng(0))
    counts = pd.crosstab(client_of, test_groups)
    # "a": 8 rows split 3:1 -> 6 and 2 exactly; "b": all 3 to client 1; "c": unused.
    assert counts.loc[0, "a"] == 6 and counts.loc[1, "a"] == 2
    assert counts.loc[1, "b"] == 3 and counts.loc[0, "b"] == 0
    assert (client_of[test_groups == "c"] == UNUSED).all()


def test_remainders_sum_exactly_and_rows_are_drawn_by_the_seed():
    train_client_of = np.repeat([0, 1, 2], 1)
    train_groups = np.zeros(3, dtype=np.int64)  # three clients with one row each of group 0
    test_groups = np.zeros(7, dtype=np.int64)  # 7 = 3 + 2 + 2: largest remainder gives the extra row to client 0
    first = deal_test_split(train_client_of, train_groups, test_groups, np.random.default_rng(1))
    assert np.bincount(first).tolist() == [3, 2, 2]
    again = deal_test_split(train_client_of, train_groups, test_groups, np.random.default_rng(1))
    other = deal_test_split(train_client_of, train_groups, test_groups, np.random.default_rng(2))
    assert (first == again).all() and not (first == other).all()


@pytest.fixture()
def manifest_file(tmp_path):
    path = tmp_path / "manifest.csv"
    manifest().to_csv(path, index=False)
    return path


def test_step3b_deals_the_test_split_and_trains_on_every_row(tmp_path, manifest_file):
    out = tmp_path / "split"
    assign.main(["--manifest", str(manifest_file), "--scheme", "dirichlet_mixture", "--alpha", "0.5",
                 "--n_clients", "3", "--client_tests", "test_split", "--seed", "3", "--out", str(out), "--no-progress"])
    rows = manifest()
    table, meta = load_assignments(out / "assignments.csv", rows)
    split_of = rows.set_index("sample_id")["split"]
    train, test = table[table.subset == "train"], table[table.subset == "test"]
    assert set(train.sample_id) == set(rows.loc[rows.split == "train", "sample_id"])  # nothing held out
    assert (test.sample_id.map(split_of) == "test").all() and len(test) == 4  # the whole test split, once each
    assert meta["client_tests"] == "test_split" and meta["client_test_fraction"] is None
    # Every client's test rows are of groups it trains on, in its share of them (hand check per group).
    for group, test_rows in test.groupby("group"):
        held = train[train.group == group].client_id.value_counts()
        shares = held / held.sum() * len(test_rows)
        dealt = test_rows.client_id.value_counts().reindex(held.index, fill_value=0)
        assert set(test_rows.client_id) <= set(held.index)
        assert (np.abs(dealt - shares) < 1).all() and dealt.sum() == len(test_rows)
    metrics = pd.read_csv(out / "metrics.csv").set_index("metric")["value"]
    assert metrics["n_client_test"] == 4
    assert json.loads((out / "config.json").read_text())["args"]["client_tests"] == "test_split"


def test_held_out_stays_the_default_with_its_fraction(tmp_path, manifest_file):
    out = tmp_path / "held"
    assign.main(["--manifest", str(manifest_file), "--n_clients", "3", "--out", str(out), "--no-progress"])
    table, meta = load_assignments(out / "assignments.csv", manifest())
    assert meta["client_tests"] == "held_out" and meta["client_test_fraction"] == 0.2
    assert (table.subset == "test").sum() == 3  # round(0.2 * 4) = 1 of each 4-row client
    assert set(table.sample_id) <= set(manifest().loc[lambda m: m.split == "train", "sample_id"])


def test_a_fraction_beside_test_split_is_one_error_before_any_output(tmp_path, manifest_file, capsys):
    out = tmp_path / "both"
    with pytest.raises(TaskHetError, match="--client_test_fraction .* --client_tests test_split"):
        assign.main(["--manifest", str(manifest_file), "--client_tests", "test_split", "--client_test_fraction", "0.1",
                     "--out", str(out)])
    assert not out.exists()


def test_a_test_split_row_may_be_a_client_test_row_but_never_a_train_row(tmp_path, manifest_file):
    out = tmp_path / "edited"
    assign.main(["--manifest", str(manifest_file), "--n_clients", "3", "--client_tests", "test_split",
                 "--out", str(out), "--no-progress"])
    path = out / "assignments.csv"
    load_assignments(path, manifest())  # as written: test-split rows only as client tests
    table = pd.read_csv(path, dtype=str, keep_default_na=False)
    row = int(np.flatnonzero(table.subset == "test")[0])
    table.loc[row, "subset"] = "train"
    table.to_csv(path, index=False)
    with pytest.raises(TaskHetError, match=rf"train row from the manifest's test split: row {row + 2} "):
        load_assignments(path, manifest())


def test_the_pipeline_passes_test_split_and_no_fraction(tmp_path):
    config = tmp_path / "exp.yaml"
    config.write_text("name: exp\ndata: {source: synthetic}\ntasks: [normal]\n"
                      "partition: {client_tests: test_split}\n")
    experiment = load_experiment(config)
    assert experiment["partition"]["client_tests"] == "test_split"
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ndata: {source: synthetic}\ntasks: [normal]\npartition: {client_tests: both}\n")
    with pytest.raises(TaskHetError, match="partition.client_tests"):
        load_experiment(bad)
    argv = flags(assignment_params(experiment, "label_based", 0.5, 0, tmp_path / "manifest.csv", None))
    assert "--client_tests" in argv and argv[argv.index("--client_tests") + 1] == "test_split"
    assert "--client_test_fraction" not in argv
