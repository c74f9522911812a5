"""Per-client distances to the pooled mixture (Jensen–Shannon and Hellinger), over labels and embedding clusters:
the functions against hand-computed values, and step 3b's client_stats.csv and assignments.json."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from datasets.digits import select_digits
from partitioning.allocation import UNUSED
from partitioning.partition_stats import hellinger_distance, js_distance, mean_distances, partition_distances
from steps import assign
from utils.errors import TaskHetError

N_CLIENTS = 4


def kl2(p, q) -> float:
    """KL(p‖q) in bits, written out term by term (0·log 0 = 0)."""
    return sum(a * math.log2(a / b) for a, b in zip(p, q) if a > 0)


def js_by_hand(p, q) -> float:
    m = [(a + b) / 2 for a, b in zip(p, q)]
    return math.sqrt(kl2(p, m) / 2 + kl2(q, m) / 2)


def test_js_and_hellinger_distances_of_the_textbook_pair():
    # p = (1, 0), q = (½, ½), m = (¾, ¼): KL(p‖m) = log2(4/3), KL(q‖m) = ½·log2(2/3) + ½·log2(2).
    expected_js = math.sqrt(0.5 * math.log2(4 / 3) + 0.5 * (0.5 * math.log2(2 / 3) + 0.5 * math.log2(2)))
    assert expected_js == pytest.approx(0.557923, abs=1e-6)
    assert float(js_distance([1.0, 0.0], [0.5, 0.5])) == pytest.approx(expected_js, rel=1e-12)
    # H = (1/√2)·√((1 − √½)² + (0 − √½)²) = √(1 − √½)
    assert float(hellinger_distance([1.0, 0.0], [0.5, 0.5])) == pytest.approx(math.sqrt(1 - math.sqrt(0.5)), rel=1e-12)
    assert math.sqrt(1 - math.sqrt(0.5)) == pytest.approx(0.541196, abs=1e-6)


def test_both_distances_are_zero_for_equal_and_one_for_disjoint_mixtures_row_by_row():
    p = np.array([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0], [0.0, 0.5, 0.5]])
    q = np.array([[0.2, 0.3, 0.5], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    np.testing.assert_allclose(js_distance(p, q), [0.0, 1.0, 1.0], atol=1e-7)
    np.testing.assert_allclose(hellinger_distance(p, q), [0.0, 1.0, 1.0], atol=1e-12)


def test_partition_distances_against_the_pooled_mixture_by_hand():
    # client 0: a, a; client 1: a, b; client 2 holds nothing; the unused b is not part of the pooled mixture.
    client_of = np.array([0, 0, 1, 1, UNUSED])
    groups = np.array(["a", "a", "a", "b", "b"])
    table = partition_distances(client_of, groups, 3, "label")
    assert list(table.columns) == ["client_id", "label_js_distance", "label_hellinger"]
    pooled = (0.75, 0.25)  # 3 a, 1 b
    np.testing.assert_allclose(table["label_js_distance"][:2], [js_by_hand((1, 0), pooled), js_by_hand((0.5, 0.5), pooled)],
                               rtol=1e-10)
    # H² = 1 − Σ √(p·q): client 0: 1 − √¾; client 1: 1 − (√(½·¾) + √(½·¼))
    np.testing.assert_allclose(table["label_hellinger"][:2],
                               [math.sqrt(1 - math.sqrt(0.75)), math.sqrt(1 - math.sqrt(0.375) - math.sqrt(0.125))],
                               rtol=1e-10)
    assert table.loc[2, ["label_js_distance", "label_hellinger"]].isna().all()
    means = mean_distances(table, "label")  # unweighted over the two clients that hold samples
    assert means["mean_label_js_distance"] == pytest.approx((js_by_hand((1, 0), pooled) + js_by_hand((0.5, 0.5), pooled)) / 2)
    assert set(means) == {"mean_label_js_distance", "mean_label_hellinger"}


def test_clients_of_unequal_sizes_are_compared_with_the_count_weighted_pooled_mixture():
    # Client 0 holds 1 row (a), client 1 holds 3 (a, b, b), over 2 classes. The pooled mixture counts rows: 2 a and
    # 2 b of 4, so q = (½, ½), not the mean of the two mixtures ((1 + ⅓)/2, (0 + ⅔)/2) = (⅔, ⅓).
    # Client 0: p = (1, 0), the textbook pair: JS = 0.557923, H = √(1 − √½) = 0.541196.
    # Client 1: p = (⅓, ⅔), m = (5/12, 7/12): KL(p‖m) = ⅓·log2(4/5) + ⅔·log2(8/7) = 0.021121,
    #   KL(q‖m) = ½·log2(6/5) + ½·log2(6/7) = 0.020321, JS = √(½·0.021121 + ½·0.020321) = 0.143947;
    #   H² = 1 − (√(⅓·½) + √(⅔·½)) = 1 − 0.408248 − 0.577350 = 0.014402, H = 0.120006.
    table = partition_distances(np.array([0, 1, 1, 1]), np.array(["a", "a", "b", "b"]), 2, "label")
    np.testing.assert_allclose(table["label_js_distance"], [0.557923, 0.143947], atol=1e-6)
    np.testing.assert_allclose(table["label_hellinger"], [0.541196, 0.120006], atol=1e-6)
    np.testing.assert_allclose(table["label_js_distance"], [js_by_hand((1, 0), (0.5, 0.5)),
                                                            js_by_hand((1 / 3, 2 / 3), (0.5, 0.5))], rtol=1e-12)
    # Each client counts once, whatever its size: (0.557923 + 0.143947) / 2, not (0.557923 + 3 · 0.143947) / 4.
    means = mean_distances(table, "label")
    assert means["mean_label_js_distance"] == pytest.approx(0.350935, abs=1e-6)
    assert means["mean_label_hellinger"] == pytest.approx((0.541196 + 0.120006) / 2, abs=1e-6)


def test_unequal_sizes_with_the_pooled_mixture_are_both_at_distance_zero():
    # 2 rows (a, b) and 4 rows (a, a, b, b): both mixtures are (½, ½), the pooled one too.
    table = partition_distances(np.array([0, 0, 1, 1, 1, 1]), np.array(["a", "b", "a", "a", "b", "b"]), 2, "label")
    np.testing.assert_allclose(table[["label_js_distance", "label_hellinger"]].to_numpy(), 0.0, atol=1e-7)



# ----- step 3b -----

@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A digits manifest, a clusters file equal to the labels and one that pools the digits by parity."""
    folder = tmp_path_factory.mktemp("digits")
    manifest = select_digits(0.2, seed=0, n_samples=200)
    manifest.to_csv(folder / "manifest.csv", index=False)
    pd.DataFrame({"sample_id": manifest["sample_id"], "cluster": manifest["label"]}).to_csv(folder / "same.csv", index=False)
    pd.DataFrame({"sample_id": manifest["sample_id"], "cluster": manifest["label"] % 2}).to_csv(folder / "parity.csv",
                                                                                                index=False)
    return folder / "manifest.csv", folder / "same.csv", folder / "parity.csv"


def step3b(manifest: Path, out: Path, *flags: str) -> tuple[pd.DataFrame, dict]:
    path = assign.main(["--manifest", str(manifest), "--n_clients", str(N_CLIENTS), "--alpha", "0.3", "--seed", "2",
                        "--out", str(out), "--no-progress", *flags])
    return pd.read_csv(out / "client_stats.csv"), json.loads(path.with_suffix(".json").read_text())


def distances_by_hand(manifest: Path, assignments: Path, group_of) -> tuple[list[float], list[float]]:
    """Each client's JS and Hellinger distance from assignments.csv's rows, with the formulas written out."""
    table = pd.read_csv(assignments).merge(pd.read_csv(manifest)[["sample_id", "label"]], on="sample_id")
    counts = pd.crosstab(table["client_id"], group_of(table["label"]))
    pooled = (counts.sum(axis=0) / counts.to_numpy().sum()).tolist()
    mixtures = [(row / row.sum()).tolist() for _, row in counts.iterrows()]
    hellinger = [math.sqrt(sum((math.sqrt(a) - math.sqrt(b)) ** 2 for a, b in zip(p, pooled)) / 2) for p in mixtures]
    return [js_by_hand(p, pooled) for p in mixtures], hellinger


def test_step3b_writes_label_and_cluster_distances_of_every_client(digits, tmp_path):
    manifest, _, parity = digits
    stats, meta = step3b(manifest, tmp_path / "out", "--distance_groups", str(parity))
    label_js, label_h = distances_by_hand(manifest, tmp_path / "out" / "assignments.csv", lambda labels: labels)
    cluster_js, cluster_h = distances_by_hand(manifest, tmp_path / "out" / "assignments.csv", lambda labels: labels % 2)
    np.testing.assert_allclose(stats["label_js_distance"], label_js, rtol=1e-9)
    np.testing.assert_allclose(stats["label_hellinger"], label_h, rtol=1e-9)
    np.testing.assert_allclose(stats["cluster_js_distance"], cluster_js, rtol=1e-9)
    np.testing.assert_allclose(stats["cluster_hellinger"], cluster_h, rtol=1e-9)
    assert list(stats.columns[-4:]) == ["label_js_distance", "label_hellinger", "cluster_js_distance", "cluster_hellinger"]
    block = meta["distances"]
    assert block["label"]["groups"] == "label" and block["cluster"]["groups"] == str(parity)
    assert block["label"]["js_distance"] == pytest.approx(label_js) and block["cluster"]["hellinger"] == pytest.approx(cluster_h)
    assert block["label"]["mean_js_distance"] == pytest.approx(np.mean(label_js))
    assert block["cluster"]["mean_hellinger"] == pytest.approx(np.mean(cluster_h))
    # Parity pools the digits, so this label-based partition looks less skewed over the two "clusters".
    assert block["js_gap"] == pytest.approx(np.mean(cluster_js) - np.mean(label_js)) and block["js_gap"] < 0
    assert block["hellinger_gap"] == pytest.approx(np.mean(cluster_h) - np.mean(label_h))
    metrics = pd.read_csv(tmp_path / "out" / "metrics.csv").set_index("metric")["value"]
    assert metrics["mean_cluster_js_distance"] == pytest.approx(np.mean(cluster_js))


def test_clusters_equal_to_the_labels_give_the_label_distances_and_no_gap(digits, tmp_path):
    manifest, same, _ = digits
    # embedding-based: --groups is the clusters file, which also serves the cluster distances
    stats, meta = step3b(manifest, tmp_path / "out", "--groups", str(same))
    np.testing.assert_allclose(stats["cluster_js_distance"], stats["label_js_distance"], rtol=1e-12)
    np.testing.assert_allclose(stats["cluster_hellinger"], stats["label_hellinger"], rtol=1e-12)
    assert meta["distances"]["cluster"]["groups"] == str(same)
    assert meta["distances"]["js_gap"] == pytest.approx(0.0, abs=1e-12)
    # the distances are a function of the partition's counts: JS distance² is step 3b's JS divergence
    np.testing.assert_allclose(stats["label_js_distance"] ** 2, stats["js_divergence"], rtol=1e-9)


def test_a_label_based_partition_without_clusters_leaves_the_cluster_distances_blank(digits, tmp_path):
    manifest, _, _ = digits
    stats, meta = step3b(manifest, tmp_path / "out")
    assert stats["cluster_js_distance"].isna().all() and stats["cluster_hellinger"].isna().all()
    assert stats["label_js_distance"].notna().all()
    assert meta["distances"]["cluster"] is None and meta["distances"]["js_gap"] is None
    assert meta["distances"]["hellinger_gap"] is None
    assert "mean_cluster_js_distance" not in set(pd.read_csv(tmp_path / "out" / "metrics.csv")["metric"])


def test_with_test_split_client_tests_the_distances_are_over_the_partitioned_train_rows(digits, tmp_path):
    """Under --client_tests test_split the manifest's test rows are dealt to the clients (subset test); the distances
    are those of the partition itself, the train rows, as documented, not of every row assignments.csv lists."""
    manifest, _, parity = digits
    stats, meta = step3b(manifest, tmp_path / "out", "--client_tests", "test_split", "--distance_groups", str(parity))
    assignments = pd.read_csv(tmp_path / "out" / "assignments.csv")
    assert (assignments["subset"] == "test").sum() > 0  # test-split rows were dealt: the case this test is about
    train_only = tmp_path / "train_rows.csv"
    assignments[assignments["subset"] == "train"].to_csv(train_only, index=False)
    label_js, label_h = distances_by_hand(manifest, train_only, lambda labels: labels)
    cluster_js, _ = distances_by_hand(manifest, train_only, lambda labels: labels % 2)
    np.testing.assert_allclose(stats["label_js_distance"], label_js, rtol=1e-9)
    np.testing.assert_allclose(stats["label_hellinger"], label_h, rtol=1e-9)
    np.testing.assert_allclose(stats["cluster_js_distance"], cluster_js, rtol=1e-9)
    every_row_js, _ = distances_by_hand(manifest, tmp_path / "out" / "assignments.csv", lambda labels: labels)
    assert not np.allclose(every_row_js, label_js, rtol=1e-6)  # the dealt test rows would have moved them
    assert "partitioned train row" in meta["distances"]["definition"]


@pytest.mark.parametrize("case, message", [
    ("missing", r"--distance_groups '.*nowhere.csv' is neither a manifest column"),
    ("short", r"short.csv: has no cluster for 1 manifest samples"),
    ("foreign", r"foreign.csv: row 2 has sample_id 'not_a_sample', which is not in the manifest"),
    ("bad_cluster", r"bad_cluster.csv.*cluster"),
])
def test_a_bad_distance_groups_file_is_one_error_before_any_output(digits, tmp_path, case, message):
    manifest, same, _ = digits
    clusters = pd.read_csv(same)
    path = tmp_path / f"{case}.csv"
    if case == "short":
        train_id = pd.read_csv(manifest).query("split == 'train' and val == 0")["sample_id"].iloc[0]
        clusters[clusters["sample_id"] != train_id].to_csv(path, index=False)
    elif case == "foreign":
        pd.concat([pd.DataFrame({"sample_id": ["not_a_sample"], "cluster": [0]}), clusters]).to_csv(path, index=False)
    elif case == "bad_cluster":
        clusters.assign(cluster=clusters["cluster"].astype(str).replace({"3": "three"})).to_csv(path, index=False)
    else:
        path = tmp_path / "nowhere.csv"
    out = tmp_path / "out"
    with pytest.raises(TaskHetError, match=message):
        step3b(manifest, out, "--distance_groups", str(path))
    assert not out.exists() or not (out / "assignments.csv").exists()
