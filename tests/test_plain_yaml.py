"""Experiment files read by utils/plain_yaml.py: plain decimal numbers and true/false read as written; YAML 1.1's
other number forms and boolean words (``010`` is 8, ``1:30`` is 90, ``yes`` is true) are one line naming the file,
the line and the key, never a value the writer did not mean."""

from __future__ import annotations

import pytest

from pipeline.experiment import load_experiment
from utils.errors import TaskHetError
from utils.plain_yaml import Ambiguous, check_plain, load

PLAIN = "write a plain decimal number (10, -3, 0.1, 1e-3), true or false, or a quoted string"


@pytest.mark.parametrize("text, value", [
    ("10", 10), ("-3", -3), ("+3", 3), ("0", 0), ("-0", 0), ("0.1", 0.1), ("-0.5", -0.5), ("1e-3", 0.001),
    ("1E3", 1000.0), ("1.5E+2", 150.0), (".5", 0.5), ("2.", 2.0), ("0e0", 0.0),
    ("true", True), ("True", True), ("TRUE", True), ("false", False), ("False", False), ("FALSE", False),
    ("null", None), (".inf", float("inf")), ("-.inf", float("-inf")),
    # not numbers in any YAML: strings, as before
    ("1e", "1e"), ("e3", "e3"), ("1.2.3", "1.2.3"), ("0o10", "0o10"), ("lognormal:1.0", "lognormal:1.0"),
    ("rotate:3:10", "rotate:3:10"), ("adamw", "adamw"), ("y", "y"), ("n", "n"),
    # quoted or tagged: what the quotes or the tag say
    ("'010'", "010"), ('"yes"', "yes"), ("'1:30'", "1:30"), ("!!int 010", 8), ("!!str 10", "10"),
])
def test_plain_scalars_read_as_written(text, value):
    assert load(text) == value and type(load(text)) is type(value)


@pytest.mark.parametrize("text", [
    "010", "-010", "00", "09", "007.5", "01e3", "0x10", "-0x1F", "0b101", "1:30", "-1:30", "190:20:30.15", "1_0",
    "1_000.5", "+1_0", "yes", "Yes", "YES", "no", "No", "NO", "on", "On", "ON", "off", "Off", "OFF",
])
def test_yaml_11_forms_are_kept_for_refusal(text):
    assert load(text) == Ambiguous(text, 1)


def test_a_refused_scalar_is_found_with_its_key_and_line():
    value = load("name: x\nfederated:\n  n_rounds: 10\n  per_task: {normal: {n_rounds: 0x10}}\nseeds: [0, 1_0]\n")
    assert check_plain(value) == ("federated.per_task.normal.n_rounds", Ambiguous("0x10", 4))
    assert check_plain(load("seeds: [0, 1_0]")) == ("seeds[1]", Ambiguous("1_0", 1))
    assert check_plain(load("skews:\n  on: 1\n")) == ("skews.on", Ambiguous("on", 2))
    assert check_plain(load("- [0, [1, 010]]")) == ("[0][1][1]", Ambiguous("010", 1))
    assert check_plain(load("seeds: [0, 10]\nname: '010'\n")) is None


def test_the_reason_says_what_yaml_11_reads_and_what_to_write():
    assert Ambiguous("010", 1).reason() == f"010 is ambiguous (YAML 1.1 reads it as 8); {PLAIN}"
    assert Ambiguous("1:30", 1).reason() == f"1:30 is ambiguous (YAML 1.1 reads it as 90); {PLAIN}"
    assert Ambiguous("off", 1).reason() == f"off is ambiguous (YAML 1.1 reads it as False); {PLAIN}"
    assert Ambiguous("09", 1).reason() == f"09 is ambiguous (a leading zero makes some numbers octal in YAML 1.1); {PLAIN}"


@pytest.mark.parametrize("line, shown, reason", [
    ("  n_rounds: 010", "federated.n_rounds", "010 is ambiguous (YAML 1.1 reads it as 8)"),
    ("  n_rounds: 1:30", "federated.n_rounds", "1:30 is ambiguous (YAML 1.1 reads it as 90)"),
    ("  n_rounds: 0x10", "federated.n_rounds", "0x10 is ambiguous (YAML 1.1 reads it as 16)"),
    ("  n_rounds: 1_0", "federated.n_rounds", "1_0 is ambiguous (YAML 1.1 reads it as 10)"),
    ("  init_lr: 1_0.5", "federated.init_lr", "1_0.5 is ambiguous (YAML 1.1 reads it as 10.5)"),
    ("  n_rounds: yes", "federated.n_rounds", "yes is ambiguous (YAML 1.1 reads it as True)"),
])
def test_an_experiment_file_with_a_yaml_11_form_is_one_line_naming_file_line_and_key(tmp_path, line, shown, reason):
    path = tmp_path / "exp.yaml"
    path.write_text(f"name: x\nfederated:\n{line}\n")
    with pytest.raises(TaskHetError) as refused:
        load_experiment(path)
    assert str(refused.value) == f"experiment file {path}, line 3: {shown}: {reason}; {PLAIN}"


def test_an_experiment_files_plain_numbers_reach_the_config(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("name: x\nfederated:\n  n_rounds: 10\n  init_lr: 1e-3\n  momentum: .5\n"
                    "model:\n  freeze_encoder: true\n  cache_features: True\npartition:\n  alphas: [1.5E+2, 2]\n")
    config = load_experiment(path)
    assert config["federated"]["n_rounds"] == 10 and config["federated"]["init_lr"] == 0.001
    assert config["federated"]["momentum"] == 0.5 and config["partition"]["alphas"] == [150.0, 2]
    assert config["model"]["freeze_encoder"] is True and config["model"]["cache_features"] is True


def test_a_quoted_form_is_the_string_the_key_then_checks(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("name: x\nfederated:\n  n_rounds: '010'\n")
    with pytest.raises(TaskHetError) as refused:
        load_experiment(path)
    assert str(refused.value) == f"{path}: federated.n_rounds must be an integer >= 1 <= 10000, got '010' (str)"
