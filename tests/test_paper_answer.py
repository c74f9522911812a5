"""The main job's answer to the paper (pipeline/studies/main_job/paper.py) on a hand-made grid: the paper column,
the change and its interval over seeds, the α-trend test, the verdict rules against the paper's size (and their
Benjamini–Hochberg twins), each against numbers worked out by hand below."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from pipeline.studies.main_job.iid import MEAN_ONLY, NO, UNDER_TRAINED, YES, converged_verdict, iid_table
from pipeline.studies.main_job.paper import (CONSISTENT, GROWS, NO_EFFECT, OPPOSITE, SHRINKS, SMALLER, UNDECIDED,
                                             headline_counts, headline_sentence, paper_markdown, paper_table)

ALPHAS = (0.1, 1.0, 10.0)  # log10: -1, 0, +1
T_975_DF2 = 4.302652729749464  # Student's t, 97.5% quantile, 2 degrees of freedom (3 seeds)
T_975_DF1 = 12.706204736174694  # 1 degree of freedom (2 seeds)


def grid(changes: dict[tuple[str, str], list[list[float]]], personal: frozenset[str] = frozenset(),
         alphas: tuple[float, ...] = ALPHAS, label: float = 2.0) -> pd.DataFrame:
    """Final losses: label-based ``label`` everywhere, embedding-based label · (1 + change/100), per task × algorithm,
    seed (outer list) and α (inner list, in ``alphas`` order). ``label`` 100 keeps integer changes exact."""
    rows = []
    for (task, algorithm), per_seed in changes.items():
        for seed, per_alpha in enumerate(per_seed):
            assert len(per_alpha) == len(alphas)
            for alpha, change in zip(alphas, per_alpha):
                model = "personal" if algorithm in personal else "global"
                rows.append({"task": task, "grouping": "label_based", "alpha": alpha, "algorithm": algorithm,
                             "seed": seed, "loss": label, "model": model})
                rows.append({"task": task, "grouping": "embedding_based", "alpha": alpha, "algorithm": algorithm,
                             "seed": seed, "loss": label + label * change / 100, "model": model})
    return pd.DataFrame(rows)


EDGES = [[30, 20, 10], [34, 22, 10], [26, 18, 10]]  # seed means 20, 22, 18; slopes -10, -12, -8 (pp per decade)
KEYPOINTS = [[1, 1, 1], [-1, -1, -1], [0.5, 0.5, 0.5]]  # means 1, -1, 0.5: the interval holds 0; slopes all 0
NORMALS = [[-5, -5, -5], [-6, -6, -6], [-4, -4, -4]]  # means -5, -6, -4: decided below 0


@pytest.fixture
def answer() -> pd.DataFrame:
    results = grid({("edge_texture", "fedavg"): EDGES, ("keypoints2d", "fedavg"): KEYPOINTS,
                    ("normal", "fedavg"): NORMALS, ("normal", "fedrep"): EDGES, ("class_scene", "fedavg"): NORMALS},
                   personal=frozenset({"fedrep"}))
    return paper_table(results, pd.DataFrame()).set_index(["task", "algorithm"])


def test_the_change_is_the_mean_over_seeds_of_each_seeds_mean_over_alpha_with_a_t_interval(answer):
    row = answer.loc[("edge_texture", "fedavg")]
    half = T_975_DF2 * 2.0 / math.sqrt(3)  # standard deviation of (20, 22, 18) is 2
    assert row.change_percent == pytest.approx(20.0)
    assert (row.change_low, row.change_high) == (pytest.approx(20 - half), pytest.approx(20 + half))
    assert row.n_seeds == 3 and row.n_alphas == 3


def test_the_trend_is_each_seeds_slope_against_log10_alpha_tested_over_seeds(answer):
    row = answer.loc[("edge_texture", "fedavg")]
    half = T_975_DF2 * 2.0 / math.sqrt(3)  # slopes (-10, -12, -8): mean -10, standard deviation 2
    assert row.trend_pp_per_decade == pytest.approx(-10.0)
    assert (row.trend_low, row.trend_high) == (pytest.approx(-10 - half), pytest.approx(-10 + half))
    assert row.trend == GROWS
    assert answer.loc[("keypoints2d", "fedavg")].trend.startswith("undecided (zero variance")


def test_the_verdict_rules_and_the_paper_column(answer):
    edges, keypoints, normals = (answer.loc[(task, "fedavg")] for task in ("edge_texture", "keypoints2d", "normal"))
    # +20% [15.0%, 25.0%], decided, against the paper's 60%: the direction holds, the size does not.
    assert edges.paper_change == "up to ≈ +60% (FedAvg)" and edges.verdict == SMALLER
    assert edges.reason == "decided above 0; the interval ends below the paper's +60%"
    # means 1, -1, 0.5: +0.17% [-2.42%, +2.75%] holds 0 and ends below the paper's 5%.
    assert keypoints.paper_change == "≈ +5% (FedAvg)" and keypoints.verdict == NO_EFFECT
    assert keypoints.reason == "the 95% interval contains 0 and ends below the paper's +5%"
    assert normals.paper_change.startswith("larger (no number") and normals.verdict == OPPOSITE
    assert normals.reason == "decided below 0: label-based partitions give the larger loss"
    # Decided above 0 where the paper gives no size: its direction is all there is to be consistent with.
    fedrep = answer.loc[("normal", "fedrep")]
    assert (fedrep.verdict, fedrep.reason) == (CONSISTENT, "decided above 0; the paper gives no size for this task")


def test_personal_models_and_controls_are_counted_apart(answer):
    table = answer.reset_index()
    assert answer.loc[("normal", "fedrep")].model == "personal"
    assert answer.loc[("class_scene", "fedavg")].role.startswith("control")
    # p-values 0.0033 (edges, normal·fedrep), 0.013 (normal, class_scene), 0.96 (keypoints): all decided rows stay
    # decided after Benjamini–Hochberg over the 5 rows (the largest adjusted of them: 0.013 · 5/4 = 0.016).
    assert list(table.decided_after_bh) == [True, True, False, True, True]  # class_scene, edges, keypoints, normal×2
    assert list(table.verdict_after_bh) == list(table.verdict)
    assert headline_counts(table, "global") == {
        "rows": 3, "bh_over": 5,
        "verdict": {CONSISTENT: 0, SMALLER: 1, NO_EFFECT: 1, UNDECIDED: 0, OPPOSITE: 1},
        "verdict_after_bh": {CONSISTENT: 0, SMALLER: 1, NO_EFFECT: 1, UNDECIDED: 0, OPPOSITE: 1}}
    assert headline_counts(table, "personal")["verdict"] == {CONSISTENT: 1, SMALLER: 0, NO_EFFECT: 0, UNDECIDED: 0,
                                                             OPPOSITE: 0}
    assert headline_sentence(table) == (
        "Does an embedding-based partition give a larger federated loss than a label-based one at equal α "
        "(arXiv 2503.14553)? Global models, 3 rows: 0 consistent with the paper, 1 smaller than the paper's, "
        "1 no effect of the paper's size, 0 undecided, 1 opposite; after Benjamini–Hochberg over the table's 5 rows: "
        "0, 1, 1, 0, 1. Clients' own models (FedRep), 1 row: 1 consistent with the paper, 0 smaller than the paper's, "
        "0 no effect of the paper's size, 0 undecided, 0 opposite; after Benjamini–Hochberg over the table's 5 rows: "
        "1, 0, 0, 0, 0. class_scene is a control and not counted.")
    assert "| normal | fedrep (own models) |" in paper_markdown(table)


def test_two_seeds_are_undecided_and_say_why():
    results = grid({("edge_texture", "fedavg"): EDGES[:2]})
    row = paper_table(results, pd.DataFrame()).iloc[0]
    assert row.verdict == UNDECIDED and row.reason == "2 paired seeds, 3 needed"


def test_the_iid_check_comes_from_the_iid_reference_table():
    results = grid({("edge_texture", "fedavg"): EDGES})
    iid_runs = pd.DataFrame([{"task": "edge_texture", "grouping": "iid", "alpha": math.inf, "algorithm": "fedavg",
                              "seed": seed, "loss": loss, "model": "global"} for seed, loss in enumerate((1.05, 1.05, 1.05))])
    iid = iid_table(pd.concat([results, iid_runs]), {"edge_texture": 1.0})
    row = paper_table(pd.concat([results, iid_runs]), iid).iloc[0]
    assert row.iid_check == "yes (+5.0%)"  # 5% above the centralized loss, every seed alike


def test_partition_distances_take_step_3bs_record_or_compute_the_cluster_space_by_hand(tmp_path):
    """A label-based partition's sidecar has no cluster space (it serves every task): its distances over the task's
    clusters are computed from its train rows. Two clients each holding one of two clusters: each mixture (1, 0)
    against the pooled (1/2, 1/2) is JS distance sqrt(0.311278) = 0.557923 and Hellinger 0.541196 by hand."""
    import json

    from pipeline.studies.main_job.meter import distance_table, partition_distances_row

    folder = tmp_path / "label_based"
    folder.mkdir()
    (folder / "assignments.json").write_text(json.dumps({"distances": {
        "label": {"mean_js_distance": 0.25, "mean_hellinger": 0.2}, "cluster": None}}))
    pd.DataFrame({"sample_id": ["a", "b", "c", "d", "e"], "client_id": [0, 0, 1, 1, 1],
                  "subset": ["train", "train", "train", "train", "test"]}).to_csv(folder / "assignments.csv", index=False)
    pd.DataFrame({"sample_id": ["a", "b", "c", "d", "e"], "cluster": [0, 0, 1, 1, 0]}).to_csv(tmp_path / "clusters.csv",
                                                                                          index=False)
    row = partition_distances_row(folder, tmp_path / "clusters.csv")  # the client-test row "e" is not counted
    assert row["label_js"] == 0.25 and row["label_hellinger"] == 0.2  # step 3b's record as written
    assert row["cluster_js"] == pytest.approx(0.557923, abs=1e-6)
    assert row["cluster_hellinger"] == pytest.approx(0.541196, abs=1e-6)
    recorded = {"label": {"mean_js_distance": 0.1, "mean_hellinger": 0.1},
                "cluster": {"mean_js_distance": 0.7, "mean_hellinger": 0.6}}
    (folder / "assignments.json").write_text(json.dumps({"distances": recorded}))
    second = partition_distances_row(folder, tmp_path / "clusters.csv")
    assert (second["cluster_js"], second["cluster_hellinger"]) == (0.7, 0.6)  # an embedding-based sidecar's own
    table = distance_table(pd.DataFrame([{"task": "t", "grouping": "label_based", "alpha": 0.1, "seed": seed, **values}
                                         for seed, values in enumerate((row, second))]))
    assert table.cluster_js.item() == pytest.approx((0.557923 + 0.7) / 2, abs=1e-6) and table.n_seeds.item() == 2
    assert table.js_gap.item() == pytest.approx((0.557923 + 0.7) / 2 - (0.25 + 0.1) / 2, abs=1e-6)


def test_the_understatement_sentence_counts_embedding_partitions_whose_labels_understate_the_clusters():
    from pipeline.studies.main_job.meter import DISTANCE_COLUMNS, understatement_sentence

    rows = [("t", 0.1, "embedding_based", 0.2, 0.2, 0.8, 0.7, 0.6), ("t", 1.0, "embedding_based", 0.5, 0.4, 0.4, 0.3, -0.1),
            ("t", 0.1, "label_based", 0.8, 0.7, 0.2, 0.2, -0.6)]  # a label-based row never counts
    table = pd.DataFrame([(*row, 3) for row in rows], columns=DISTANCE_COLUMNS)
    assert understatement_sentence(table) == (
        "Partition distances: for 1 of 2 embedding-based partitions (task × α) the label-space JS distance "
        "under-states the cluster-space one (JS gap, clusters − labels: mean +0.250, from -0.100 to +0.600); "
        "label statistics miss that skew.")


# ----- the rules at their edges -----
def one_row(changes: list[list[float]], task: str = "edge_texture", **options) -> pd.Series:
    return paper_table(grid({(task, "fedavg"): changes}, **options), pd.DataFrame()).iloc[0]


def test_one_seed_is_undecided_without_an_interval_and_its_trend_too():
    row = one_row([[30, 20, 10]])
    assert row.n_seeds == 1 and row.change_percent == pytest.approx(20.0) and math.isnan(row.change_low)
    assert (row.verdict, row.reason, row.verdict_after_bh) == (UNDECIDED, "1 paired seed, 3 needed", UNDECIDED)
    assert not row.decided_after_bh
    assert row.trend_pp_per_decade == pytest.approx(-10.0) and math.isnan(row.trend_low)
    assert row.trend == "undecided (1 paired seed, 3 needed)"
    assert math.isnan(row.detectable_percent)  # no spread from one seed: no detectable size either
    assert paper_markdown(pd.DataFrame([row])).splitlines()[-1] == (
        "| edge_texture | fedavg | up to ≈ +60% (FedAvg) | +20.0% | – | undecided (1 paired seed, 3 needed) "
        "| undecided (1 paired seed, 3 needed) | no iid runs |")


def test_two_seeds_stay_undecided_even_when_their_interval_excludes_0_and_ends_below_the_papers_size():
    row = one_row(EDGES[:2])  # means 20, 22: 21 ± 12.706 · √2 / √2 = [8.29, 33.71], above 0 and below 60
    assert (row.change_low, row.change_high) == (pytest.approx(21 - T_975_DF1), pytest.approx(21 + T_975_DF1))
    # 2 seeds measure nothing: neither "smaller than the paper's" nor "no effect of the paper's size".
    assert (row.verdict, row.reason) == (UNDECIDED, "2 paired seeds, 3 needed")
    assert row.verdict_after_bh == UNDECIDED and not row.decided_after_bh
    assert row.trend == "undecided (2 paired seeds, 3 needed)"  # slopes -10, -12


def test_a_decided_small_change_is_smaller_than_a_large_claim_never_consistent_with_it():
    """Seed means 2, 3, 4: +3% ± 4.303 · 1 / √3 = [+0.52%, +5.48%], decided above 0 (p 0.035)."""
    small = [[2, 2, 2], [3, 3, 3], [4, 4, 4]]
    edges = one_row(small)
    assert edges.change_high == pytest.approx(3 + T_975_DF2 / math.sqrt(3)) and edges.change_low > 0
    assert (edges.verdict, edges.verdict_after_bh) == (SMALLER, SMALLER)  # alone in its table, BH keeps it decided
    keypoints = one_row(small, task="keypoints2d")  # the same numbers reach the paper's +5%
    assert (keypoints.verdict, keypoints.reason) == (CONSISTENT, "decided above 0; the interval reaches the paper's +5%")
    assert one_row(small, task="normal").verdict == CONSISTENT  # no size given: the direction is the claim
    assert paper_markdown(pd.DataFrame([edges])).splitlines()[-1] == (
        "| edge_texture | fedavg | up to ≈ +60% (FedAvg) | +3.0% [+0.5%, +5.5%] | ≥ 3.3% "
        "| undecided (zero variance (every seed gives +0)) | smaller than the paper's | no iid runs |")
    # Seed means 2, 3, 4 spread with s = 1: at 3 seeds a change is detected 4 times in 5 from 3.264 s up (noncentral t).
    assert edges.detectable_percent == pytest.approx(3.2640, abs=1e-4)


def test_a_change_near_0_with_an_interval_ending_below_the_papers_size_is_no_effect_of_that_size():
    """The demo's FedAvg edges row had this shape (+0.7% [-2.5%, +3.8%] against +60%); here seed means -0.3, 0.7,
    1.7: +0.7% ± 4.303 · 1 / √3 = [-1.78%, +3.18%]."""
    near_zero = [[-0.3] * 3, [0.7] * 3, [1.7] * 3]
    edges = one_row(near_zero)
    assert edges.change_low == pytest.approx(0.7 - T_975_DF2 / math.sqrt(3))
    assert (edges.verdict, edges.reason) == (NO_EFFECT, "the 95% interval contains 0 and ends below the paper's +60%")
    assert edges.verdict_after_bh == NO_EFFECT and not edges.decided_after_bh
    normal = one_row(near_zero, task="normal")  # no size to exclude: only undecided
    assert (normal.verdict, normal.reason) == (UNDECIDED, "the 95% interval contains 0")


def test_exactly_two_alphas_give_each_seed_the_slope_through_its_two_points():
    """α 0.1 and 10 (log10 -1 and +1): a seed's slope is (change at 10 − change at 0.1) / 2 per decade."""
    half = T_975_DF2 * 2.0 / math.sqrt(3)  # slopes -10, -12, -8 (or +10, +12, +8): standard deviation 2
    falling = one_row([[30, 10], [34, 10], [26, 10]], alphas=(0.1, 10.0))
    assert falling.n_alphas == 2 and falling.change_percent == pytest.approx(20.0)  # seed means 20, 22, 18
    assert falling.trend_pp_per_decade == pytest.approx(-10.0) and falling.trend_high == pytest.approx(-10 + half)
    assert falling.trend == GROWS  # the change is larger at the smaller α
    rising = one_row([[10, 30], [10, 34], [10, 26]], alphas=(0.1, 10.0))
    assert rising.trend_pp_per_decade == pytest.approx(10.0) and rising.trend == SHRINKS
    single = one_row([[30], [34], [26]], alphas=(0.1,))
    assert single.n_alphas == 1 and single.trend == "one α: no trend" and math.isnan(single.trend_pp_per_decade)


def test_ties_every_seed_alike_are_zero_variance_never_a_decision():
    same = one_row([[20, 20, 20]] * 3)  # every seed +20 at every α: the interval would have zero width
    assert (same.verdict, same.reason) == (UNDECIDED, "zero variance (every seed gives +20)")  # not "smaller"
    assert same.verdict_after_bh == UNDECIDED
    assert same.trend == "undecided (zero variance (every seed gives +0))"  # three flat seeds: slope 0 each
    equal = one_row([[0, 0, 0]] * 3)  # label and embedding tie everywhere: not "no effect" either
    assert (equal.verdict, equal.reason) == (UNDECIDED, "zero variance (every seed gives +0)")


@pytest.fixture
def t_quantile(monkeypatch):
    """Set Student's t quantile by hand, so that an interval's bound lands exactly where a test wants it. With 4 seeds
    whose changes are (1, 1, 1, 5) + c (mean 2 + c, standard deviation 2: deviations -1, -1, -1, 3) the half-width
    is quantile · 2 / √4 = the quantile itself. (The p-values, and so Benjamini–Hochberg, keep scipy's t.)"""
    import scipy.stats

    def use(value: float) -> None:
        monkeypatch.setattr(scipy.stats.t, "ppf", lambda q, df: value)

    return use


def four_seeds(shift: float, task: str = "normal") -> pd.Series:
    """One α, label loss 100: the changes (1, 1, 1, 5) + ``shift`` are exact in floating point."""
    return one_row([[1 + shift], [1 + shift], [1 + shift], [5 + shift]], task=task, alphas=(1.0,), label=100.0)


def test_an_interval_whose_bound_is_0_contains_0(t_quantile):
    t_quantile(2.0)
    row = four_seeds(0.0)  # 2 ± 2 = [0, 4]: the closed interval holds 0
    assert (row.change_low, row.change_high) == (0.0, 4.0)
    assert (row.verdict, row.reason) == (UNDECIDED, "the 95% interval contains 0")
    below = one_row([[-1], [-1], [-1], [-5]], task="normal", alphas=(1.0,), label=100.0)  # -2 ± 2 = [-4, 0]
    assert (below.change_low, below.change_high) == (-4.0, 0.0) and below.verdict == UNDECIDED
    assert four_seeds(0.0, task="keypoints2d").verdict == NO_EFFECT  # [0, 4] measured, and ends below the paper's 5
    t_quantile(1.5)  # 2 ± 1.5 = [0.5, 3.5] and -2 ± 1.5 = [-3.5, -0.5]: just clear of 0
    assert four_seeds(0.0).verdict == CONSISTENT
    assert one_row([[-1], [-1], [-1], [-5]], task="normal", alphas=(1.0,), label=100.0).verdict == OPPOSITE


@pytest.mark.parametrize("task, quantile, shift, verdict, reason", [
    ("edge_texture", 2.0, 56.0, CONSISTENT, "decided above 0; the interval reaches the paper's +60%"),  # [56, 60]
    ("edge_texture", 2.0, 55.5, SMALLER, "decided above 0; the interval ends below the paper's +60%"),  # [55.5, 59.5]
    ("edge_texture", 2.0, 60.0, CONSISTENT, "decided above 0; the interval reaches the paper's +60%"),  # [60, 64]
    ("keypoints2d", 3.0, 0.0, UNDECIDED, "the 95% interval contains 0 and reaches the paper's +5%"),  # [-1, 5]
    ("keypoints2d", 2.5, 0.0, NO_EFFECT, "the 95% interval contains 0 and ends below the paper's +5%"),  # [-0.5, 4.5]
    ("keypoints2d", 1.5, -4.0, OPPOSITE, "decided below 0: label-based partitions give the larger loss"),  # [-3.5, -0.5]
])
def test_an_upper_end_exactly_at_the_papers_size_reaches_it(t_quantile, task, quantile, shift, verdict, reason):
    t_quantile(quantile)
    row = four_seeds(shift, task=task)
    assert (row.change_low + quantile, row.change_high - quantile) == (row.change_percent, row.change_percent)
    assert (row.verdict, row.reason) == (verdict, reason)


@pytest.mark.parametrize("changes, task, verdict, after_bh", [
    ([[2] * 3, [3] * 3, [4] * 3], "edge_texture", SMALLER, NO_EFFECT),  # [+0.52, +5.48]: excludes 60 either way
    ([[2] * 3, [3] * 3, [4] * 3], "keypoints2d", CONSISTENT, UNDECIDED),  # reaches 5: undecided once not decided
    ([[-2] * 3, [-3] * 3, [-4] * 3], "edge_texture", OPPOSITE, NO_EFFECT),  # [-5.48, -0.52] ends below 60
    ([[-2] * 3, [-3] * 3, [-4] * 3], "normal", OPPOSITE, UNDECIDED),  # no size: not decided is undecided
])
def test_a_row_decided_before_benjamini_hochberg_and_not_after_gets_its_twin_verdict(changes, task, verdict, after_bh):
    """Seed means ±(2, 3, 4): t = 3√3 on 2 degrees of freedom, p = 1 − 3√3/√29 = 0.0351 (decided). Beside the control
    class_scene's near-zero row (p 0.96), Benjamini–Hochberg over the table's 2 rows adjusts it to 2 · 0.0351 = 0.070
    > 0.05: no longer decided, though the control is never counted in the headline."""
    results = grid({(task, "fedavg"): changes, ("class_scene", "fedavg"): KEYPOINTS})
    table = paper_table(results, pd.DataFrame())
    row = table.set_index("task").loc[task]
    assert row.change_p == pytest.approx(1 - 3 * math.sqrt(3) / math.sqrt(29))
    assert (row.verdict, row.decided_after_bh, row.verdict_after_bh) == (verdict, False, after_bh)
    assert f"| {verdict}; after BH: {after_bh} |" in paper_markdown(table)
    counts = headline_counts(table, "global")
    assert (counts["rows"], counts["bh_over"]) == (1, 2)
    assert counts["verdict"][verdict] == 1 and counts["verdict_after_bh"][after_bh] == 1
    assert "after Benjamini–Hochberg over the table's 2 rows: " in headline_sentence(table)
    alone = paper_table(grid({(task, "fedavg"): changes}), pd.DataFrame()).iloc[0]  # over 1 row: p stays 0.0351
    assert (alone.decided_after_bh, alone.verdict_after_bh) == (True, verdict)


def test_tasks_that_did_not_learn_keep_their_rows_but_stay_out_of_the_counts_like_controls():
    results = grid({("edge_texture", "fedavg"): EDGES, ("keypoints2d", "fedavg"): EDGES,
                    ("keypoints2d", "fedrep"): EDGES, ("class_scene", "fedavg"): NORMALS}, personal=frozenset({"fedrep"}))
    table = paper_table(results, pd.DataFrame(), did_not_learn={"keypoints2d": "ends 60% below the centralized loss"})
    roles = table.set_index(["task", "algorithm"]).role
    assert roles[("keypoints2d", "fedavg")] == roles[("keypoints2d", "fedrep")] == (
        "did not learn: ends 60% below the centralized loss")
    assert roles[("edge_texture", "fedavg")] == "headline" and roles[("class_scene", "fedavg")].startswith("control")
    assert table.set_index(["task", "algorithm"]).verdict[("keypoints2d", "fedavg")] == CONSISTENT  # still judged
    assert headline_counts(table, "global")["rows"] == 1 and headline_counts(table, "personal")["rows"] == 0
    assert headline_sentence(table) == (
        "Does an embedding-based partition give a larger federated loss than a label-based one at equal α "
        "(arXiv 2503.14553)? Global models, 1 row: 0 consistent with the paper, 1 smaller than the paper's, "
        "0 no effect of the paper's size, 0 undecided, 0 opposite; after Benjamini–Hochberg over the table's 4 rows: "
        "0, 1, 0, 0, 0. class_scene is a control and not counted; keypoints2d did not learn and is not counted.")
    # the reason is long and the same on every row: the table marks the task, the report gives the reason once
    assert "| keypoints2d (did not learn) | fedavg |" in paper_markdown(table)
    nothing = paper_table(results, pd.DataFrame(), did_not_learn={"keypoints2d": "x", "edge_texture": "y"})
    assert headline_sentence(nothing).endswith(
        "? No task × algorithm row is counted. class_scene is a control and not counted; edge_texture and keypoints2d "
        "did not learn and are not counted.")
    control = paper_table(results, pd.DataFrame(), did_not_learn={"class_scene": "z"})  # the stronger statement wins
    assert control.set_index("task").role["class_scene"] == "did not learn: z"


@pytest.mark.parametrize("above, above_low, above_high, verdict", [
    (10.0, 9.0, 10.0, YES),  # the whole interval at most 10% above: within, its end included
    (10.0, 9.0, 10.5, MEAN_ONLY),  # the mean is, the interval's upper end is not
    (10.0, math.nan, math.nan, MEAN_ONLY),  # no interval (one seed)
    (10.5, 10.0, 10.5, NO),
    (-10.0, -10.0, -9.0, YES),  # the lower edge: 10% below is within too, the interval's end included
    (-10.0, -10.5, -9.0, MEAN_ONLY),  # the interval reaches past 10% below
    (-10.5, -11.0, -10.0, UNDER_TRAINED),  # more than 10% below: the centralized model stopped short
    (-60.3, -65.0, -55.0, UNDER_TRAINED),  # the demo's keypoints: once 'yes', now the reference's failure
])
def test_the_iid_verdict_at_ten_percent(above, above_low, above_high, verdict):
    assert converged_verdict(above, above_low, above_high) == verdict


def test_one_iid_seed_has_no_interval_so_at_most_mean_only():
    runs = pd.DataFrame([{"task": "normal", "grouping": "iid", "alpha": math.inf, "algorithm": "fedavg", "seed": 0,
                          "loss": 1.0, "model": "global"}])
    row = iid_table(runs, {"normal": 1.0}).iloc[0]
    assert row.above_centralized_percent == 0.0 and math.isnan(row.above_ci_high)
    assert row.converged == MEAN_ONLY and row.within_10_percent and row.n_seeds == 1
