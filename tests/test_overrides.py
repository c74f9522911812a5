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
from tests.scripts_in_process import run_script
from utils.cli import run_main
from utils.errors import TaskHetError

ROOT = Path(__file__).resolve().parent.parent
DEMO, TOOLBOX = ROOT / "experiments" / "demo.yaml", ROOT / "experiments" / "digits_heterogeneity.yaml"


def test_overrides_reach_the_config_with_the_types_the_file_would_give():
    config = load_experiment(DEMO, ["federated.n_rounds=7", "seeds=[0, 4]", "federated.algorithms.fedprox={mu: 0.1}",
                                    "partition.alphas=[1e-1, 2]"])
    assert config["federated"]["n_rounds"] == 7 and config["seeds"] == [0, 4]
    assert config["federated"]["algorithms"]["fedprox"] == {"mu": 0.1}
    assert config["partition"]["alphas"] == [0.1, 2]  # 1e-1 is a number (YAML 1.1 would read a string)
    assert config["overrides"] == ["federated.n_rounds=7", "seeds=[0, 4]", "federated.algorithms.fedprox={mu: 0.1}",
                                   "partition.alphas=[1e-1, 2]"]


def test_a_list_item_of_a_grid_study_is_overridden_in_place():
    config = load_experiment(TOOLBOX, ["grid[0].algorithms.fedprox={mu: [0.01, 0.1]}", "federated.evaluations=3"])
    fedprox = [variant for variant in config["grid"][0]["variants"] if variant.algorithm == "fedprox"]
    assert [dict(variant.settings) for variant in fedprox] == [{"mu": 0.01}, {"mu": 0.1}]
    assert config["federated"]["evaluations"] == 3


FEDERATED_KEYS = ("algorithms, batch_size, checkpoint_every, client_fraction, eval_every, init_from, init_lr, local_steps, "
                  "lr_schedule, momentum, n_rounds, per_task, privacy, task_init_lr, weight_decay")
PLAIN = "write a plain decimal number (10, -3, 0.1, 1e-3), true or false, or a quoted string"
N_ROUNDS = "federated.n_rounds must be an integer >= 1 <= 10000"


# Every way an override is refused, each with its whole line (demo.yaml: seeds [0, 1, 2], partition.alphas 3 items).
@pytest.mark.parametrize("overrides, message", [
    (["federated.n_round=10"], f"override 'federated.n_round=10': unknown key 'federated.n_round'; allowed under "
                               f"federated: {FEDERATED_KEYS}"),
    (["federated.n_rounds=ten"], f"{DEMO}: {N_ROUNDS}, got 'ten' (str) (set by the override 'federated.n_rounds=ten')"),
    (["federated.n_rounds=true"], f"{DEMO}: {N_ROUNDS}, got True (bool) (set by the override 'federated.n_rounds=true')"),
    (["federated.n_rounds=2.0"], f"{DEMO}: {N_ROUNDS}, got 2.0 (float) (set by the override 'federated.n_rounds=2.0')"),
    (["federated.n_rounds=1e30"], f"{DEMO}: {N_ROUNDS}, got 1e+30 (float) (set by the override "
                                  "'federated.n_rounds=1e30')"),
    (["federated.n_rounds=10001"], f"{DEMO}: {N_ROUNDS}, got 10001 (int) (set by the override "
                                   "'federated.n_rounds=10001')"),
    # an empty value is null, which a key without "or null" refuses
    (["federated.n_rounds="], f"{DEMO}: {N_ROUNDS}, got None (NoneType) (set by the override 'federated.n_rounds=')"),
    (["partition.alphas=[0.1, ²]"], f"{DEMO}: partition.alphas[1] must be a finite number > 0 and <= 1e+06, got '²' "
                                    "(str) (set by the override 'partition.alphas=[0.1, ²]')"),
    (["seeds=[0"], "override 'seeds=[0': the value is not YAML (while parsing a flow sequence)"),
    (["seeds"], "override 'seeds': expected KEY=VALUE, e.g. federated.n_rounds=10"),
    (["=3"], "override '=3': '' is not a key path (names of letters, digits and _ joined by dots, a list item as name[0])"),
    (["fed..rounds=1"], "override 'fed..rounds=1': 'fed..rounds' is not a key path (names of letters, digits and _ "
                        "joined by dots, a list item as name[0])"),
    (["federated.n_rounds=1", "federated.n_rounds=2"], "override 'federated.n_rounds=2': federated.n_rounds is "
                                                       "overridden twice"),
    (["study=fed_lt"], "override 'study=fed_lt': the study kind is the file's; write another file"),
    (["grid[7].local_steps=[1]"], "override 'grid[7].local_steps=[1]': unknown key 'grid[7].local_steps'; allowed: "
                                  "centralized, data, embeddings, federated, heterogeneity_meter, model, name, partition, "
                                  "run_plots, seeds, tasks, tensorboard, use_accelerator"),
    # list items: the last index, one past it, far past it, a negative one, an index into a number
    (["seeds[3]=7"], "override 'seeds[3]=7': seeds has 3 items in the file (indexes 0 to 2), so no item 3; set the "
                     "whole list with seeds=[...]"),
    (["partition.alphas[9999]=7"], "override 'partition.alphas[9999]=7': partition.alphas has 3 items in the file "
                                   "(indexes 0 to 2), so no item 9999; set the whole list with partition.alphas=[...]"),
    (["seeds[-1]=7"], "override 'seeds[-1]=7': 'seeds[-1]' is not a key path (names of letters, digits and _ joined "
                      "by dots, a list item as name[0])"),
    (["seeds[10000]=7"], "override 'seeds[10000]=7': 'seeds[10000]' is not a key path (names of letters, digits and _ "
                         "joined by dots, a list item as name[0])"),
    (["federated.n_rounds[0]=7"], "override 'federated.n_rounds[0]=7': federated.n_rounds is not a list in the file, "
                                  "so it has no item 0"),
    (["name.x=1"], "override 'name.x=1': name.x: not inside a mapping"),
    # YAML 1.1's other number forms and boolean words, at the top of the value and inside it
    (["federated.n_rounds=010"], f"override 'federated.n_rounds=010': 010 is ambiguous (YAML 1.1 reads it as 8); {PLAIN}"),
    (["federated.n_rounds=0x10"], f"override 'federated.n_rounds=0x10': 0x10 is ambiguous (YAML 1.1 reads it as 16); "
                                  f"{PLAIN}"),
    (["federated.n_rounds=1:30"], f"override 'federated.n_rounds=1:30': 1:30 is ambiguous (YAML 1.1 reads it as 90); "
                                  f"{PLAIN}"),
    (["federated.n_rounds=1_0"], f"override 'federated.n_rounds=1_0': 1_0 is ambiguous (YAML 1.1 reads it as 10); {PLAIN}"),
    (["federated.n_rounds=09"], "override 'federated.n_rounds=09': 09 is ambiguous (a leading zero makes some numbers "
                                f"octal in YAML 1.1); {PLAIN}"),
    (["model.freeze_encoder=yes"], f"override 'model.freeze_encoder=yes': yes is ambiguous (YAML 1.1 reads it as True); "
                                   f"{PLAIN}"),
    (["seeds=[0, 0b1]"], f"override 'seeds=[0, 0b1]': seeds[1]: 0b1 is ambiguous (YAML 1.1 reads it as 1); {PLAIN}"),
    (["federated.task_init_lr={off: 0.1}"], "override 'federated.task_init_lr={off: 0.1}': federated.task_init_lr.off: "
                                            f"off is ambiguous (YAML 1.1 reads it as False); {PLAIN}"),
])
def test_a_bad_override_is_its_one_line(overrides, message):
    with pytest.raises(TaskHetError) as refused:
        load_experiment(DEMO, overrides)
    assert str(refused.value) == message


def test_at_most_64_overrides():
    assert len(parse_overrides([f"a{index}=1" for index in range(64)])) == 64
    with pytest.raises(TaskHetError) as refused:
        parse_overrides([f"a{index}=1" for index in range(65)])
    assert str(refused.value) == "65 key=value overrides; at most 64 (write the rest into the file)"


def test_an_item_the_file_does_not_have_is_named_with_the_lists_length():
    with pytest.raises(TaskHetError) as refused:  # the toolbox file's grid is four blocks
        load_experiment(TOOLBOX, ["grid[4].local_steps=[1]"])
    assert str(refused.value) == ("override 'grid[4].local_steps=[1]': grid has 4 items in the file (indexes 0 to 3), so "
                                  "no item 4; set the whole list with grid=[...]")


def test_a_list_the_file_leaves_out_has_no_items_to_change(tmp_path):
    experiment = tmp_path / "exp.yaml"
    experiment.write_text("name: bare\n")  # seeds come from the defaults, not the file
    with pytest.raises(TaskHetError) as refused:
        load_experiment(experiment, ["seeds[0]=3"])
    assert str(refused.value) == ("override 'seeds[0]=3': seeds has 0 items in the file, so no item 0; set the whole "
                                  "list with seeds=[...]")


def test_the_last_item_of_a_list_is_changed_in_place():
    config = load_experiment(DEMO, ["seeds[2]=7", "partition.alphas[2]=3"])
    assert config["seeds"] == [0, 1, 7] and config["partition"]["alphas"] == [0.1, 0.5, 3.0]


def test_an_item_made_a_repeat_names_the_override_that_set_it():
    with pytest.raises(TaskHetError) as refused:
        load_experiment(DEMO, ["seeds[2]=1"])
    assert str(refused.value) == f"{DEMO}: seeds lists an item twice: [0, 1, 1] (set by the override 'seeds[2]=1')"


@pytest.mark.parametrize("text, value", [
    ("10", 10), ("-3", -3), ("+3", 3), ("0", 0), ("0.1", 0.1), ("1e-3", 0.001), ("1.5E+2", 150.0), (".5", 0.5),
    ("2.", 2.0), ("true", True), ("False", False), ("null", None), ("", None), ("adamw", "adamw"), ("'010'", "010"),
    ('"yes"', "yes"), ("[0, 1]", [0, 1]), ("{mu: 0.1}", {"mu": 0.1}), ("lognormal:1.0", "lognormal:1.0"),
])
def test_plain_values_read_as_written(text, value):
    assert parse_overrides([f"key={text}"])[0].value == value


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
    run_main(run_pipeline.main, [*argv, "--no-disk_check"])  # nor the disk, which the projection reads the data for
    record = json.loads((tmp_path / "results" / "over" / "config.json").read_text())
    assert record["args"]["overrides"] == ["federated.n_rounds=3", "seeds=[5]"]
    assert record["args"]["resolved"]["federated"]["n_rounds"] == 3 and record["args"]["resolved"]["seeds"] == [5]
    assert record["args"]["experiment"] == str(experiment)


def test_overrides_may_follow_a_flag_on_the_command_line(tmp_path, capsys, monkeypatch):
    experiment = tmp_path / "exp.yaml"
    experiment.write_text(yaml.safe_dump({"name": "mixed", "data": {"source": "taskonomy", "root": str(tmp_path),
                                                                      "split_csv": "split.csv"}, "tasks": ["normal"]}))
    results = tmp_path / "results"
    # a bad value after --threads is read as an override (its own line), not as an unrecognised argument
    refused = run_script("run_pipeline.py", [experiment, "--threads", "1", "federated.n_rounds=0", "--results", results],
                         capsys, monkeypatch)
    assert refused.returncode != 0 and "unrecognized" not in refused.stderr
    assert (f"error: {experiment}: federated.n_rounds must be an integer >= 1 <= 10000, got 0 (int) (set by the "
            "override 'federated.n_rounds=0')") in refused.stderr

    def checks_only(config, out_dir, command, **options):  # the steps themselves are other tests' subject
        Pipeline(config, out_dir, command, record=options["record"]).check_inputs()
        return pd.DataFrame()

    monkeypatch.setattr("pipeline.command.run_experiment", checks_only)
    monkeypatch.setattr("pipeline.runner.check_input_files", lambda config: None)  # the data is no subject here
    ran = run_script("run_pipeline.py", [experiment, "seeds=[4]", "--threads", "1", "federated.n_rounds=2", "--results",
                                         results, "federated.local_steps=3", "--no-disk_check"], capsys, monkeypatch)
    assert ran.returncode == 0, ran.stderr
    record = json.loads((results / "mixed" / "config.json").read_text())["args"]
    assert record["overrides"] == ["seeds=[4]", "federated.n_rounds=2", "federated.local_steps=3"]
    assert record["threads"] == 1 and record["resolved"]["federated"]["n_rounds"] == 2
    assert record["resolved"]["federated"]["local_steps"] == 3 and record["resolved"]["seeds"] == [4]
