"""Every number a user can type has a finite, documented range, checked before any work.

Property tests (hypothesis) over every parser and type function: any text (unicode digits, huge integers, NaN,
inf, signs, underscores) gives a value inside the documented range or one TaskHetError/ArgumentTypeError, never
another exception. A generic walk over every script's parser and every algorithm's settings refuses a huge value
and a non-ASCII digit for each number, and finds the range in --help. Regression tests pin the reported cases.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from network.algorithms import list_algorithms
from network.algorithms.base import get_settings_class
from network.lr_schedule import DECAY_FACTORS, make_lr_schedule
from network.settings import MAX_SETTING_FLOAT, MAX_SETTING_INT, build_settings, describe
from partitioning.allocation import SIZE_SKEW_RANGES, parse_size_skew
from partitioning.skew_record import _client_id, read_skews
from partitioning.skews import MAX_CLASSES, SHIFT_LIMITS, SkewContext, parse_pairs
from partitioning.temporal import (MAX_PHASES, MAX_ROUNDS, MAX_SCHEDULE_CELLS, TemporalSpec, check_schedule_size,
                                   parse_temporal, schedule_rows)
from steps import assign, explain, federated
from steps.select_scenes import BUILDING_COUNTS, buildings_argument
from steps.skew_flags import parse_limits
from utils import cli
from utils.cli import Range, run_main
from utils.errors import TaskHetError

HUGE = "1" + "0" * 30  # 10^30
UNICODE_DIGITS = ["²", "٣", "۷", "𝟗", "５", "1_000", "१"]
HOSTILE = [HUGE, "-" + HUGE, "1e400", "-1e400", "nan", "inf", "-inf", "NaN", "", " ", "0x10", "1e", ".", "--1",
           "9" * 5000, *UNICODE_DIGITS]
PROPERTY = settings(deadline=None)  # max_examples: the profile of tests/conftest.py (50; thorough: 150)

# Text a user might type for a number: anything at all, numbers of every size, and near-misses.
number_text = st.one_of(
    st.text(max_size=24),
    st.integers(min_value=-10**45, max_value=10**45).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.from_regex(r"[+-]?[0-9]{0,44}(\.[0-9]{0,5})?([eE][+-]?[0-9]{1,4})?", fullmatch=True),
    st.text(alphabet="0123456789²٣５.eE+-_ :,x", max_size=24),
    st.sampled_from(HOSTILE),
)


# ----- the shared type: utils.cli.Range -----
@PROPERTY
@given(number_text, st.sampled_from([cli.THREADS, cli.SEEDS, cli.FRACTIONS, cli.MOMENTA, cli.LEARNING_RATES,
                                     cli.floats(-1e308, 1e308), cli.ints(-5, 5), cli.floats(0.0, 1.0, True, True)]))
def test_a_range_type_gives_a_number_in_its_range_or_an_argument_type_error(text, kind):
    try:
        value = kind(text)
    except argparse.ArgumentTypeError as error:
        assert str(error).startswith(f"must be {kind.describe()}, got ")
        return
    assert type(value) is (int if kind.integer else float) and kind.contains(value)
    assert math.isfinite(value) and text.strip().isascii()


@pytest.mark.parametrize("text", ["²", "٣", "1_000", "𝟗", "1e3", "0x10", "3.0", "", "+", "9" * 41])
def test_an_integer_is_ascii_digits_only(text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"must be an integer in \[1, 1024\]"):
        cli.THREADS(text)


def test_ranges_read_as_help_shows_them_and_a_huge_int_is_named_not_printed():
    assert cli.ints(1, 10_000).describe() == "an integer in [1, 10000]"
    assert cli.floats(0.0, 1.0, low_open=True).describe() == "a number in (0, 1]"
    assert str(cli.SEEDS) == "[0, 2^63-1]"
    assert cli.THREADS(" 7 ") == 7 and cli.FRACTIONS("1") == 1.0 and isinstance(cli.FRACTIONS("1"), float)
    with pytest.raises(ValueError, match=r"got an integer of about 5000 digits$"):
        cli.ints(0, 1).check(10**4999)
    with pytest.raises(TaskHetError, match=r"^--x part must be an integer in \[0, 1\], got '2'$"):
        cli.ints(0, 1).read("2", "--x part")


# ----- the mini-languages -----
@PROPERTY
@given(st.one_of(number_text, st.tuples(st.sampled_from(["rotate", "abrupt", "spin", ""]), number_text,
                                        number_text).map(":".join),
                 st.tuples(st.just("abrupt"), number_text).map(":".join)))
def test_temporal_is_a_spec_in_range_or_one_error(text):
    try:
        spec = parse_temporal(text)
    except TaskHetError as error:
        assert str(error).startswith(f"--temporal {text!r}")
        return
    assert isinstance(spec, TemporalSpec)
    if spec.kind == "rotate":
        assert 2 <= spec.phases <= MAX_PHASES and 1 <= spec.phase_rounds <= MAX_ROUNDS
        assert 1 + (spec.phases - 1) * spec.phase_rounds <= MAX_ROUNDS
    else:
        assert spec.phases == 2 and 2 <= spec.change_round <= MAX_ROUNDS


@PROPERTY
@given(st.one_of(number_text, st.tuples(st.sampled_from(["lognormal", "powerlaw", "gauss"]), number_text).map(":".join)))
def test_size_skew_is_a_kind_and_a_parameter_in_its_range_or_one_error(text):
    try:
        parsed = parse_size_skew(text)
    except TaskHetError as error:
        assert str(error).startswith(f"--size_skew {text!r}")
        return
    kind, value = parsed
    assert SIZE_SKEW_RANGES[kind].contains(value) and math.isfinite(value)


@PROPERTY
@given(st.one_of(number_text, st.lists(st.tuples(number_text, number_text).map("-".join), min_size=1, max_size=4)
                 .map(",".join)))
def test_label_swap_is_a_count_or_pairs_in_range_or_one_error(text):
    try:
        pairs = parse_pairs(text)
    except TaskHetError as error:
        assert str(error).startswith("--label_swap")
        return
    if isinstance(pairs, int):
        assert 1 <= pairs <= MAX_CLASSES // 2
    else:
        assert all(len(pair) == 2 and all(isinstance(c, int) and 0 <= c < MAX_CLASSES for c in pair) for pair in pairs)


@PROPERTY
@given(st.lists(st.tuples(st.sampled_from([*SHIFT_LIMITS, "sharpen", ""]), number_text).map("=".join), max_size=3)
       .map(",".join))
def test_feature_shift_limits_are_finite_numbers_or_one_error(text):
    try:
        limits = parse_limits(text)
    except TaskHetError as error:
        assert str(error).startswith(f"--feature_shift {text!r}")
        return
    assert all(math.isfinite(value) for value in limits.values())


@PROPERTY
@given(st.one_of(number_text, st.tuples(st.just("exponential"), number_text).map(":".join),
                 st.tuples(st.just("step"), number_text, number_text).map(":".join)),
       st.sampled_from([1e-6, 0.01, 1e6]), st.integers(1, MAX_ROUNDS))
def test_an_lr_schedule_gives_finite_rates_at_most_the_initial_one_or_one_error(text, init_lr, n_rounds):
    try:
        schedule = make_lr_schedule(text, init_lr, n_rounds)
    except TaskHetError as error:
        assert str(error).startswith(f"--lr_schedule {text!r}")
        return
    for round_index in {1, 2, n_rounds // 2 + 1, n_rounds}:
        rate = schedule(round_index)
        assert math.isfinite(rate) and 0 <= rate <= init_lr


@PROPERTY
@given(st.one_of(st.text(max_size=12), st.integers(-10**12, 10**12).map(str), st.sampled_from(UNICODE_DIGITS)),
       st.integers(1, 10_000))
def test_a_recorded_client_key_is_ascii_digits_below_n_clients_or_one_error(key, n_clients):
    try:
        client = _client_id(key, n_clients, "skews.label_swap.clients")
    except TaskHetError as error:
        assert f"{key!r} is not a client id in 0..{n_clients - 1}" in str(error)
        return
    assert key.isascii() and key.isdigit() and 0 <= client < n_clients


@PROPERTY
@given(number_text)
def test_a_buildings_count_is_in_range_or_the_text_is_a_list_of_ids(text):
    try:
        value = buildings_argument(text)
    except argparse.ArgumentTypeError:
        assert cli.INTEGER_PATTERN.fullmatch(text.strip())  # only a count out of range is refused
        return
    assert BUILDING_COUNTS.contains(value) if isinstance(value, int) else isinstance(value, tuple)


@PROPERTY
@given(st.lists(number_text, min_size=1, max_size=5).map(",".join))
def test_the_lambdas_grid_is_numbers_in_range_or_one_error(text):
    from steps.merge import LAMBDAS, _grid

    try:
        grid = _grid(text)
    except TaskHetError as error:
        assert str(error).startswith("--lambdas")
        return
    assert grid and all(LAMBDAS.contains(value) for value in grid) and len(set(grid)) == len(grid)


# ----- every algorithm setting -----
def numeric_settings() -> list[tuple[str, str]]:
    return [(name, info.name) for name in list_algorithms() for info in describe(get_settings_class(name))
            if info.type in (int, float)]


@pytest.mark.parametrize("algorithm, name", numeric_settings())
def test_every_numeric_setting_refuses_a_huge_value_and_non_ascii_digits(algorithm, name):
    settings_class = get_settings_class(algorithm)
    for value in (HUGE, 10**30, -10**30, 1e300, "1e300", *UNICODE_DIGITS, "nan", math.inf):
        with pytest.raises(TaskHetError, match=f"^{algorithm} setting {name} must be "):
            build_settings(settings_class, {name: value}, algorithm)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(numeric_settings()), st.one_of(number_text, st.integers(-10**40, 10**40),
                                                       st.floats(allow_nan=True, allow_infinity=True)))
def test_a_setting_is_a_bounded_number_or_one_error(algorithm_and_name, value):
    algorithm, name = algorithm_and_name
    info = next(info for info in describe(get_settings_class(algorithm)) if info.name == name)
    try:
        built = build_settings(get_settings_class(algorithm), {name: value}, algorithm)
    except TaskHetError:
        return
    number = getattr(built, name)
    assert type(number) is info.type and math.isfinite(number) and abs(number) <= info.high


def test_settings_that_allocate_models_or_repeat_training_have_their_own_bound_and_show_it():
    highs = {(name, info.name): info.high for name in list_algorithms() for info in describe(get_settings_class(name))}
    assert highs[("fedem", "n_components")] == 64 and highs[("ifca", "n_cluster_models")] == 64
    assert highs[("pfedme", "inner_steps")] == 1000 and highs[("fedavg", "server_lr")] == MAX_SETTING_FLOAT
    assert highs[("cfl", "start_round")] == MAX_SETTING_INT
    assert "(default: 3; at most 64 in magnitude)" in " ".join(federated.build_parser("fedem").format_help().split())


# ----- every script's parser -----
# The flags each script needs besides the one under test (paths need not exist: parsing reads no file).
SCRIPTS = {
    "render": [], "select_scenes": [], "select_cifar": [], "select_digits": [], "explain": [], "download": [],
    "train_centralized": ["--task", "digit_class"], "search_centralized": ["--task", "digit_class", "--lrs", "0.1"],
    "embed": ["--checkpoint", "c.pt", "--manifest", "m.csv", "--data_path", "d", "--out", "o"],
    "meter": ["--checkpoint", "c.pt", "--manifest", "m.csv", "--data_path", "d", "--out", "o", "--assignments", "a.csv"],
    "assign": ["--manifest", "m.csv", "--out", "o"], "merge": ["--out", "o"],
    **{f"federated:{method}": ["--task", "class_scene", "--method", method] for method in list_algorithms()},
}


def script_parser(script: str) -> argparse.ArgumentParser:
    name, _, method = script.partition(":")
    module = importlib.import_module(f"steps.{name}")
    return module.build_parser(method) if method else module.build_parser()


def bounded_flags() -> list[tuple[str, str]]:
    found = []
    for script in SCRIPTS:
        for action in script_parser(script)._actions:
            if cli.range_note(action.type) and (script == "federated:fedavg" or not script.startswith("federated")):
                found.append((script, action.option_strings[0]))
    return found


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_no_numeric_flag_is_unbounded(script):
    parser = script_parser(script)
    unbounded = (int, float, cli.positive_int, cli.nonnegative_int, cli.positive_float, cli.nonnegative_float,
                 cli.finite_float)
    for action in parser._actions:
        assert action.type not in unbounded, f"{script} {action.option_strings}: give it a cli.Range"
        kind = action.type if isinstance(action.type, Range) else getattr(action.type, "each", None)
        defaults = action.default if isinstance(action.default, list) else [action.default]
        if isinstance(kind, Range) and action.default is not None:  # the default lies in the documented range
            assert all(kind.contains(value) for value in defaults), (script, action.option_strings)


@pytest.mark.parametrize("script, flag", bounded_flags())
def test_every_numeric_flag_refuses_a_huge_value_and_non_ascii_digits_and_shows_its_range(script, flag):
    parser = script_parser(script)
    action = next(action for action in parser._actions if flag in action.option_strings)
    for text in HOSTILE:
        with pytest.raises(TaskHetError, match=f"argument {re.escape(flag)}"):
            parser.parse_args([*SCRIPTS[script], f"{flag}={text}"])
    assert cli.range_note(action.type) in " ".join(parser.format_help().split())


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(bounded_flags()), number_text)
def test_a_parsed_flag_is_in_its_range_or_one_error(script_and_flag, text):
    script, flag = script_and_flag
    parser = script_parser(script)
    action = next(action for action in parser._actions if flag in action.option_strings)
    try:
        args = parser.parse_args([*SCRIPTS[script], f"{flag}={text}"])
    except TaskHetError as error:
        assert "\n" not in str(error)
        return
    kind = action.type if isinstance(action.type, Range) else action.type.each
    values = getattr(args, action.dest)
    assert all(kind.contains(value) for value in (values if isinstance(values, list) else [values]))


def test_run_pipeline_bounds_jobs_and_threads():
    import run_pipeline

    assert run_pipeline.parse_args(["x.yaml", "--jobs", "256", "--threads", "1024"]).jobs == 256
    for flag, value in (("--jobs", "257"), ("--jobs", "٣"), ("--threads", "1025"), ("--threads", HUGE)):
        with pytest.raises(TaskHetError, match=f"argument {flag}: must be an integer in"):
            run_pipeline.parse_args(["x.yaml", flag, value])


# ----- the reported cases, end to end: one error line, exit code 2, no folder -----
def error_line(capsys, main, argv) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_main(main, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("temporal, expected", [
    ("rotate:2:10000000000000000000", r"ROUNDS_PER_PHASE must be an integer in \[1, 10000\]"),
    ("rotate:200000000:1", r"PHASES must be an integer in \[2, 1000\]"),
    ("rotate:1000:10000", "the last phase would start at round 9990001"),
    ("abrupt:٣", r"ROUND .* must be an integer in \[2, 10000\]"),
])
def test_step3b_refuses_a_temporal_spec_out_of_range_before_any_folder(tmp_path, capsys, temporal, expected):
    out = tmp_path / "out"
    line = error_line(capsys, assign.main, ["--manifest", str(tmp_path / "none.csv"), "--out", str(out),
                                            "--temporal", temporal])
    assert f"--temporal {temporal!r}" in line and re.search(expected, line), line
    assert not out.exists()


@pytest.mark.parametrize("flags, expected", [
    (("--label_swap", "²"), "--label_swap '²': expected K"),
    (("--label_swap", "1-²"), r"--label_swap '1-²': class id must be an integer in \[0, 99999\]"),
    (("--label_swap", "0-0"), "swaps class 0 onto itself"),
    (("--feature_shift", "blur=99"), r"--feature_shift blur must be a finite number in \[0, 10\], got 99.0"),
    (("--feature_noise", "nan"), r"argument --feature_noise: must be a number in \[0, 10\], got 'nan'"),
    (("--target_variant", "normal:depth_zbuffer"), "--target_variant: task 'normal' has no target variant"),
    (("--concept_fraction", "1.5"), r"argument --concept_fraction: must be a number in \[0, 1\]"),
    (("--size_skew", "lognormal:1e300"), r"--size_skew 'lognormal:1e300': expected lognormal:NUMBER with NUMBER a number "
                                         r"in \[0, 10\]"),
    (("--n_clients", "10001"), r"argument --n_clients: must be an integer in \[1, 10000\]"),
    (("--temporal", "rotate:1000:10", "--n_clients", "10000"), "cells"),
    (("--temporal", "abrupt:5", "--n_rounds", "3"), "after --n_rounds 3"),
])
def test_step3b_refuses_bad_flags_before_any_folder(tmp_path, capsys, flags, expected):
    out = tmp_path / "out"
    line = error_line(capsys, assign.main, ["--manifest", str(tmp_path / "none.csv"), "--out", str(out), *flags])
    assert re.search(expected, line), line
    assert not out.exists()


def test_a_recorded_client_key_of_unicode_digits_is_one_error_naming_the_key(tmp_path):
    sidecar = tmp_path / "assignments.json"
    meta = {"n_clients": 4, "skews": {"feature_noise": {"settings": {"sigma": 0.1}, "clients": {
        "²": {"sigma": 0.1, "seed": 1}}}}}
    sidecar.write_text(json.dumps(meta))
    with pytest.raises(TaskHetError, match=r"skews\.feature_noise\.clients\.²: '²' is not a client id in 0\.\.3$"):
        read_skews(sidecar, meta, SkewContext("digits", 10, ("digit_class",), 4))


def test_test_fed_refuses_a_huge_thread_count_before_any_folder_or_lock(tmp_path, capsys):
    out = tmp_path / "run"
    line = error_line(capsys, federated.main, ["--task", "class_scene", "--assignments", str(tmp_path / "a.csv"),
                                               "--out", str(out), "--threads", "100000000"])
    assert line == ("error: argument --threads: must be an integer in [1, 1024], got '100000000' "
                    "(see test_fed.py --help)")
    assert not out.exists()  # no folder, so no LOCK without INCOMPLETE


@pytest.mark.parametrize("flags, expected", [
    (("--scales", "1e200"), r"argument --scales: must be a number in \(0, 1e\+06\], got '1e200'"),
    (("--rounds", "100000000000"), r"argument --rounds: must be an integer in \[1, 10000\], got '100000000000'"),
    (("--etas", "1e-300"), r"argument --etas: must be a number in \[1e-06, 1\]"),
    (("--local_steps", "1000", "--rounds", "1000"), "client steps; at most 20,000,000"),
    (("--etas", *[f"0.0{i}" for i in range(1, 10)], *[f"0.1{i}" for i in range(10)]), "lists 19 values; at most 16"),
])
def test_the_explainer_refuses_values_that_would_make_inf_or_never_end(tmp_path, capsys, flags, expected):
    out = tmp_path / "explain"
    line = error_line(capsys, explain.main, ["--out", str(out), *flags])
    assert re.search(expected, line), line
    assert not out.exists()


def test_the_explainer_results_are_finite_at_the_edges_of_its_ranges():
    import numpy as np

    from network.quadratic_explainer import MAX_SCALE, iid_control, worked_example

    for scale in (1e-300, MAX_SCALE):
        for federation in (worked_example(scale), iid_control(worked_example(scale))):
            row, distances = explain.explain_case(federation, "case", scale, 1000, 1e-6, 3)
            assert np.isfinite(distances).all() and all(np.isfinite(v) for v in row.values() if isinstance(v, float))
    with pytest.raises(TaskHetError, match=r"scale must be in \(0, 1e\+06\]"):
        worked_example(1e200)


# ----- check_arguments: what the pipeline calls, and what main calls first -----
def test_step3b_check_arguments_reads_no_file_and_fills_the_test_fraction(tmp_path):
    args = assign.check_arguments(["--manifest", str(tmp_path / "none.csv"), "--out", str(tmp_path / "out"),
                                   "--temporal", "rotate:3:5", "--n_rounds", "30", "--label_swap", "1-7,2-3",
                                   "--size_skew", "powerlaw:1.5"])
    assert args.client_test_fraction == 0.2 and args.n_rounds == 30
    assert not (tmp_path / "out").exists()


def test_step4_check_arguments_checks_settings_schedule_and_the_number_of_clients():
    base = ["--task", "class_scene", "--assignments", "a.csv"]
    with pytest.raises(TaskHetError, match=r"^fedem setting n_components must be at most 64 in magnitude, got '100000000'$"):
        federated.check_arguments([*base, "--method", "fedem", "--n_components", "100000000"])
    with pytest.raises(TaskHetError, match="^fedem setting n_components must be a int, got '1e8'$"):
        federated.check_arguments([*base, "--method", "fedem", "--n_components", "1e8"])
    with pytest.raises(TaskHetError, match=r"--lr_schedule 'step:0:0.5': EVERY must be an integer in \[1, 10000\]"):
        federated.check_arguments([*base, "--lr_schedule", "step:0:0.5"])
    capped = [*base, "--weighting", "capped", "--cap", "0.05"]
    assert federated.check_arguments(capped).cap == "0.05"  # N unknown: the cap cannot be checked yet
    with pytest.raises(TaskHetError, match=r"setting cap must be >= 1/N = 0.1 for N = 10 clients"):
        federated.check_arguments(capped, n_clients=10)
    with pytest.raises(TaskHetError, match=r"setting cap must be >= 1/N = 0.05 for N = 20 clients"):
        federated.check_arguments([*capped[:-1], "0.04", "--n_clients", "20"])  # the flag gives N too
    with pytest.raises(TaskHetError, match="n_cluster_models must be <= the number of clients \\(3\\)"):
        federated.check_arguments([*base, "--method", "ifca", "--n_cluster_models", "5"], n_clients=3)
    assert federated.check_arguments(["--list_methods"]).list_methods


@pytest.mark.parametrize("module, argv", [(assign, ["--manifest", "m.csv", "--out", "o"]),
                                          (federated, ["--task", "class_scene", "--assignments", "a.csv"])])
def test_main_calls_check_arguments_first(monkeypatch, module, argv):
    def refuse(argv, **kwargs):
        raise TaskHetError("checked first")

    monkeypatch.setattr(module, "check_arguments", refuse)
    with pytest.raises(TaskHetError, match="^checked first$"):
        module.main(argv)


def test_a_schedule_too_large_for_memory_is_refused_before_it_is_built(monkeypatch):
    import numpy as np

    check_schedule_size(TemporalSpec("rotate", 4, phase_rounds=5), 1000, 100)
    with pytest.raises(TaskHetError, match=f"at most {MAX_SCHEDULE_CELLS:,}"):
        check_schedule_size(TemporalSpec("rotate", 100, phase_rounds=1), 10_000, 10_000)
    monkeypatch.setattr("partitioning.temporal.MAX_SCHEDULED_ROWS", 100)
    with pytest.raises(TaskHetError, match="would list 150 rows"):  # 30 rows, each in 5 windows of its phase
        schedule_rows(np.zeros(30, dtype=np.int64), TemporalSpec("rotate", 2, phase_rounds=1), 10)


def test_world_size_is_ascii_digits_in_range(monkeypatch):
    for value, expected in (("1", 1), ("4", 4)):
        monkeypatch.setenv("WORLD_SIZE", value)
        assert cli.world_size() == expected
    for value in ("²", "0", HUGE):
        monkeypatch.setenv("WORLD_SIZE", value)
        with pytest.raises(TaskHetError, match=r"WORLD_SIZE must be an integer in \[1, 4096\]"):
            cli.world_size()


def test_the_flower_wait_seconds_are_bounded():
    pytest.importorskip("flwr")
    from network.flower.app import wait_seconds

    assert wait_seconds({}, "node-wait-s", 600.0) == 600.0 and wait_seconds({"k": "12.5"}, "k", 0.0) == 12.5
    for value in ("nan", math.inf, -1, "٣", True, 10**30):
        with pytest.raises(TaskHetError, match=r"^the Flower run config's k must be a number in \[0, 604800\]"):
            wait_seconds({"k": value}, "k", 0.0)


def test_decay_factors_keep_a_rate_from_growing():
    assert DECAY_FACTORS.contains(1.0) and not DECAY_FACTORS.contains(1.0000001) and not DECAY_FACTORS.contains(0.0)


@pytest.mark.parametrize("field, value, expected", [
    ("n_rounds", 10**9, r"--n_rounds must be an integer in \[1, 10000\], got 1000000000"),
    ("threads", 100_000_000, r"--threads must be an integer in \[1, 1024\]"),
    ("client_fraction", 1.5, r"--client_fraction must be a number in \(0, 1\], got 1.5"),
    ("lr_schedule", "exponential:2", r"--lr_schedule 'exponential:2': RATE must be a number in \(0, 1\]"),
])
def test_a_deployment_run_config_edited_out_of_range_is_refused_by_the_flower_app(field, value, expected):
    pytest.importorskip("flwr")
    from flwr.app import Context, RecordDict

    from network.flower import app, protocol
    from network.run_config import RunConfig

    record = json.loads(RunConfig(task="class_scene", assignments="a.csv").to_json())
    assert app.run_config(Context(run_id=1, node_id=0, state=RecordDict(), node_config={},
                                  run_config={protocol.RUN_CONFIG: json.dumps(record)})).n_rounds == 100
    record[field] = value
    context = Context(run_id=1, node_id=0, state=RecordDict(), node_config={},
                      run_config={protocol.RUN_CONFIG: json.dumps(record)})
    with pytest.raises(TaskHetError, match=f"^{expected}"):
        app.run_config(context)


@pytest.mark.parametrize("alpha", ["../../x", 1e300, -1, 0, True, "0.5"])
def test_a_sidecar_alpha_out_of_range_is_refused_since_it_names_step4s_folder(tmp_path, alpha):
    from partitioning.assignments import read_meta

    (tmp_path / "assignments.json").write_text(json.dumps({"alpha": alpha, "n_clients": 3}))
    with pytest.raises(TaskHetError, match=r"assignments.json: alpha must be a number in \(0, 1e\+06\], got .* \(or null\)$"):
        read_meta(tmp_path / "assignments.csv")
    (tmp_path / "assignments.json").write_text(json.dumps({"alpha": 0.5, "n_clients": 3}))
    assert read_meta(tmp_path / "assignments.csv")["alpha"] == 0.5
