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
            fields = stat_fields(int(entry.name))
            if fields is None:
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            table[int(entry.name)] = (int(fields[1]), fields[0], cmdline)
    return table


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (the state letter, then the parent pid, ...); None once
    the process has gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def parent_of(pid: int) -> int | None:
    """``pid``'s parent, from /proc (None once it has gone)."""
    fields = stat_fields(pid)
    return None if fields is None else int(fields[1])


def workers_of(parent: int) -> list[int]:
    """The pool workers of ``parent``: the children of its multiprocessing fork server (pipeline/pool.py)."""
    table = process_table()
    servers = {pid for pid, (ppid, _, cmdline) in table.items() if ppid == parent and "forkserver" in cmdline}
    return [pid for pid, (ppid, _, _) in table.items() if ppid in servers]


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


ORPHAN_SCRIPT = """
import multiprocessing, os, sys, time

def child(late):
    if late:
        time.sleep(1.0)  # the parent is gone by now: the race, a parent dead before the watch starts
    from utils.parent_death import die_with_parent
    die_with_parent()
    time.sleep(60 if not late else 2)
    print("survived", flush=True)

if __name__ == "__main__":
    worker = multiprocessing.get_context("forkserver").Process(target=child, args=(sys.argv[1] == "late",))
    worker.start()
    print(worker.pid, flush=True)
    time.sleep(0.5)
    os._exit(0)  # the parent goes without a word, as after SIGKILL
"""


@pytest.mark.parametrize("when", ["early", "late"])
def test_a_worker_dies_with_its_parent_also_when_the_parent_died_first(tmp_path, when):
    """A fork server's child (the pool's kind of worker) dies once its parent is gone, whether the parent dies
    after the worker started watching it or before."""
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN_SCRIPT)
    parent = subprocess.run([sys.executable, str(script), when], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    pid = int(parent.stdout.split()[0])
    deadline = time.time() + (4.0 if when == "late" else 2.0)
    while alive([pid]) and time.time() < deadline:
        time.sleep(0.05)
    assert alive([pid]) == [], f"the worker outlived its parent ({when})"
    assert "survived" not in parent.stdout


def test_die_with_parent_outside_multiprocessing_is_refused():
    from utils.parent_death import die_with_parent

    with pytest.raises(RuntimeError, match="started by multiprocessing"):
        die_with_parent()

