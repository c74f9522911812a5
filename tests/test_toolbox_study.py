"""The heterogeneity study file (experiments/digits_heterogeneity.yaml): its situations as step-3b options, the
class-group situation's groups file and partition, and bad keys or values stopping with one error line before
any work."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pandas as pd
import pytest
import yaml

import run_pipeline
from network.client import UNSEEN_SPLIT_OF
from pipeline.experiment import load_experiment
from pipeline.runner import Pipeline
from pipeline.studies.grid.runner import GridStudy
from pipeline.studies.grid.runs import Partition, study_runs
from steps import select_digits
from utils.cli import run_main
from utils.errors import TaskHetError

ROOT = Path(__file__).resolve().parent.parent
STUDY_FILE = ROOT / "experiments" / "digits_heterogeneity.yaml"
SITUATIONS = ["mild_label_skew", "moderate_label_skew", "severe_label_skew", "feature_skew", "concept_shift",
              "quantity_skew", "temporal_skew", "distinct_groups", "compound", "unequal_work"]
# The standard non-IID baselines, each in the situations it is meant for (the study file's later blocks).
GLOBAL_REMEDIES = {"feddyn", "fednova", "moon", "feddecorr", "fedlc"}
PERSONAL_REMEDIES = {"perfedavg", "apfl", "lgfedavg", "fedala"}
# the label-set form of distinct groups (commented in the study file, run by the tests)
LABEL_GROUPS = {"situation": "distinct_label_groups", "scheme": "nc_shards", "groups_per_client": 1,
                "class_groups": [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]]}
GROUPS = ((0, 1, 2), (3, 4, 5, 6), (7, 8, 9))


def test_study_file_is_the_documented_grid():
    config = load_experiment(STUDY_FILE)
    runs = study_runs(config)
    # 9 situations × 11 algorithms (the 12th method, fedavg+ft, is FedAvg's runs), then the baselines: 5 global remedies
    # in 4 situations, unequal work's 3 own baselines, 4 personalised ones in 3 situations; 3 seeds each
    assert len(runs) == (9 * 11 + 4 * 5 + 3 + 3 * 4) * 3
    partitions = {run.partition.label: run.partition for run in runs}
    assert list(partitions) == SITUATIONS
    by_situation = {label: {run.variant.algorithm for run in runs if run.partition.label == label} for label in SITUATIONS}
    for label in ("moderate_label_skew", "severe_label_skew", "feature_skew", "unequal_work"):
        assert GLOBAL_REMEDIES <= by_situation[label], label
    for label in ("concept_shift", "feature_skew", "distinct_groups"):
        assert PERSONAL_REMEDIES <= by_situation[label], label
    assert by_situation["unequal_work"] == GLOBAL_REMEDIES | {"fedavg", "fedprox", "scaffold"}
    assert partitions["unequal_work"].work == (("straggler_fraction", 0.5), ("straggler_share", 0.25))
    assert partitions["quantity_skew"] == Partition("iid", (("size_skew", "lognormal:1.0"),), "quantity_skew")
    assert dict(partitions["compound"].params) == {"alpha": 0.5, "size_skew": "lognormal:1.0", "feature_noise": 0.3,
                                                   "temporal": "rotate:3:10", "n_rounds": 30}
    # distinct groups differ in concept (issue 22): half the clients see every digit pair swapped
    assert dict(partitions["distinct_groups"].params) == {"label_swap": "0-1,2-3,4-5,6-7,8-9", "concept_fraction": 0.5}
    assert dict(partitions["temporal_skew"].params)["n_rounds"] == config["federated"]["rounds_x_local_steps"] // 4
    assert config["practitioners_table"] == {"mild": "mild_label_skew", "moderate": "moderate_label_skew",
                                             "groups": "distinct_groups", "personal": "concept_shift",
                                             "transfer": "feature_skew", "severe": "severe_label_skew",
                                             "unequal": "unequal_work"}
    assert config["heterogeneity_meter"] and config["federated"]["finetune_steps"] > 0
    assert config["federated"]["client_test_fraction"] > 0  # personalised accuracy needs client test rows


def test_a_situation_with_stragglers_gives_every_run_its_unequal_work_and_its_own_folder(tmp_path):
    from pipeline.studies.grid.params import federated_params

    config = yaml.safe_load(STUDY_FILE.read_text())
    config["grid"] = config["grid"][:1]
    config["grid"][0]["partitions"] = [{"situation": "mild_label_skew", "scheme": "dirichlet_mixture", "alpha": 10.0},
                                       {"scheme": "dirichlet_mixture", "alpha": 10.0, "straggler_fraction": 0.5,
                                        "straggler_share": 0.25}]
    config["practitioners_table"] = {"mild": "mild_label_skew"}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    loaded = load_experiment(path)
    runs = study_runs(loaded)
    plain, stragglers = runs[0].partition, runs[-1].partition
    assert plain.work == () and stragglers.work == (("straggler_fraction", 0.5), ("straggler_share", 0.25))
    assert stragglers.label == "dirichlet_mixture-a10.0-straggler_fraction0.5-straggler_share0.25"
    params = federated_params(loaded, runs[-1], "data", "m.csv", "a.csv", "best.pt")
    assert (params["straggler_fraction"], params["straggler_share"]) == (0.5, 0.25)
    assert "straggler_fraction" not in federated_params(loaded, runs[0], "data", "m.csv", "a.csv", "best.pt")


def test_distinct_groups_clients_each_hold_one_class_group(tmp_path):
    manifest = select_digits.main(["--n_samples", "300", "--out", str(tmp_path / "step1"), "--no-progress"])
    config = load_experiment(STUDY_FILE)
    config["federated"]["client_test_fraction"] = 0.0
    study = GridStudy(Pipeline(config, tmp_path / "study", "test", show_progress=False))
    partition = Partition("nc_shards", (("groups_per_client", 1),), "distinct_groups", GROUPS)
    groups = pd.read_csv(study.class_groups_file(partition, manifest))
    labels = pd.read_csv(manifest).set_index("sample_id")["label"]
    group_of = {label: index for index, group in enumerate(GROUPS) for label in group}
    assert len(groups) == len(labels)  # every row, test and validation too
    assert (groups["cluster"].to_numpy() == labels[groups["sample_id"]].map(group_of).to_numpy()).all()
    assignments = pd.read_csv(study.assignments(partition, 0, manifest, study.class_groups_file(partition, manifest))
                              / "assignments.csv")
    client_groups = (assignments.assign(group=labels[assignments["sample_id"]].map(group_of).to_numpy())
                     .groupby("client_id")["group"].unique())
    assert all(len(held) == 1 for held in client_groups)  # each client: one group's classes only
    assert sorted(held[0] for held in client_groups) == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]  # 3-4 clients a group


def situation(config: dict, name: str) -> dict:
    return next(entry for entry in config["grid"][0]["partitions"] if entry["situation"] == name)


@pytest.mark.parametrize("change, message", [
    (lambda c: situation(c, "distinct_label_groups").update(class_groups=[[0, 1, 2], [3, 4, 5, 6], [7, 8]]),
     "grid[0].partitions[9].class_groups: every class 0..9 must be in exactly one group; classes [9] are in no group"),
    (lambda c: situation(c, "distinct_label_groups").update(class_groups=[[0, 1, 2, 3], [3, 4, 5, 6], [7, 8, 9]]),
     "grid[0].partitions[9].class_groups: every class 0..9 must be in exactly one group; class 3 is in two groups"),
    (lambda c: situation(c, "distinct_label_groups").update(class_groups=[[0, 1, 2], [3, 4, 5, 6], [7, 8, 10]]),
     "grid[0].partitions[9].class_groups[2][2] must be an integer >= 0 <= 9"),
    (lambda c: situation(c, "distinct_label_groups").update(class_groups=[list(range(10))]),
     "grid[0].partitions[9].class_groups must list at least 2 item(s)"),
    (lambda c: situation(c, "distinct_label_groups").update(groups_per_client=4),
     "grid[0].partitions[9].groups_per_client 4 exceeds the 3 class groups"),
    (lambda c: situation(c, "quantity_skew").update(size_skew="lognormal:x"),
     ": grid[0].partitions[5].size_skew 'lognormal:x': expected lognormal:NUMBER"),
    (lambda c: situation(c, "severe_label_skew").update(size_skew="lognormal:1.0"),
     "grid[0].partitions[2]: nc_shards: client sizes are equal by construction"),
    (lambda c: situation(c, "mild_label_skew").update(colour_skew=0.1),
     "grid[0].partitions[0].colour_skew: not a step-3b option a study may set"),
    (lambda c: situation(c, "mild_label_skew").update(n_clients=5),
     "grid[0].partitions[0].n_clients: not a step-3b option a study may set"),
    (lambda c: situation(c, "mild_label_skew").update(seed=3), "grid[0].partitions[0].seed: not a step-3b option"),
    # Unequal local work: step 4's options in a situation, checked as its flags are.
    (lambda c: situation(c, "mild_label_skew").update(straggler_fraction=1.5),
     "grid[0].partitions[0].straggler_fraction must be a finite number >= 0 and <= 1"),
    (lambda c: situation(c, "mild_label_skew").update(straggler_share=0),
     "grid[0].partitions[0].straggler_share must be a finite number > 0 and <= 1"),
    (lambda c: situation(c, "mild_label_skew").update(local_steps_range="5:2"),
     "grid[0].partitions[0]: --local_steps_range must be LOW:HIGH with 1 <= LOW <= HIGH, got 5:2"),
    (lambda c: situation(c, "mild_label_skew").update(local_steps_range="1:2", straggler_fraction=0.5),
     "grid[0].partitions[0]: pass one of --straggler_fraction and --local_steps_range"),
    # Unseen clients and private weightings: step 3b's and the algorithm's own checks, named by the YAML key.
    (lambda c: situation(c, "mild_label_skew").update(unseen_fraction=1.5), "grid[0].partitions[0].unseen_fraction"),
    (lambda c: situation(c, "mild_label_skew").update(unseen_fraction=".nan"), "grid[0].partitions[0].unseen_fraction"),
    (lambda c: situation(c, "mild_label_skew").update(unseen_fraction=0.01),
     "grid[0].partitions[0].unseen_fraction"),  # round(0.01 · 10) = 0 clients held out
    (lambda c: c["grid"][0]["algorithms"].update(fedavg={"weighting": ["samples", "hidden"]}),
     "grid[0].algorithms.fedavg.weighting"),
    (lambda c: c["grid"][0]["algorithms"].update(fedavg={"weighting": "noisy", "noise_scale": 0}),
     "grid[0].algorithms.fedavg"),
    (lambda c: c["grid"][0]["algorithms"].update(fedavg={"weighting": ["noisy", "noisy"]}),
     "grid[0].algorithms.fedavg.weighting lists the value 'noisy' twice"),
    (lambda c: situation(c, "quantity_skew").update(alpha=1.0), "grid[0].partitions[5].alpha: scheme iid does not take it"),
    (lambda c: situation(c, "mild_label_skew").update(alpha=-1), "grid[0].partitions[0].alpha must be a finite number > 0"),
    (lambda c: situation(c, "mild_label_skew").update(situation="mild skew"),
     "grid[0].partitions[0].situation must be a plain name"),
    (lambda c: situation(c, "moderate_label_skew").update(situation="mild_label_skew"),
     "grid[0].partitions[1] is named 'mild_label_skew' like another, different partition"),
    (lambda c: c["practitioners_table"].update(severe_skew="severe_label_skew"),
     "practitioners_table.severe_skew: not a row of the practitioners' table"),
    (lambda c: c["practitioners_table"].update(personal="no_such_situation"),
     "practitioners_table.personal: 'no_such_situation' is not a situation of the grid"),
    (lambda c: c.update(study="fed_lt"), "unknown key 'practitioners_table'; allowed here:"),
    (lambda c: c.update(heterogeneity_meter="yes"), "heterogeneity_meter must be true or false"),
    (lambda c: c["grid"][0]["algorithms"].update(ifca={"n_cluster_models": 11}), "grid[0].algorithms.ifca"),
])
def test_bad_study_file_stops_with_one_error_line_before_any_work(tmp_path, capsys, change, message):
    config = yaml.safe_load(STUDY_FILE.read_text())
    config["grid"] = config["grid"][:1]  # a changed situation must not clash with its twin in a later block
    config["practitioners_table"].pop("unequal")
    config["grid"][0]["partitions"].append(dict(LABEL_GROUPS))  # partitions[9]
    change(config)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    with pytest.raises(SystemExit) as exit_info:
        run_main(run_pipeline.main, [str(path), "--results", str(tmp_path / "results")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1
    assert lines[0].startswith(f"error: {path}: ") and message in lines[0]
    assert not (tmp_path / "results").exists()  # nothing was started


def test_a_step3b_option_is_a_study_option_without_study_code(tmp_path, monkeypatch):
    """A flag step 3b gains (here a stand-in flag, --feature_blur) is accepted, converted by the
    flag's own type and handed to step 3b; its bad values stop with the key named."""
    from pipeline.argv import flags
    from steps import assign

    original = assign.build_parser

    def parser_with_a_new_flag():
        parser = original()
        parser.add_argument("--feature_blur", type=float, default=None)
        parser.add_argument("--feature_form", choices=("noise", "shift"), default="noise")
        return parser

    monkeypatch.setattr(assign, "build_parser", parser_with_a_new_flag)
    config = yaml.safe_load(STUDY_FILE.read_text())
    situation(config, "quantity_skew").update(feature_blur="0.3", feature_form="shift")
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    partition = load_experiment(path)["grid"][0]["partitions"][5]
    assert dict(partition.params) == {"feature_form": "shift", "feature_blur": 0.3, "size_skew": "lognormal:1.0"}
    assert flags(dict(partition.params)) == ["--feature_blur", "0.3", "--feature_form", "shift",
                                             "--size_skew", "lognormal:1.0"]
    situation(config, "quantity_skew").update(feature_blur="x")
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    with pytest.raises(TaskHetError, match=re.escape("grid[0].partitions[5].feature_blur: could not convert string "
                                                     "to float: 'x'")):
        load_experiment(path)
    situation(config, "quantity_skew").update(feature_blur=0.3, feature_form="blur")
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    with pytest.raises(TaskHetError, match=re.escape("grid[0].partitions[5].feature_form must be one of noise, shift")):
        load_experiment(path)


@pytest.mark.slow
def test_tiny_heterogeneity_study_end_to_end(tmp_path, capsys):
    """The study file at a tiny size: step 3c runs per situation and seed (in the worker pool, beside the federated
    runs), the class-group file feeds step 3b, and the report holds every method (fedavg+ft included), G² and the
    table check."""
    config = yaml.safe_load(STUDY_FILE.read_text())
    config.update(name="tiny", seeds=[0], practitioners_table={"groups": "distinct_groups", "mild": "mild_label_skew"})
    config["grid"] = config["grid"][:1]  # the first block's algorithms only
    config["data"]["n_samples"] = 150
    config["model"]["image_size"] = 8
    config["centralized"]["n_epochs"] = 1
    config["federated"].update(rounds_x_local_steps=2, evaluations=1, finetune_steps=1)
    config["grid"][0].update(local_steps=[1], algorithms={"fedavg": {"weighting": ["samples", "noisy"]},
                                                          "ifca": {"n_cluster_models": 3}})
    config["grid"][0]["partitions"] = [dict(situation(config, "mild_label_skew"), unseen_fraction=0.2),
                                       dict(LABEL_GROUPS, situation="distinct_groups")]
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    run_pipeline.main([str(path), "--results", str(tmp_path / "results"), "--threads", "1", "--no-progress",
                       "--jobs", "2", "--no-run_plots"])
    assert re.search(r"step 3c: 2 readings; step 4: \d+ runs, 2 at a time in worker processes", capsys.readouterr().out)
    out = tmp_path / "results" / "tiny"
    report = pd.read_csv(out / "report.csv")
    assert list(zip(report.situation, report.method)) == [
        (name, method) for name in ("mild_label_skew", "distinct_groups")
        for method in ("fedavg-weightingsamples", "fedavg-weightingsamples+ft", "fedavg-weightingnoisy",
                       "fedavg-weightingnoisy+ft", "ifca-n_cluster_models3")]
    # Unseen clients (2 of 10 held out in mild_label_skew only): each method's unseen column is its run's unseen twin
    # of the split it is scored on, and empty where no client was held out.
    runs = pd.read_csv(out / "runs.csv")
    for _, row in runs.iterrows():
        (metrics_csv,) = out.glob(f"federated/{row.situation}/J1/{row.method.removesuffix('+ft')}/s0-*/metrics.csv")
        metrics = pd.read_csv(metrics_csv, dtype={"client": str})
        unseen = metrics[(metrics.split == UNSEEN_SPLIT_OF[row.split]) & (metrics.client == "mean")
                         & (metrics.metric == "top1")]
        if row.situation == "mild_label_skew":
            assert row.unseen == pytest.approx(unseen[unseen["round"] == unseen["round"].max()].value.iloc[0])
        else:
            assert unseen.empty and math.isnan(row.unseen)
    text = (out / "report.md").read_text()
    assert "| method | global | personalised | worst 10% | unseen clients | seeds |" in text
    # Private weighting: the noisy variant against its samples twin, per situation and for fedavg+ft too (one seed:
    # a difference without an interval).
    weightings = pd.read_csv(out / "weightings.csv")
    assert list(zip(weightings.situation, weightings.method, weightings.against)) == [
        (name, "fedavg-weightingnoisy" + suffix, "fedavg-weightingsamples" + suffix)
        for name in ("mild_label_skew", "distinct_groups") for suffix in ("", "+ft")]
    by_method = runs.set_index(["situation", "method"])
    first = weightings.iloc[0]
    assert first.personal_mean == pytest.approx(by_method.personal[("mild_label_skew", "fedavg-weightingnoisy")]
                                                - by_method.personal[("mild_label_skew", "fedavg-weightingsamples")])
    assert first.personal_verdict == "undecided: 1 paired seed, 3 needed"
    assert "## Private weightings against samples" in text
    situations = pd.read_csv(out / "situations.csv")
    meters = {path.parent.name.rsplit("-s0-", 1)[0]: json.loads(path.read_text())["g2"]
              for path in out.glob("heterogeneity/*/meter.json")}
    assert dict(zip(situations.situation, situations.g2_mean)) == pytest.approx(meters) and len(meters) == 2
    check = pd.read_csv(out / "table_check.csv", keep_default_na=False).set_index("row")
    assert check.situation["groups"] == "distinct_groups" and check.outcome["transfer"] == "not measured"
    assert "## distinct_groups" in (out / "report.md").read_text()
    groups_file = next(out.glob("groups/distinct_groups-*/groups.csv"))
    assert json.loads(next(out.glob("assignments/distinct_groups-s0-*/assignments.json")).read_text())["groups"] == \
        str(groups_file)


def test_the_skew_situations_of_the_file_are_step3b_options_converted_by_their_flags():
    """Feature skew, concept shift and temporal skew reach step 3b as its flags read them (--feature_noise,
    --label_swap (a string: a count or pairs), --concept_fraction, --temporal, --n_rounds)."""
    partitions = {partition.label: dict(partition.params)
                  for partition in load_experiment(STUDY_FILE)["grid"][0]["partitions"]}
    assert partitions["feature_skew"] == {"feature_noise": 0.3}
    assert partitions["concept_shift"] == {"label_swap": "2", "concept_fraction": 1.0}
    assert partitions["temporal_skew"] == {"alpha": 0.5, "temporal": "rotate:3:10", "n_rounds": 30}


def test_private_weightings_pair_with_their_samples_twin_and_differences_are_paired_by_seed():
    """A bucketed or noisy variant pairs with the variant of the same settings weighted by samples, named or by
    default (settings that only matter to private weightings ignored); one without a twin is left out. The difference
    is private − samples over the seeds both have, with its t interval."""
    from pipeline.studies.grid.runs import Variant
    from pipeline.studies.heterogeneity_toolbox import weighting_pairs, weighting_table

    variants = [Variant("fedavg", ()), Variant("fedavg", (("buckets", "5,50"), ("weighting", "bucketed"))),
                Variant("fedprox", (("mu", 0.1), ("weighting", "samples"))), Variant("fedprox", (("mu", 0.1), ("weighting", "noisy"))),
                Variant("fedprox", (("mu", 0.5), ("weighting", "noisy"))),  # no samples twin at mu 0.5
                Variant("scaffold", (("weighting", "uniform"),))]
    pairs = weighting_pairs({"grid": [{"variants": variants}]})
    assert pairs == [("fedavg-buckets5,50-weightingbucketed", "fedavg"),
                     ("fedprox-mu0.1-weightingnoisy", "fedprox-mu0.1-weightingsamples")]
    personal = {("fedavg", 0): 0.80, ("fedavg", 1): 0.70, ("fedavg", 2): 0.90, ("fedavg", 3): 0.5,
                ("fedavg-buckets5,50-weightingbucketed", 0): 0.78, ("fedavg-buckets5,50-weightingbucketed", 1): 0.69,
                ("fedavg-buckets5,50-weightingbucketed", 2): 0.87}
    runs = pd.DataFrame([{"situation": "s", "method": method, "seed": seed, "global": math.nan, "personal": value,
                          "worst10": math.nan, "unseen": math.nan} for (method, seed), value in personal.items()])
    (row,) = weighting_table(runs, pairs).to_dict("records")
    # Differences -0.02, -0.01, -0.03 (seed 3 has no bucketed run: left out): mean -0.02, s = 0.01.
    half_width = 4.302652729911275 * 0.01 / math.sqrt(3)  # t(0.975, 2) · s / √n, s = 0.01
    assert (row["method"], row["against"]) == ("fedavg-buckets5,50-weightingbucketed", "fedavg")
    assert row["personal_mean"] == pytest.approx(-0.02)
    assert (row["personal_low"], row["personal_high"]) == pytest.approx((-0.02 - half_width, -0.02 + half_width))
    assert row["personal_verdict"] == "undecided: the 95% interval contains 0"
    assert math.isnan(row["global_mean"]) and row["global_verdict"] == "no paired seed"
