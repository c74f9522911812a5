"""A step's run.log is closed when the step ends (utils.run_dir.run_log): a process that runs many steps one after
another (the pipeline's local executor, a pool worker) keeps neither a file descriptor nor a logger per run."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from utils.run_dir import RUN_LOG, run_log, run_logger_name, setup_logging

needs_proc = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="no /proc/self/fd to list open files")


def open_run_logs() -> list[str]:
    """The run.log files this process holds open (none listed where there is no /proc/self/fd)."""
    if not Path("/proc/self/fd").is_dir():
        return []
    paths = []
    for entry in os.listdir("/proc/self/fd"):
        try:
            paths.append(os.readlink(f"/proc/self/fd/{entry}"))
        except OSError:  # the descriptor listdir itself used, closed already
            continue
    return sorted(path for path in paths if Path(path).name == RUN_LOG)


def run_loggers() -> list[str]:
    """The run loggers logging's registry still holds."""
    prefix = run_logger_name(Path("/")).rsplit(".", 1)[0] + "."
    return sorted(name for name, logger in logging.Logger.manager.loggerDict.items()
                  if name.startswith(prefix) and isinstance(logger, logging.Logger))


@needs_proc
def test_a_hundred_runs_in_one_process_leave_no_run_log_open_and_no_logger(tmp_path):
    before = open_run_logs(), run_loggers()
    for run in range(100):
        with run_log(tmp_path / f"run{run}") as logger:
            logger.info("round %d", run)
            assert open_run_logs() == sorted([*before[0], str(tmp_path / f"run{run}" / RUN_LOG)])
    assert (open_run_logs(), run_loggers()) == before
    assert (tmp_path / "run99" / RUN_LOG).read_text().endswith("INFO round 99\n")


@needs_proc
def test_a_step_that_fails_closes_its_run_log_too(tmp_path):
    with pytest.raises(RuntimeError, match="stopped"):
        with run_log(tmp_path / "run") as logger:
            logger.info("started")
            raise RuntimeError("stopped")
    assert str(tmp_path / "run" / RUN_LOG) not in open_run_logs()
    assert run_logger_name(tmp_path / "run") not in run_loggers()


def test_a_rerun_in_the_same_process_appends_to_the_folders_run_log(tmp_path, capsys):
    for attempt in ("first", "second"):
        with run_log(tmp_path / "run") as logger:
            logger.info("%s attempt", attempt)
    lines = (tmp_path / "run" / RUN_LOG).read_text().splitlines()
    assert [line.split(" INFO ")[1] for line in lines] == ["first attempt", "second attempt"]
    assert capsys.readouterr().out == "first attempt\nsecond attempt\n"  # the console once a line, not twice


def test_within_a_run_the_folder_has_one_logger_whatever_path_names_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with run_log(Path("run")) as logger:
        assert setup_logging(tmp_path / "run") is logger and len(logger.handlers) == 2
