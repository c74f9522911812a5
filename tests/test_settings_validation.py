"""Both engines and the Flower app validate an algorithm's settings through the same ``Settings`` (issue 19, item 11)."""

from __future__ import annotations

import json
import math

import pytest

import test_fed
from network.algorithms import list_algorithms
from network.algorithms.base import get_settings_class
from network.run_config import RunConfig
from network.settings import build_settings, describe
from tests.fixtures import tiny_data_root, tiny_manifest  # noqa: F401  (session fixtures)
from tests.test_step4 import argv, assignments  # noqa: F401  (the step-4 fixture: 3 clients)
from utils.errors import TaskHetError

MESSAGE = "sparse_ft setting density must be a finite float, got 'nan'"
FLAGS = ["--task", "class_scene", "--method", "sparse_ft", "--density", "nan", "--assignments", "missing.csv",
         "--manifest", "missing_manifest.csv", "--no-progress"]


@pytest.mark.parametrize("engine", ["sequential", "flower"])
def test_test_fed_refuses_a_nan_density_on_either_engine_before_reading_any_file(engine, tmp_path):
    with pytest.raises(TaskHetError) as refused:
        test_fed.main([*FLAGS, "--engine", engine, "--out", str(tmp_path / "run")])
    assert str(refused.value) == MESSAGE  # not "manifest ... does not exist": the settings come first
    assert not (tmp_path / "run").exists()


def test_the_flower_app_refuses_it_with_the_same_message_in_every_entry():
    pytest.importorskip("flwr")
    from flwr.app import Context, RecordDict

    from network.flower import app, protocol

    with pytest.raises(TaskHetError) as printed:  # python -m network.flower.app <flags>: the run-config line
        app.main([*FLAGS, "--engine", "flower"])
    assert str(printed.value) == MESSAGE
    # a deployment's run config written by hand (or by an older version): the ServerApp and every node refuse it
    record = json.loads(RunConfig(task="class_scene", method="sparse_ft").to_json())
    record["settings"] = {"density": "nan"}
    run_config = {protocol.RUN_CONFIG: json.dumps(record)}
    server = Context(run_id=1, node_id=0, state=RecordDict(), node_config={}, run_config=run_config)
    node = Context(run_id=1, node_id=1, state=RecordDict(), node_config={"partition-ids": "0"}, run_config=run_config)
    for build in (lambda: app.build_engine(None, server), lambda: app.build_node(node)):
        with pytest.raises(TaskHetError) as refused:
            build()
        assert str(refused.value) == MESSAGE


def float_settings() -> list[tuple[str, str]]:
    return [(name, info.name) for name in list_algorithms() for info in describe(get_settings_class(name))
            if info.type is float]


@pytest.mark.parametrize("algorithm, setting", float_settings())
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", math.nan, math.inf, -math.inf])
def test_every_float_setting_of_every_algorithm_refuses_non_finite_values(algorithm, setting, value):
    expected = f"{algorithm} setting {setting} must be a finite float, got {value!r}"
    with pytest.raises(TaskHetError) as refused:
        build_settings(get_settings_class(algorithm), {setting: value}, algorithm)
    assert str(refused.value) == expected
    with pytest.raises(TaskHetError) as in_a_run:  # a run config of either engine goes through the same check
        RunConfig(task="class_scene", method=algorithm, settings={setting: value})
    assert str(in_a_run.value) == expected


def test_the_generic_test_covers_the_float_settings_of_several_algorithms():
    names = {algorithm for algorithm, _ in float_settings()}
    assert {"fedavg", "fedprox", "sparse_ft", "ifca", "ditto"} <= names


@pytest.mark.parametrize("field", ["init_lr", "momentum", "client_fraction", "calibration_fraction",
                                   "client_state_memory_mb", "flower_num_cpus"])
def test_a_deployment_run_config_with_a_non_finite_number_is_refused(field):
    record = json.loads(RunConfig(task="class_scene").to_json())
    record[field] = math.nan
    with pytest.raises(TaskHetError, match=f"--{field} must be a finite number, got nan"):
        RunConfig.from_json(json.dumps(record))


@pytest.mark.parametrize("change, message", [
    (lambda record: record.pop("task"), "the run config must be a RunConfig as JSON with a 'task'$"),
    (lambda record: record.update(n_round=3, extra=1), "with a 'task'; unknown field\\(s\\): extra, n_round$"),
])
def test_a_run_config_without_a_task_or_with_unknown_fields_is_one_error(change, message):
    record = json.loads(RunConfig(task="class_scene").to_json())
    change(record)
    with pytest.raises(TaskHetError, match=message):
        RunConfig.from_json(json.dumps(record))


def test_a_setting_with_choices_refuses_a_value_outside_them():
    import dataclasses

    from network.settings import setting

    @dataclasses.dataclass(frozen=True)
    class WithChoices:
        option: str = setting("II", "SCAFFOLD-style control variate option", choices=("I", "II"))

    assert describe(WithChoices)[0].choices == ("I", "II")
    assert build_settings(WithChoices, {"option": "I"}, "x").option == "I"
    with pytest.raises(TaskHetError, match=r"^x setting option must be one of I, II, got 'III'$"):
        build_settings(WithChoices, {"option": "III"}, "x")


def test_ifca_with_more_cluster_models_than_clients_is_one_error_at_setup(tiny_data_root, tiny_manifest,  # noqa: F811
                                                                            assignments, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(TaskHetError, match=r"^ifca setting n_cluster_models must be <= the number of clients \(3\), "
                                           r"got 64$"):
        test_fed.main(argv(tiny_data_root, tiny_manifest, assignments, out, "--method", "ifca",
                           "--n_cluster_models", "64"))  # the most a user may ask (a huge k is refused by its range)
    assert not out.exists()  # refused at setup, before the run folder and before any cluster model


def test_resolve_fills_alpha_type_and_the_default_out_from_the_sidecar_and_refuses_a_whole_calibration_split():
    from pathlib import Path

    from network.run_config import resolve

    meta = {"groups": "clusters.csv", "n_clients": 5, "alpha": 0.5}
    config = resolve(RunConfig(task="class_scene", assignments=Path("a.csv"), method="fedavg", rand_seed=3), meta)
    assert (config.type, config.alpha, config.local_steps) == ("embedding_based", 0.5, 50)
    assert config.out == Path("results/test_federated/class_scene/embedding_based/fedavg/a0.5-s3")
    with pytest.raises(TaskHetError, match=r"^--calibration_fraction must be in \[0, 1\), got 1.0$"):
        resolve(RunConfig(task="class_scene", assignments=Path("a.csv"), calibration_fraction=1.0), meta)
