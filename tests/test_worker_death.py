"""run_pipeline.py --jobs N killed with kill -9 takes its worker processes with it (issue 19, item 7)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.test_digits import tiny_digits_experiment

ROOT = Path(__file__).resolve().parent.parent


def process_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state letter, command line) of every process, from psutil or else /proc."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        table = {}
        for process in psutil.process_iter(["ppid", "status", "cmdline"]):
            info = process.info
            state = "Z" if info["status"] == psutil.STATUS_ZOMBIE else "R"
            table[process.pid] = (info["ppid"], state, " ".join(info["cmdline"] or []))
        return table
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            table[int(entry.name)] = (int(fields[1]), fields[0], cmdline)
    return table


def workers_of(parent: int) -> list[int]:
    """The multiprocessing workers (spawned children) of ``parent``."""
    return [pid for pid, (ppid, _, cmdline) in process_table().items() if ppid == parent and "spawn_main" in cmdline]


def alive(pids: list[int]) -> list[int]:
    table = process_table()
    return [pid for pid in pids if pid in table and table[pid][1] != "Z"]


@pytest.mark.slow
def test_killing_the_pipeline_with_sigkill_kills_its_workers(tmp_path):
    config = tiny_digits_experiment(tmp_path)
    config["federated"]["n_rounds"] = 400  # the workers would train for minutes after the kill
    config["federated"]["algorithms"]["fedprox"] = {"mu": 0.01}
    experiment = tmp_path / "digits.yaml"
    experiment.write_text(yaml.safe_dump(config))
    results = tmp_path / "results"
    pipeline = subprocess.Popen([sys.executable, "run_pipeline.py", str(experiment), "--results", str(results),
                                 "--jobs", "2", "--threads", "1"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.time() + 600
        # Both workers are training: each has written its run's config.json.
        while time.time() < deadline and pipeline.poll() is None:
            workers = workers_of(pipeline.pid)
            if len(workers) == 2 and len(list(results.glob("*/federated/**/config.json"))) >= 2:
                break
            time.sleep(0.1)
        assert pipeline.poll() is None and len(workers) == 2, "the pipeline never ran two workers at once"
        os.kill(pipeline.pid, signal.SIGKILL)
        pipeline.wait()
        killed_at = time.time()
        while alive(workers) and time.time() < killed_at + 2.0:
            time.sleep(0.05)
        assert alive(workers) == [], f"workers {alive(workers)} still alive 2 s after the pipeline was killed"
    finally:
        pipeline.kill()
        for pid in alive(workers):  # never leave a stray trainer behind, whatever the outcome
            os.kill(pid, signal.SIGKILL)


def test_a_worker_whose_parent_is_already_gone_kills_itself_at_once():
    """The race prctl leaves open: the parent dies before the worker sets its death signal."""
    code = ("import os, sys; from utils.parent_death import die_with_parent; "
            "die_with_parent(os.getppid() + 1_000_000); print('survived')")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL and "survived" not in result.stdout


def test_the_fallback_watcher_kills_an_orphan(tmp_path):
    """Where prctl is missing (macOS, Windows), a thread watching the parent's pid does the same job."""
    code = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import os, sys, time
from utils import parent_death
parent_death.sys.platform = "darwin"  # take the path of platforms without prctl
print(parent_death.die_with_parent(os.getppid()), os.getpid(), flush=True)
time.sleep(60)
'''], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
print(child.stdout.readline().strip(), flush=True)
os._exit(0)  # the parent goes without waiting for its child
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    how, pid = result.stdout.split()
    assert how == "watcher"
    deadline = time.time() + 2.0
    while alive([int(pid)]) and time.time() < deadline:
        time.sleep(0.05)
    assert alive([int(pid)]) == []

