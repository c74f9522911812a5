"""bench/gpu_check.py: the dry run writes every stage's figures in the fixed CSV format and the paper-grid
projection follows its stated arithmetic, a failing stage is one row, and without CUDA the check is one error line.

The dry run runs every stage at tiny sizes on the CPU, so the script cannot rot before a GPU is lent.
"""

from __future__ import annotations

import csv
import math

import pytest
import torch

from bench import gpu_check, gpu_stage_kit, gpu_stages
from bench.gpu_report import COLUMNS, CSV_FILE, MARKDOWN_FILE, Report, Row, goal_lines
from utils.cli import run_main

STAGE_FIGURES = {  # figures every dry run must record, per stage
    "device": {"device", "torch", "cuda", "bf16_matmul", "bf16_peak"},
    "train_loop": {"plain_samples_per_s", "taskhet_samples_per_s", "taskhet_over_plain", "peak_memory"},
    "vectorised": {f"{model}_k2_{what}" for model in ("mlp", "cnn", "decoder")
                   for what in ("sequential", "vectorised", "ratio", "peak_memory")},
    "paper_round": {"runs", "fedavg_round", "fedprox_round", "scaffold_round", "fedrep_round", "eval_samples_per_s",
                    "grid_1gpu", "grid_8gpu", "checkpoint_write", "train_samples_per_s", "step2_1gpu",
                    "embeddings_1gpu", "readings_1gpu", "checkpoints_1gpu", "complete_1gpu", "complete_8gpu"},
    "fedloge": {"sse_c_init", "first_round", "round", "projected_run"},
}


def read_csv(path):
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        return reader.fieldnames, list(reader)


def test_dry_run_records_every_stage_in_the_fixed_format(tmp_path, capsys):
    out = tmp_path / "check"
    report = gpu_check.main(["--dry-run", "--eval_samples", "3000", "--train_samples", "5000", str(out)])
    printed = capsys.readouterr().out.splitlines()
    columns, rows = read_csv(out / CSV_FILE)
    assert tuple(columns) == COLUMNS
    assert len(rows) == len(report.rows) == len(printed)  # one stdout line per figure
    by_stage: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_stage.setdefault(row["stage"], {})[row["figure"]] = row
    assert list(by_stage) == [stage.name for stage in gpu_check.STAGES]
    assert [row for row in rows if row["figure"] == "error"] == []
    for stage, figures in STAGE_FIGURES.items():
        assert figures <= set(by_stage[stage]), stage
    for stage in by_stage.values():
        assert float(stage["stage_seconds"]["value"]) >= 0
    # CUDA-only figures are skipped with a reason, not left out
    for stage, figure in (("device", "bf16_peak"), ("device", "cudnn"), ("train_loop", "peak_memory"),
                          ("paper_round", "peak_memory"), ("fedloge", "peak_memory")):
        assert by_stage[stage][figure]["value"] == "skipped" and by_stage[stage][figure]["detail"], (stage, figure)
    pfl = by_stage["pfl"]
    assert pfl.get("pfl", {}).get("value") == "not installed" or "k2_vectorised_over_pfl" in pfl
    # 7 tasks × 2 groupings × 5 alphas × 4 algorithms × 3 seeds, from experiments/paper.yaml
    assert by_stage["paper_round"]["runs"]["value"] == "840"
    markdown = (out / MARKDOWN_FILE).read_text()
    assert "| stage | figure | value | unit | detail |" in markdown
    assert "## The goals" in markdown and "## The paper-grid projection: its assumptions" in markdown
    assert markdown.count("dry run: tiny sizes on the CPU") == 4  # each goal is marked not measured
    check_projection(report, 3000)
    check_complete_projection(report, 3000, 5000)


def check_projection(report: Report, eval_samples: int) -> None:
    """The paper grid's hours follow the assumptions the Markdown states, from the timed figures."""
    value = {row.figure: row.value for row in report.rows if row.stage == "paper_round"}
    methods = ("fedavg", "fedprox", "scaffold", "fedrep")
    # 100 rounds, eval_every 5: round 0 and rounds 5, 10, ..., 100 -> 21 evaluations
    eval_hours = 21 * eval_samples / value["eval_samples_per_s"] / 3600
    for method in methods:
        assert value[f"{method}_run"] == pytest.approx(100 * value[f"{method}_round"] / 3600 + eval_hours)
    grid = 840 / 4 * sum(value[f"{method}_run"] for method in methods)
    assert value["grid_1gpu"] == pytest.approx(grid)
    assert value["grid_8gpu"] == pytest.approx(grid / 8)
    assert any("21 evaluations a run" in line and f"{eval_samples:,} samples" in line for line in report.notes)


def check_complete_projection(report: Report, eval_samples: int, train_samples: int) -> None:
    """Steps 2, 3 and 3c and the checkpoint writes follow the arithmetic the Markdown states."""
    from bench.gpu_federated_stages import paper_setting
    from bench.gpu_grid_projection import run_bytes_written, step2_bytes_written

    value = {row.figure: row.value for row in report.rows if row.stage == "paper_round"}
    # the dry run's round: 2 of 5 clients (client_fraction 0.4) × 1 local step at batch 2
    train_rate = 2 * 1 * 2 / value["fedavg_round"]
    assert value["train_samples_per_s"] == pytest.approx(train_rate)
    eval_rate = value["eval_samples_per_s"]
    # 7 tasks × 3 seeds = 21 step-2 models of 30 epochs; 210 readings (7 tasks × 2 groupings × 5 alphas × 3 seeds)
    epoch = train_samples / train_rate + eval_samples / eval_rate
    assert value["step2_1gpu"] == pytest.approx(21 * 30 * epoch / 3600)
    assert value["embeddings_1gpu"] == pytest.approx(21 * (train_samples + eval_samples) / eval_rate / 3600)
    assert value["readings_1gpu"] == pytest.approx(210 * train_samples / train_rate / 3600)
    setting = paper_setting(gpu_stage_kit.DRY)
    written = 210 * sum(run_bytes_written(setting, method) for method in ("fedavg", "fedprox", "scaffold", "fedrep")) \
        + 21 * step2_bytes_written(setting)
    assert value["checkpoints_1gpu"] == pytest.approx(written / 2**20 / value["checkpoint_write"] / 3600)
    compute = value["grid_1gpu"] + value["step2_1gpu"] + value["embeddings_1gpu"] + value["readings_1gpu"]
    assert value["complete_1gpu"] == pytest.approx(compute + value["checkpoints_1gpu"])
    assert value["complete_8gpu"] == pytest.approx(compute / 8 + value["checkpoints_1gpu"])  # writes: one disk
    assert any("210 readings" in line and f"{train_samples:,} samples" in line for line in report.notes)


def stage(name, run, budget=10.0):
    return gpu_stage_kit.Stage(name, name, budget, run)


def context(tmp_path):
    report = Report(tmp_path, ["# test"])
    return gpu_stage_kit.Context(report, gpu_stage_kit.DRY, torch.device("cpu"), 10, (), 0.0)


def test_a_failing_stage_is_one_error_row_and_the_later_stages_still_run(tmp_path, capsys):
    ctx = context(tmp_path)

    def broken(ctx):
        ctx.add("before", 1.0, "s")
        raise RuntimeError("CUDA out of memory | try less")

    gpu_check.run_stages((stage("a", broken), stage("b", lambda ctx: ctx.add("x", 2.5, "×"))), ctx, math.inf)
    figures = [(row.stage, row.figure, row.value) for row in ctx.report.rows]
    assert figures[:3] == [("a", "before", 1.0), ("a", "error", "failed"), ("a", "stage_seconds", figures[2][2])]
    assert figures[3:5] == [("b", "x", 2.5), ("b", "stage_seconds", figures[4][2])]
    assert ctx.report.rows[1].detail == "RuntimeError: CUDA out of memory | try less"
    _, rows = read_csv(tmp_path / CSV_FILE)
    assert [row["figure"] for row in rows] == ["before", "error", "stage_seconds", "x", "stage_seconds"]
    assert "CUDA out of memory \\| try less" in (tmp_path / MARKDOWN_FILE).read_text()  # a '|' stays in its cell


def test_a_spent_budget_skips_the_later_stages(tmp_path, capsys):
    ctx = context(tmp_path)
    ran = []
    gpu_check.run_stages((stage("a", ran.append), stage("b", ran.append)), ctx, deadline=-1.0)
    assert ran == []
    assert [(row.stage, row.figure, row.value) for row in ctx.report.rows] == [("a", "stage", "skipped"),
                                                                               ("b", "stage", "skipped")]


def test_a_case_that_no_longer_fits_the_stage_budget_is_not_started(tmp_path, capsys):
    ctx = context(tmp_path)
    ctx.deadline = float("-inf")
    steps = gpu_stage_kit.Steps(ctx, 2)
    assert steps.start("first")  # the first case always runs: nothing says how long it takes
    steps.finish()
    assert not steps.start("second")


@pytest.mark.parametrize("argv", [["OUT"], ["--quick"]])
def test_without_cuda_the_check_is_one_error_line_and_writes_nothing(tmp_path, capsys, monkeypatch, argv):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stopped:
        run_main(gpu_check.main, [str(out) if arg == "OUT" else arg for arg in argv])
    assert stopped.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no CUDA device is visible to torch")
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["--dry-run"], "give the folder for gpu_check.csv"),
    (["--dry-run", "--stages", "device,nope", "OUT"], "--stages 'device,nope': choose from device, train_loop"),
    (["--quick", "--dry-run", "--encoders", "resnet51"], "--encoders 'resnet51': choose from"),
    (["--dry-run", "FILE"], "is a file, not a folder"),
])
def test_bad_arguments_are_one_error_line(tmp_path, capsys, argv, message):
    (tmp_path / "file").write_text("")
    argv = [str(tmp_path / "out") if arg == "OUT" else str(tmp_path / "file") if arg == "FILE" else arg for arg in argv]
    with pytest.raises(SystemExit) as stopped:
        run_main(gpu_check.main, argv)
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert not (tmp_path / "out").exists()


def test_quick_dry_run_trains_one_step_of_each_chosen_encoder(capsys):
    report = gpu_check.main(["--quick", "--dry-run", "--encoders", "small_cnn"])
    figures = {(row.stage, row.figure): row for row in report.rows}
    assert [stage for stage, _ in figures if stage not in ("device", "encoders")] == []
    step = figures[("encoders", "small_cnn_step")]
    assert isinstance(step.value, float) and step.value > 0 and step.unit == "ms"
    loss = float(step.detail.split("loss ")[1].split(";")[0])
    assert math.isfinite(loss)


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                        ("NVIDIA H100 NVL", 835.0), ("NVIDIA GH200 480GB", 989.0),
                                        ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                        ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0), ("Tesla V100-SXM2-16GB", None)])
def test_the_bf16_peak_is_the_longest_matching_name(name, peak):
    assert gpu_stages.bf16_peak(name) == peak


def rows_report(rows, dry_run=False):
    return Report(None, [], rows=[Row(*row) for row in rows], dry_run=dry_run)


def test_goals_read_the_figures_back():
    report = rows_report([
        ("vectorised", "mlp_k128_ratio", 12.5, "×"), ("vectorised", "cnn_k128_ratio", 3.0, "×"),
        ("vectorised", "cnn_k32_ratio", 20.0, "×"),  # 32 clients do not count for the goal at 128
        ("train_loop", "taskhet_over_plain", 0.89, "×"),
        ("pfl", "k32_vectorised_over_pfl", 1.5, "×"), ("pfl", "k128_vectorised_over_pfl", 0.9, "×"),
        ("paper_round", "grid_1gpu", 47.5, "h"), ("paper_round", "grid_8gpu", 5.9, "h"),
    ])
    assert goal_lines(report) == [
        "| vectorised ≥ 10× sequential at 128 clients | mlp 12.50×, cnn 3.00× | mlp: met, cnn: not met |",
        "| step 2's loop ≥ 0.9 of a plain bf16 loop | 0.890 | not met |",
        "| TaskHet ≥ 1× pfl | k32_vectorised 1.50×, k128_vectorised 0.90× "
        "| not met (TaskHet's vectorised engine, at every K) |",
        "| the paper grid ≤ 48 h on one GPU | 47.5 h on 1 GPU, 5.9 h on 8 | met |",
    ]
    # with the grid's other parts projected, the goal is judged on the whole grid
    whole = rows_report([("paper_round", "grid_1gpu", 47.5, "h"), ("paper_round", "grid_8gpu", 5.9, "h"),
                         ("paper_round", "complete_1gpu", 60.25, "h"), ("paper_round", "complete_8gpu", 9.0, "h")])
    assert goal_lines(whole) == ["| the paper grid ≤ 48 h on one GPU | the whole grid 60.2 h on 1 GPU, 9.0 h on 8 "
                                 "(step 4 alone 47.5 h) | not met |"]


def test_goals_say_why_a_figure_is_missing():
    report = rows_report([("pfl", "pfl", "not installed", "", "No module named 'pfl'"),
                          ("train_loop", "error", "failed", "", "RuntimeError: boom")])
    assert goal_lines(report) == [
        "| step 2's loop ≥ 0.9 of a plain bf16 loop | — | not measured |",
        "| TaskHet ≥ 1× pfl | — | not measured (not installed: No module named 'pfl') |",
    ]
