"""bench/bench_suite.py (the suite timed beside a host probe) and bench/machine.py (the machine's CPU seconds)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench import bench_suite
from bench.machine import CpuSeconds, machine_cpu_seconds, used_between
from utils.errors import TaskHetError


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="no /proc/stat")
def test_the_machine_counts_this_process_busy_seconds():
    before = machine_cpu_seconds()
    start = time.process_time()
    while time.process_time() - start < 0.3:  # 0.3 s of this process's CPU
        pass
    used = used_between(before, machine_cpu_seconds())
    assert used.busy >= 0.25 and used.idle >= 0  # at least this process's own 0.3 s (ticks of 1/100 s)


def test_used_between_is_the_difference_and_none_without_a_reading():
    assert used_between(CpuSeconds(10.0, 50.0), CpuSeconds(12.5, 51.0)) == CpuSeconds(2.5, 1.0)
    assert used_between(None, CpuSeconds(1.0, 1.0)) is None and used_between(CpuSeconds(1.0, 1.0), None) is None


@pytest.mark.parametrize("line, counts, seconds", [
    ("3593 passed, 13 warnings in 258.20s (0:04:18)", "3593 passed, 13 warnings", "258.20"),
    ("===== 5 passed in 1.02s =====", "5 passed", "1.02"),
    ("12 passed, 1 skipped in 3.50s", "12 passed, 1 skipped", "3.50"),
])
def test_the_summary_line_of_a_passing_suite_is_read(line, counts, seconds):
    match = bench_suite.SUMMARY.match(line)
    assert (match["counts"], match["seconds"]) == (counts, seconds)


@pytest.mark.parametrize("line", ["2 failed, 3591 passed in 300.00s", "no tests ran in 0.50s", "", "error: x"])
def test_a_suite_that_did_not_pass_is_not_read_as_passed(line):
    assert bench_suite.SUMMARY.match(line) is None


def fake_run(monkeypatch, last_line: str, code: int, wall: float = 300.0, failed: list[str] | None = None):
    monkeypatch.setattr(bench_suite, "probe_seconds", lambda times: {3: 2.0, 1: 3.0}[times])
    seen = []

    def run_suite(args):
        seen.append(args)
        return bench_suite.SuiteRun(wall, last_line, code, failed or [])
    monkeypatch.setattr(bench_suite, "run_suite", run_suite)
    return seen


def test_the_report_names_the_suite_the_cpu_and_the_probes(monkeypatch, capsys):
    seen = fake_run(monkeypatch, "3593 passed, 13 warnings in 258.20s (0:04:18)", 0, wall=262.0)
    bench_suite.main([])
    out = capsys.readouterr().out
    assert seen == [["tests"]]
    assert "suite: 3593 passed, 13 warnings, 262 s of wall time (4 min 22 s; pytest's own 258 s)" in out
    assert "median of 3): 2.00 s before, 2.00 s after" in out
    assert "ratio suite / probe: 131" in out  # 262 / 2.0


@pytest.mark.parametrize("wall, shown", [(405.4, "405 s of wall time (6 min 45 s;"),
                                         (359.6, "360 s of wall time (6 min 00 s;"),
                                         (59.4, "59 s of wall time (0 min 59 s;")])
def test_minutes_and_seconds_are_whole_and_never_rounded_up_past_the_minute(monkeypatch, capsys, wall, shown):
    fake_run(monkeypatch, "1 passed in 0.10s", 0, wall=wall)
    bench_suite.main([])
    assert shown in capsys.readouterr().out


def test_arguments_after_the_separator_go_to_pytest(monkeypatch, capsys):
    seen = fake_run(monkeypatch, "1 passed in 0.10s", 0)
    bench_suite.main(["--probes", "1", "--", "tests/test_engine.py", "-k", "resume"])
    assert seen == [["tests/test_engine.py", "-k", "resume"]]
    assert "median of 1): 3.00 s before, 3.00 s after" in capsys.readouterr().out


@pytest.mark.parametrize("last_line, code", [("2 failed, 3591 passed in 300.00s", 1),
                                              ("3593 passed in 250.00s", 3)])
def test_a_failed_suite_is_an_error_naming_its_last_line(monkeypatch, capsys, last_line, code):
    fake_run(monkeypatch, last_line, code)
    with pytest.raises(TaskHetError, match=rf"^the suite did not pass \(pytest exit code {code}\): {last_line}$"):
        bench_suite.main([])
    assert capsys.readouterr().out == ""  # no partial report


def test_a_failed_suite_names_its_failed_tests_from_pytests_summary(monkeypatch, capsys):
    output = "\n".join([
        "........F..E [100%]",
        "=========================== short test summary info ============================",
        "FAILED tests/test_a.py::test_one[x-1] - AssertionError: assert 1 == 2",
        "ERROR tests/test_b.py::test_two - RuntimeError: boom",
        "FAILED: not a summary line",
        "1 failed, 1 error, 10 passed in 3.00s"])
    assert bench_suite.failed_tests(output) == ["tests/test_a.py::test_one[x-1]", "tests/test_b.py::test_two"]
    fake_run(monkeypatch, "1 failed, 1 error, 10 passed in 3.00s", 1, failed=bench_suite.failed_tests(output))
    with pytest.raises(TaskHetError) as raised:
        bench_suite.main([])
    assert str(raised.value) == ("the suite did not pass (pytest exit code 1): 1 failed, 1 error, 10 passed in 3.00s; "
                                 "failed: tests/test_a.py::test_one[x-1], tests/test_b.py::test_two")
    assert capsys.readouterr().out == ""
    many = bench_suite.SuiteRun(1.0, "7 failed in 1.00s", 1, [f"t{index}" for index in range(7)])
    assert bench_suite.failure_message(many).endswith("; failed: t0, t1, t2, t3, t4 and 2 more")


@pytest.mark.parametrize("probes", ["0", "51", "²", "1e3", "-1"])
def test_a_probe_count_out_of_range_is_refused(monkeypatch, probes):
    fake_run(monkeypatch, "1 passed in 0.10s", 0)
    with pytest.raises(SystemExit):
        bench_suite.main(["--probes", probes])
