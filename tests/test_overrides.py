"""``key=value`` overrides of an experiment file (pipeline/overrides.py): applied before the file's own checks, so a
bad value meets the same one-line errors as in the file; unknown keys, malformed texts and repeated keys are one
line naming the override; what ran is recorded in the experiment folder's config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import run_pipeline
from pipeline.experiment import load_experiment
from pipeline.overrides import Override, parse_overrides
from pipeline.runner import Pipeline
from utils.cli import run_main
from utils.errors import TaskHetError

ROOT = Path(__file__).resolve().parent.parent
DEMO, TOOLBOX = ROOT / "experiments" / "demo.yaml", ROOT / "experiments" / "digits_heterogeneity.yaml"


def test_overrides_reach_the_config_with_the_types_the_file_would_give():
    config = load_experiment(DEMO, ["federated.n_rounds=7", "seeds=[0, 4]", "federated.algorithms.fedprox={mu: 0.1}",
                                    "partition.alphas=[1e-1, 2]"])
    assert config["federated"]["n_rounds"] == 7 and config["seeds"] == [0, 4]
    assert config["federated"]["algorithms"]["fedprox"] == {"mu": 0.1}
    assert config["partition"]["alphas"] == [0.1, 2]  # YAML 1.1 reads 1e-1 as a string; the key's type reads a number
    assert config["overrides"] == ["federated.n_rounds=7", "seeds=[0, 4]", "federated.algorithms.fedprox={mu: 0.1}",
                                   "partition.alphas=[1e-1, 2]"]


def test_a_list_item_of_a_grid_study_is_overridden_in_place():
    config = load_experiment(TOOLBOX, ["grid[0].algorithms.fedprox={mu: [0.01, 0.1]}", "federated.evaluations=3"])
    fedprox = [variant for variant in config["grid"][0]["variants"] if variant.algorithm == "fedprox"]
    assert [dict(variant.settings) for variant in fedprox] == [{"mu": 0.01}, {"mu": 0.1}]
    assert config["federated"]["evaluations"] == 3


@pytest.mark.parametrize("overrides, message", [
    (["federated.n_round=10"], "override 'federated.n_round=10': unknown key 'federated.n_round'; allowed under "
                               "federated: algorithms, batch_size"),
    (["federated.n_rounds=ten"], "federated.n_rounds must be an integer >= 1 <= 10000, got 'ten' (str) (set by the "
                                 "override 'federated.n_rounds=ten')"),
    (["federated.n_rounds=1e30"], "federated.n_rounds must be an integer >= 1 <= 10000, got '1e30'"),
    (["partition.alphas=[0.1, ²]"], "partition.alphas[1] must be a finite number > 0 and <= 1e+06, got '²'"),
    (["seeds=[0"], "override 'seeds=[0': the value is not YAML"),
    (["seeds"], "override 'seeds': expected KEY=VALUE"),
    (["fed..rounds=1"], "override 'fed..rounds=1': 'fed..rounds' is not a key path"),
    (["federated.n_rounds=1", "federated.n_rounds=2"], "override 'federated.n_rounds=2': federated.n_rounds is "
                                                       "overridden twice"),
    (["study=fed_lt"], "override 'study=fed_lt': the study kind is the file's"),
    (["grid[7].local_steps=[1]"], None),  # the demo (a main job) has no grid key: unknown key
])
def test_a_bad_override_is_one_line_naming_it(overrides, message):
    with pytest.raises(TaskHetError) as refused:
        load_experiment(DEMO, overrides)
    text = str(refused.value)
    assert "\n" not in text
    assert message in text if message else "unknown key 'grid[7].local_steps'" in text


def test_an_item_the_file_does_not_have_is_named():
    with pytest.raises(TaskHetError, match=r"override 'grid\[9\].local_steps=\[1\]': grid\[9\].local_steps: the file has "
                                           r"no item 9 there"):
        load_experiment(TOOLBOX, ["grid[9].local_steps=[1]"])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(max_size=40), max_size=4))
def test_any_text_parses_or_is_refused_in_one_line(texts):
    try:
        parsed = parse_overrides(texts)
    except TaskHetError as error:
        assert "\n" not in str(error)
        return
    assert all(isinstance(override, Override) and override.text in texts for override in parsed)


def test_the_experiment_folder_records_the_file_and_its_overrides(tmp_path, capsys, monkeypatch):
    experiment = tmp_path / "exp.yaml"
    experiment.write_text(yaml.safe_dump({"name": "over", "data": {"source": "taskonomy", "root": str(tmp_path / "none"),
                                                                     "split_csv": "split.csv"}, "tasks": ["normal"]}))
    argv = [str(experiment), "federated.n_rounds=3", "seeds=[5]", "--results", str(tmp_path / "results")]
    with pytest.raises(SystemExit):  # no data root: refused before step 0, and no folder looks like a run
        run_main(run_pipeline.main, argv)
    assert "data.root" in capsys.readouterr().err
    assert not (tmp_path / "results" / "over").exists()

    def checks_only(config, out_dir, command, **options):  # the steps themselves are other tests' subject
        Pipeline(config, out_dir, command, record=options["record"]).check_inputs()
        return pd.DataFrame()

    monkeypatch.setattr("pipeline.command.run_experiment", checks_only)
    monkeypatch.setattr("pipeline.runner.check_input_files", lambda config: None)  # the data is no subject here
    run_main(run_pipeline.main, argv)
    record = json.loads((tmp_path / "results" / "over" / "config.json").read_text())
    assert record["args"]["overrides"] == ["federated.n_rounds=3", "seeds=[5]"]
    assert record["args"]["resolved"]["federated"]["n_rounds"] == 3 and record["args"]["resolved"]["seeds"] == [5]
    assert record["args"]["experiment"] == str(experiment)
