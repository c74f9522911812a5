"""One run at a time writes a folder (issue 19, item 6): two real processes, a stale lock, two pipelines."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

import run_pipeline  # noqa: F401  (its modules loaded before a test races a pipeline for the lock)
from steps import assign, select
from tests.scripts_in_process import run_script
from tests.test_digits import tiny_digits_experiment
from utils.cli import run_main
from utils.errors import FolderInUseError
from utils.locks import LOCK_FILE

ROOT = Path(__file__).resolve().parent.parent
HOLD = """
import sys, time
from utils.locks import folder_lock
with folder_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Path:
    return select.main(["--family", "digits", "--n_samples", "60", "--out", str(tmp_path_factory.mktemp("step1"))])


@pytest.fixture
def holder(tmp_path):
    """A separate process that holds the lock of ``tmp_path / 'out'`` until killed."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "out")], cwd=ROOT, stdout=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline().strip() == "held"
    yield process
    process.kill()
    process.wait()


def assign_argv(manifest: Path, out: Path) -> list[str]:
    return ["--manifest", str(manifest), "--n_clients", "2", "--alpha", "1", "--out", str(out)]


def error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_a_second_run_of_a_real_step_is_refused_naming_the_holder(manifest, holder, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    # The script in this process: the lock's holder is the other process.
    result = run_script("make_client_assignments.py", assign_argv(manifest, out), capsys, monkeypatch)
    assert result.returncode == 2, result.stderr
    (line,) = error_lines(result.stderr)
    assert f"--out {out} is being written by another run: pid {holder.pid} on host {socket.gethostname()} since " in line
    record = json.loads((out / LOCK_FILE).read_text())
    assert record["pid"] == holder.pid and record["since"] in line
    assert sorted(path.name for path in out.iterdir()) == [LOCK_FILE]  # the refused run wrote nothing


def test_the_lock_of_a_run_killed_with_sigkill_is_taken_over(manifest, holder, tmp_path, capsys):
    out = tmp_path / "out"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert (out / LOCK_FILE).exists()  # left behind: a killed run deletes nothing
    run_main(assign.main, assign_argv(manifest, out))
    err = capsys.readouterr().err
    assert err.splitlines() == [f"note: {out}: took over the lock left by pid {holder.pid} (ended)"]
    assert (out / "assignments.csv").is_file() and not (out / LOCK_FILE).exists()  # released at the end


def test_a_stale_lock_file_of_a_dead_pid_is_taken_over(manifest, tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                             "since": "2026-01-01T00:00:00+00:00", "command": "python old_run.py"}))
    assign.main(assign_argv(manifest, out))
    assert f"took over the lock left by pid {dead.pid}" in capsys.readouterr().err
    assert (out / "assignments.csv").is_file() and not (out / LOCK_FILE).exists()


def test_a_run_refused_before_work_leaves_no_folder_behind(tmp_path):
    out = tmp_path / "new" / "out"
    with pytest.raises(Exception, match="does not exist|no such file|not found"):
        assign.main(assign_argv(tmp_path / "missing.csv", out))
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_two_pipelines_on_one_experiment_the_second_is_refused_and_a_rerun_completes(tmp_path, capsys, monkeypatch):
    config = tiny_digits_experiment(tmp_path)
    config["federated"]["n_rounds"] = 4  # steps 2-4 and the report: seconds of work left when the second starts
    experiment = tmp_path / "digits.yaml"
    experiment.write_text(yaml.safe_dump(config))
    results = tmp_path / "results"
    out = results / config["name"]
    args = [str(experiment), "--results", str(results), "--threads", "1"]
    # The first pipeline is a process of its own; the second and the rerun run here (their modules are imported
    # already, so the second asks for the lock within milliseconds of the first's step 1).
    first = subprocess.Popen([sys.executable, "run_pipeline.py", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not list(out.glob("step1-*")) and time.time() < deadline and first.poll() is None:  # at work
            time.sleep(0.05)
        assert first.poll() is None, "the first pipeline ended before a second could start"
        second = run_script("run_pipeline.py", args, capsys, monkeypatch)
        assert second.returncode == 2, second.stderr  # (0 would mean it ran: before locks it wrote beside the first)
        assert first.wait(timeout=900) == 0, first.stderr.read()
    finally:
        first.kill()
    (line,) = error_lines(second.stderr)
    assert f"experiment 'tinydigits' in --results {out} is being written by another run: pid {first.pid} on host" in line
    third = run_script("run_pipeline.py", args, capsys, monkeypatch)
    assert third.returncode == 0, third.stderr
    assert (out / "report.md").stat().st_size > 0 and (out / "report.csv").stat().st_size > 0
    (step2,) = out.glob("centralized/*/metrics.csv")
    rows = pd.read_csv(step2)
    assert not rows.duplicated().any() and rows.epoch.max() == config["centralized"]["n_epochs"]
    assert not list(results.rglob(LOCK_FILE))  # every lock released


@pytest.fixture(scope="module")
def held_folder(tmp_path_factory):
    """A folder whose lock a separate process holds for the whole module."""
    out = tmp_path_factory.mktemp("held") / "out"
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    yield out, process.pid
    process.kill()
    process.wait()


STEP_ARGV = {  # just enough to parse: the lock comes before any input is read
    "render": ["--out", "{out}"],
    "select --family digits": ["--family", "digits", "--out", "{out}"],
    "select --family cifar": ["--family", "cifar", "--data_path", "{missing}", "--out", "{out}"],
    "select --family taskonomy": ["--data_path", "{missing}", "--out", "{out}"],
    "train_centralized": ["--task", "digit_class", "--manifest", "{manifest}", "--out", "{out}"],
    "search_centralized": ["--task", "digit_class", "--manifest", "{manifest}", "--lrs", "0.1", "--out", "{out}"],
    "embed": ["--checkpoint", "{missing}", "--manifest", "{manifest}", "--data_path", "{missing}", "--out", "{out}"],
    "assign": ["--manifest", "{manifest}", "--out", "{out}"],
    "meter": ["--checkpoint", "{missing}", "--manifest", "{manifest}", "--assignments", "{missing}", "--data_path",
              "{missing}", "--out", "{out}"],
    # step 4 reads its assignments before the lock (the default --out needs them): real ones
    "federated": ["--task", "digit_class", "--method", "fedavg", "--manifest", "{manifest}", "--assignments",
                  "{assignments}", "--out", "{out}"],
    "merge": ["--base", "{missing}", "--finetuned", "a={missing}", "--out", "{out}"],
    "explain": ["--out", "{out}"],
}


@pytest.mark.parametrize("step", sorted(STEP_ARGV))
def test_every_step_refuses_a_folder_another_run_holds(step, held_folder, manifest, tmp_path):
    import importlib

    out, pid = held_folder
    module = importlib.import_module(f"steps.{step.split()[0]}")
    assignments = (assign.main(assign_argv(manifest, tmp_path / "step3b")) if step == "federated"
                   else None)
    argv = [arg.format(out=out, manifest=manifest, missing=tmp_path / "missing", assignments=assignments)
            for arg in STEP_ARGV[step]]
    with pytest.raises(FolderInUseError, match=f"is being written by another run: pid {pid} on host"):
        module.main(argv)
    assert sorted(path.name for path in out.iterdir()) == [LOCK_FILE]


def test_without_flock_the_recorded_pid_decides(tmp_path, monkeypatch, capsys):
    """Platforms without fcntl (Windows): a live holder on this host refuses, a dead one is taken over."""
    from utils import locks

    monkeypatch.setattr(locks, "fcntl", None)
    out = tmp_path / "out"
    out.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        record = {"pid": live.pid, "host": socket.gethostname(), "since": "2026-01-01T00:00:00+00:00"}
        (out / LOCK_FILE).write_text(json.dumps(record))
        with pytest.raises(FolderInUseError, match=f"pid {live.pid} on host"):
            with locks.folder_lock(out):
                pass
    finally:
        live.kill()
        live.wait()
    with locks.folder_lock(out):
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"took over the lock left by pid {live.pid}" in capsys.readouterr().err
    assert not (out / LOCK_FILE).exists()
