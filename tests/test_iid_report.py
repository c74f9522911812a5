"""The iid reference's "within 10% of the centralized loss", above and below (pipeline/studies/main_job/iid.py), on
hand-made numbers."""

import numpy as np
import pandas as pd

from pipeline.studies.main_job.iid import (MEAN_ONLY, NO, NOT_COMPARED, UNDER_TRAINED, YES, iid_clause, iid_section,
                                          iid_table)


def _iid_runs() -> pd.DataFrame:
    losses = {"fedavg": (2.1, 2.1, 2.1), "fedprox": (2.0, 2.1, 2.2), "scaffold": (2.6, 2.8, 3.0), "fedrep": (0.5, 0.6, 0.7)}
    rows = [dict(task="normal", grouping="iid", alpha=float("inf"), algorithm=algorithm, seed=seed, loss=loss,
                 metric="mean_angle", metric_value=30.0, result_is_personal=algorithm == "fedrep")
            for algorithm, values in losses.items() for seed, loss in enumerate(values)]
    label = dict(rows[0], grouping="label_based", alpha=0.1, loss=9.0)  # not an iid run: never counted here
    return pd.DataFrame(rows + [label])


def test_within_10_percent_holds_by_the_mean_and_the_table_says_whether_the_interval_does():
    table = iid_table(_iid_runs(), {"normal": 2.0}).set_index("algorithm")
    # fedavg: 2.1 every seed: +5.0%, zero spread, so the interval is the mean: wholly within.
    assert np.isclose(table.loc["fedavg", "above_centralized_percent"], 5.0)
    assert np.isclose(table.loc["fedavg", "above_ci_high"], 5.0) and table.loc["fedavg", "converged"] == YES
    # fedprox: mean 2.1 (+5%); log-scale t interval: logs' mean 0.741181, sd 0.047660, half-width
    # t(0.975, 2)·sd/√3 = 4.302653·0.047660/1.732051 = 0.118393 -> [e^0.622788, e^0.859574] = [1.864117, 2.362153],
    # i.e. [-6.79%, +18.11%]: the mean is within 10%, the interval's upper end is not.
    row = table.loc["fedprox"]
    assert np.isclose(row.iid_loss_mean, 2.1) and np.isclose(row.above_centralized_percent, 5.0)
    assert np.isclose(row.iid_loss_ci_low, 1.864117, atol=1e-6) and np.isclose(row.iid_loss_ci_high, 2.362153, atol=1e-6)
    assert np.isclose(row.above_ci_low, -6.794136, atol=1e-5) and np.isclose(row.above_ci_high, 18.107666, atol=1e-5)
    assert row.within_10_percent and row.converged == MEAN_ONLY and row.n_seeds == 3
    # scaffold: mean 2.8 = +40%: does not hold.
    assert np.isclose(table.loc["scaffold", "above_centralized_percent"], 40.0)
    assert not table.loc["scaffold", "within_10_percent"] and table.loc["scaffold", "converged"] == NO
    # fedrep's losses are its clients' own models on their own test splits: listed, never compared.
    assert table.loc["fedrep", "converged"] == NOT_COMPARED and not table.loc["fedrep", "within_10_percent"]
    assert np.isnan(table.loc["fedrep", "above_centralized_percent"])


def test_the_report_says_where_within_10_percent_does_not_hold():
    table = iid_table(_iid_runs(), {"normal": 2.0})
    section = "\n".join(iid_section(table))
    assert "It does **not** hold for 1 of 3: normal · scaffold (+40.0%)." in section
    assert "| normal | fedprox | 2.1000 [1.8641, 2.3622] | 2.0000 | +5.0% [-6.8%, +18.1%] | mean only | 3 |" in section
    assert "| normal | scaffold |" in section and "| **no** | 3 |" in section
    assert "| normal | fedrep |" in section and "not compared" in section
    clause = iid_clause(table, "normal")
    assert "+5% to +40% off the centralized loss" in clause  # fedrep (not compared) left out of the span
    assert "NOT within 10% for scaffold (+40%)" in clause and "interval reaches past 10% for fedprox" in clause


def test_every_compared_algorithm_within_says_so():
    runs = _iid_runs()
    table = iid_table(runs[runs.algorithm.isin(["fedavg", "fedrep"])], {"normal": 2.0})
    assert "It holds for every compared task × algorithm (1)." in "\n".join(iid_section(table))
    assert "(all within 10%)" in iid_clause(table, "normal")
    assert iid_section(iid_table(runs[runs.grouping != "iid"], {"normal": 2.0})) == []


def _three_seeds(algorithm_losses: dict[str, float]) -> pd.DataFrame:
    """Each algorithm ends at the same loss in 3 seeds: zero spread, so its interval is its mean."""
    return pd.DataFrame([dict(task="normal", grouping="iid", alpha=float("inf"), algorithm=algorithm, seed=seed,
                              loss=loss) for algorithm, loss in algorithm_losses.items() for seed in range(3)])


def test_both_ten_percent_edges_hold_though_float_division_overshoots_them():
    # 1.1 / 1.0 - 1 is 0.10000000000000009 and 0.9 / 1.0 - 1 is -0.09999999999999998 in floats; both are the edge
    table = iid_table(_three_seeds({"fedavg": 1.1, "fedprox": 0.9}), {"normal": 1.0}).set_index("algorithm")
    assert table.loc["fedavg", "above_centralized_percent"] == 100.0 * (1.1 / 1.0 - 1.0) > 10.0
    assert table.loc["fedavg", "converged"] == YES and table.loc["fedavg", "within_10_percent"]
    assert table.loc["fedprox", "converged"] == YES and table.loc["fedprox", "within_10_percent"]


def test_more_than_ten_percent_below_is_an_under_trained_reference_never_a_pass():
    # 0.89 is 11% below 1.0 and 0.4 is 60% below (the demo's keypoints ended about there): the centralized model
    # stopped short; 1.11 is 11% above: the federated runs did
    table = iid_table(_three_seeds({"fedavg": 0.89, "fedprox": 0.4, "scaffold": 1.11}), {"normal": 1.0})
    rows = table.set_index("algorithm")
    assert list(rows.converged) == [UNDER_TRAINED, UNDER_TRAINED, NO]
    assert not rows.within_10_percent.any()
    assert UNDER_TRAINED == "reference under-trained"
    section = "\n".join(iid_section(table))
    assert ("It does **not** hold for 3 of 3: normal · fedavg (-11.0%), normal · fedprox (-60.0%), "
            "normal · scaffold (+11.0%). For normal the federated loss ends more than 10% *below* the centralized "
            "one: the centralized reference is under-trained") in section
    assert "| normal | fedprox | 0.4000 [0.4000, 0.4000] | 1.0000 | -60.0% [-60.0%, -60.0%] | **reference under-trained** | 3 |" in section
    clause = iid_clause(table, "normal")
    assert clause == ("; under the iid partition the federated loss is -60% to +11% off the centralized loss "
                      "(NOT within 10% for scaffold (+11%); more than 10% below it for fedavg (-11%), fedprox (-60%): "
                      "the centralized reference is under-trained)")


def test_an_interval_reaching_below_ten_percent_is_mean_only():
    # seeds 0.84, 0.92, 0.96: mean 0.906667 (-9.33%); logs' mean -0.099519, sd 0.068213, half-width
    # 4.302653·0.068213/√3 = 0.169450 -> [e^-0.268969, e^0.069931] = [0.764167, 1.072434]: only the lower end is
    # more than 10% below
    runs = _three_seeds({"fedavg": 1.0})
    runs["loss"] = [0.84, 0.92, 0.96]
    row = iid_table(runs, {"normal": 1.0}).iloc[0]
    assert np.isclose(row.above_ci_low, -23.583282, atol=1e-5) and np.isclose(row.above_ci_high, 7.243385, atol=1e-5)
    assert row.converged == MEAN_ONLY and row.within_10_percent
