"""How a run shows itself (issue 24): --progress/--threads on every step, TensorBoard, clients.csv, round lines."""

from __future__ import annotations

import importlib
import io
import json

import pandas as pd
import pytest
import torch
from hypothesis import given, strategies as st

import test_fed
from network.algorithms.base import TRAIN_LOSS
from steps import train_centralized
from tests.fixtures import tiny_data_root, tiny_manifest  # noqa: F401  (session fixtures)
from tests.test_step4 import argv as fed_argv, assignments  # noqa: F401  (a fixture)
from utils.cli import apply_runtime_flags

STEP_MODULES = ["render", "select_scenes", "select_cifar", "select_digits", "train_centralized", "search_centralized",
                "embed", "assign", "meter", "explain", "federated", "merge", "download"]


@pytest.mark.parametrize("name", STEP_MODULES)
def test_every_step_script_takes_no_progress_and_threads(name):
    parser = importlib.import_module(f"steps.{name}").build_parser()
    options = {option for action in parser._actions for option in action.option_strings}
    assert {"--progress", "--no-progress", "--threads"} <= options


def test_run_pipeline_takes_no_progress():
    import run_pipeline

    args = run_pipeline.parse_args(["x.yaml", "--no-progress", "--threads", "1"])
    assert args.progress is False and args.threads == 1


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_bars_when_stdout_is_not_a_terminal_and_threads_are_set(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr("sys.stdout", io.StringIO())
        assert apply_runtime_flags(_namespace(progress=True, threads=None)).progress is False
        monkeypatch.setattr("sys.stdout", _Terminal())
        assert apply_runtime_flags(_namespace(progress=True, threads=None)).progress is True
        assert apply_runtime_flags(_namespace(progress=False, threads=1)).progress is False
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def _namespace(**values):
    import argparse

    return argparse.Namespace(**values)


def _scalars(log_dir) -> dict[tuple[str, int], float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {(tag, event.step): event.value for tag in events.Tags()["scalars"] for event in events.Scalars(tag)}


def test_step2_tensorboard_has_metrics_csv_scalars_and_threads_are_recorded(tiny_data_root, tiny_manifest,  # noqa: F811
                                                                           tmp_path):
    before = torch.get_num_threads()
    out = tmp_path / "step2"
    try:
        train_centralized.main(["--task", "normal", "--encoder", "small_cnn", "--weights", "none",
                                           "--data_path", str(tiny_data_root), "--manifest", str(tiny_manifest),
                                           "--image_size", "32", "--batch_size", "6", "--n_epochs", "2",
                                           "--no-use_accelerator", "--out", str(out), "--no-progress", "--threads", "1",
                                           "--tensorboard"])
    finally:
        torch.set_num_threads(before)
    args = json.loads((out / "config.json").read_text())["args"]
    assert args["threads"] == 1 and args["progress"] is False and args["tensorboard"] is True
    metrics = pd.read_csv(out / "metrics.csv")
    expected = {(f"{row.split}/{row.metric}", int(row.epoch)): row.value for row in metrics.itertuples()}
    scalars = _scalars(out / "tensorboard")
    assert set(scalars) == set(expected) and len(expected) == len(metrics)
    assert all(scalars[key] == pytest.approx(value, rel=1e-6, abs=1e-12) for key, value in expected.items())


def test_step4_writes_clients_csv_tensorboard_and_one_line_instead_of_one_per_round(  # noqa: F811
        tiny_data_root, tiny_manifest, assignments, tmp_path, capsys):
    out = tmp_path / "run"
    test_fed.main(fed_argv(tiny_data_root, tiny_manifest, assignments, out, "--method", "fedrep", "--tensorboard",
                           "--no-round_lines", "--threads", "1"))
    console = capsys.readouterr().out  # progress goes to stdout: a log file of stdout alone has it
    assert "round 1 of 2" not in console and "round 2 of 2" not in console and "2 rounds done" in console
    run_log = (out / "run.log").read_text()
    assert "round 0 of 2: test loss" in run_log and "round 1 of 2: train loss" in run_log
    assert "round 2 of 2: train loss" in run_log
    assert json.loads((out / "config.json").read_text())["args"]["threads"] == 1

    metrics = pd.read_csv(out / "metrics.csv", dtype={"client": str})
    clients = pd.read_csv(out / "clients.csv", dtype={"client": str}).set_index("client")
    assert list(clients.index) == ["0", "1", "2"]
    table = pd.read_csv(assignments, dtype={"client_id": str})
    sizes = table[table.subset == "train"].groupby("client_id").size()
    assert clients["train_samples"].to_dict() == sizes.to_dict()
    last = metrics[metrics["round"] == 2]
    for split, prefix in (("client_test", "global"), ("client_test_personal", "personal")):
        for client in ("0", "1", "2"):
            expected = last[(last.split == split) & (last.client == client) & (last.metric == "loss")].value.item()
            assert clients.loc[client, f"{prefix}_loss"] == pytest.approx(expected)
    trained = metrics[metrics.split == "train"]
    for client in ("0", "1", "2"):  # client fraction 1: every client trains in round 2
        assert clients.loc[client, "last_trained_round"] == 2
        expected = trained[(trained.client == client) & (trained["round"] == 2) & (trained.metric == TRAIN_LOSS)].value.item()
        assert clients.loc[client, TRAIN_LOSS] == pytest.approx(expected)

    scalars = _scalars(out / "tensorboard")
    assert len(scalars) == len(metrics)
    for row in metrics.itertuples():
        assert scalars[(f"{row.split}/{row.client}/{row.metric}", int(row.round))] == pytest.approx(row.value, rel=1e-6)


def pivoted_clients_table(metrics: pd.DataFrame, client_sizes: dict[str, int]) -> pd.DataFrame:
    """clients.csv's table the pandas way (pivot_table and joins), written from its docstring: the oracle below."""
    metrics = metrics.assign(client=metrics["client"].astype(str))
    table = pd.DataFrame({"client": list(client_sizes), "train_samples": list(client_sizes.values())}).set_index("client")
    for split, prefix in (("client_test", "global"), ("client_test_personal", "personal"),
                          ("client_test_finetuned", "finetuned")):
        rows = metrics[(metrics.split == split) & metrics.client.isin(table.index)]
        if not rows.empty:
            last = rows[rows["round"] == rows["round"].max()]
            table = table.join(last.pivot_table(index="client", columns="metric", values="value",
                                                aggfunc="first").add_prefix(f"{prefix}_"))
    trained = metrics[(metrics.split == "train") & metrics.client.isin(table.index)]
    if not trained.empty:
        last_round = trained.groupby("client")["round"].max().rename("last_trained_round")
        latest = trained.merge(last_round, left_on="client", right_index=True)
        latest = latest[latest["round"] == latest["last_trained_round"]]
        table = table.join(last_round).join(latest.pivot_table(index="client", columns="metric", values="value",
                                                               aggfunc="first"))
    return table.reset_index()


# Few rounds, splits, clients and metrics: drawn rows share cells (a value after a first one, a missing first
# value), and the last round of a split holds several metrics (their column order); "x" is no client of the run.
CELLS = [(round_index, split, client, metric) for round_index in (0, 1)
         for split in ("train", "client_test", "client_test_personal") for client in ("0", "1", "x")
         for metric in ("rmse", "loss", "cluster")]


@given(rows=st.lists(st.tuples(st.sampled_from(CELLS), st.one_of(st.floats(-1e3, 1e3), st.just(float("nan")))),
                     min_size=8, max_size=40),
       clients=st.lists(st.sampled_from(["0", "1", "2"]), min_size=1, max_size=3, unique=True))
def test_clients_table_equals_pandas_pivot_of_the_same_rows(rows, clients):
    """Any rows (missing values, clients never evaluated or trained, rounds out of order, rows of other clients)
    give the frame and the bytes of pandas' pivot_table: the same columns in the same order, dtypes and values."""
    from network.clients_table import clients_table

    metrics = pd.DataFrame([(*cell, value) for cell, value in rows],
                           columns=["round", "split", "client", "metric", "value"]).astype({"round": int})
    sizes = {client: 10 + index for index, client in enumerate(clients)}
    expected = pivoted_clients_table(metrics, sizes)
    pd.testing.assert_frame_equal(clients_table(metrics, sizes), expected)
    assert clients_table(metrics, sizes).to_csv(index=False) == expected.to_csv(index=False)


def test_clients_table_on_hand_made_rows():
    from network.clients_table import clients_table

    rows = [(1, "train", "a", "train_loss", 0.9), (1, "train", "a", "cluster", 1), (2, "train", "a", "train_loss", 0.5),
            (2, "train", "a", "cluster", 0), (1, "train", "b", "train_loss", 0.7), (1, "train", "b", "cluster", 1),
            (2, "client_test", "a", "loss", 0.4), (2, "client_test", "b", "loss", 0.6), (2, "client_test", "c", "loss", 0.8),
            (1, "client_test", "a", "loss", 9.0), (2, "client_test", "mean", "loss", 0.6),
            (2, "client_test_personal", "a", "loss", 0.3)]
    metrics = pd.DataFrame(rows, columns=["round", "split", "client", "metric", "value"])
    table = clients_table(metrics, {"a": 10, "b": 20, "c": 5}).set_index("client")
    assert list(table.index) == ["a", "b", "c"] and table["train_samples"].tolist() == [10, 20, 5]
    assert table["global_loss"].tolist() == [0.4, 0.6, 0.8]  # the last evaluated round, not round 1's 9.0
    assert table.loc["a", "personal_loss"] == 0.3 and table[["personal_loss"]].loc[["b", "c"]].isna().all(axis=None)
    assert table.loc["a", "last_trained_round"] == 2 and table.loc["a", "cluster"] == 0 and table.loc["a", "train_loss"] == 0.5
    assert table.loc["b", "last_trained_round"] == 1 and table.loc["b", "cluster"] == 1  # its last sampled round
    assert pd.isna(table.loc["c", "last_trained_round"]) and pd.isna(table.loc["c", "cluster"])  # never sampled
