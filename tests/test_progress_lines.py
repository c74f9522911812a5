"""Progress a log file can hold (utils/progress.py): step 4's line per evaluated round, the pipeline's line per step,
the ETA; the default thread count; the pipeline's TensorBoard switch."""

from __future__ import annotations

import argparse
import io
import math
import re
from pathlib import Path

import pytest
import torch

from network.algorithms import build_algorithm
from network.engine_sequential import EngineConfig, SequentialEngine
from network.lr_schedule import make_lr_schedule
from tests.test_engine import CPU, global_test, make_clients
from tests.tiny_models import evaluate, loss_fn, tiny_model_for
from utils.progress import Pace, StepLines, clock_text, eta_text, seconds_left
from utils.run_dir import setup_logging
from tests.fixtures import Killed, die_after_saving

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("seconds, text", [
    (0, "0:00:00"), (0.49, "0:00:00"), (0.5, "0:00:01"),  # the nearest whole second, half up
    (10, "0:00:10"), (59.5, "0:01:00"), (201, "0:03:21"), (3599.5, "1:00:00"), (3723.4, "1:02:03"),
    (25 * 3600 + 1, "25:00:01"),  # hours pass 24: no days
    (-5, "0:00:00"), (math.inf, "0:00:00"), (math.nan, "0:00:00")])
def test_every_duration_is_h_mm_ss_to_the_nearest_second(seconds, text):
    assert clock_text(seconds) == text
    assert eta_text(seconds) == f"ETA {text}"


class FakeClock:
    """Seconds that advance ``step`` at every reading: each call is one piece of work later."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_a_resumed_loop_paces_only_the_pieces_done_in_this_process():
    """3 of 10 pieces were done before a resume; this process does piece 4 in 10 s and piece 5 in 10 s more. The
    pace is 10 s a piece over the 7 left to it: 6 left after piece 4 (60 s), 5 after piece 5 (50 s); counting the 3
    resumed pieces as done in no time would say 20/5·5 = 20 s after piece 5."""
    pace = Pace(3, 10, clock=FakeClock(10.0))  # began at 10 s
    assert pace.eta(4) == "ETA 0:01:00"  # read at 20 s: 1 piece in 10 s
    assert pace.eta(5) == "ETA 0:00:50"  # read at 30 s: 2 pieces in 20 s
    fresh = Pace(0, 10, clock=FakeClock(10.0))
    assert fresh.eta(1) == "ETA 0:01:30" and fresh.eta(10) == "ETA 0:00:00"


def test_time_left_is_the_pieces_left_at_the_mean_pace_so_far():
    assert seconds_left(100.0, 4, 10) == 150.0  # 25 s a piece, 6 to go
    assert seconds_left(100.0, 0, 10) == 0.0 and seconds_left(100.0, 10, 10) == 0.0


def _engine(out_dir, rounds: int, eval_every: int) -> SequentialEngine:
    torch.manual_seed(0)
    task_model = tiny_model_for("fedavg")
    clients = make_clients()
    algorithm, model = build_algorithm("fedavg", task_model, {client.client_id: client.num_samples for client in clients},
                                       None, seed=7)
    config = EngineConfig(out_dir=out_dir, n_rounds=rounds, lr_schedule=make_lr_schedule("constant", 0.05, rounds),
                          seed=7, local_steps=2, client_fraction=0.6, eval_every=eval_every, progress=False)
    return SequentialEngine(model, algorithm, clients, loss_fn, evaluate, global_test(), config, CPU,
                            logger=setup_logging(out_dir))


def test_a_run_prints_one_stdout_line_per_evaluated_round_and_run_log_has_every_round(tmp_path, capsys):
    _engine(tmp_path, rounds=5, eval_every=2).run()
    printed = capsys.readouterr().out.splitlines()
    rounds = [line for line in printed if line.startswith("round ")]
    assert [line.split(":")[0] for line in rounds] == ["round 0 of 5", "round 2 of 5", "round 4 of 5", "round 5 of 5"]
    assert re.fullmatch(r"round 2 of 5: train loss [0-9.e+-]+, test loss [0-9.e+-]+ \([0-9.]+ s\); ETA \d+:\d\d:\d\d",
                        rounds[1]), rounds[1]
    assert rounds[0].startswith("round 0 of 5: test loss ") and rounds[-1].endswith("ETA 0:00:00")
    logged = [line.split(" INFO ")[1] for line in (tmp_path / "run.log").read_text().splitlines()
              if " INFO round " in line]
    assert [line.split(":")[0] for line in logged] == [f"round {r} of 5" for r in range(6)]
    assert "test loss" not in logged[1] and "test loss" in logged[2]  # round 1 trained only; run.log has it anyway



def resumed_etas(log: Path, what: str) -> dict[int, str]:
    """``{piece: its ETA}`` of the ``<what> k of|/N`` lines run.log has after its last resume line."""
    lines = log.read_text().splitlines()
    last_resume = max(index for index, line in enumerate(lines) if " INFO resum" in line)
    found = {}
    for line in lines[last_resume:]:
        match = re.search(rf" INFO {what} (\d+)(?: of |/)\d+: .*(ETA \d+:\d\d:\d\d)$", line)
        if match:
            found[int(match.group(1))] = match.group(2)
    return found


def paced_by(module, monkeypatch, step: float) -> None:
    """``module``'s Pace reads a FakeClock that advances ``step`` seconds at each reading."""
    monkeypatch.setattr(module, "Pace", lambda start, total: Pace(start, total, clock=FakeClock(step)))


def test_a_resumed_federated_run_paces_only_the_rounds_it_ran(tmp_path, monkeypatch):
    """Killed before round 3 of 5 (checkpoint at round 2), the rerun trains rounds 3, 4, 5 at 10 s a round on the
    fake clock: ETAs 20 s, 10 s, 0 s (counting rounds 1 and 2 as done in no time would say 10/3·2 ≈ 7 s after
    round 3)."""
    import network.engine_sequential

    first = _engine(tmp_path, rounds=5, eval_every=1)
    run_round = first._run_round

    def killed_at_round_3(round_index, bar, pace):
        if round_index == 3:
            raise Killed
        run_round(round_index, bar, pace)

    first._run_round = killed_at_round_3
    with pytest.raises(Killed):
        first.run()
    paced_by(network.engine_sequential, monkeypatch, 10.0)
    _engine(tmp_path, rounds=5, eval_every=1).run()
    assert resumed_etas(tmp_path / "run.log", "round") == {3: "ETA 0:00:20", 4: "ETA 0:00:10", 5: "ETA 0:00:00"}


def test_a_resumed_step2_run_paces_only_the_epochs_it_ran(tmp_path, monkeypatch):
    """Step 2 killed after epoch 2 of 5 resumes and trains epochs 3, 4, 5 at 10 s an epoch on the fake clock: ETAs
    20 s, 10 s, 0 s (counting epochs 1 and 2 as done in no time would say 10/3·2 ≈ 7 s after epoch 3)."""
    import training.fit
    from datasets.digits import select_digits
    from steps import train_centralized as step2

    manifest = tmp_path / "manifest.csv"
    select_digits(0.25, seed=0, n_samples=60).to_csv(manifest, index=False)
    out = tmp_path / "run"
    argv = ["--task", "digit_class", "--encoder", "small_cnn", "--weights", "none", "--data_path", str(tmp_path),
            "--manifest", str(manifest), "--image_size", "8", "--batch_size", "8", "--scheduler", "none",
            "--n_epochs", "5", "--no-use_accelerator", "--no-plots", "--no-progress", "--out", str(out)]
    real_save = training.fit.atomic_torch_save
    die_after_saving(monkeypatch, training.fit, epoch=2)
    with pytest.raises(Killed):
        step2.main(argv)
    monkeypatch.setattr(training.fit, "atomic_torch_save", real_save)
    paced_by(training.fit, monkeypatch, 10.0)
    step2.main(argv)
    assert resumed_etas(out / "run.log", "epoch") == {3: "ETA 0:00:20", 4: "ETA 0:00:10", 5: "ETA 0:00:00"}


def test_without_a_bar_the_pipeline_prints_a_line_per_step_it_ran(tmp_path, capsys):
    from pipeline.runner import Pipeline

    ran = []

    class Script:
        @staticmethod
        def main(argv):
            ran.append(argv[0])
            (tmp_path / argv[0] / "out.txt").write_text("done")

    pipeline = Pipeline({"data": {}}, tmp_path, "run_pipeline.py x.yaml", show_progress=False)
    with pipeline.progress_bar(3, "pipeline") as pipeline.progress:
        assert isinstance(pipeline.progress, StepLines)
        for name in ("a", "b", "a"):  # the second "a" is done: counted, not run, no line
            pipeline.step(f"step {name}", tmp_path / name, {}, Script, [name])
    assert ran == ["a", "b"] and pipeline.progress.n == 3
    lines = capsys.readouterr().out.splitlines()
    assert [re.sub(r"\d+ s$", "S s", line) for line in lines] == ["step 1 of 3: step a, S s", "step 2 of 3: step b, S s"]
    # the experiment's run.log keeps the steps that ran, timestamped, whatever the console did
    logged = (tmp_path / "run.log").read_text().splitlines()
    assert [re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (.*) \d+ s$", r"\1", line) for line in logged] == [
        "step a:", "step b:"]


def test_the_default_is_one_torch_thread_and_recorded(monkeypatch):
    from utils.cli import DEFAULT_THREADS, add_runtime_flags, apply_runtime_flags

    parser = argparse.ArgumentParser()
    add_runtime_flags(parser)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr("sys.stdout", io.StringIO())
        args = apply_runtime_flags(parser.parse_args([]))
        assert DEFAULT_THREADS == 1 and args.threads == 1 and torch.get_num_threads() == 1
        assert apply_runtime_flags(parser.parse_args(["--threads", "2"])).threads == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert "(default: 1)" in parser.format_help()


def test_tensorboard_reaches_steps_2_and_4_of_the_pipeline_as_a_flag_not_a_stage_key(tmp_path):
    import run_pipeline
    from pipeline.runner import Pipeline
    from steps import embed, federated, train_centralized

    assert run_pipeline.parse_args(["x.yaml", "--tensorboard"]).tensorboard is True
    assert run_pipeline.parse_args(["x.yaml"]).tensorboard is None  # the file's key decides
    on = Pipeline({"tensorboard": True}, tmp_path, "c")
    off = Pipeline({"tensorboard": False}, tmp_path, "c")
    for script in (train_centralized, federated):
        assert "--tensorboard" in on.shared_flags(script) and "--tensorboard" not in off.shared_flags(script)
    assert "--tensorboard" not in on.shared_flags(embed)


def test_the_main_jobs_tensorboard_key_changes_no_stage_parameter(tmp_path):
    import yaml

    from pipeline.experiment import load_experiment
    from pipeline.studies.main_job.config import Combination, federated_params

    raw = yaml.safe_load((ROOT / "experiments" / "demo.yaml").read_text())
    loaded = []
    for value in (False, True):
        path = tmp_path / f"tb_{value}.yaml"
        path.write_text(yaml.safe_dump({**raw, "tensorboard": value}))
        loaded.append(load_experiment(path))
    off, on = loaded
    assert on["tensorboard"] is True and off["tensorboard"] is False
    combination = Combination("normal", "label_based", 0.1, "fedavg", 0)
    inputs = ("data", "manifest.csv", "assignments.csv", "best.pt")
    assert federated_params(on, combination, *inputs) == federated_params(off, combination, *inputs)
