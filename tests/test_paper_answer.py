"""The main job's answer to the paper (pipeline/studies/main_job/paper.py) on a hand-made grid: the paper column,
the change and its interval over seeds, the α-trend test and the verdict rules, each against numbers worked out by
hand below."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from pipeline.studies.main_job.iid import MEAN_ONLY, NO, YES, converged_verdict, iid_table
from pipeline.studies.main_job.paper import (GROWS, NOT_REPRODUCED, REPRODUCED, SHRINKS, UNDECIDED, headline_counts,
                                             headline_sentence, paper_markdown, paper_table)

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
    assert edges.paper_change == "up to ≈ +60% (FedAvg)" and edges.verdict == REPRODUCED
    assert "below the paper's up to ≈ +60%" in edges.reason  # the whole interval [15.0%, 25.0%] is under 60%
    assert keypoints.paper_change == "≈ +5% (FedAvg)" and keypoints.verdict == UNDECIDED
    assert keypoints.reason.endswith("the 95% interval contains 0")
    assert normals.paper_change.startswith("larger (no number") and normals.verdict == NOT_REPRODUCED
    assert normals.reason.endswith("label-based partitions give the larger loss")


def test_personal_models_and_controls_are_counted_apart(answer):
    table = answer.reset_index()
    assert answer.loc[("normal", "fedrep")].model == "personal"
    assert answer.loc[("class_scene", "fedavg")].role.startswith("control")
    assert headline_counts(table, "global") == {"rows": 3, REPRODUCED: 1, NOT_REPRODUCED: 1, UNDECIDED: 1}
    assert headline_counts(table, "personal") == {"rows": 1, REPRODUCED: 1, NOT_REPRODUCED: 0, UNDECIDED: 0}
    sentence = headline_sentence(table)
    assert "global models: 1 of 3 task × algorithm rows reproduced, 1 not reproduced, 1 undecided" in sentence
    assert "clients' own models (FedRep): 1 of 1" in sentence and "class_scene is a control and not counted" in sentence
    assert "| normal | fedrep (own models) |" in paper_markdown(table)


def test_two_seeds_are_undecided_and_say_why():
    results = grid({("edge_texture", "fedavg"): EDGES[:2]})
    row = paper_table(results, pd.DataFrame()).iloc[0]
    assert row.verdict == UNDECIDED and row.reason.endswith("undecided: 2 paired seeds, 3 needed")


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
    assert (row.verdict, row.reason) == (UNDECIDED, "+20.0%: undecided: 1 paired seed, 3 needed")
    assert row.trend_pp_per_decade == pytest.approx(-10.0) and math.isnan(row.trend_low)
    assert row.trend == "undecided (1 paired seed, 3 needed)"
    assert paper_markdown(pd.DataFrame([row])).splitlines()[-1] == (
        "| edge_texture | fedavg | up to ≈ +60% (FedAvg) | +20.0% | undecided (1 paired seed, 3 needed) | undecided "
        "| no iid runs |")


def test_two_seeds_show_their_interval_and_stay_undecided_even_when_it_excludes_0():
    row = one_row(EDGES[:2])  # means 20, 22: 21 ± 12.706 · √2 / √2 = [8.29, 33.71], above 0, yet 2 seeds decide nothing
    assert (row.change_low, row.change_high) == (pytest.approx(21 - T_975_DF1), pytest.approx(21 + T_975_DF1))
    assert (row.verdict, row.reason) == (UNDECIDED, "+21.0% [+8.3%, +33.7%]: undecided: 2 paired seeds, 3 needed")
    assert row.trend == "undecided (2 paired seeds, 3 needed)"  # slopes -10, -12


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
    assert (same.verdict, same.reason) == (UNDECIDED, "+20.0%: undecided: zero variance (every seed gives +20)")
    assert same.trend == "undecided (zero variance (every seed gives +0))"  # three flat seeds: slope 0 each
    equal = one_row([[0, 0, 0]] * 3)  # label and embedding tie everywhere
    assert (equal.verdict, equal.reason) == (UNDECIDED, "+0.0%: undecided: zero variance (every seed gives +0)")


@pytest.fixture
def t_quantile(monkeypatch):
    """Set Student's t quantile by hand, so that an interval's bound lands exactly where a test wants it. With 4 seeds
    whose changes are (1, 1, 1, 5) + c (mean 2 + c, standard deviation 2: deviations -1, -1, -1, 3) the half-width
    is quantile · 2 / √4 = the quantile itself."""
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
    assert (row.verdict, row.reason) == (UNDECIDED, "+2.0% [+0.0%, +4.0%]: undecided: the 95% interval contains 0")
    below = one_row([[-1], [-1], [-1], [-5]], task="normal", alphas=(1.0,), label=100.0)  # -2 ± 2 = [-4, 0]
    assert (below.change_low, below.change_high) == (-4.0, 0.0) and below.verdict == UNDECIDED
    t_quantile(1.5)  # 2 ± 1.5 = [0.5, 3.5] and -2 ± 1.5 = [-3.5, -0.5]: just clear of 0
    assert four_seeds(0.0).verdict == REPRODUCED
    assert one_row([[-1], [-1], [-1], [-5]], task="normal", alphas=(1.0,), label=100.0).verdict == NOT_REPRODUCED


@pytest.mark.parametrize("quantile, shift, relation", [
    (2.0, 1.0, "consistent with"),  # [1, 5]: the upper bound is the paper's 5
    (2.0, 5.0, "consistent with"),  # [5, 9]: the lower bound is the paper's 5
    (2.0, 3.0, "consistent with"),  # [3, 7]: straddles 5
    (1.5, 1.0, "below"),  # [1.5, 4.5]
    (1.5, 5.0, "above"),  # [5.5, 8.5]
])
def test_a_reproduced_change_is_set_beside_the_papers_size_bounds_included(t_quantile, quantile, shift, relation):
    t_quantile(quantile)
    row = four_seeds(shift, task="keypoints2d")  # the paper: ≈ +5% (FedAvg)
    assert row.verdict == REPRODUCED
    assert row.reason.endswith(f"embedding-based partitions give the larger loss; its size is {relation} the paper's "
                               "≈ +5% (FedAvg)")


@pytest.mark.parametrize("above, above_high, verdict", [
    (10.0, 10.0, YES),  # the whole interval at most 10% above: within
    (10.0, 10.5, MEAN_ONLY),  # the mean is, the interval's upper end is not
    (10.0, math.nan, MEAN_ONLY),  # no interval (one seed)
    (10.5, 10.5, NO),
    (-60.3, -55.0, YES),  # below the centralized loss counts as within: the rule is one-sided ("at most 10% above")
])
def test_the_iid_verdict_at_ten_percent(above, above_high, verdict):
    assert converged_verdict(above, above_high) == verdict


def test_one_iid_seed_has_no_interval_so_at_most_mean_only():
    runs = pd.DataFrame([{"task": "normal", "grouping": "iid", "alpha": math.inf, "algorithm": "fedavg", "seed": 0,
                          "loss": 1.0, "model": "global"}])
    row = iid_table(runs, {"normal": 1.0}).iloc[0]
    assert row.above_centralized_percent == 0.0 and math.isnan(row.above_ci_high)
    assert row.converged == MEAN_ONLY and row.within_10_percent and row.n_seeds == 1


@pytest.mark.xfail(strict=True, reason="iid.py promises 'holds when the mean is at most 10% above'; a loss of 1.1 "
                                       "against 1.0 computes as 10.000000000000009% and is judged 'no'")
def test_an_iid_loss_exactly_ten_percent_above_holds():
    runs = pd.DataFrame([{"task": "normal", "grouping": "iid", "alpha": math.inf, "algorithm": "fedavg", "seed": seed,
                          "loss": 1.1, "model": "global"} for seed in range(3)])
    assert iid_table(runs, {"normal": 1.0}).iloc[0].converged != NO
