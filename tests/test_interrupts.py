"""Ctrl-C and SIGTERM (utils/interrupts.py): one line saying where a run stopped and how to resume, exit 130 or 143,
no traceback; in step 4's engine, step 2's loop, a pipeline step, and a pool of workers (real signals to two
subprocesses)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import training.fit
from tests.fixtures import tiny_data_root, tiny_manifest  # noqa: F401  (session fixtures)
from tests.test_engine import make_clients, make_engine
from tests.test_step4 import argv as fed_argv, assignments  # noqa: F401  (a fixture)
from utils.interrupts import Interrupted
from utils.locks import LOCK_FILE, STAGE_LOCK
from utils.run_dir import load_checkpoint

ROOT = Path(__file__).resolve().parent.parent
HINT = "rerun the same command to resume"


def test_an_engine_interrupt_names_the_running_round_and_the_last_checkpoint(tmp_path):
    # 3 clients a round: call 14 is round 5's second client; checkpoints every 3 rounds: round 3's is the last one.
    engine = make_engine(tmp_path, "fedavg", rounds=6, clients=make_clients(kill_after_calls=13), checkpoint_every=3)
    with pytest.raises(Interrupted) as stopped:
        engine.run()
    assert str(stopped.value) == f"interrupted at round 5 (checkpoint at round 3); {HINT}"
    assert stopped.value.signum == signal.SIGINT and isinstance(stopped.value, KeyboardInterrupt)
    assert load_checkpoint(tmp_path / "checkpoint.pt")["round"] == 3


def test_a_step2_interrupt_names_the_running_epoch_and_last_pt(tiny_data_root, tiny_manifest, tmp_path,  # noqa: F811
                                                              monkeypatch):
    from steps import train_centralized as step2
    from tests.test_step2 import argv as step2_argv

    evaluate_all = training.fit._evaluate_all
    calls = []

    def stopped_in_epoch_2(*args, **kwargs):  # calls: epoch 0 (untrained), epoch 1, epoch 2
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return evaluate_all(*args, **kwargs)

    monkeypatch.setattr(training.fit, "_evaluate_all", stopped_in_epoch_2)
    with pytest.raises(Interrupted, match=re.escape(f"interrupted at epoch 2 (checkpoint at epoch 1); {HINT}")):
        step2.main(step2_argv(tiny_data_root, tiny_manifest, tmp_path / "run", "normal", "--n_epochs", "3",
                              "--no-progress"))
    assert load_checkpoint(tmp_path / "run" / "last.pt")["state"]["epoch"] == 1


@pytest.mark.parametrize("raised, code, line", [
    (KeyboardInterrupt(), 130, f"interrupted; {HINT}"),
    (Interrupted(signal.SIGTERM, "interrupted at round 4 (checkpoint at round 2); rerun"), 143,
     "interrupted at round 4 (checkpoint at round 2); rerun"),
])
def test_run_main_prints_the_line_and_exits_with_the_signals_code(raised, code, line, capsys):
    from utils.cli import run_main

    def main(argv):
        raise raised

    try:
        with pytest.raises(SystemExit) as exit_info:
            run_main(main, [])
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # run_main ignores a second Ctrl-C while it prints
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert exit_info.value.code == code and capsys.readouterr().err == line + "\n"


def test_a_pipeline_step_puts_its_name_before_the_steps_own_line(tmp_path):
    from pipeline.runner import Pipeline

    class Stopped:
        @staticmethod
        def main(argv):
            raise Interrupted(signal.SIGTERM, f"interrupted at round 7 (checkpoint at round 5); {HINT}")

    pipeline = Pipeline({"data": {}}, tmp_path, "run_pipeline.py x.yaml", show_progress=False)
    with pytest.raises(Interrupted) as stopped:
        pipeline.step("step 4: normal · iid · fedavg · seed 0", tmp_path / "stage", {}, Stopped, [])
    assert str(stopped.value) == f"step 4: normal · iid · fedavg · seed 0: interrupted at round 7 (checkpoint at round 5); {HINT}"
    assert stopped.value.signum == signal.SIGTERM


def _wait_for(condition, what: str, timeout: float = 600.0) -> None:
    """Poll ``condition`` until it holds (a loaded machine may take minutes to start a process)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)


def test_ctrl_c_stops_step4_with_one_line_naming_the_round_and_exit_130(tiny_data_root, tiny_manifest,  # noqa: F811
                                                                        assignments, tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "test_fed.py", *fed_argv(tiny_data_root, tiny_manifest, assignments, out, "--n_rounds", "500",
                                                         "--threads", "1")]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (out / "run.log").is_file() and "round 2 of 500" in (out / "run.log").read_text()
                  or process.poll() is not None, "round 2")
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=600)
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    found = re.fullmatch(rf"interrupted at round (\d+) \(checkpoint at round (\d+)\); {HINT}\n", stderr)
    assert found, stderr
    running, checkpoint = int(found[1]), int(found[2])
    assert checkpoint == load_checkpoint(out / "checkpoint.pt")["round"] and checkpoint <= running <= checkpoint + 1
    assert "round 1 of 500" in stdout  # the per-round lines go to stdout, the interruption to stderr


POOL_DRIVER = """
import sys
from pathlib import Path
from pipeline.pool import PoolStage, run_in_workers
from utils.cli import run_main
folder = Path(sys.argv[1])
stages = [PoolStage(f"step 4: run {name}", folder / name, {}, [str(folder / f"{name}.pid"), str(folder / name)],
                    script="tests.sleeping_stage") for name in sys.argv[2:]]
run_main(lambda argv: run_in_workers(stages, 2, 1, lambda stage, placement: None))
"""


def _stop_a_pool(tmp_path: Path, names: str, stop) -> tuple[subprocess.Popen, str, list[int]]:
    """run_in_workers with --jobs 2 in a process of its own session (a terminal's process group) over sleeping
    stages named ``names``; ``stop(process)`` once the first two run. Returns the process, its stderr and the
    workers' pids."""
    pids = [tmp_path / f"{name}.pid" for name in names[:2]]
    process = subprocess.Popen([sys.executable, "-c", POOL_DRIVER, str(tmp_path), *names], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for(lambda: all(path.is_file() and path.read_text() for path in pids) or process.poll() is not None,
                  "two stages to start")
        stop(process)
        _, stderr = process.communicate(timeout=600)
    finally:
        process.kill()
    return process, stderr, [int(path.read_text()) for path in pids]


def _assert_stopped_cleanly(tmp_path: Path, stderr: str, workers: list[int]) -> None:
    """No folder lock left behind, no resource-tracker warning, every worker gone."""
    assert not list(tmp_path.rglob(LOCK_FILE))  # each running stage unwound and released its lock
    assert "leaked semaphore" not in stderr and "Traceback" not in stderr
    for pid in workers:
        _wait_for(lambda: not _alive(pid), f"worker {pid} to end")


@pytest.mark.slow
def test_sigterm_to_a_pipeline_with_workers_names_the_running_stages_and_the_workers_end_quietly(tmp_path):
    """The pool of run_pipeline.py --jobs 2 (pipeline/pool.py), two stages running in two workers."""
    process, stderr, workers = _stop_a_pool(tmp_path, "ab", lambda process: process.send_signal(signal.SIGTERM))
    assert process.returncode == 143, stderr
    assert stderr == (f"interrupted while running step 4: run a, step 4: run b; each resumes from its last checkpoint: "
                      f"{HINT}\n")  # one line: no traceback from the pipeline or from a worker
    _assert_stopped_cleanly(tmp_path, stderr, workers)


@pytest.mark.slow
def test_ctrl_c_with_a_stage_queued_names_it_not_started_and_leaves_no_lock(tmp_path):
    """Three stages, two workers: Ctrl-C reaches the whole process group (as a terminal sends it) while a and b run;
    c was never handed to a worker."""
    process, stderr, workers = _stop_a_pool(tmp_path, "abc", lambda process: os.killpg(process.pid, signal.SIGINT))
    assert process.returncode == 130, stderr
    assert stderr == (f"interrupted while running step 4: run a, step 4: run b; not started: step 4: run c; "
                      f"each resumes from its last checkpoint: {HINT}\n")
    assert not (tmp_path / "c").exists() and not (tmp_path / "c.pid").exists()  # never started
    # unfinished: no stage.json, no LOCK; the stage lock's file stays (never deleted; unheld, it blocks nothing)
    assert {path.name for path in (tmp_path / "a").iterdir()} == {STAGE_LOCK}
    _assert_stopped_cleanly(tmp_path, stderr, workers)


@pytest.mark.parametrize("running, not_started, line", [
    ([], [], "interrupted"),
    (["a"], [], "interrupted while running a"),
    (["a", "b"], ["c", "d", "e"], "interrupted while running a, b; not started: c, d, e"),  # 3: all named
    (["a", "b"], ["c", "d", "e", "f"], "interrupted while running a, b; not started: c, d, e and 1 more"),
    ([], ["c"], "interrupted; not started: c"),
])
def test_the_stopped_pools_line_names_at_most_three_stages_not_started(running, not_started, line):
    from utils.interrupts import stages_message

    stopped = stages_message(Interrupted(signal.SIGTERM), running, not_started)
    assert str(stopped) == f"{line}; each resumes from its last checkpoint: {HINT}"
    assert stopped.signum == signal.SIGTERM


@pytest.mark.slow
def test_ctrl_c_to_run_pipeline_with_jobs_2_names_the_running_runs_and_leaves_no_lock(tmp_path):
    """The real pipeline: 4 step-4 runs of 3000 rounds, 2 workers; Ctrl-C to the process group once both run."""
    import yaml

    from tests.test_digits import tiny_digits_experiment

    config = tiny_digits_experiment(tmp_path)
    config["federated"]["n_rounds"] = 3000
    config["seeds"] = [0, 1]
    (tmp_path / "digits.yaml").write_text(yaml.safe_dump(config))
    results = tmp_path / "results"
    process = subprocess.Popen([sys.executable, "run_pipeline.py", str(tmp_path / "digits.yaml"), "--results",
                                str(results), "--jobs", "2", "--threads", "1"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)

    def both_run() -> bool:
        logs = list(results.glob("tinydigits/federated/**/run.log"))
        return len(logs) == 2 and all("round 1 of 3000" in log.read_text() for log in logs)

    try:
        _wait_for(lambda: both_run() or process.poll() is not None, "two runs at round 1")
        os.killpg(process.pid, signal.SIGINT)
        stdout, stderr = process.communicate(timeout=600)
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    name = "step 4: digit_class · {} · α=1 · fedavg · seed {}"
    assert stderr == (f"interrupted while running {name.format('label_based', 0)}, {name.format('label_based', 1)}; "
                      f"not started: {name.format('embedding_based', 0)}, {name.format('embedding_based', 1)}; "
                      f"each resumes from its last checkpoint: {HINT}\n")
    assert "step 4: 4 runs, 2 at a time in worker processes" in stdout
    assert not list(results.rglob(LOCK_FILE))  # the runs' folders and the experiment's own


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
