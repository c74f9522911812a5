"""The positive control's groups: quantile bins of a target property, and the step that writes them."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from partitioning.property_bins import quantile_bins


def test_bins_split_at_the_reference_quantiles():
    # 1..6 in 3 bins: edges at the 1/3 and 2/3 quantiles, 2.667 and 4.333 (numpy's linear rule).
    assert quantile_bins([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], 3).tolist() == [0, 0, 1, 1, 2, 2]
    # Two values, two bins: the edge is their midpoint.
    assert quantile_bins([0.1, 0.4], [0.1, 0.4], 2).tolist() == [0, 1]


def test_a_value_on_an_edge_goes_to_the_lower_bin_and_ties_share_one():
    # Reference 1, 2, 3, 4 in 2 bins: the edge is 2.5; 2.5 itself goes low.
    assert quantile_bins([2.5, 2.4, 2.6], [1, 2, 3, 4], 2).tolist() == [0, 0, 1]
    # Mostly zeros: the 1/2 quantile is 0, so every 0 shares the lower bin; 3 bins ask for edges 0 and 0.
    assert quantile_bins([0, 0, 0, 1], [0, 0, 0, 1], 2).tolist() == [0, 0, 0, 1]
    assert quantile_bins([0, 0, 0, 1], [0, 0, 0, 1], 3).tolist() == [0, 0, 0, 1]  # the empty middle bin is dropped


def test_other_rows_are_binned_by_the_reference_edges_and_renumbered_with_them():
    # The edges come from the training values only (1..4: edge 2.5, where all six values would put it at 3.5); test
    # values of 100 and 90 join the top bin.
    bins = quantile_bins([1, 2, 3, 4, 100, 90], [1, 2, 3, 4], 2)
    assert bins.tolist() == [0, 0, 1, 1, 1, 1]
    # Unequal parts: 10 training values, 4 bins; edges 2.25, 4.5 and 6.75.
    reference = np.arange(10.0)
    assert np.bincount(quantile_bins(reference, reference, 4)).tolist() == [3, 2, 2, 3]


def test_one_bin_and_one_value():
    assert quantile_bins([5.0, -1.0], [1.0], 1).tolist() == [0, 0]
    assert quantile_bins([7.0], [1.0, 9.0], 2).tolist() == [0]  # in the upper bin, the only non-empty one: bin 0


@pytest.mark.parametrize("values, reference, n_bins", [([1.0], [], 2), ([np.nan], [1.0], 2), ([1.0], [np.inf], 2),
                                                        ([1.0], [1.0], 0)])
def test_bad_input_is_refused(values, reference, n_bins):
    with pytest.raises(ValueError):
        quantile_bins(values, reference, n_bins)


# ----- step 3p on rendered data -----
from datasets.taskonomy import TaskonomyDataset, read_manifest  # noqa: E402
from steps import target_groups  # noqa: E402
from tests.fixtures import tiny_data_root, tiny_manifest  # noqa: E402,F401
from utils.cli import run_main  # noqa: E402


def test_step_bins_every_sample_by_its_mean_valid_target(tiny_data_root, tiny_manifest, tmp_path):
    out = tmp_path / "property"
    target_groups.main(["--task", "normal", "--manifest", str(tiny_manifest), "--data_path", str(tiny_data_root),
                        "--out", str(out), "--n_bins", "3", "--image_size", "16", "--no-progress"])
    manifest = read_manifest(tiny_manifest)
    groups = pd.read_csv(out / "groups.csv")
    table = pd.read_csv(out / "property.csv")
    assert groups.sample_id.tolist() == table.sample_id.tolist() == manifest.sample_id.tolist()
    assert (groups.cluster == table["bin"]).all() and set(groups.cluster) <= {0, 1, 2}
    # By hand for the first sample: the mean over the valid pixels of all three normal channels (windows left out).
    item = TaskonomyDataset(tiny_data_root, manifest.iloc[:1], ["normal"], 16)[0]
    valid = item["mask"].expand_as(item["normal"]).bool()
    assert table.value.iloc[0] == pytest.approx(float(item["normal"][valid].double().mean()), rel=1e-12)
    # A higher value never sits in a lower bin, and the training rows fill every bin.
    ordered = table.sort_values("value")
    assert (np.diff(ordered["bin"].to_numpy()) >= 0).all()
    assert table[table.split == "train"]["bin"].nunique() == 3
    for name in ("config.json", "run.log", "metrics.csv", "property_bins.png"):
        assert (out / name).is_file()
    assert not (out / "INCOMPLETE").exists()


@pytest.mark.parametrize("task, says", [("class_scene", "classification task"), ("segment_semantic", "class ids")])
def test_step_refuses_a_target_without_a_mean(tiny_data_root, tiny_manifest, tmp_path, capsys, task, says):
    with pytest.raises(SystemExit) as stop:
        run_main(target_groups.main, ["--task", task, "--manifest", str(tiny_manifest), "--data_path",
                                      str(tiny_data_root), "--out", str(tmp_path / "out"), "--no-progress"])
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("error:") and says in error[0]
    assert not (tmp_path / "out" / "groups.csv").exists()
