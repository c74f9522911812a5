"""``class_based``, the original code's name for label-based partitions, is accepted and read as ``label_based``."""

from __future__ import annotations

import pytest
import yaml

from network.run_inputs import default_assignments
from steps.federated import build_parser, parse_run_config
from partitioning.groupings import GROUPINGS, LABEL_BASED, canonical_grouping
from pipeline.experiment import load_experiment
from utils.errors import TaskHetError


@pytest.mark.parametrize("given, expected", [("class_based", LABEL_BASED), *((name, name) for name in GROUPINGS),
                                             ("clas_based", "clas_based"), (3, 3)])
def test_canonical_grouping_replaces_only_the_alias(given, expected):
    assert canonical_grouping(given) == expected


def test_test_fed_type_accepts_class_based_as_label_based():
    parser = build_parser()
    assert parser.parse_args(["--task", "normal", "--type", "class_based"]).type == LABEL_BASED
    assert parser.parse_args(["--task", "normal", "--type", "label_based"]).type == LABEL_BASED
    with pytest.raises(TaskHetError, match="--type: invalid choice: 'clas_based'"):  # one error: line via run_main
        parser.parse_args(["--task", "normal", "--type", "clas_based"])


def test_test_fed_default_assignments_path_uses_label_based(tmp_path):
    config = parse_run_config(["--task", "normal", "--type", "class_based", "--alpha", "0.5",
                               "--assignment_files_path", str(tmp_path)])
    assert default_assignments(config) == tmp_path / "label_based" / "labels" / "a0.5" / "assignments.csv"


def test_test_fed_default_assignments_path_of_an_embedding_partition_and_without_type_or_alpha(tmp_path):
    config = parse_run_config(["--task", "normal", "--type", "embedding_based", "--alpha", "0.1", "--n_clusters", "7",
                               "--assignment_files_path", str(tmp_path)])
    assert default_assignments(config) == tmp_path / "embedding_based" / "normal" / "k7" / "a0.1" / "assignments.csv"
    for flags in (["--type", "label_based"], ["--alpha", "0.5"]):  # neither --assignments nor both of --type, --alpha
        with pytest.raises(TaskHetError) as refused:  # refused with the other argument checks, before any file
            parse_run_config(["--task", "normal", *flags, "--assignment_files_path", str(tmp_path)])
        assert str(refused.value) == ("pass --assignments FILE, or --type and --alpha to find it under "
                                      "--assignment_files_path")


def test_experiment_file_groupings_are_normalised(tmp_path):
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump({"partition": {"groupings": ["class_based", "embedding_based"]}}))
    assert load_experiment(path)["partition"]["groupings"] == [LABEL_BASED, "embedding_based"]
    path.write_text(yaml.safe_dump({"partition": {"groupings": ["clas_based"]}}))
    with pytest.raises(TaskHetError, match="clas_based"):
        load_experiment(path)


@pytest.mark.parametrize("algorithms, message", [
    ({"fedprox": {"muu": 0.1}}, r"federated.algorithms.fedprox: fedprox has no setting muu; its settings: .*mu"),
    ({"fedavg": {"mu": 0.1}}, r"federated.algorithms.fedavg: fedavg has no setting mu"),
    ({"ditto": {"lam": "abc"}}, r"federated.algorithms.ditto: ditto setting lam must be a float"),
    ({"scaffold": {"option": "III"}}, r"federated.algorithms.scaffold: scaffold setting option must be one of I, II"),
    (["fedavg", "fedprox"], r"federated.algorithms must map algorithm names to their settings"),
])
def test_experiment_algorithm_settings_are_checked_before_any_work(tmp_path, algorithms, message):
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump({"federated": {"algorithms": algorithms}}))
    with pytest.raises(TaskHetError, match=message):
        load_experiment(path)


def test_an_experiment_needs_both_groupings(tmp_path):
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump({"partition": {"groupings": ["label_based"]}}))
    with pytest.raises(TaskHetError, match="partition.groupings must list both label_based and embedding_based"):
        load_experiment(path)
