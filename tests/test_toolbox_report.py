"""The heterogeneity study's report (pipeline/studies/heterogeneity_toolbox.py) on hand-made metrics: which splits it reads, the
winner and its paired intervals against FedAvg, the practitioners'-table verdicts and their undecided cases."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from pipeline.studies.grid.runs import Partition, StudyRun, Variant
from pipeline.studies.heterogeneity_toolbox import TABLE, Row, run_rows, table_check, table_verdict, winner, write_report

T_975_2 = 4.302652729911275  # Student's t, 97.5% quantile, 2 degrees of freedom (3 paired seeds)


def runs_frame(values: dict[str, list[float]], column: str = "personal", situation: str = "s",
               algorithms: dict[str, str] | None = None) -> pd.DataFrame:
    """One situation's runs: method -> its value per seed (seeds 0, 1, ...); the algorithm is the method's name
    unless ``algorithms`` says otherwise."""
    rows = []
    for method, per_seed in values.items():
        algorithm = (algorithms or {}).get(method, method)
        for seed, value in enumerate(per_seed):
            rows.append({"situation": situation, "method": method, "algorithm": algorithm, "seed": seed,
                         "global": math.nan, "personal": math.nan, "worst10": math.nan, column: value})
    return pd.DataFrame(rows)


def test_winner_has_the_hand_computed_paired_interval_against_fedavg():
    runs = runs_frame({"fedavg": [0.80, 0.82, 0.84], "fedprox": [0.85, 0.86, 0.90], "local": [0.50, 0.60, 0.70]})
    found = winner(runs, "personal")
    # fedprox − fedavg per seed: 0.05, 0.04, 0.06: mean 0.05, sd 0.01, half-width t·0.01/√3.
    half = T_975_2 * 0.01 / math.sqrt(3)
    assert found.method == "fedprox" and found.mean == pytest.approx(0.87)
    assert found.vs_baseline.mean == pytest.approx(0.05)
    assert (found.vs_baseline.low, found.vs_baseline.high) == pytest.approx((0.05 - half, 0.05 + half))
    assert found.vs_baseline.decided and found.vs_baseline.sign == 1
    assert found.runner_up == "fedavg" and found.vs_runner_up == found.vs_baseline


def test_winner_is_undecided_with_two_seeds_zero_variance_or_an_interval_holding_zero():
    two_seeds = winner(runs_frame({"fedavg": [0.80, 0.82], "ditto": [0.90, 0.95]}), "personal")
    assert two_seeds.method == "ditto" and not two_seeds.vs_baseline.decided
    assert two_seeds.vs_baseline.explain() == "undecided: 2 paired seeds, 3 needed"
    constant = winner(runs_frame({"fedavg": [0.80, 0.70, 0.60], "ditto": [0.85, 0.75, 0.65]}), "personal")
    assert constant.vs_baseline.explain().startswith("undecided: zero variance")
    noisy = winner(runs_frame({"fedavg": [0.80, 0.70, 0.60], "ditto": [0.90, 0.65, 0.62]}), "personal")
    # differences +0.10, −0.05, +0.02: mean 0.0233, the interval holds 0.
    assert noisy.method == "ditto" and noisy.vs_baseline.explain() == "undecided: the 95% interval contains 0"


def test_winner_may_be_fedavg_itself_and_ignores_missing_values():
    runs = runs_frame({"fedavg": [0.9, 0.9, 0.95], "fedprox": [0.5, 0.6, 0.7], "fedem": [math.nan] * 3})
    found = winner(runs, "personal")
    assert found.method == "fedavg" and found.vs_baseline is None and found.runner_up == "fedprox"
    assert winner(runs_frame({"fedem": [math.nan] * 3}), "personal") is None


ROW = Row("severe skew", ("fedem",), "personal")


@pytest.mark.parametrize("values, outcome, detail", [
    # the recommended method has the best mean
    ({"fedavg": [0.5, 0.6, 0.7], "fedem": [0.8, 0.8, 0.9]}, "agrees", "fedem has the best mean 83.3%"),
    # not the best, but not decidedly below it: the best − it differences +0.1, −0.1, +0.05 hold 0
    ({"local": [0.9, 0.7, 0.85], "fedem": [0.8, 0.8, 0.8]}, "agrees", "not decidedly below the best, local 81.7%"),
    # decidedly below the best: differences 0.10, 0.12, 0.11
    ({"local": [0.90, 0.92, 0.91], "fedem": [0.80, 0.80, 0.80]}, "disagrees", "local 91.0% is decidedly better"),
    # two seeds: no verdict either way
    ({"local": [0.90, 0.92], "fedem": [0.80, 0.80]}, "undecided", "undecided: 2 paired seeds, 3 needed"),
    # every seed the same difference: zero variance, no verdict
    ({"local": [0.90, 0.85, 0.95], "fedem": [0.80, 0.75, 0.85]}, "undecided", "undecided: zero variance"),
    # the recommended method did not run
    ({"local": [0.9, 0.9, 0.9], "fedavg": [0.8, 0.8, 0.8]}, "not measured", "none of fedem ran"),
])
def test_table_verdicts(values, outcome, detail):
    verdict = table_verdict(runs_frame(values), ROW)
    assert verdict.outcome == outcome and detail in verdict.detail


def test_table_verdict_matches_variants_and_local_fine_tuning_by_algorithm():
    runs = runs_frame({"fedavg": [0.5, 0.5, 0.6], "fedavg+ft": [0.70, 0.71, 0.69], "pfedme-inner_steps3": [0.6, 0.6, 0.6]},
                      algorithms={"pfedme-inner_steps3": "pfedme"})
    verdict = table_verdict(runs, TABLE["personal"])  # pFedMe or fine-tuning
    assert verdict.outcome == "agrees" and verdict.detail.startswith("fedavg+ft has the best mean")
    verdict = table_verdict(runs, Row("x", ("pfedme",), "personal"))
    assert verdict.outcome == "disagrees" and "pfedme-inner_steps3 60.0%" in verdict.detail


def test_table_check_lists_every_row_and_the_unmapped_ones_as_not_measured():
    runs = pd.concat([runs_frame({"fedavg": [0.9, 0.91, 0.92], "fedprox": [0.8, 0.8, 0.81]}, "global", "mild"),
                      runs_frame({"fedavg": [0.5, 0.5, 0.6], "fedem": [0.7, 0.72, 0.71]}, "personal", "severe")])
    check = table_check(runs, {"mild": "mild", "moderate": "mild", "severe": "severe", "groups": "absent"})
    assert list(check.row) == list(TABLE)
    outcomes = dict(zip(check.row, check.outcome))
    assert outcomes == {"mild": "agrees", "moderate": "disagrees", "groups": "not measured", "personal": "not measured",
                        "transfer": "not measured", "severe": "agrees", "unequal": "not measured"}
    # fedavg − fedprox per seed: 0.10, 0.11, 0.11: decided, so the moderate row (FedProx or SCAFFOLD) disagrees.
    assert "fedavg 91.0% is decidedly better: fedprox 80.3%" in check.set_index("row").detail["moderate"]


def write_metrics(run_dir: Path, splits: dict[str, dict[str, float]], global_top1: float, rounds: int = 30) -> None:
    """A finished metrics.csv: an early round that must be ignored, then the final round's rows."""
    run_dir.mkdir(parents=True)
    rows = [(10, "test", "global", "top1", 0.11)]
    rows += [(rounds, "test", "global", "top1", global_top1), (rounds, "test", "global", "loss", 0.3)]
    for split, values in splits.items():
        rows += [(rounds, split, client, "top1", value) for client, value in values.items()]
    pd.DataFrame(rows, columns=["round", "split", "client", "metric", "value"]).to_csv(run_dir / "metrics.csv", index=False)


def run(algorithm: str, seed: int, situation: str = "mild_label_skew") -> StudyRun:
    return StudyRun(Partition("dirichlet_mixture", (("alpha", 10.0),), situation), 4, Variant(algorithm, ()), seed)


def test_run_rows_read_the_personal_split_and_fedavg_fine_tuned(tmp_path):
    write_metrics(tmp_path / "ditto", {"client_test": {"mean": 0.5, "worst_decile": 0.1},
                                       "client_test_personal": {"0": 0.9, "mean": 0.8, "worst_decile": 0.6}}, 0.7)
    (row,) = run_rows(run("ditto", 0), tmp_path / "ditto")
    assert (row["global"], row["personal"], row["worst10"], row["split"]) == (0.7, 0.8, 0.6, "client_test_personal")
    write_metrics(tmp_path / "fedavg", {"client_test": {"mean": 0.5, "worst_decile": 0.2},
                                        "client_test_finetuned": {"mean": 0.75, "worst_decile": 0.4}}, 0.72)
    plain, tuned = run_rows(run("fedavg", 1), tmp_path / "fedavg")
    assert (plain["method"], plain["personal"], plain["worst10"]) == ("fedavg", 0.5, 0.2)
    assert (tuned["method"], tuned["algorithm"], tuned["global"], tuned["personal"], tuned["worst10"]) == (
        "fedavg+ft", "fedavg+ft", 0.72, 0.75, 0.4)
    assert plain["situation"] == tuned["situation"] == "mild_label_skew" and tuned["seed"] == 1


def test_a_method_personalised_by_fine_tuning_reads_its_fine_tuned_split_and_only_that(tmp_path):
    splits = {"client_test": {"mean": 0.5, "worst_decile": 0.2}, "client_test_finetuned": {"mean": 0.8, "worst_decile": 0.3}}
    write_metrics(tmp_path / "perfedavg", splits, 0.6)
    (row,) = run_rows(run("perfedavg", 0), tmp_path / "perfedavg")  # Per-FedAvg: one row, no "+ft" twin
    assert (row["method"], row["split"], row["personal"], row["worst10"]) == ("perfedavg", "client_test_finetuned", 0.8, 0.3)
    write_metrics(tmp_path / "fedprox", splits, 0.6)
    (row,) = run_rows(run("fedprox", 0), tmp_path / "fedprox")  # a global-model method stays on the global model
    assert (row["split"], row["personal"]) == ("client_test", 0.5)


def test_write_report_on_hand_made_runs(tmp_path):
    run_dirs, meters = {}, {}
    partition = run("fedavg", 0).partition
    personal = {"fedavg": [0.60, 0.62, 0.64], "fedem": [0.70, 0.73, 0.74]}
    for algorithm, values in personal.items():
        for seed, value in enumerate(values):
            run_dir = tmp_path / "runs" / f"{algorithm}{seed}"
            write_metrics(run_dir, {"client_test_personal" if algorithm == "fedem" else "client_test":
                                    {"mean": value, "worst_decile": value - 0.3}}, 0.5 + seed / 100)
            run_dirs[run(algorithm, seed)] = run_dir
    for seed, g2 in enumerate([2.0, 4.0, 8.0]):
        meter_dir = tmp_path / "meter" / str(seed)
        meter_dir.mkdir(parents=True)
        (meter_dir / "meter.json").write_text(json.dumps({"g2": g2, "b2": 1.5}))
        meters[(partition, seed)] = meter_dir
    config = {"name": "toy", "data": {"source": "digits"}, "task": "digit_class",
              "model": {"encoder": "small_cnn", "image_size": 16}, "seeds": [0, 1, 2],
              "federated": {"n_clients": 10, "client_fraction": 0.5, "rounds_x_local_steps": 120,
                            "client_test_fraction": 0.2, "finetune_steps": 0},
              "grid": [{"partitions": [partition], "variants": list(dict.fromkeys(run.variant for run in run_dirs))}],
              "practitioners_table": {"severe": "mild_label_skew"}}
    out = tmp_path / "out"
    out.mkdir()
    table = write_report(config, out, run_dirs, {}, "cmd", meters)
    # No private weighting in the grid, no unseen client in the runs: an empty weightings.csv, no such section or column.
    assert pd.read_csv(out / "weightings.csv").empty
    assert "Private weightings" not in (out / "report.md").read_text()
    assert "unseen clients" not in (out / "report.md").read_text() and table.unseen_mean.isna().all()
    assert list(table.method) == ["fedavg", "fedem"]
    fedem = table.set_index("method").loc["fedem"]
    assert fedem.personal_mean == pytest.approx((0.70 + 0.73 + 0.74) / 3)
    assert fedem.worst10_mean == pytest.approx((0.40 + 0.43 + 0.44) / 3)
    situations = pd.read_csv(out / "situations.csv").iloc[0]
    assert situations.g2_mean == pytest.approx(14 / 3) and situations.b2_mean == pytest.approx(1.5)
    # fedem − fedavg: 0.10, 0.11, 0.10 per seed
    assert situations.personal_winner == "fedem" and situations.personal_vs_fedavg == "better than fedavg"
    assert situations.personal_vs_fedavg_mean == pytest.approx(0.31 / 3)
    assert situations.global_winner == "fedavg" and situations.global_vs_fedavg == "fedavg itself"
    check = pd.read_csv(out / "table_check.csv", keep_default_na=False).set_index("row")
    assert check.outcome["severe"] == "agrees" and check.outcome["mild"] == "not measured"
    text = (out / "report.md").read_text()
    assert "1 rows agree, 0 disagree, 0 undecided, 6 not measured" in text
    assert "| fedem | 51.0 [" in text and "personalised accuracy: **fedem** (72.3%)" in text


def test_a_situations_options_name_its_unequal_local_work():
    from pipeline.studies.heterogeneity_toolbox import situation_options

    work = Partition("dirichlet_mixture", (("alpha", 0.5),), "unequal_work", None,
                     (("straggler_fraction", 0.5), ("straggler_share", 0.25)))
    options = situation_options({"grid": [{"partitions": [work]}]})
    assert options == {"unequal_work": "scheme dirichlet_mixture; alpha 0.5; step 4's straggler_fraction 0.5; "
                                       "step 4's straggler_share 0.25"}
